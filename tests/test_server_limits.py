"""The limits of a public server, tried as a hostile client would, through real HTTP.

A tiny random llama serves under small limits (tests/test_server.py's `serving`); while SLOW
is set each step sleeps 50 ms, so that requests last long enough to be timed out or counted.
"""

from __future__ import annotations

import json
import logging.handlers
import socket
import threading
import time

import httpx
import openai
import pytest

from hearth.cli import build_parser
from hearth.engine_config import EngineConfig
from hearth.engine.async_engine import AsyncEngine
from hearth.engine.engine import LLMEngine
from hearth.server.app import build_app
from hearth.server.limits import ServerLimits
from test_server import API_KEY, NAME, auth, folder, serving, wait_engine_idle  # noqa: F401 (folder: a fixture)

LIMITS = ServerLimits(max_body_bytes=2**20, body_timeout=1.0, max_prompt_tokens=100, max_output_tokens=40,
                      max_sequences=8, request_timeout=1.5, max_concurrent_requests=3)
SLOW = threading.Event()
LONG = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def limited(folder):  # noqa: F811
    llm_engine = LLMEngine(folder, EngineConfig(), progress=False)
    step = llm_engine.step
    llm_engine.step = lambda: (SLOW.is_set() and time.sleep(0.05), step())[1]  # SLOW: 40 tokens take ~2 s
    engine = AsyncEngine(llm_engine)
    with serving(build_app(engine, NAME, api_key=API_KEY, limits=LIMITS)) as url:
        yield url, engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(limited):
    return openai.OpenAI(base_url=limited[0] + "/v1", api_key=API_KEY, max_retries=0)


def raw_request(url: str, headers: dict[str, str]) -> socket.socket:
    """A connection that sent a POST's headers and no body yet."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    lines = [f"POST /v1/completions HTTP/1.1", f"Host: {host}", f"Authorization: Bearer {API_KEY}",
             "Content-Type: application/json", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    sock.sendall("\r\n".join(lines).encode())
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict | None]:
    """The status and JSON body (None if empty) of the response on `sock` (read to the end of its Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), json.loads(body) if body else None


def assert_error(status: int, body: dict, expected: int) -> str:
    assert status == expected, body
    error = body["error"]
    assert error["code"] == expected and error["type"] and error["message"]
    return error["message"]


def test_a_64_mib_body_is_a_413_at_once_declared_or_streamed(limited):
    url, _ = limited
    start = time.monotonic()
    sock = raw_request(url, {"Content-Length": str(64 * 2**20)})
    sock.sendall(b'{"prompt": "' + b"a" * 65536)
    assert "limit of 1,048,576 bytes" in assert_error(*read_response(sock), 413)
    sock.close()

    # no Content-Length: the body is counted as it comes, and refused once past the limit
    sock = raw_request(url, {"Transfer-Encoding": "chunked"})
    sent, status = 0, None
    sock.settimeout(0.01)
    while status is None and sent < 64 * 2**20:
        chunk = b"a" * 2**18
        sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        sent += len(chunk)
        try:
            sock.recv(1, socket.MSG_PEEK)  # has the answer come?
        except TimeoutError:
            continue
        sock.settimeout(10)
        status = read_response(sock)
    assert status is not None and sent < 4 * 2**20  # answered soon after the first MiB, not after 64
    assert_error(*status, 413)
    sock.close()
    assert time.monotonic() - start < 10
    assert httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth()).status_code == 200


def test_a_client_that_sends_its_body_slowly_holds_nothing_and_gets_a_408(limited):
    url, _ = limited
    sock = raw_request(url, {"Content-Length": "1000"})
    sock.sendall(b'{"prompt": ')  # ... and nothing more
    start = time.monotonic()
    for _ in range(3):  # the server keeps answering everyone else meanwhile
        assert httpx.get(url + "/health", timeout=2).status_code == 200
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth(), timeout=5)
    assert r.status_code == 200
    assert "did not arrive within 1 s" in assert_error(*read_response(sock), 408)
    assert time.monotonic() - start < 5
    sock.close()


def test_tokenizing_a_long_prompt_does_not_stop_the_server(limited):
    url, _ = limited
    text = "Once upon a time there was a little fox. " * 8000  # ~330 KB: ~2 s to tokenize, then refused (> 100 tokens)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
        url + "/v1/completions", json={"prompt": text}, headers=auth(), timeout=60)))
    thread.start()
    gaps = []
    while thread.is_alive():
        start = time.monotonic()
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        gaps.append(time.monotonic() - start)
    thread.join()
    r = result["r"]
    assert "limit is 100" in assert_error(r.status_code, r.json(), 400)
    assert max(gaps) < 1.0, gaps


