"""Faults inside the engine: a step that raises fails its own requests only; a dead engine
thread turns the server unhealthy and ends every request instead of hanging it.

The fault is injected in the runner (the model's forward pass) whenever a batch holds the
POISON token: the requests that carry it fail, and the ones around them are checked against
the same engine's outputs without any fault (the offline LLM on the same folder).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from hearth import LLM, SamplingParams
from hearth.engine_config import EngineConfig
from hearth.engine.async_engine import AsyncEngine
from hearth.engine.engine import LLMEngine, StepFailed
from hearth.server.app import build_app
from test_server import NAME, folder, serving, wait_engine_idle  # noqa: F401 (folder: a fixture)

POISON = 299  # a token id no other prompt of these tests holds
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 101, 102, 103, 104], [7, 9, 11]]


class EngineDied(BaseException):
    """Not an Exception: what no step handler catches (as a thread killed mid-step)."""


def poison_runner(engine: LLMEngine, error: BaseException) -> None:
    """Make the model pass raise `error` when a batch holds the POISON token."""
    model_pass = engine.runner._pass

    def faulty(step, entries):
        if any(POISON in entry.token_ids for entry in entries):
            raise error
        return model_pass(step, entries)

    engine.runner._pass = faulty


def greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(folder):  # noqa: F811
    outputs = LLM(folder, progress=False).generate(PROMPTS, greedy(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_a_failed_step_fails_its_requests_frees_their_blocks_and_the_rest_run_on(folder, reference):  # noqa: F811
    engine = LLMEngine(folder, EngineConfig.from_options(max_num_seqs=2), progress=False)
    poison_runner(engine, RuntimeError("CUDA error: an illegal memory access was encountered"))
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(f"ok{i}", prompt, greedy())
    engine.add_request("bad", [1, 2, POISON], greedy())
    for i, prompt in enumerate(PROMPTS[2:], start=2):
        engine.add_request(f"ok{i}", prompt, greedy())
    done, failed = {}, []
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except StepFailed as e:
            assert "illegal memory access" in str(e)
            failed.append(e.request_ids)
            continue
        done.update({o.request_id: o.outputs[0].token_ids for o in outputs if o.finished})
    # two seats: ok0 and ok1 ran first, then "bad" ran with ok2 in the same (failed) step
    assert failed == [["bad", "ok2"]]
    assert done == {"ok0": reference[0], "ok1": reference[1], "ok3": reference[3]}
    assert engine.block_manager.check_all_free()
    engine.add_request("after", PROMPTS[2], greedy())  # the engine serves on, correctly
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert outputs[0].outputs[0].token_ids == reference[2]


def completion(http: httpx.Client, prompt: list[int], stream: bool = False) -> httpx.Response:
    return http.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 12,
                                              "temperature": 0, "ignore_eos": True, "stream": stream})


def test_the_server_answers_500_for_a_failed_step_and_serves_the_next_requests(folder, reference):  # noqa: F811
    llm_engine = LLMEngine(folder, EngineConfig.from_options(max_num_seqs=1), progress=False)
    poison_runner(llm_engine, MemoryError("out of memory"))
    engine = AsyncEngine(llm_engine)
    try:
        with serving(build_app(engine, NAME)) as url, httpx.Client(base_url=url, timeout=30) as http:
            r = completion(http, [1, 2, POISON])
            assert r.status_code == 500, r.text
            error = r.json()["error"]
            assert error["code"] == 500 and "MemoryError: out of memory" in error["message"]
            r = completion(http, [1, 2, POISON], stream=True)
            events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 500
            assert http.get("/health").status_code == 200
            for prompt, expected in zip(PROMPTS, reference):
                r = completion(http, prompt)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
                assert r.json()["choices"][0]["text"] == llm_engine.tokenizer.decode(expected)
            wait_engine_idle(engine)
            assert llm_engine.block_manager.check_all_free()
    finally:
        engine.shutdown()


def test_a_dead_engine_thread_makes_health_503_and_ends_every_request(folder):  # noqa: F811
    llm_engine = LLMEngine(folder, EngineConfig.from_options(max_num_seqs=4), progress=False)
    poison_runner(llm_engine, EngineDied("the engine thread was killed"))
    engine = AsyncEngine(llm_engine)
    try:
        assert_poison_ends_every_request(engine, "EngineDied")  # the poisoned step kills the engine thread
    finally:
        engine.shutdown()


def assert_poison_ends_every_request(engine: AsyncEngine, message: str) -> None:
    """Served: a streaming request runs, a POISON request comes; both end in 503s saying `message`
    within seconds, /health answers 503 and later requests get 503s."""
    long = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with serving(build_app(engine, NAME)) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        with http.stream("POST", "/v1/completions", json=long) as running:
            lines = running.iter_lines()
            next(lines)  # it streams
            start = time.monotonic()
            r = completion(http, [1, 2, POISON])
            assert r.status_code == 503 and message in r.json()["error"]["message"], r.text
            rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]" and json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == 503
            assert time.monotonic() - start < 10
        assert http.get("/health").status_code == 503
        r = completion(http, PROMPTS[1])
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"


def test_a_step_that_hangs_is_caught_by_the_watchdog_health_503_every_request_ended(folder):  # noqa: F811
    llm_engine = LLMEngine(folder, EngineConfig.from_options(max_num_seqs=4), progress=False)
    release = threading.Event()
    model_pass = llm_engine.runner._pass

    def hanging(step, entries):  # a kernel that deadlocks on the POISON token, until released
        if any(POISON in entry.token_ids for entry in entries):
            release.wait()
        return model_pass(step, entries)

    llm_engine.runner._pass = hanging
    engine = AsyncEngine(llm_engine, step_timeout=1.0)
    try:
        assert_poison_ends_every_request(engine, "stalled")  # the poisoned step never returns
    finally:
        release.set()  # the step returns at last: the engine thread stops and frees every block
        engine.shutdown()
    assert not engine._thread.is_alive()
    assert llm_engine.block_manager.check_all_free()
