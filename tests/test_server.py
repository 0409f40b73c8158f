"""The HTTP server, as OpenAI's own client sees it, against a live server on 127.0.0.1.

A tiny random llama (tests/models.py) serves in-process on a free port; the offline LLM on
the same folder is the reference for greedy text, logprobs and token counts. One test runs
the real `hearth serve` command and stops it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from hearth import LLM, SamplingParams
from hearth.engine.async_engine import AsyncEngine
from hearth.engine.engine import LLMEngine
from hearth.engine_config import EngineConfig
from hearth.server.app import build_app
from hearth.server.connections import uvicorn_config
from hearth.server.limits import ServerLimits
from models import make_hf_model

API_KEY = "sk-hearth-test"
NAME = "tiny-llama"
REPO = Path(__file__).resolve().parents[1]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Once upon a time"},
    {"role": "assistant", "content": "there was a fox."},
    {"role": "user", "content": "The quick brown fox"},
]


@contextlib.contextmanager
def serving(app, limits: ServerLimits = ServerLimits()):
    """Run `app` under uvicorn, as `hearth serve` configures it, on a free port in a thread; yields its base URL."""
    server = uvicorn.Server(uvicorn_config(app, limits, host="127.0.0.1", port=0, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("server-model") / "llama", "llama")


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder, progress=False)


@pytest.fixture(scope="module")
def server(folder):
    engine = AsyncEngine(LLMEngine(folder, EngineConfig(), progress=False))
    with serving(build_app(engine, NAME, api_key=API_KEY)) as url:
        yield url, engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def metric_values(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics").text
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def wait_idle(url: str, engine: AsyncEngine, timeout: float = 20.0) -> None:
    """Until the gauges say nothing runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metric_values(url)
        if (m[("hearth:num_requests_running", ())] == 0 and m[("hearth:num_requests_waiting", ())] == 0
                and engine.engine.block_manager.check_all_free()):
            return
        time.sleep(0.05)
    raise AssertionError("the server did not become idle")


def wait_engine_idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (engine.num_running or engine.num_waiting) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not (engine.num_running or engine.num_waiting)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


# ---------------------------------------------------------------- completions


def test_models_health_and_version(server, client):
    url, _ = server
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(url + "/health").status_code == 200  # open without the key
    assert httpx.get(url + "/version").json()["version"]