def test_n_and_best_of_are_bounded_with_an_immediate_400(limited, client):
    url, engine = limited
    for kw in ({"n": 100000}, {"best_of": 100000}, {"n": 3, "prompt": ["a", "b", "c"]}):
        start = time.monotonic()
        with pytest.raises(openai.BadRequestError, match="limit is 8") as e:
            client.completions.create(**{"model": NAME, "prompt": "hi", "max_tokens": 2, **kw})
        assert time.monotonic() - start < 2
        assert e.value.body["param"] == ("best_of" if "best_of" in kw else "n")
    with pytest.raises(openai.BadRequestError, match="100000 sequences"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], n=100000)
    res = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], n=8, max_tokens=2)
    assert len(res.choices) == 8  # at the limit: served
    wait_engine_idle(engine)
    assert engine.engine.block_manager.check_all_free()


def test_prompt_and_max_tokens_caps(limited, client):
    with pytest.raises(openai.BadRequestError, match="101 tokens; this server's limit is 100"):
        client.completions.create(model=NAME, prompt=list(range(5, 106)), max_tokens=1)
    assert client.completions.create(model=NAME, prompt=list(range(5, 105)), max_tokens=1).usage.prompt_tokens == 100
    with pytest.raises(openai.BadRequestError, match="max_tokens is 41; this server's limit is 40") as e:
        client.completions.create(model=NAME, prompt="hi", max_tokens=41)
    assert e.value.body["param"] == "max_tokens"
    # a chat request that gives no max_tokens stops at the cap
    res = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                         extra_body={"ignore_eos": True}, timeout=10)
    assert res.usage.completion_tokens == 40 and res.choices[0].finish_reason == "length"
    # a completion that gives none gets OpenAI's default of 16, and the cap where it is lower
    res = client.completions.create(model=NAME, prompt="hi", extra_body={"ignore_eos": True})
    assert res.usage.completion_tokens == 16
    with serving(build_app(limited[1], NAME, api_key=API_KEY, limits=ServerLimits(max_output_tokens=8))) as url:
        low = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        res = low.completions.create(model=NAME, prompt="hi", extra_body={"ignore_eos": True})
        assert res.usage.completion_tokens == 8 and res.choices[0].finish_reason == "length"


def test_a_request_past_its_time_is_stopped_with_a_408_streamed_or_not(limited):
    url, engine = limited
    slow = {**LONG, "max_tokens": 40}  # ~2 s of steps, past the 1.5 s limit
    SLOW.set()
    with httpx.Client(base_url=url, headers=auth(), timeout=10) as http:
        start = time.monotonic()
        r = http.post("/v1/completions", json=slow)
        assert "1.5 s" in assert_error(r.status_code, r.json(), 408)
        assert 1.4 < time.monotonic() - start < 3
        with http.stream("POST", "/v1/completions", json={**slow, "stream": True}) as r:
            events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == 408
        assert len(events) > 3  # tokens streamed before the limit
    SLOW.clear()
    wait_engine_idle(engine)
    assert engine.engine.block_manager.check_all_free()


def test_requests_in_flight_are_bounded_and_health_stays_outside_the_count(limited):
    url, engine = limited
    streaming = {**LONG, "max_tokens": 20, "stream": True}  # ~1 s each
    SLOW.set()
    clients = [httpx.Client(base_url=url, headers=auth(), timeout=10) for _ in range(3)]
    try:
        streams = [c.stream("POST", "/v1/completions", json=streaming) for c in clients]
        lines = [s.__enter__().iter_lines() for s in streams]  # (kept: a dropped iterator closes its connection)
        for line in lines:  # three in flight: the limit
            next(line)
        r = httpx.post(url + "/v1/completions", json=LONG, headers=auth())
        assert "limit 3" in assert_error(r.status_code, r.json(), 503)
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/metrics").status_code == 200
        for s in streams:
            s.__exit__(None, None, None)
    finally:
        SLOW.clear()
        for c in clients:
            c.close()
    wait_engine_idle(engine)
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth())
    assert r.status_code == 200


CONNECTION_LIMITS = ServerLimits(max_connections=4, header_timeout=1.5)


@pytest.fixture(scope="module")
def few_connections(folder):  # noqa: F811
    engine = AsyncEngine(LLMEngine(folder, EngineConfig(), progress=False))
    with serving(build_app(engine, NAME, limits=CONNECTION_LIMITS), CONNECTION_LIMITS) as url:
        yield url
    engine.shutdown()


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes `sock` within `within` seconds (the client sends nothing more)."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_sockets_that_send_no_whole_head_are_closed_after_the_header_timeout(few_connections):
    host, port = few_connections.removeprefix("http://").split(":")
    silent = socket.create_connection((host, int(port)))
    trickling = socket.create_connection((host, int(port)))
    start = time.monotonic()
    with pytest.raises((BrokenPipeError, ConnectionResetError)):  # the server closes it mid-head
        for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" * 10:  # each byte would reset a keep-alive timer
            trickling.sendall(bytes([byte]))
            time.sleep(0.1)
    assert CONNECTION_LIMITS.header_timeout <= time.monotonic() - start < 5
    assert closed_by_server(silent, within=1)
    with httpx.Client(base_url=few_connections) as http:  # the server answers everyone else
        assert http.get("/health").status_code == 200


