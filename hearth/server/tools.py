"""Tool calling in /v1/chat/completions: OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`.

tool_choice (default "auto" with tools, "none" without):
  "none"      the tools reach the chat template, the reply is plain content;
  "auto"      the reply is read in the served model's format (hearth/tool_calls.py): a reply that
              holds whole calls comes back as `tool_calls`, any other as content;
  "required"  the output is constrained (llguidance) to a JSON list of {"name", "parameters"}
              objects, one of the tools each, so it always parses (vLLM's way);
  a function  {"type": "function", "function": {"name": ...}}: the output is constrained to that
              function's parameters schema and is its arguments.
parallel_tool_calls=false: at most one call ("required": a list of one; "auto": the first).

Streamed as OpenAI streams calls: per call a delta with its index, id, type and name (and the
arguments written so far), then deltas of `arguments`.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import string
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from hearth.errors import RequestError
from hearth.sampling_params import SamplingParams, StructuredOutputsParams
from hearth.tool_calls import PARSERS, READS_CHANNELS, Reader, Reply, arguments_reader, read_call_list

_ID_CHARS = string.ascii_letters + string.digits
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class _Fields(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDefinition(_Fields):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Fields):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Fields):
    name: str


class NamedToolChoice(_Fields):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
_TOOLS = TypeAdapter(list[Tool])
_TOOL_CHOICE = TypeAdapter(ToolChoice | None)


def _checked(tools: list[dict[str, Any]] | None, choice: Any) -> tuple[list[Tool], Any]:
    try:
        checked = _TOOLS.validate_python(tools or [])
    except ValidationError as e:
        first = e.errors()[0]
        raise RequestError(f"invalid tools.{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    try:
        return checked, _TOOL_CHOICE.validate_python(choice)
    except ValidationError:
        raise RequestError('tool_choice must be "none", "auto", "required" or '
                           '{"type": "function", "function": {"name": ...}}') from None


def new_call_id() -> str:
    """9 letters and digits: Mistral's templates refuse any other tool call id in the conversation."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


def template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool call as chat templates read it: OpenAI sends the arguments
    as JSON text, templates expect the object (transformers' convention; vLLM does the same)."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError("a tool call in messages needs function.name")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise RequestError(f"the arguments of tool call {function['name']!r} are not valid JSON: {e}") from None
    return {**call, "function": {**function, "arguments": arguments}}


@dataclasses.dataclass
class ToolCalling:
    """How one request's replies are read, and what constrains them."""

    read: Reader
    constraint: StructuredOutputsParams | None  # "required" and named choices
    parallel: bool
    # the format is read from the whole reply, channels and all (gpt-oss's harmony: a call's recipient is
    # in its message's header), not from what a reasoning parser leaves as content
    reads_channels: bool = False

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        if self.constraint is None:  # "auto": a format's markers may be special tokens ([TOOL_CALLS])
            return dataclasses.replace(params, skip_special_tokens=False)
        if params.structured_outputs is not None:
            raise RequestError("this tool_choice constrains the output already (a required or named choice, or "
                               "tools in the generic format): give no response_format or guided_* with it")
        return dataclasses.replace(params, structured_outputs=self.constraint)

    def reply(self, text: str, final: bool) -> Reply:
        reply = self.read(text, final)
        if not self.parallel:
            reply.calls = reply.calls[:1]
        return reply

    def message(self, text: str) -> dict[str, Any]:
        """The non-streamed reply: tool calls when it holds whole calls, else its text."""
        reply = self.reply(text, True)
        if not reply.valid_calls:  # (a call cut short is no call: the reply reads as its text)
            return {"role": "assistant", "content": text if reply.calls and not self.reads_channels else reply.content}
        calls = [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in reply.calls]
        return {"role": "assistant", "content": reply.content if reply.content.strip() else None, "tool_calls": calls}


def tool_calling(tools: list[dict[str, Any]] | None, choice: Any, parallel: bool | None,
                 parser: str) -> ToolCalling | None:
    """The request's tool calling (None: plain replies); RequestError for what does not fit."""
    checked, choice = _checked(tools, choice)
    if not checked:
        if choice not in (None, "none"):
            raise RequestError("tool_choice needs tools")
        return None
    parallel = parallel is not False
    if choice == "none":
        return None
    if choice in (None, "auto"):
        return ToolCalling(PARSERS[parser], None, parallel, parser in READS_CHANNELS)
    functions = {t.function.name: t.function.parameters or EMPTY_PARAMETERS for t in checked}
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, parameters in functions.items()]
        schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        return ToolCalling(read_call_list, StructuredOutputsParams(json=schema), parallel)
    name = choice.function.name
    if name not in functions:
        raise RequestError(f"tool_choice names {name!r}, which is not among the tools: {', '.join(functions)}")
    return ToolCalling(arguments_reader(name), StructuredOutputsParams(json=functions[name]), parallel)


class ToolCallStream:
    """One choice's reply streamed: its content, then each call's id and name, then its arguments."""

    def __init__(self, calling: ToolCalling) -> None:
        self.calling = calling
        self.content_sent = 0
        self.calls_sent: list[int] = []  # per call: characters of its arguments sent

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        reply = self.calling.reply(text, final)
        delta: dict[str, Any] = {}
        if len(reply.content) > self.content_sent:
            delta["content"] = reply.content[self.content_sent:]
            self.content_sent = len(reply.content)
        items = []
        for i, call in enumerate(reply.calls):
            if call.name is None:
                break
            if i == len(self.calls_sent):
                self.calls_sent.append(len(call.arguments))
                items.append({"index": i, "id": new_call_id(), "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > self.calls_sent[i]:
                items.append({"index": i, "function": {"arguments": call.arguments[self.calls_sent[i]:]}})
                self.calls_sent[i] = len(call.arguments)
        if items:
            delta["tool_calls"] = items
        return delta

    @property
    def called(self) -> bool:
        return bool(self.calls_sent)
