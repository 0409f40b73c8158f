"""Tool calls in a model's reply: each model family's format read into content and calls, whole
or as far as a streamed text goes, and the format a chat template implies.

    read = PARSERS[parser_for(template)]       # or a name (`hearth serve --tool-call-parser`)
    reply = read(text, final)                   # final=False: a prefix of the reply, still growing
    reply.content, reply.calls                  # calls: name (None until written), arguments so far

The formats, as each family's chat template writes an assistant's tool calls:
  hermes       Hermes, Qwen 2.5/3:  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one per call
  llama3_json  Llama 3.1-3.3:       {"name": ..., "parameters": {...}} (after an optional <|python_tag|>), ';' between calls
  mistral      Mistral Nemo:        [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
               Mistral Small 3.2:   [TOOL_CALLS]name[CALL_ID]id[ARGS]{...}, once per call
  gpt_oss      gpt-oss (harmony):   <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json
                                    <|message|>{...}<|call|> (the recipient in the channel's header or after
                                    the role, as the template writes it); read from the whole reply, channels
                                    and all (`reads_channels`): final and commentary messages without a
                                    recipient are content, analysis messages reasoning (not content here:
                                    hearth/reasoning.py's gpt_oss split gives them)

A call's arguments are the reply's own JSON text (so a streamed call's argument deltas add up to
the final arguments). While a text grows, a tail that may become a format's marker is held back
from the content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from hearth.reasoning import HARMONY_ENDS

_DECODER = json.JSONDecoder()
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_WHITESPACE = re.compile(r"\s*")


@dataclass
class CallText:
    name: str | None  # None until the name is written whole
    arguments: str  # the arguments' JSON text as far as written
    complete: bool = False


@dataclass
class Reply:
    content: str
    calls: list[CallText] = field(default_factory=list)

    @property
    def valid_calls(self) -> bool:
        """Every call whole, named, with a JSON object for arguments (so the reply is tool calls)."""
        return bool(self.calls) and all(c.complete and c.name and _is_object(c.arguments) for c in self.calls)


Reader = Callable[[str, bool], Reply]


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _json_end(text: str, start: int) -> int | None:
    """Where the JSON value at text[start] ends; None while it is incomplete (or not JSON)."""
    try:
        return _DECODER.raw_decode(text, start)[1]
    except ValueError:
        return None


def _skip_space(text: str, pos: int) -> int:
    return _WHITESPACE.match(text, pos).end()


def _held(text: str, marker: str, final: bool) -> str:
    """`text` less a tail that is the start of `marker` (it may be one when more text comes)."""
    if not final:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                return text[:-k]
    return text


def _object_call(text: str, start: int) -> tuple[CallText, int | None]:
    """The call in the JSON object at text[start] and where the object ends (None: not yet)."""
    end = _json_end(text, start)
    stop = len(text) if end is None else end
    name, args = _NAME.search(text, start, stop), _ARGUMENTS.search(text, start, stop)
    if end is not None:
        obj = json.loads(text[start:end])
        if not isinstance(obj, dict):
            return CallText(None, "", True), end
        value = obj.get("arguments", obj.get("parameters"))
        arguments = json.dumps(value, ensure_ascii=False)
        if args is not None:  # the reply's own text, when the key found is the object's own
            args_end = _json_end(text, args.end())
            if args_end is not None and json.loads(text[args.end():args_end]) == value:
                arguments = text[args.end():args_end]
        name_value = obj.get("name")
        return CallText(name_value if isinstance(name_value, str) else None, arguments, True), end
    if name is None or (args is not None and args.start() < name.start()):
        return CallText(None, ""), None  # the name may still come (or be an argument's)
    arguments = "" if args is None else text[args.end():_json_end(text, args.end())]  # the object may go on past them
    return CallText(json.loads(f'"{name.group(1)}"'), arguments), None


def _calls_from(text: str, pos: int, separator: str) -> list[CallText]:
    """Calls in JSON objects from `pos`, `separator` between them (',' in a list, ';' for Llama)."""
    calls: list[CallText] = []
    while True:
        pos = _skip_space(text, pos)
        if pos >= len(text) or text[pos] != "{":
            return calls
        call, end = _object_call(text, pos)
        calls.append(call)
        if end is None:
            return calls
        pos = _skip_space(text, end)
        if not text.startswith(separator, pos):
            return calls
        pos += len(separator)


def read_hermes(text: str, final: bool) -> Reply:
    marker = "<tool_call>"
    start = text.find(marker)
    if start < 0:
        return Reply(_held(text, marker, final))
    reply = Reply(text[:start])
    while start >= 0:
        pos = _skip_space(text, start + len(marker))
        if not text.startswith("{", pos):
            break
        call, end = _object_call(text, pos)
        reply.calls.append(call)
        if end is None:
            break
        start = text.find(marker, end)
    return reply


def read_llama3_json(text: str, final: bool) -> Reply:
    tag = "<|python_tag|>"
    pos = _skip_space(text, 0)
    if text.startswith(tag, pos):
        pos += len(tag)
    elif not text.startswith("{", pos):
        return Reply("" if not final and tag.startswith(text[pos:]) else text)
    return Reply("", _calls_from(text, pos, ";"))


def read_mistral(text: str, final: bool) -> Reply:
    marker, call_id, args = "[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"
    start = text.find(marker)
    if start < 0:
        return Reply(_held(text, marker, final))
    reply = Reply(text[:start])
    pos = _skip_space(text, start + len(marker))
    if text.startswith("[", pos):  # Nemo: a JSON list of calls
        reply.calls = _calls_from(text, pos + 1, ",")
        return reply
    while start >= 0:  # Small 3.2: name[CALL_ID]id[ARGS]{...} after each marker
        begin = start + len(marker)
        args_at = text.find(args, begin)
        if args_at < 0:
            break
        name = text[begin:args_at].split(call_id)[0].strip()
        args_start = _skip_space(text, args_at + len(args))
        args_end = _json_end(text, args_start)
        reply.calls.append(CallText(name, text[args_start:args_end], args_end is not None))
        if args_end is None:
            break
        start = text.find(marker, args_end)
    return reply


_HARMONY_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_HARMONY_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


def _held_harmony(text: str, final: bool) -> str:
    """`text` less a tail that may become one of harmony's markers."""
    return text if final else min((_held(text, marker, False) for marker in HARMONY_ENDS), key=len)