def test_connections_past_the_limit_get_503_until_idle_ones_are_closed(few_connections):
    host, port = few_connections.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(CONNECTION_LIMITS.max_connections)]
    time.sleep(0.2)  # the server has taken them
    r = httpx.get(few_connections + "/v1/models")
    assert_error(r.status_code, r.json(), 503)  # past the limit, in OpenAI's JSON; the connection is closed
    assert httpx.get(few_connections + "/health").status_code == 200  # monitoring is answered even past it
    assert all(closed_by_server(sock, within=3) for sock in idle)  # the head deadline frees their places
    r = httpx.get(few_connections + "/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == NAME
    for sock in idle:
        sock.close()


def test_a_wrong_key_of_any_length_is_refused(limited):
    url, _ = limited
    for key in ("x", API_KEY[:-1], API_KEY + "x", "x" * len(API_KEY)):
        r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert_error(r.status_code, r.json(), 401)


def test_hearth_serve_takes_every_limit_as_an_option():
    args = build_parser().parse_args(["serve", "--max-body-size", "2MiB", "--body-timeout", "5", "--max-prompt-tokens",
                                      "1000", "--max-output-tokens", "200", "--max-sequences", "4",
                                      "--request-timeout", "30", "--max-concurrent-requests", "16",
                                      "--max-connections", "64", "--header-timeout", "5"])
    assert ServerLimits.from_args(args) == ServerLimits(2 * 2**20, 5.0, 1000, 200, 4, 30.0, 16, 64, 5.0)
    assert ServerLimits.from_args(build_parser().parse_args(["serve"])) == ServerLimits()
    with pytest.raises(ValueError, match="max_sequences must be positive"):
        ServerLimits.from_args(build_parser().parse_args(["serve", "--max-sequences", "0"]))


def test_slow_server_queue_overflow_is_503_at_once_and_a_gone_client_is_aborted(folder):  # noqa: F811
    llm_engine = LLMEngine(folder, EngineConfig.from_options(max_num_seqs=1), progress=False)
    step = llm_engine.step
    llm_engine.step = lambda: (time.sleep(0.01), step())[1]  # the tiny model is too quick to keep a queue
    engine = AsyncEngine(llm_engine, max_queue=1)
    long = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    try:
        with serving(build_app(engine, NAME)) as url, httpx.Client(base_url=url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=long) as running:
                lines = running.iter_lines()  # (keep it: a dropped iterator closes the connection)
                next(lines)  # the first request runs
                with http.stream("POST", "/v1/completions", json=long) as waiting:
                    assert waiting.status_code == 200  # queued behind it
                    start = time.monotonic()
                    r = http.post("/v1/completions", json={**long, "stream": False})
                    assert r.status_code == 503 and time.monotonic() - start < 5
                    assert r.json()["error"]["type"] == "ServiceUnavailableError"
            wait_engine_idle(engine)  # the server noticed the two disconnects and aborted them
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200

            # a non-streaming client that gives up: its request is aborted, not run to the end (4 s),
            # and the server logs no error for it
            errors = logging.handlers.BufferingHandler(capacity=100)
            errors.setLevel(logging.ERROR)
            logging.getLogger("uvicorn.error").addHandler(errors)
            try:
                for _ in range(3):
                    with pytest.raises(httpx.ReadTimeout):
                        http.post("/v1/completions", json={**long, "stream": False}, timeout=0.5)
                    start = time.monotonic()
                    wait_engine_idle(engine)
                    assert time.monotonic() - start < 2.5
            finally:
                logging.getLogger("uvicorn.error").removeHandler(errors)
            assert [record.getMessage() for record in errors.buffer] == []
            assert engine.engine.block_manager.check_all_free()
    finally:
        engine.shutdown()


def test_the_responses_and_messages_apis_end_a_stream_past_its_time_with_their_own_error_event(limited):
    url, engine = limited
    SLOW.set()
    with httpx.Client(base_url=url, headers=auth(), timeout=10) as http:
        ask = {"model": NAME, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/responses",
                         json={**ask, "input": "Once upon a time", "max_output_tokens": 40}) as r:
            events = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1]["type"] == "error" and events[-1]["code"] == "408" and "1.5 s" in events[-1]["message"]
        assert "response.output_text.delta" in [e["type"] for e in events]  # text streamed before the limit
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        user = [{"role": "user", "content": "Once upon a time"}]
        with http.stream("POST", "/v1/messages", json={**ask, "max_tokens": 40, "messages": user}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-2:] == ["event: error", lines[-1]] and "content_block_delta" in "".join(lines)
        assert json.loads(lines[-1].removeprefix("data: "))["error"]["type"] == "timeout_error"
    SLOW.clear()
    wait_engine_idle(engine)
    assert engine.engine.block_manager.check_all_free()
