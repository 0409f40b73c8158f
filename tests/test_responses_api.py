"""OpenAI's Responses API (/v1/responses) as the openai SDK's `client.responses` sees it, on SmolLM2
served live: every reply against chat completions on the same conversation at temperature 0."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from agent_apis import API_KEY, NAME, TIME, WEATHER, chat_reply, needs_smollm2, reasoning_then_text
from agent_apis import openai_client, server  # noqa: F401 (the fixtures)
from hearth.server.chat import ChatRun
from hearth.server.responses import ResponseEvents, ResponseShape, ResponsesRequest
from hearth.server.turns import Finish

pytestmark = needs_smollm2
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "description": "The time in a zone", "parameters": TIME}]
QUESTION = "What is the capital of France?"
BRIEF = "Answer in one sentence."  # SmolLM2 then ends its reply within a few tokens


def test_create_reads_instructions_and_input_as_chat_completions_does(openai_client):
    r = openai_client.responses.create(model=NAME, instructions=BRIEF, input=QUESTION,
                                       temperature=0, max_output_tokens=40)
    ref = chat_reply(openai_client, [{"role": "system", "content": BRIEF},
                                     {"role": "user", "content": QUESTION}], max_tokens=40)
    assert r.object == "response" and r.status == "completed" and r.model == NAME and r.id.startswith("resp_")
    assert r.output_text == ref.choices[0].message.content and "Paris" in r.output_text
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (ref.usage.prompt_tokens, ref.usage.completion_tokens)
    assert r.usage.total_tokens == ref.usage.total_tokens and r.usage.output_tokens_details.reasoning_tokens == 0
    # input as items: a developer message is the system's, an earlier reply given back as output_text
    items = [{"role": "developer", "content": BRIEF},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": r.output_text}]},
             {"role": "user", "content": "And of Italy?"}]
    r2 = openai_client.responses.create(model=NAME, input=items, temperature=0, max_output_tokens=40)
    ref2 = chat_reply(openai_client, [{"role": "system", "content": BRIEF},
                                      {"role": "user", "content": QUESTION},
                                      {"role": "assistant", "content": r.output_text},
                                      {"role": "user", "content": "And of Italy?"}], max_tokens=40)
    assert r2.output_text == ref2.choices[0].message.content
    assert r2.usage.input_tokens == ref2.usage.prompt_tokens
    # cut at max_output_tokens: incomplete, as OpenAI says it
    short = openai_client.responses.create(model=NAME, input=QUESTION, temperature=0, max_output_tokens=3)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.output_tokens == 3


def test_stream_sends_the_typed_events_in_order_and_adds_up_to_the_reply(openai_client):
    whole = openai_client.responses.create(model=NAME, input=QUESTION, instructions=BRIEF, temperature=0,
                                           max_output_tokens=40)
    with openai_client.responses.stream(model=NAME, input=QUESTION, instructions=BRIEF, temperature=0,
                                        max_output_tokens=40) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == final.output_text == events[-2].item.content[0].text
    assert events[0].response.status == "in_progress" and final.status == "completed"
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}
    assert openai_client.responses.retrieve(final.id).output[0].content[0].text == text  # stored when streamed too


def test_previous_response_id_continues_the_conversation_and_store_keeps_retrieve_and_delete(openai_client):
    first = openai_client.responses.create(model=NAME, instructions=BRIEF, input=QUESTION, temperature=0,
                                           max_output_tokens=30)
    second = openai_client.responses.create(model=NAME, previous_response_id=first.id, input="And of Germany?",
                                            temperature=0, max_output_tokens=30)
    # instructions are not carried over (OpenAI's rule): the conversation without its system message
    ref = chat_reply(openai_client, [{"role": "user", "content": QUESTION},
                                     {"role": "assistant", "content": first.output_text},
                                     {"role": "user", "content": "And of Germany?"}], max_tokens=30)
    assert second.output_text == ref.choices[0].message.content and second.previous_response_id == first.id
    assert second.usage.input_tokens == ref.usage.prompt_tokens
    got = openai_client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.usage == first.usage
    openai_client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        openai_client.responses.create(model=NAME, previous_response_id=first.id, input="Hi", max_output_tokens=5)
    unstored = openai_client.responses.create(model=NAME, input="Hi", store=False, max_output_tokens=5)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(unstored.id)
    nulls = openai_client.responses.create(model=NAME, input="Hi", max_output_tokens=5, tool_choice="auto",
                                           extra_body={"store": None, "stream": None})  # null: the defaults
    assert openai_client.responses.retrieve(nulls.id).id == nulls.id


def test_a_function_tool_round_trip_with_function_call_output(openai_client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = openai_client.responses.create(model=NAME, input=ask, tools=TOOLS, temperature=0, max_output_tokens=60,
                                       tool_choice={"type": "function", "name": "get_weather"})
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with openai_client.responses.stream(model=NAME, input=ask, tools=TOOLS, tool_choice="required", temperature=0,
                                        max_output_tokens=60) as stream:
        events = list(stream)
        final = stream.get_final_response()
    [streamed] = final.output
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert streamed.type == "function_call" and arguments == done.arguments == streamed.arguments
    assert [e.type for e in events][2] == "response.output_item.added" and events[2].item.type == "function_call"
    # the result goes back as a function_call_output item after the call (given back as an item)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}
    answer = openai_client.responses.create(model=NAME, input=ask + [call.model_dump(exclude_none=True), result],
                                            tools=TOOLS, tool_choice="none", temperature=0, max_output_tokens=60)
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    ref = chat_reply(openai_client, ask + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temperature": 21}'}], max_tokens=60,
        tools=chat_tools, tool_choice="none")  # (with "auto", SmolLM2 calls the tool again, in both APIs)
    assert answer.output_text == ref.choices[0].message.content and answer.output_text
    assert answer.usage.input_tokens == ref.usage.prompt_tokens
    # ... or with previous_response_id: the stored conversation holds the call
    again = openai_client.responses.create(model=NAME, previous_response_id=r.id, input=[result], tools=TOOLS,
                                           tool_choice="none", temperature=0, max_output_tokens=60)
    assert again.output_text == answer.output_text


def test_text_format_json_schema_constrains_the_reply(openai_client):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}}, "required": ["capital"],
              "additionalProperties": False}
    r = openai_client.responses.create(model=NAME, input=QUESTION, instructions=BRIEF, max_output_tokens=40,
                                       temperature=0,
                                       text={"format": {"type": "json_schema", "name": "capital", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize("kw, status, message", [
    ({"tools": [{"type": "web_search"}]}, 400, "tools.0"),
    ({"tool_choice": "required"}, 400, "tool_choice needs tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "needs a schema"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "neither a data URL"),
    ({"model": "gpt-4o"}, 404, "does not exist"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
])
def test_bad_requests_are_errors_in_openai_shape(server, kw, status, message):
    body = {"model": NAME, "input": "Hi", **kw}
    res = httpx.post(server + "/v1/responses", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert res.status_code == status and message in res.json()["error"]["message"]
    assert set(res.json()["error"]) == {"message", "type", "param", "code"}


def test_reasoning_reads_as_a_reasoning_item_before_the_message():
    """Where a reasoning parser gives `reasoning_content` (chat completions' name), it is an item of its
    own: the events as the route sends them, read by the openai SDK's own stream state."""
    changes = reasoning_then_text()
    shape = ResponseShape(ResponsesRequest(input="Hi"), ChatRun(NAME, "resp_1", 7, [], None), 0)
    writer = ResponseEvents(shape)
    sent = [writer.event("response.created", response=shape.snapshot("in_progress", [])),
            *(text for e in changes for text in writer.block(e))]
    finished = shape.finished(writer.blocks, Finish("stop", None, 7, 5, 0))
    sent.append(writer.event("response.completed", response=finished))
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    kinds = []
    for text in sent:
        data = json.loads(text.split("data: ", 1)[1])
        for e in state.handle_event(construct_type(type_=ResponseStreamEvent, value=data)):
            kinds.append(e.type)
    assert kinds[:4] == ["response.created", "response.output_item.added", "response.reasoning_text.delta",
                         "response.reasoning_text.done"]
    final = state._completed_response
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == "Paris."
    assert final.output[0].content[0].text == "Paris, surely." and final.usage.total_tokens == 12


@pytest.mark.slow  # importing openai-agents alone takes 3 s of CPU (13 s on a busy machine); 6 model calls
def test_an_openai_agents_runner_completes_a_two_tool_loop(server):
    """The openai-agents runner drives the loop: a call, its output given back, the next call, then
    the answer. SmolLM2's template drops tools, so the hooks name the tool each turn asks for
    (get_weather, then get_time, then none); the rest is the runner's own traffic, streamed or not."""
    import agents  # openai-agents, in the test extras (imported here: 3 s of CPU)

    called = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(("get_weather", city))
        return "21 degrees and sunny"

    @agents.function_tool
    def get_time(zone: Literal["CET", "UTC", "PST"]) -> str:
        """The time in a time zone."""
        called.append(("get_time", zone))
        return "14:00"

    class NextTool(agents.RunHooks):
        async def on_tool_end(self, context, agent, tool, result) -> None:
            choice = "get_time" if tool.name == "get_weather" else "none"
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice=choice)

    async def run(streamed: bool) -> str:
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0)
        settings = agents.ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=24)
        agent = agents.Agent(name="assistant", instructions=BRIEF, tools=[get_weather, get_time],
                             model_settings=settings, model=agents.OpenAIResponsesModel(NAME, client),
                             reset_tool_choice=False)
        question = "What is the weather in Paris, and the time in CET?"
        if not streamed:
            return (await agents.Runner.run(agent, question, hooks=NextTool(), max_turns=4)).final_output
        result = agents.Runner.run_streamed(agent, question, hooks=NextTool(), max_turns=4)
        async for _ in result.stream_events():
            pass
        return result.final_output

    agents.set_tracing_disabled(True)
    answer = asyncio.run(run(streamed=False))
    assert [name for name, _ in called] == ["get_weather", "get_time"] and called[0][1]
    assert isinstance(answer, str) and answer
    called.clear()
    assert asyncio.run(run(streamed=True)) == answer and [name for name, _ in called] == ["get_weather", "get_time"]