def read_harmony(text: str, final: bool) -> Reply:
    """gpt-oss's harmony reply, message by message (header, <|message|>, body, an end marker): a message
    to functions.NAME is a call of NAME with its body for arguments (a call cut short or not a JSON
    object is content once the reply is whole); final and commentary messages without a recipient are
    content; analysis ones, and messages to tools other than the functions, are neither."""
    reply, pos = Reply(""), 0
    while (at := text.find("<|message|>", pos)) >= 0:
        header, start = text[pos:at], at + len("<|message|>")
        ends = [i for i in (text.find(m, start) for m in HARMONY_ENDS) if i >= 0]
        end = min(ends, default=-1)
        body = text[start:end] if end >= 0 else _held_harmony(text[start:], final)
        recipient, channel = _HARMONY_RECIPIENT.search(header), _HARMONY_CHANNEL.search(header)
        if recipient is not None:
            call = CallText(recipient.group(1), body.strip(), end >= 0 or final)
            if not call.complete or _is_object(call.arguments):
                reply.calls.append(call)
            else:
                reply.content += body
        elif (channel is None or channel.group(1) != "analysis") and "to=" not in header:
            reply.content += body
        if end < 0:
            return reply
        marker = next(m for m in HARMONY_ENDS if text.startswith(m, end))
        pos = end if marker in ("<|start|>", "<|channel|>") else end + len(marker)  # (those begin the next header)
    if final and not reply.calls and "<|channel|>" not in text[pos:]:  # a reply without messages: its text
        reply.content += text[pos:].replace("<|start|>", "").removeprefix("assistant")
    return reply


PARSERS: dict[str, Reader] = {"hermes": read_hermes, "llama3_json": read_llama3_json, "mistral": read_mistral,
                              "gpt_oss": read_harmony}
# the formats read from the whole reply, channels and all, rather than from a reasoning parser's content
READS_CHANNELS = ("gpt_oss",)


def parser_for(template: str | None) -> str:
    """The format a chat template writes tool calls in; hermes (the most common) when it says none."""
    for marker, name in (("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"), ("<|channel|>commentary", "gpt_oss"),
                         ('"parameters"', "llama3_json")):
        if template and marker in template:
            return name
    return "hermes"


# ---- the replies of constrained tool choices (hearth/server/tools.py builds their schemas)


def read_call_list(text: str, final: bool) -> Reply:
    """tool_choice "required": a JSON list of {"name", "parameters"} objects."""
    pos = _skip_space(text, 0)
    return Reply("", _calls_from(text, pos + 1, ",") if text.startswith("[", pos) else [])


def arguments_reader(name: str) -> Reader:
    """A named tool_choice: the whole reply is the named function's arguments."""

    def read(text: str, final: bool) -> Reply:
        start = _skip_space(text, 0)
        return Reply("", [CallText(name, text[start:], _json_end(text, start) is not None)])

    return read


_RESPONSE = re.compile(r'\{\s*"response"\s*:\s*"')


def read_generic(text: str, final: bool) -> Reply:
    """The generic format of models whose template has no tools (hearth/server/tool_fallback.py): one
    JSON object, {"tool_calls": [{"name", "arguments"}, ...]} or {"response": text}; while the
    response's string grows, its content is as much of it as decodes."""
    start = _skip_space(text, 0)
    calls = re.match(r'\{\s*"tool_calls"\s*:\s*\[', text[start:])
    if calls is not None:
        return Reply("", _calls_from(text, start + calls.end(), ","))
    response = _RESPONSE.match(text, start)
    if response is None:
        return Reply(text if final else "")
    end = _json_end(text, response.end() - 1)
    if end is not None:
        return Reply(json.loads(text[response.end() - 1:end]))
    return Reply(_partial_string(text[response.end():]))


def _partial_string(body: str) -> str:
    """A JSON string's text so far (without its opening quote), less an escape cut short."""
    for cut in range(0, min(6, len(body)) + 1):
        try:
            return json.loads(f'"{body[:len(body) - cut]}"')
        except ValueError:
            continue
    return ""
