"""Tool calls from a model whose chat template has no tools (hearth/server/tool_fallback.py):
SmolLM2-135M-Instruct, whose template renders the same prompt with and without them, served live
and called with OpenAI's client."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import openai
import pytest

from hearth.engine_config import EngineConfig
from hearth.engine.async_engine import AsyncEngine
from hearth.engine.engine import LLMEngine
from hearth.server import tool_fallback
from hearth.server.app import build_app
from hearth.tool_calls import read_generic
from test_server import serving

GGUF = (Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "smollm2-135m-instruct"
        / "SmolLM2-135M-Instruct.Q4_1.gguf")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_the_generic_reply_reads_as_calls_or_content_as_it_grows():
    calls = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", ' \
            '"arguments": {"city": "Rome"}}]}'
    reply = read_generic(calls, True)
    assert reply.valid_calls and [json.loads(c.arguments) for c in reply.calls] == [{"city": "Paris"}, {"city": "Rome"}]
    response = json.dumps({"response": 'Hello "there" \u00e9\n'})
    grown = [read_generic(response[:i], False).content for i in range(len(response) + 1)]
    assert grown[-1] == read_generic(response, True).content == 'Hello "there" \u00e9\n'
    assert all(b.startswith(a) for a, b in zip(grown, grown[1:]))  # content only grows: streamable


@pytest.fixture(scope="module")
def client():
    if not GGUF.exists():
        pytest.skip(f"reference data not found: {GGUF}")
    engine = AsyncEngine(LLMEngine(GGUF, EngineConfig.from_options(kv_cache_memory=64 << 20), progress=False))
    with serving(build_app(engine, "smollm2")) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    engine.shutdown()


def streamed(client, **kw) -> tuple[list[dict], str, str]:
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(model="smollm2", stream=True, **kw):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
            calls[d.index]["arguments"] += d.function.arguments or ""
    return list(calls.values()), content, finish


def test_smollm2_calls_the_weather_tool_for_paris(client, caplog):
    tool_fallback._warned.clear()
    with caplog.at_level(logging.WARNING, logger="hearth"):
        res = client.chat.completions.create(model="smollm2", messages=PARIS, tools=[WEATHER], tool_choice="auto",
                                             temperature=0, max_tokens=60)
    assert "chat template ignores `tools`" in caplog.text
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    calls, content, finish = streamed(client, messages=PARIS, tools=[WEATHER], temperature=0, max_tokens=60)
    assert finish == "tool_calls" and content == ""
    assert calls == [{"name": "get_weather", "arguments": call.function.arguments}]


def test_auto_answers_with_text_and_the_conversation_goes_on_after_a_result(client):
    # greedy's first choice here leads the next by ~0.4 nats on every kernel path (AVX2 groups, VNNI tiles, cold or
    # after a prefix hit); "Hello! How are you?" was a near-tie (0.04) that the int8 activations' rounding flipped
    hello = [{"role": "user", "content": "What is 2 + 2?"}]
    res = client.chat.completions.create(model="smollm2", messages=hello, tools=[WEATHER], temperature=0,
                                         max_tokens=60)
    message = res.choices[0].message
    assert res.choices[0].finish_reason == "stop" and message.tool_calls is None and message.content.strip()
    assert "{" not in message.content  # the text of the response, not its JSON
    _, content, finish = streamed(client, messages=hello, tools=[WEATHER], temperature=0, max_tokens=60)
    assert (content, finish) == (message.content, "stop")
    # the call and its result go back as text in the generic format; the reply is constrained as before
    turn = [*PARIS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "abc123XYZ", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "abc123XYZ", "content": "sunny, 21 degrees"}]
    res = client.chat.completions.create(model="smollm2", messages=turn, tools=[WEATHER], tool_choice="required",
                                         temperature=0, max_tokens=60, parallel_tool_calls=False)
    assert res.choices[0].finish_reason == "tool_calls" and len(res.choices[0].message.tool_calls) == 1


def test_a_request_s_own_chat_template_needs_the_server_s_trust(client):
    with pytest.raises(openai.BadRequestError, match="trust-request-chat-template"):
        client.chat.completions.create(model="smollm2", messages=PARIS, max_tokens=1,
                                       extra_body={"chat_template": "{{ messages[0].content }}"})
