"""Tool calling: the parsers on the formats the model families' own chat templates write, and
/v1/chat/completions with tools as OpenAI's client calls it (a tiny random model served live)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from hearth.chat_template import render_chat_template
from hearth.engine_config import EngineConfig
from hearth.engine.async_engine import AsyncEngine
from hearth.engine.engine import LLMEngine
from hearth.server.app import build_app
from hearth.server.tools import ToolCallStream, tool_calling
from hearth.tool_calls import PARSERS, parser_for
from models import make_hf_model
from test_server import serving

TEMPLATES = Path(__file__).resolve().parents[2] / "shared" / "data" / "chat_templates"
API_KEY, NAME = "sk-tools", "tiny-tools"

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}, "hours": {"type": "integer"}},
        "required": ["zone", "hours"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME}}]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CALLS = [{"id": "abcDEF123", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}},
         {"id": "xyz789ABC", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET", "hours": 2}}}]
USER = {"role": "user", "content": "Weather in Paris, and the time?"}

# template, parser it implies, calls it can write (Llama 3.1's templates write one call a turn)
FAMILIES = [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes", 2),
    ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", "hermes", 2),
    ("Qwen-Qwen3-0.6B.jinja", "hermes", 2),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3_json", 1),
    ("meta-llama-Llama-3.3-70B-Instruct.jinja", "llama3_json", 1),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral", 2),
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral", 2),
    ("openai-gpt-oss-120b.jinja", "gpt_oss", 1),  # harmony: a message per call, to=functions.NAME in its header
]
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "</s>")


def assistant_text(template: str, calls: list[dict]) -> str:
    """What the template writes for an assistant turn made of `calls`: the conversation with the
    turn, less the conversation up to the generation prompt, less the end of turn."""
    tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    prompt = render_chat_template(template, [USER], True, tools=TOOLS, **tokens)
    whole = render_chat_template(template, [USER, {"role": "assistant", "content": "", "tool_calls": calls}],
                                 False, tools=TOOLS, **tokens)
    assert whole.startswith(prompt)
    text = whole[len(prompt):]
    for end in END_OF_TURN:
        text = text.split(end)[0]
    return text


@pytest.mark.parametrize("name,parser,num_calls", FAMILIES)
def test_each_family_format_as_its_own_template_writes_it_parses_back(name, parser, num_calls):
    path = TEMPLATES / name
    if not path.exists():
        pytest.skip(f"real chat templates not found at {TEMPLATES}")
    template = path.read_text()
    assert parser_for(template) == parser
    calls = CALLS[:num_calls]
    text = assistant_text(template, calls)
    reply = PARSERS[parser](text, True)
    assert reply.valid_calls and "{" not in reply.content, text  # content: nothing, or Qwen 3's empty <think>
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    # streamed a few characters at a time: the deltas add up to the same calls, names whole
    calling = tool_calling(TOOLS, "auto", None, parser)
    stream, got = ToolCallStream(calling), defaultdict(lambda: {"name": None, "arguments": ""})
    for end in [*range(0, len(text), 3), len(text)]:
        for item in stream.delta(text[:end], end == len(text)).get("tool_calls", []):
            call = got[item["index"]]
            call["name"] = item.get("function", {}).get("name", call["name"])
            call["arguments"] += item["function"]["arguments"]
    assert [(c["name"], json.loads(c["arguments"])) for c in got.values()] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_plain_replies_stay_content_and_a_marker_is_held_back_until_it_is_one():
    for parser in PARSERS:
        reply = PARSERS[parser]("Paris is sunny {today}.", True)
        assert reply.content == "Paris is sunny {today}." and not reply.valid_calls
    assert PARSERS["hermes"]("It is <tool_", False).content == "It is "
    assert PARSERS["hermes"]("It is <tool_", True).content == "It is <tool_"
    assert PARSERS["mistral"]("[TOOL_CA", False).content == ""
    # a call cut short is no call: the reply reads as text
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    assert not PARSERS["hermes"](cut, True).valid_calls


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = make_hf_model(tmp_path_factory.mktemp("tools-model") / "llama", "llama")
    engine = AsyncEngine(LLMEngine(folder, EngineConfig(), progress=False))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with serving(build_app(engine, NAME, api_key=API_KEY)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0)


def ask(client, **kw):
    return client.chat.completions.create(model=NAME, messages=[USER], tools=TOOLS, max_tokens=400,
                                          temperature=1.0, **kw)


def streamed_calls(client, **kw) -> tuple[list[dict], str, dict[int, int]]:
    """The calls a stream adds up to (as OpenAI's clients add them), its finish reason, and how
    many chunks carried each call's arguments."""
    calls: dict[int, dict] = {}
    chunks: dict[int, int] = defaultdict(int)
    finish = None
    for chunk in ask(client, stream=True, **kw):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name  # the first delta names the call
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
            chunks[d.index] += bool(d.function.arguments)
    return list(calls.values()), finish, chunks


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_required_gives_valid_calls_streamed_or_not(client, seed):
    res = ask(client, tool_choice="required", seed=seed)
    for choice in res.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call.function.name, call.function.arguments)
    calls, finish, chunks = streamed_calls(client, tool_choice="required", seed=seed)
    assert finish == "tool_calls" and calls
    for call in calls:
        check_call(call["name"], call["arguments"])
    assert chunks[0] > 1  # the arguments came as they were written, not in one piece


