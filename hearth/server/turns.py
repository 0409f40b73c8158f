"""A chat reply as the Responses and Messages APIs shape it: a sequence of blocks.

Both APIs answer with an ordered list of parts, each one kind: OpenAI's output items (a
`reasoning` item, a `message`, `function_call`s), Anthropic's content blocks (`thinking`,
`text`, `tool_use`). A reply of chat completions (its message, or its deltas as ToolCallStream
writes them: `reasoning_content`, `content`, `tool_calls`) reads as such blocks here, whole or
as start / delta / stop events while it streams; each API's module only names the blocks and
events in its own shapes. `reply_deltas` drives one ChatRun's stream (chat.py's start_chat).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from hearth.outputs import RequestOutput
from hearth.server.chat import ChatFormat, ChatRun
from hearth.server.served import ServedModel
from hearth.server.streaming import Delta
from hearth.server.tools import EMPTY_PARAMETERS

BlockKind = Literal["reasoning", "text", "call"]


@dataclass
class Block:
    kind: BlockKind
    text: str = ""  # the reasoning, the text, or a call's arguments (JSON text)
    call_id: str | None = None
    name: str | None = None


@dataclass
class BlockEvent:
    type: Literal["start", "delta", "stop"]
    index: int  # the block's place in the reply
    block: Block
    delta: str = ""


@dataclass
class Blocks:
    """Chat-shaped deltas read as blocks: a new kind (or a new call) closes the block before it."""

    blocks: list[Block] = field(default_factory=list)
    open: int | None = None
    calls: dict[int, int] = field(default_factory=dict)  # a chat tool call's index -> its block

    def _start(self, block: Block) -> list[BlockEvent]:
        events = self.stop()
        self.blocks.append(block)
        self.open = len(self.blocks) - 1
        return events + [BlockEvent("start", self.open, block)]

    def _add(self, index: int, text: str) -> BlockEvent:
        block = self.blocks[index]
        block.text += text
        return BlockEvent("delta", index, block, text)

    def _text(self, kind: BlockKind, text: str) -> list[BlockEvent]:
        if not text:
            return []
        events = [] if self.open is not None and self.blocks[self.open].kind == kind else self._start(Block(kind))
        return events + [self._add(self.open, text)]

    def feed(self, delta: dict[str, Any]) -> list[BlockEvent]:
        events = self._text("reasoning", delta.get("reasoning_content") or "")
        events += self._text("text", delta.get("content") or "")
        for i, call in enumerate(delta.get("tool_calls") or []):
            key, function = call.get("index", i), call["function"]  # a whole message's calls have no index
            if "id" in call:
                events += self._start(Block("call", "", call["id"], function["name"]))
                self.calls[key] = self.open
            if function.get("arguments"):
                events.append(self._add(self.calls[key], function["arguments"]))
        return events

    def stop(self) -> list[BlockEvent]:
        """Close the open block (at the end of the reply)."""
        if self.open is None:
            return []
        index, self.open = self.open, None
        return [BlockEvent("stop", index, self.blocks[index])]


def reply_blocks(message: dict[str, Any]) -> list[Block]:
    """A whole reply (a chat message) as blocks; a text of nothing is no block."""
    blocks = Blocks()
    blocks.feed(message)
    return blocks.blocks


@dataclass
class Finish:
    """How a reply ended, in chat completions' terms, and what it cost."""

    reason: str | None  # "stop", "length", "tool_calls", "abort"
    stop_reason: int | str | None  # the stop string or token that ended it
    input_tokens: int
    output_tokens: int
    cached_tokens: int

    @classmethod
    def of(cls, output: RequestOutput, called: bool) -> "Finish":
        c = output.outputs[0]
        return cls(ChatFormat.finish_reason(c, called), c.stop_reason, len(output.prompt_token_ids),
                   len(c.token_ids), output.num_cached_tokens)


def whole_reply(run: ChatRun, output: RequestOutput) -> tuple[list[Block], Finish]:
    """A finished ChatRun's reply as blocks, read as chat completions reads it."""
    message = run.fmt.response_choice(output.outputs[0])["message"]
    return reply_blocks(message), Finish.of(output, bool(message.get("tool_calls")))


async def reply_deltas(s: ServedModel, run: ChatRun) -> AsyncIterator[tuple[list[BlockEvent], Finish | None]]:
    """A ChatRun's reply as it streams: each step's block events (its deltas read as chat completions
    reads them: reasoning, content, tool calls), and at the end how it finished (the last open block
    stopped)."""
    blocks = Blocks()
    sent = 0
    async for _, output in s.outputs(run.streams):
        c = output.outputs[0]
        delta = run.fmt.message_delta(Delta(0, output, c, c.text[sent:], [], [], sent == 0))
        sent = len(c.text)
        events = blocks.feed(delta)
        if c.finish_reason is not None:
            yield events + blocks.stop(), Finish.of(output, run.fmt.called(c.index))
        elif events:
            yield events, None


def template_call(call_id: str, name: str, arguments: str | dict) -> dict[str, Any]:
    """A tool call of an earlier turn as a chat message carries it (arguments: JSON text or an object)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def sse_event(name: str, data: dict[str, Any]) -> str:
    """A server-sent event with its type named (both APIs name every event)."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def chat_tool(name: str, description: str | None, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function tool in chat completions' shape."""
    function = {"name": name, "parameters": parameters or EMPTY_PARAMETERS}
    if description is not None:
        function["description"] = description
    return {"type": "function", "function": function}

