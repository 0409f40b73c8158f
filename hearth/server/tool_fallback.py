"""Tool calls for a model whose chat template has no place for tools (llama.cpp's generic format).

A template that renders the same prompt with and without `tools` (SmolLM2's, and many small
models') would hide them from the model, and "auto" would never call one. Then, with a warning in
the log (once per template), the tools go into the conversation's system message as their JSON
definitions, with an instruction to answer with one JSON object:

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]}   to call tools
    {"response": "the reply to the user"}                                             to answer

and the reply is constrained to that (llguidance, a JSON schema whose calls are each one of the
tools with its parameters' schema): "auto" lets the model choose between the two objects,
"required" allows only calls; one call a reply unless parallel_tool_calls is true. The reply is read back by
hearth/tool_calls.py's read_generic: calls as tool_calls, the response's text as content (streamed
as it is written). Earlier turns are written the same way: an assistant's tool calls as the
{"tool_calls": ...} object, a tool's result as a user message {"tool_result": {"tool_call_id",
"content"}}.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from hearth.sampling_params import StructuredOutputsParams
from hearth.server.tools import EMPTY_PARAMETERS, ToolCalling
from hearth.tool_calls import read_generic

logger = logging.getLogger("hearth")
_warned: set[int] = set()  # the templates already named in the log

# (the wording matters to a small model: this one makes SmolLM2-135M call for the weather in Paris, and
# answer a greeting or a request for a joke with a response)
INSTRUCTIONS = ('Answer with a JSON object: {"tool_calls": [{"name": "<function name>", "arguments": {<arguments>}}]} '
                'to call functions, or {"response": "<your reply>"} to reply to the user directly.')
REQUIRED_INSTRUCTIONS = ('Answer with a JSON object that calls functions: '
                         '{"tool_calls": [{"name": "<function name>", "arguments": {<arguments>}}]}.')


def template_drops_tools(render: Callable[..., str], messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                         template: str | None) -> bool:
    """Whether the template renders this conversation the same with and without the tools (then
    the generic format is used; the first time for a template, a warning says so)."""
    if render(messages, tools=tools) != render(messages, tools=None):
        return False
    if hash(template) not in _warned:
        _warned.add(hash(template))
        logger.warning("the model's chat template ignores `tools`: tools go into the system message in hearth's "
                       "generic JSON format and replies are constrained to it (docs/tool-calling.md)")
    return True


def generic_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]], required: bool) -> list[dict[str, Any]]:
    """The conversation with the tools in its system message (added first if it has none) and its
    tool calls and results written as text."""
    functions = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    block = f"You can call these functions:\n{functions}\n\n{REQUIRED_INSTRUCTIONS if required else INSTRUCTIONS}"
    out = [_as_text(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        result = {"tool_call_id": message.get("tool_call_id"), "content": message["content"]}
        return {"role": "user", "content": json.dumps({"tool_result": result}, ensure_ascii=False)}
    if message.get("tool_calls"):  # (the arguments are objects here: protocol's template_tool_call)
        calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message["tool_calls"]]
        text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
        return {"role": message["role"], "content": f"{message['content']}\n{text}" if message["content"] else text}
    return message


def generic_schema(tools: list[dict[str, Any]], required: bool, parallel: bool) -> StructuredOutputsParams:
    """The reply's constraint: the calls object (each call one of the tools), or also the response."""
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "arguments": t["function"].get("parameters") or EMPTY_PARAMETERS},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    call_object = {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
                   "additionalProperties": False}
    response = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                "additionalProperties": False}
    return StructuredOutputsParams(json=call_object if required else {"anyOf": [call_object, response]})



def generic_calling(calling: ToolCalling, tools: list[dict[str, Any]], choice: Any,
                    parallel_tool_calls: bool | None) -> ToolCalling:
    """The request's tool calling in the generic format; a named choice stays as it is (its reply
    is the function's arguments, constrained to their schema, whatever the model). One call per
    reply unless the request sets parallel_tool_calls (llama.cpp's default for such models: a small
    one, once allowed a list, repeats its call until max_tokens)."""
    if isinstance(choice, dict):
        return calling
    parallel = parallel_tool_calls is True
    return ToolCalling(read_generic, generic_schema(tools, choice == "required", parallel), parallel)
