"""Every request field of /v1/completions and /v1/chat/completions, fuzzed through real HTTP
(hypothesis): any JSON body gets a 200 or an OpenAI-shaped 4xx (503 when busy), never a 5xx or
a body that is not JSON; a stream's events are JSON, its error events 4xx, and it ends in [DONE].

Each field gets values of its own kind (often valid, to reach the code behind validation) or any
JSON value at all; the server's limits (16 output tokens, 4 sequences) keep every case short.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hearth.engine_config import EngineConfig
from hearth.engine.async_engine import AsyncEngine
from hearth.engine.engine import LLMEngine
from hearth.server.app import build_app
from hearth.server.limits import ServerLimits
from hearth.server.protocol import ChatCompletionRequest, CompletionRequest
from test_server import NAME, folder, serving, wait_engine_idle  # noqa: F401 (folder: a fixture)

CASES = 250  # per route

ANY_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6)
SMALL_INT = st.integers(-3, 12)
PROBABILITY = st.one_of(st.floats(-0.5, 1.5), st.sampled_from([0.0, 1.0, float("nan"), float("inf")]))
TEXT = st.one_of(st.text(max_size=30), st.sampled_from(["Once upon a time", "<s>", "</s>", "<|im_start|>", "\x00"]))
TOKEN_IDS = st.lists(st.one_of(st.integers(0, 330), st.integers(-(2**40), 2**40)), max_size=12)
SCHEMA = st.one_of(st.just({"type": "object", "properties": {"a": {"type": "integer"}}}), ANY_JSON)

OWN_KIND = {
    "model": st.one_of(st.just(NAME), TEXT), "n": SMALL_INT, "best_of": SMALL_INT, "max_tokens": SMALL_INT,
    "max_completion_tokens": SMALL_INT, "min_tokens": SMALL_INT, "top_k": SMALL_INT, "logprobs": st.one_of(
        SMALL_INT, st.booleans()), "top_logprobs": SMALL_INT, "prompt_logprobs": SMALL_INT,
    "truncate_prompt_tokens": SMALL_INT, "temperature": PROBABILITY, "top_p": PROBABILITY, "min_p": PROBABILITY,
    "presence_penalty": PROBABILITY, "frequency_penalty": PROBABILITY, "repetition_penalty": PROBABILITY,
    "seed": st.integers(-(2**64), 2**64), "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3)),
    "stop_token_ids": TOKEN_IDS, "logit_bias": st.dictionaries(st.one_of(st.integers(-5, 400).map(str), TEXT),
                                                               PROBABILITY, max_size=3),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}),
    "prompt": st.one_of(TEXT, TOKEN_IDS, st.lists(TEXT, max_size=3), st.lists(TOKEN_IDS, max_size=3)),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "x"]),
                                                "content": st.one_of(TEXT, st.none(), st.lists(st.fixed_dictionaries(
                                                    {"type": st.just("text"), "text": TEXT}), max_size=2))}),
                         max_size=4),
    "response_format": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
                                 st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema":
                                                        st.fixed_dictionaries({"name": TEXT, "schema": SCHEMA})})),
    "guided_json": SCHEMA, "json_schema": SCHEMA, "guided_regex": st.sampled_from(["[a-z]+", "(", "a{1000000}"]),
    "guided_choice": st.lists(TEXT, max_size=3), "grammar": TEXT, "guided_grammar": TEXT,
    "watermark": st.fixed_dictionaries({"key": st.integers(-5, 2**33)}, optional={"delta": PROBABILITY,
                                                                                 "gamma": PROBABILITY}),
}


SANE = {  # values a real client sends: these bodies mostly pass validation and generate
    "n": st.integers(1, 2), "best_of": st.integers(1, 3), "max_tokens": st.integers(0, 8), "min_tokens": st.integers(0, 4),
    "temperature": st.floats(0, 1.5), "top_p": st.floats(0.05, 1), "top_k": st.integers(0, 50), "min_p": st.floats(0, 1),
    "logprobs": st.integers(0, 5), "top_logprobs": st.integers(0, 5), "prompt_logprobs": st.integers(0, 3),
    "seed": st.integers(0, 2**32), "echo": st.booleans(), "ignore_eos": st.booleans(), "stream": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
    "prompt": st.one_of(st.text(min_size=1, max_size=30), st.lists(st.integers(3, 300), min_size=1, max_size=12)),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                "content": st.text(max_size=30)}), min_size=1, max_size=3),
}


def bodies(model) -> st.SearchStrategy[dict]:
    """Bodies whose every field of `model` may appear, with a value of its own kind or any JSON;
    or bodies of sane values with a few fields of their own kind (reaching generation)."""
    fields = {name: st.one_of(OWN_KIND[name], ANY_JSON) if name in OWN_KIND else st.one_of(st.booleans(), ANY_JSON)
              for name in model.model_fields}
    required = "prompt" if "prompt" in fields else "messages"
    anything = st.fixed_dictionaries({required: OWN_KIND[required]},
                                     optional={k: v for k, v in fields.items() if k != required})
    sane = st.fixed_dictionaries({required: SANE[required]}, optional={
        k: v for k, v in SANE.items() if k != required and k in fields})
    own_kind = st.sets(st.sampled_from(sorted(set(OWN_KIND) & set(fields) - {required})), max_size=2).flatmap(
        lambda names: st.fixed_dictionaries({n: OWN_KIND[n] for n in names}))
    return st.one_of(anything, st.builds(lambda a, b: {**a, **b}, sane, own_kind))


@pytest.fixture(scope="module")
def fuzz_server(folder):  # noqa: F811
    engine = AsyncEngine(LLMEngine(folder, EngineConfig.from_options(max_num_seqs=8), progress=False), max_queue=64)
    limits = ServerLimits(max_output_tokens=16, max_sequences=4, request_timeout=20)  # (16: completions default)
    with serving(build_app(engine, NAME, limits=limits)) as url, httpx.Client(base_url=url, timeout=30) as http:
        yield http, engine
    engine.shutdown()


def check(http: httpx.Client, path: str, body: dict) -> None:
    content = json.dumps(body)  # NaN and Infinity as Python writes them: what a careless client sends
    with http.stream("POST", path, content=content, headers={"Content-Type": "application/json"}) as r:
        raw = r.read().decode()
    assert r.status_code < 500 or r.status_code == 503, f"{r.status_code} for {content}: {raw[:300]}"
    if r.status_code != 200:
        error = json.loads(raw)["error"]
        assert error["code"] == r.status_code and error["message"], raw
        return
    if not r.headers["content-type"].startswith("text/event-stream"):
        assert json.loads(raw)["choices"] is not None
        return
    events = [line.removeprefix("data: ") for line in raw.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", raw[-300:]
    for event in events[:-1]:
        data = json.loads(event)
        if "error" in data:
            assert 400 <= data["error"]["code"] < 500 or data["error"]["code"] == 503, event


@settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=bodies(CompletionRequest))
def test_completions_any_body(fuzz_server, body):
    check(fuzz_server[0], "/v1/completions", body)


@settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=bodies(ChatCompletionRequest))
def test_chat_completions_any_body(fuzz_server, body):
    check(fuzz_server[0], "/v1/chat/completions", body)


def test_after_the_fuzzing_every_kv_block_is_free(fuzz_server):
    http, engine = fuzz_server
    wait_engine_idle(engine)
    assert engine.engine.block_manager.check_all_free()
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
