"""Anthropic's Messages API (/v1/messages) as the anthropic SDK sees it, on SmolLM2 served live:
every reply against chat completions on the same conversation at temperature 0."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from agent_apis import API_KEY, NAME, TIME, WEATHER, chat_reply, needs_smollm2, reasoning_then_text
from agent_apis import openai_client, server  # noqa: F401 (the fixtures)
from hearth.server.chat import ChatRun
from hearth.server.messages import block_events, content_block, event, message_object
from hearth.server.turns import Finish

pytestmark = needs_smollm2
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER},
         {"name": "get_time", "description": "The time in a zone", "input_schema": TIME}]
BRIEF = "Answer in one sentence."  # SmolLM2 then ends its reply within a few tokens
QUESTION = "What is the capital of France?"
GREEDY = {"extra_body": {"temperature": 0}}  # the SDK no longer names temperature; the API takes it


# the SDK is imported where a test uses it: its import (~2.5 s of CPU) is not paid by every xdist worker's collection


@pytest.fixture(scope="module")
def client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server, api_key=API_KEY, max_retries=0)  # the key as x-api-key


def test_create_reads_system_and_turns_as_chat_completions_does(client, openai_client):
    turns = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "Paris."},
             {"role": "user", "content": [{"type": "text", "text": "And of Italy?"}]}]
    m = client.messages.create(model=NAME, max_tokens=40, system=BRIEF, messages=turns, **GREEDY)
    ref = chat_reply(openai_client, [{"role": "system", "content": BRIEF}, turns[0], turns[1],
                                     {"role": "user", "content": "And of Italy?"}], max_tokens=40)
    assert m.type == "message" and m.role == "assistant" and m.model == NAME and m.id.startswith("msg_")
    [block] = m.content
    assert block.type == "text" and block.text == ref.choices[0].message.content
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert (m.usage.input_tokens, m.usage.output_tokens) == (ref.usage.prompt_tokens, ref.usage.completion_tokens)
    # system as text blocks reads the same; count_tokens counts the prompt that create ran
    blocks = client.messages.create(model=NAME, max_tokens=40, system=[{"type": "text", "text": BRIEF}],
                                    messages=turns, **GREEDY)
    assert blocks.content[0].text == block.text
    assert client.messages.count_tokens(model=NAME, system=BRIEF, messages=turns).input_tokens == m.usage.input_tokens
    cut = client.messages.create(model=NAME, max_tokens=2, system=BRIEF, messages=turns, **GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2


def test_stop_sequences_end_the_reply_with_stop_reason_stop_sequence(client):
    ask = {"model": NAME, "max_tokens": 40, "system": BRIEF, "messages": [{"role": "user", "content": QUESTION}]}
    whole = client.messages.create(**ask, **GREEDY).content[0].text
    m = client.messages.create(**ask, stop_sequences=["Paris", "never"], **GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Paris"
    assert m.content[0].text == whole[:whole.index("Paris")]


def test_stream_sends_anthropics_event_sequence_and_adds_up_to_the_reply(client, server):
    ask = {"model": NAME, "max_tokens": 40, "system": BRIEF, "messages": [{"role": "user", "content": QUESTION}]}
    whole = client.messages.create(**ask, **GREEDY)
    with client.messages.stream(**ask, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == whole.usage.output_tokens
    # the raw events: names and data types agree, a ping after the first block starts
    with httpx.stream("POST", server + "/v1/messages", json={**ask, "stream": True, "temperature": 0},
                      headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}) as res:
        lines = [line for line in res.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[0::2]]
    data = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert [d["type"] for d in data] == names
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    assert data[0]["message"]["usage"]["input_tokens"] == whole.usage.input_tokens
    assert data[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert data[-2]["usage"]["output_tokens"] == whole.usage.output_tokens


def test_a_tool_use_and_tool_result_round_trip(client, openai_client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = client.messages.create(model=NAME, max_tokens=60, tools=TOOLS, messages=ask,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               **GREEDY)
    [use] = m.content
    assert m.stop_reason == "tool_use" and use.type == "tool_use" and use.name in ("get_weather", "get_time")
    jsonschema.validate(use.input, WEATHER if use.name == "get_weather" else TIME)
    with client.messages.stream(model=NAME, max_tokens=60, tools=TOOLS, messages=ask, **GREEDY,
                                tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
                                ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert final.stop_reason == "tool_use" and final.content[0].type == "tool_use"
    assert json.loads(partial) == final.content[0].input and final.content[0].name == "get_weather"
    result = "21 degrees and sunny"
    turns = ask + [{"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}]
    # (tool_choice none: with auto, SmolLM2 calls the tool again, in both APIs)
    answer = client.messages.create(model=NAME, max_tokens=24, tools=TOOLS, tool_choice={"type": "none"},
                                    messages=turns, **GREEDY)
    ref = chat_reply(openai_client, ask + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": use.id, "type": "function", "function": {
            "name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": result}], max_tokens=24, tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "input_schema"}
                | {"parameters": t["input_schema"]}} for t in TOOLS])
    assert answer.content[0].text == ref.choices[0].message.content and answer.content[0].text
    assert answer.usage.input_tokens == ref.usage.prompt_tokens
    none = client.messages.create(model=NAME, max_tokens=40, system=BRIEF, tools=TOOLS, tool_choice={"type": "none"},
                                  messages=[{"role": "user", "content": QUESTION}], **GREEDY)
    assert none.stop_reason == "end_turn" and none.content[0].type == "text"


def test_errors_are_anthropics_shape_and_the_sdks_own_exceptions(client, server):
    import anthropic

    user = [{"role": "user", "content": "Hi"}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=NAME, max_tokens=0, messages=user)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-opus-4", max_tokens=5, messages=user)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="tool_choice needs tools"):
        client.messages.create(model=NAME, max_tokens=5, messages=user, tool_choice={"type": "any"})
    with pytest.raises(anthropic.BadRequestError, match="belong in an assistant"):
        client.messages.create(model=NAME, max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "get_time", "input": {}}]}])
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.count_tokens(
            model=NAME, messages=user)
    assert e.value.body["error"]["type"] == "authentication_error"
    missing = httpx.post(server + "/v1/messages", json={"model": NAME, "messages": user},
                         headers={"Authorization": f"Bearer {API_KEY}"})  # the key as a Bearer works here too
    assert missing.status_code == 400 and missing.json()["error"]["message"].endswith("max_tokens: Field required")


def test_reasoning_reads_as_a_thinking_block_before_the_text():
    """Where a reasoning parser gives `reasoning_content` (chat completions' name), it is a block of its
    own: the events as the route sends them, accumulated by the anthropic SDK's own stream reader."""
    from anthropic.lib.streaming._messages import accumulate_event

    changes = reasoning_then_text()
    run = ChatRun(NAME, "msg_1", 7, [], None)
    finish = Finish("stop", None, 7, 5, 0)
    sent = [event("message_start", message=message_object(run, [], None)),
            *(text for e in changes for text in block_events(e)),
            event("message_delta", delta={"stop_reason": "end_turn", "stop_sequence": None},
                  usage={"output_tokens": 5}),
            event("message_stop")]
    snapshot, buffers = None, {}
    for text in sent:
        data = json.loads(text.split("data: ", 1)[1])
        snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=buffers)
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in snapshot.content] == [
        ("thinking", "Paris, surely."), ("text", "Paris.")]
    whole = message_object(run, [content_block(e.block, True) for e in changes if e.type == "start"], finish)
    assert whole["content"][0] == {"type": "thinking", "thinking": "Paris, surely.", "signature": ""}
