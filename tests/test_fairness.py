"""Priorities and fairness: a request's priority (vLLM's semantics) in the engine's admission order, and
the connection limits that keep one client's idle sockets from taking the server from everyone else.

The scheduler's own tests (tests/test_scheduler.py) check admission and preemption order without a
model; here the engine serves a tiny random llama (tests/test_server.py's `folder`).
"""

from __future__ import annotations

import json
import resource
import socket
import time

import httpx
import pytest

from hearth.engine_config import EngineConfig
from hearth.engine.async_engine import AsyncEngine
from hearth.engine.engine import LLMEngine
from hearth.errors import RequestError
from hearth.sampling_params import SamplingParams
from hearth.server.app import build_app
from hearth.server.limits import ServerLimits
from test_server import NAME, folder, serving  # noqa: F401 (folder: a fixture)
from test_server_limits import read_response

IDLE_SOCKETS = 1000
OTHER_CLIENT = "127.0.0.2"  # the loopback network is 127/8: a second address is a second client


def test_a_queued_request_of_better_priority_is_admitted_before_earlier_ones(folder):  # noqa: F811
    engine = LLMEngine(folder, EngineConfig.from_options(max_num_seqs=1), progress=False)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("first", [1, 2, 3], params, priority=5)
    engine.step()  # "first" runs: the one seat is taken
    for request_id in ("low-1", "low-2"):
        engine.add_request(request_id, [4, 5, 6], params, priority=5)
    engine.add_request("urgent", [7, 8, 9], params, priority=-1)
    engine.add_request("default", [7, 8, 9], params)  # priority 0: between them
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    # the running one is never preempted for a better one; then the best first, FCFS among equals
    assert finished == ["first", "urgent", "default", "low-1", "low-2"]
    with pytest.raises(RequestError, match="priority must be an integer"):
        engine.add_request("bad", [1], params, priority="high")


def test_batch_lines_wait_behind_an_online_request(folder, tmp_path):  # noqa: F811
    """One seat (max_num_seqs 1): a batch keeps a line running and the next one waiting; an online request
    sent then is admitted before that waiting line, so it is answered while one line at most is done."""
    llm_engine = LLMEngine(folder, EngineConfig.from_options(max_num_seqs=1), progress=False)
    step = llm_engine.step
    llm_engine.step = lambda: (time.sleep(0.02), step())[1]  # 10 tokens take ~0.2 s
    engine = AsyncEngine(llm_engine)
    body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 10, "ignore_eos": True}
    lines = "".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n"
                    for i in range(4))
    try:
        with serving(build_app(engine, NAME, batch_dir=tmp_path)) as url, httpx.Client(base_url=url, timeout=30) as http:
            file_id = http.post("/v1/files", files={"file": ("in.jsonl", lines)}, data={"purpose": "batch"}).json()["id"]
            batch_id = http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                      "completion_window": "24h"}).json()["id"]
            deadline = time.monotonic() + 10
            while not (engine.num_running == 1 and engine.num_waiting == 1):  # a line runs, the next waits
                assert time.monotonic() < deadline
                time.sleep(0.005)
            assert http.post("/v1/completions", json=body).status_code == 200
            assert http.get(f"/v1/batches/{batch_id}").json()["request_counts"]["completed"] <= 1
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def public_server(folder):  # noqa: F811
    """The default limits of `hearth serve` (a server's connections and one client's share)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard, 4 * IDLE_SOCKETS)  # both ends of every socket live in this process
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    engine = AsyncEngine(LLMEngine(folder, EngineConfig(), progress=False))
    limits = ServerLimits()
    with serving(build_app(engine, NAME, limits=limits), limits) as url:
        yield url, limits
    engine.shutdown()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def send_get(sock: socket.socket, path: str) -> tuple[int, dict | None]:
    """The status and JSON body of a GET sent on `sock`."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return read_response(sock)


def test_a_thousand_idle_sockets_from_one_client_leave_health_and_other_clients_served(public_server):
    url, limits = public_server
    port = int(url.rsplit(":", 1)[1])
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 3 * IDLE_SOCKETS:
        pytest.skip("this process may not open enough files for the test")
    idle = [socket.create_connection(("127.0.0.1", port), source_address=(OTHER_CLIENT, 0))
            for _ in range(IDLE_SOCKETS)]
    try:
        time.sleep(0.3)  # the server has taken them all
        # the flooding client's share is full: a request on a connection past it is refused in OpenAI's
        # error JSON (the connection then closed), while /health still answers it
        status, body = send_get(idle[-1], "/v1/models")
        assert status == 429 and body["error"]["type"] == "RateLimitError"
        assert "limit per client is 256" in body["error"]["message"]
        assert send_get(idle[-2], "/health")[0] == 200
        with httpx.Client(base_url=url, timeout=10) as http:  # another client (127.0.0.1)
            assert http.get("/health").status_code == 200
            r = http.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and len(r.json()["choices"]) == 1
        assert send_get(idle[0], "/v1/models")[0] == 200  # within its share, the flooding client is served
    finally:
        for sock in idle:
            sock.close()
    assert limits.max_connections_per_client < IDLE_SOCKETS <= limits.max_connections


def test_a_malformed_request_head_gets_a_400_in_openai_json(public_server):
    url, _ = public_server
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost x\r\n\r\n")  # a header line without its colon
        status, body = read_response(sock)
    assert status == 400 and body["error"]["type"] == "BadRequestError" and body["error"]["message"]