def test_completions_greedy_stream_equals_offline(client, llm):
    prompts = ["Once upon a time", "def fibonacci(n):"]
    ids_prompt = llm.get_tokenizer().encode("The quick brown fox")
    expected = llm.generate(prompts + [ids_prompt], greedy(max_tokens=24, ignore_eos=True), use_tqdm=False)
    res = client.completions.create(model=NAME, prompt=prompts, max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(res.choices, key=lambda c: c.index)] == [e.outputs[0].text for e in expected[:2]]
    assert all(c.finish_reason == "length" for c in res.choices)
    tok = llm.get_tokenizer()
    assert res.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert res.usage.completion_tokens == 48 and res.usage.total_tokens == res.usage.prompt_tokens + 48

    res = client.completions.create(model=NAME, prompt=ids_prompt, max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert res.choices[0].text == expected[2].outputs[0].text

    texts: dict[int, str] = {0: "", 1: ""}
    chunks, usage = 0, None
    for chunk in client.completions.create(model=NAME, prompt=prompts, max_tokens=24, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            chunks += bool(c.text)
    assert [texts[0], texts[1]] == [e.outputs[0].text for e in expected[:2]]
    assert chunks > 2  # deltas, not one blob per prompt
    assert (usage.prompt_tokens, usage.completion_tokens) == (sum(len(tok.encode(p)) for p in prompts), 48)


def test_completion_stop_string_and_seeded_sampling(client, llm):
    full = llm.generate(["Once upon a time"], greedy(max_tokens=16, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    stop = full[5:8]
    res = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=16, temperature=0, stop=[stop])
    assert res.choices[0].text == full[: full.index(stop)]
    assert res.choices[0].finish_reason == "stop"

    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    expected = [c.text for c in llm.generate(["Once"], params, use_tqdm=False)[0].outputs]
    res = client.completions.create(model=NAME, prompt="Once", n=2, temperature=1.0, seed=7, max_tokens=12,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(res.choices, key=lambda c: c.index)] == expected
    assert res.usage.completion_tokens == 24

    params = SamplingParams(n=1, best_of=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    expected = llm.generate(["Once"], params, use_tqdm=False)[0].outputs[0].text
    res = client.completions.create(model=NAME, prompt="Once", best_of=3, temperature=1.0, seed=3, max_tokens=8,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in res.choices] == [expected]


def test_echo_logprobs_max_tokens_zero_scores_the_prompt(client, llm):
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 0."""
    prompt = "The quick brown fox jumps"
    tok = llm.get_tokenizer()
    ids = tok.encode(prompt)
    expected = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)[0]
    res = client.completions.create(model=NAME, prompt=prompt, echo=True, logprobs=1, max_tokens=0, temperature=0)
    choice = res.choices[0]
    assert choice.text == prompt
    lp = choice.logprobs
    assert lp.tokens == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i, token_id in enumerate(ids[1:], start=1):
        assert lp.token_logprobs[i] == pytest.approx(expected.prompt_logprobs[i][token_id], abs=1e-4)
        assert 1 <= len(lp.top_logprobs[i]) <= 2
        assert max(lp.top_logprobs[i].values()) >= lp.token_logprobs[i] - 1e-6
    assert res.usage.prompt_tokens == len(ids) and res.usage.completion_tokens == 0

    # with generation: the prompt's logprobs, then the completion's
    res = client.completions.create(model=NAME, prompt=prompt, echo=True, logprobs=2, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    gen = llm.generate([prompt], greedy(max_tokens=4, ignore_eos=True, logprobs=2), use_tqdm=False)[0].outputs[0]
    lp = res.choices[0].logprobs
    assert res.choices[0].text == prompt + gen.text
    assert len(lp.tokens) == len(ids) + 4
    for got, token_id, entry in zip(lp.token_logprobs[len(ids):], gen.token_ids, gen.logprobs):
        assert got == pytest.approx(entry[token_id], abs=1e-4)


# ---------------------------------------------------------------- chat


def test_chat_greedy_stream_equals_offline_with_usage(client, llm):
    expected = llm.chat(MESSAGES, greedy(max_tokens=40, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    prompt_tokens = len(llm.render_chat(MESSAGES))
    res = client.chat.completions.create(model=NAME, messages=MESSAGES, max_completion_tokens=40, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert res.object == "chat.completion"
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == expected.text
    assert res.choices[0].finish_reason == "length"
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (prompt_tokens, 40)

    text, roles, content_chunks, usage, finish = "", [], 0, None, None
    stream = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=40, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            text += c.delta.content or ""
            content_chunks += bool(c.delta.content)
            finish = c.finish_reason or finish
    assert text == expected.text and roles == ["assistant"] and finish == "length"
    assert content_chunks > 1
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (prompt_tokens, 40, prompt_tokens + 40)


def test_chat_logprobs_and_n(client, llm):
    expected = llm.chat(MESSAGES, greedy(max_tokens=6, ignore_eos=True, logprobs=3), use_tqdm=False)[0].outputs[0]
    res = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=3, extra_body={"ignore_eos": True})
    content = res.choices[0].logprobs.content
    assert len(content) == 6
    for item, token_id, entry in zip(content, expected.token_ids, expected.logprobs):
        assert item.logprob == pytest.approx(entry[token_id], abs=1e-4)
        assert len(item.top_logprobs) == 3
        best = sorted(entry.values(), reverse=True)[:3]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(best, abs=1e-4)
        assert item.top_logprobs[0].logprob >= item.logprob - 1e-6  # greedy took the best token

    params = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=5, ignore_eos=True)
    expected = [c.text for c in llm.chat(MESSAGES[:2], params, use_tqdm=False)[0].outputs]
    res = client.chat.completions.create(model=NAME, messages=MESSAGES[:2], max_tokens=5, n=3, temperature=0.8,
                                         seed=11, extra_body={"ignore_eos": True})
    assert [c.message.content for c in sorted(res.choices, key=lambda c: c.index)] == expected
    assert res.usage.completion_tokens == 15


def test_vllm_sampling_extras(client, llm):
    tok = llm.get_tokenizer()
    forced = tok.encode("fox", add_special_tokens=False)[0]
    res = client.completions.create(model=NAME, prompt="Once", max_tokens=5, temperature=0,
                                    logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert res.choices[0].text == tok.decode([forced] * 5)
    ids = tok.encode("Once upon a time there was a little fox")
    expected = llm.generate([ids[-4:]], greedy(max_tokens=6, ignore_eos=True, top_k=5, repetition_penalty=1.3),
                            use_tqdm=False)[0].outputs[0].text
    res = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0, extra_body={
        "ignore_eos": True, "truncate_prompt_tokens": 4, "top_k": 5, "repetition_penalty": 1.3, "unknown_field": 1})
    assert res.choices[0].text == expected and res.usage.prompt_tokens == 4
    # contrastive search by transformers' names (tests/test_contrastive_search.py checks its tokens)
    search = SamplingParams(penalty_alpha=0.6, top_k=4, max_tokens=6, ignore_eos=True)
    expected = llm.chat(MESSAGES, search, use_tqdm=False)[0].outputs[0].text
    res = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=6, extra_body={
        "ignore_eos": True, "penalty_alpha": 0.6, "top_k": 4})
    assert res.choices[0].message.content == expected
    with pytest.raises(openai.BadRequestError, match="top_k"):
        client.completions.create(model=NAME, prompt="Once", max_tokens=2, extra_body={"penalty_alpha": 0.6})


def test_tokenize_and_detokenize(server, llm):
    url, _ = server
    tok = llm.get_tokenizer()
    body = httpx.post(url + "/tokenize", json={"model": NAME, "prompt": "Once upon a time", "return_token_strs": True},
                      headers=auth()).json()
    assert body["tokens"] == tok.encode("Once upon a time") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512 and body["token_strs"] == [tok.id_to_piece(i) for i in body["tokens"]]
    body = httpx.post(url + "/tokenize", json={"messages": MESSAGES}, headers=auth()).json()
    assert body["tokens"] == llm.render_chat(MESSAGES)
    body = httpx.post(url + "/detokenize", json={"tokens": tok.encode("hello world")}, headers=auth()).json()
    assert body == {"prompt": "hello world"}


# ---------------------------------------------------------------- structured output

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


def test_response_format_json_schema_gives_valid_json_streamed_or_not(client, llm):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    res = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=300, temperature=1.0, n=3, seed=1,
                                         response_format=response_format)
    for choice in res.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=300, temperature=1.0, seed=2, stream=True,
        response_format=response_format) if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    res = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=300, temperature=1.0, seed=3,
                                         response_format={"type": "json_object", "schema": PERSON})  # llama.cpp's
    jsonschema.validate(json.loads(res.choices[0].message.content), PERSON)
    # any object: a random model's keys and strings run long unless closing them is likelier
    closers = {str(t): 5 for text in ('"', "}") for t in llm.get_tokenizer().encode(text, add_special_tokens=False)}
    res = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=300, temperature=1.0, seed=3,
                                         response_format={"type": "json_object"}, logit_bias=closers)
    assert isinstance(json.loads(res.choices[0].message.content), dict)


@pytest.mark.parametrize("extra,check", [
    ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    ({"guided_regex": r"[0-9]{2}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{2}-[a-z]{2}", t)),
    ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"structured_outputs": {"choice": ["x", "y"]}}, lambda t: t in ("x", "y")),
    ({"guided_grammar": 'root ::= "a" [0-9]'}, lambda t: re.fullmatch(r"a[0-9]", t)),
    ({"grammar": 'root ::= ("yes" | "no") "!"'}, lambda t: t in ("yes!", "no!")),  # llama.cpp
    ({"json_schema": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),  # llama.cpp
])
def test_every_way_of_asking_for_structure(client, extra, check):
    res = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=300, temperature=1.0, seed=4,
                                    extra_body=extra)
    assert res.choices[0].finish_reason == "stop" and check(res.choices[0].text), res.choices[0].text


def test_a_schema_or_grammar_that_cannot_compile_is_a_400_naming_the_problem(client):
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "object", "properties": 5}}}
    with pytest.raises(openai.BadRequestError, match="properties must be an object"):
        client.chat.completions.create(model=NAME, messages=MESSAGES, response_format=bad)
    with pytest.raises(openai.BadRequestError, match="unclosed group"):
        client.completions.create(model=NAME, prompt="hi", extra_body={"guided_regex": "a(b"})
    with pytest.raises(openai.BadRequestError, match="undefined_rule"):
        client.completions.create(model=NAME, prompt="hi", extra_body={"grammar": "root ::= undefined_rule"})
    with pytest.raises(openai.BadRequestError, match="json_schema.schema"):
        client.chat.completions.create(model=NAME, messages=MESSAGES,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(openai.BadRequestError, match="not several"):
        client.completions.create(model=NAME, prompt="hi", extra_body={"guided_regex": "a", "guided_choice": ["b"]})


def test_watermark_field_marks_the_reply(client, llm):
    from hearth.watermark import detect

    res = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=200, temperature=1.0, seed=5,
                                    extra_body={"ignore_eos": True, "watermark": {"key": 99}})
    ids = llm.get_tokenizer().encode(res.choices[0].text, add_special_tokens=False)
    assert detect(ids, 99).z > 4
    with pytest.raises(openai.BadRequestError, match="gamma"):
        client.completions.create(model=NAME, prompt="hi", extra_body={"watermark": {"key": 1, "gamma": 2}})


def test_tokenizer_info_lets_a_remote_client_tokenize(server, llm, folder):
    """What lm-eval's remote tokenizer reads, checked against transformers' own tokenizer of the folder."""
    from transformers import AutoTokenizer

    url, _ = server
    info = httpx.get(url + "/tokenizer_info", headers=auth()).json()
    reference = AutoTokenizer.from_pretrained(folder)
    assert (info["eos_token"], info["bos_token"]) == (reference.eos_token, reference.bos_token)
    assert info["chat_template"] == reference.chat_template and info["model_max_length"] == 512
    ids = httpx.post(url + "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False},
                     headers=auth()).json()["tokens"]
    assert ids == [reference.eos_token_id]


# ---------------------------------------------------------------- metrics, faults


def test_metrics_count_a_request(server, client):
    url, engine = server
    wait_idle(url, engine)
    before = metric_values(url)
    res = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    after = metric_values(url)

    def delta(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert delta("hearth:prompt_tokens_total") == res.usage.prompt_tokens
    assert delta("hearth:generation_tokens_total") == 7
    assert delta("hearth:request_success_total", (("finished_reason", "length"),)) == 1
    for name in ("hearth:time_to_first_token_seconds", "hearth:request_time_per_output_token_seconds",
                 "hearth:e2e_request_latency_seconds", "hearth:request_queue_time_seconds"):
        assert delta(name + "_count") == 1, name
    assert delta("hearth:prefix_cache_queries_total") >= res.usage.prompt_tokens
    for name in ("hearth:num_requests_running", "hearth:num_requests_waiting", "hearth:kv_cache_usage_perc",
                 "hearth:prefix_cache_hit_rate", "hearth:prefix_cache_hits_total", "hearth:num_preemptions_total"):
        assert (name, ()) in after, name


@pytest.mark.parametrize("method", ["ngram", "draft", "draft tree"])
def test_speculative_decoding_metrics_and_opt_out(folder, llm, method):
    """A server with prompt-lookup speculation, or a draft model (the target itself; and with token
    trees of three branches): greedy replies equal plain offline decoding, the spec_decode counters
    (vLLM's names) count the guesses, and "speculative": false opts out."""
    options = (dict(speculative_method="ngram", prompt_lookup_min=1) if method == "ngram"
               else dict(speculative_method="draft", speculative_model=str(folder)))
    options |= dict(speculative_tree_width=3) if method.endswith("tree") else {}
    config = EngineConfig.from_options(speculative_adaptive=False, **options)
    engine = AsyncEngine(LLMEngine(folder, config, progress=False))
    with serving(build_app(engine, NAME, api_key=API_KEY)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        prompt = "one two three one two three one two"
        expected = llm.generate(prompt, greedy(max_tokens=16, ignore_eos=True), use_tqdm=False)[0].outputs[0].text

        def ask(**extra):
            return client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0,
                                             extra_body={"ignore_eos": True, **extra}).choices[0].text

        before = metric_values(url)
        assert ask() == expected
        after = metric_values(url)
        drafts = after[("hearth:spec_decode_num_draft_tokens_total", ())]
        accepted = after[("hearth:spec_decode_num_accepted_tokens_total", ())]
        assert drafts > before.get(("hearth:spec_decode_num_draft_tokens_total", ()), 0) and 0 < accepted <= drafts
        assert after[("hearth:spec_decode_num_drafts_total", ())] > 0
        assert after[("hearth:spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),))] > 0
        assert ask(speculative=False) == expected
        assert metric_values(url)[("hearth:spec_decode_num_draft_tokens_total", ())] == drafts
    engine.shutdown()


def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(server, client):
    url, _ = server
    post = lambda path, **kw: httpx.post(url + path, headers={**auth(), **kw.pop("headers", {})}, **kw)  # noqa: E731

    def error(r, status):
        assert r.status_code == status, r.text
        body = r.json()["error"]
        assert body["message"] and body["code"] == status and body["type"]
        return body["message"]

    error(post("/v1/completions", content=b'{"prompt": "hi", ', headers={"Content-Type": "application/json"}), 400)
    error(post("/v1/chat/completions", content=b"not json", headers={"Content-Type": "application/json"}), 400)
    assert "max_tokens" in error(post("/v1/completions", json={"prompt": "hi", "max_tokens": "many"}), 400)
    error(post("/v1/completions", json={"prompt": {"text": "hi"}}), 400)
    error(post("/v1/chat/completions", json={"messages": "hello"}), 400)
    assert "temperature" in error(post("/v1/completions", json={"prompt": "hi", "temperature": -1}), 400)
    assert "top_p" in error(post("/v1/chat/completions", json={"messages": MESSAGES, "top_p": 7}), 400)
    error(post("/v1/completions", json={"prompt": "hi", "logprobs": 99}), 400)
    error(post("/v1/completions", json={"prompt": [5, 100000]}), 400)
    error(post("/v1/completions", json={"prompt": []}), 400)
    error(post("/v1/completions", json={"prompt": "hi", "seed": 2**70}), 400)
    error(post("/v1/completions", json={"prompt": "hi", "n": 0}), 400)
    error(post("/v1/completions", json={"prompt": "hi", "stop": [""]}), 400)
    assert "message" in error(post("/v1/chat/completions", json={"messages": []}), 400)
    error(post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400)
    error(post("/detokenize", json={"tokens": [-1]}), 400)
    error(httpx.get(url + "/v1/nothing-here", headers=auth()), 404)

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=NAME, prompt=list(range(5, 305)) * 2, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=600)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=NAME, messages=MESSAGES, temperature=-1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[])

    assert httpx.post(url + "/v1/completions", json={"prompt": "hi"}).status_code == 401
    assert error(httpx.post(url + "/v1/completions", json={"prompt": "hi"},
                            headers={"Authorization": "Bearer wrong"}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(url + "/metrics").status_code == 200

    res = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=3)
    assert res.usage.completion_tokens <= 3 and res.choices[0].finish_reason in ("stop", "length")


def test_64_concurrent_streams_then_32_disconnects_free_everything(server):
    url, engine = server
    wait_idle(url, engine)
    before = metric_values(url)

    async def main():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)

        async def chat(i: int) -> tuple[str, str]:
            text, finish = "", None
            stream = await client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": f"story {i}"}], max_tokens=16 + i % 8,
                temperature=0.7, seed=i, stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                for c in chunk.choices:
                    text += c.delta.content or ""
                    finish = c.finish_reason or finish
            return text, finish

        results = await asyncio.gather(*(chat(i) for i in range(64)))
        assert all(finish == "length" for _, finish in results)
        await client.close()

        async with httpx.AsyncClient(base_url=url, headers=auth(), timeout=30) as http:
            async def disconnect(i: int) -> None:
                body = {"model": NAME, "messages": [{"role": "user", "content": f"long {i}"}], "max_tokens": 450,
                        "ignore_eos": True, "stream": True}
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    seen = 0
                    async for line in r.aiter_lines():
                        seen += line.startswith("data:")
                        if seen == 2:
                            break  # leaving the block closes the connection mid-stream

            await asyncio.gather(*(disconnect(i) for i in range(32)))

    asyncio.run(main())
    wait_idle(url, engine)  # running gauge back to 0 and every KV block free
    after = metric_values(url)
    key = ("hearth:request_success_total", (("finished_reason", "abort"),))
    assert after[key] - before.get(key, 0) == 32
    assert after[("hearth:kv_cache_usage_perc", ())] == 0.0


def check_image_options(client: openai.OpenAI) -> None:
    """The image options reach the server: its pixel limit, and the one host it fetches from (which
    does not resolve: the fetch is tried and fails, where another host is refused)."""
    from io import BytesIO

    from PIL import Image

    png = BytesIO()
    Image.new("RGB", (11, 10)).save(png, "PNG")
    for url, expected in ((f"data:image/png;base64,{base64.b64encode(png.getvalue()).decode()}",
                           "110 pixels; this server's limit is 100"),
                          ("https://images.invalid/cat.png", "https://images.invalid/cat.png"),
                          ("https://other.invalid/cat.png", "does not fetch images from other.invalid")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=NAME, max_tokens=4, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
        message = caught.value.body["message"]
        assert expected in message and ("does not fetch" in message) == ("other" in url), message


def test_hearth_serve_prints_serves_and_exits_on_sigterm(folder):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hearth.cli", "serve", str(folder), "--port", "0", "--served-model-name", NAME,
         "--no-access-log", "--kv-cache-memory", "4MiB", "--max-image-pixels", "100", "--image-fetch-timeout", "1",
         "--allowed-media-domains", "images.invalid"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("listening"):
                break
        banner = "".join(lines)
        assert "listening" in banner, banner
        assert str(folder) in banner and NAME in banner
        assert "8,192 tokens" in banner  # 4 MiB / 512 bytes per token
        url = line.split()[1].removesuffix("/v1")
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4).choices[0].message
        check_image_options(client)
        with httpx.stream("POST", url + "/v1/completions", timeout=30,
                          json={"prompt": "hi", "max_tokens": 100, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"  # the open request was let finish
        assert proc.wait(timeout=30) == 0
        tail = proc.stdout.read()
        assert "stopped" in tail and "POST /v1/" not in tail  # --no-access-log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