def test_a_named_function_is_called_streamed_or_not(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    res = ask(client, tool_choice=choice, seed=4)
    [call] = res.choices[0].message.tool_calls
    assert call.function.name == "get_time" and res.choices[0].message.content is None
    check_call("get_time", call.function.arguments)
    calls, _, chunks = streamed_calls(client, tool_choice=choice, seed=5)
    assert [c["name"] for c in calls] == ["get_time"] and chunks[0] > 1
    check_call("get_time", calls[0]["arguments"])


def test_parallel_tool_calls_false_gives_one_call(client):
    for seed in range(3):
        res = ask(client, tool_choice="required", seed=seed, parallel_tool_calls=False)
        assert len(res.choices[0].message.tool_calls) == 1


def test_auto_reads_a_reply_in_the_model_format(client):
    # the tiny model's ChatML template names no format: hermes; a regex makes the model write one
    reply = r'Let me check\.\n<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)", "hours": [1-9]\}\}\n</tool_call>'
    res = ask(client, seed=6, extra_body={"guided_regex": reply})
    message = res.choices[0].message
    assert res.choices[0].finish_reason == "tool_calls" and message.content == "Let me check.\n"
    check_call("get_time", message.tool_calls[0].function.arguments)
    calls, finish, _ = streamed_calls(client, seed=6, extra_body={"guided_regex": reply})
    assert finish == "tool_calls" and [c["name"] for c in calls] == ["get_time"]
    assert calls[0]["arguments"] == message.tool_calls[0].function.arguments  # same seed, same reply
    plain = ask(client, seed=6, tool_choice="none", extra_body={"guided_regex": reply}).choices[0]
    assert plain.message.tool_calls is None and plain.message.content.startswith("Let me check.\n<tool_call>")


def test_a_chosen_parser_reads_its_format(engine):
    # `hearth serve --tool-call-parser mistral`: Mistral Small's format, special tokens kept in the text
    reply = r'\[TOOL_CALLS\]get_time\[ARGS\]\{"zone": "PST", "hours": [1-9]\}'
    with serving(build_app(engine, NAME, tool_call_parser="mistral")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        message = ask(client, seed=9, extra_body={"guided_regex": reply}).choices[0].message
    [call] = message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] == "PST"


def test_a_conversation_with_a_tool_result_continues(client, server):
    first = ask(client, tool_choice="required", seed=7, parallel_tool_calls=False).choices[0].message
    messages = [USER, first.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 degrees"} for c in first.tool_calls]
    res = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, max_tokens=20, seed=8)
    assert res.choices[0].finish_reason in ("stop", "length", "tool_calls") and res.usage.completion_tokens > 0
    # the tool's result reached the prompt
    tokens = httpx.post(server + "/tokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                        json={"model": NAME, "messages": messages, "tools": TOOLS}).json()["tokens"]
    detok = httpx.post(server + "/detokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": NAME, "tokens": tokens}).json()["prompt"]
    assert "sunny, 21 degrees" in detok


def test_tool_calls_in_the_conversation_reach_the_template_as_transformers_passes_them(server, tmp_path):
    path = TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"
    if not path.exists():
        pytest.skip(f"real chat templates not found at {TEMPLATES}")
    from transformers import PreTrainedTokenizerFast

    from models import make_tokenizer

    make_tokenizer(tmp_path)
    template = path.read_text()
    # OpenAI's clients send arguments as JSON text; transformers' templates take the object
    sent = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}} for c in CALLS]
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": sent},
                {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny"}]
    from hearth.server.protocol import ChatMessage

    ours = render_chat_template(template, [ChatMessage(**m).for_template() for m in messages], True, tools=TOOLS)
    reference = [USER, {"role": "assistant", "content": None, "tool_calls": CALLS}, messages[2]]
    theirs = PreTrainedTokenizerFast.from_pretrained(tmp_path).apply_chat_template(
        reference, tools=TOOLS, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert ours == theirs


@pytest.mark.parametrize("kw,message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "constrains the output already"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice needs tools"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_time", "arguments": "{not json"}}]}]},
     "not valid JSON"),
])
def test_bad_tool_requests_are_400s_naming_the_problem(client, kw, message):
    body = {"model": NAME, "messages": [USER], "tools": TOOLS, **kw}
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(**body)
