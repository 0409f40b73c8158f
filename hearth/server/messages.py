"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

A request translates into a chat completions request (`system` first, each message's text and
`image` blocks (as image_url parts: base64 ones as data URLs), `tool_use` blocks as the assistant's tool calls, `tool_result` blocks as tool messages; tools
and tool_choice, stop_sequences and the sampling fields) and runs as one (chat.py's start_chat);
the reply's blocks (turns.py) become content blocks: `text`, `tool_use`, and a `thinking` block
where the reply has reasoning. Streamed as Anthropic streams: message_start, then per block
content_block_start / content_block_delta (text_delta, input_json_delta, thinking_delta) /
content_block_stop (a ping after the first start), message_delta with the stop reason and usage,
message_stop. The key may come as `x-api-key` (middleware.py); errors on these routes are in
Anthropic's shape (errors.py).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from hearth.errors import RequestError
from hearth.server.chat import ChatRun, chat_prompt, start_chat, with_image_tokens
from hearth.server.errors import exception_body
from hearth.server.protocol import PREFILL_HEADER, ChatCompletionRequest, OpenAIModel, chat_content
from hearth.server.served import ServedModel, served
from hearth.server.streaming import SSEResponse, cancel_on_disconnect
from hearth.server.turns import (Block, BlockEvent, Finish, chat_tool, reply_deltas, sse_event, template_call,
                                whole_reply)

router = APIRouter()
Served = Annotated[ServedModel, Depends(served)]


class TextBlock(OpenAIModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(OpenAIModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(OpenAIModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""


class Base64Source(OpenAIModel):
    type: Literal["base64"]
    media_type: str
    data: str


class URLSource(OpenAIModel):
    type: Literal["url"]
    url: str


class ImageBlock(OpenAIModel):
    """An image (hearth/server/images.py reads it): base64 data, read as the data URL it makes, or a URL."""

    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]

    def url(self) -> str:
        s = self.source
        return s.url if isinstance(s, URLSource) else f"data:{s.media_type};base64,{s.data}"


class ThinkingBlock(OpenAIModel):
    """An earlier reply's thinking given back: chat templates leave past reasoning out, so does this."""

    type: Literal["thinking", "redacted_thinking"]


ContentBlock = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                         Field(discriminator="type")]


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


class InputMessage(OpenAIModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def chat_messages(self) -> list[dict[str, Any]]:
        """This message as chat messages: a user's tool results are tool messages before its text."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        text = chat_content([("text", b.text) if isinstance(b, TextBlock) else ("image", b.url())
                             for b in self.content if isinstance(b, (TextBlock, ImageBlock))])
        calls = [template_call(b.id, b.name, b.input) for b in self.content if isinstance(b, ToolUseBlock)]
        results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)}
                   for b in self.content if isinstance(b, ToolResultBlock)]
        if self.role == "assistant":
            if results:
                raise RequestError("tool_result blocks belong in a user message")
            return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
        if calls:
            raise RequestError("tool_use blocks belong in an assistant message")
        return results + ([{"role": "user", "content": text}] if text or not results else [])


class Tool(OpenAIModel):
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, ...) are not served
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    def chat(self) -> str | dict[str, Any]:
        if self.type != "tool":
            return {"auto": "auto", "any": "required", "none": "none"}[self.type]
        if self.name is None:
            raise RequestError('tool_choice of type "tool" needs the tool\'s name')
        return {"type": "function", "function": {"name": self.name}}


class CountTokensRequest(OpenAIModel):
    model: str
    messages: list[InputMessage]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    def chat_request(self, **sampling: Any) -> ChatCompletionRequest:
        system = [] if self.system is None else [{"role": "system", "content": _text(self.system)}]
        choice = self.tool_choice
        return ChatCompletionRequest.model_validate({
            "model": self.model, "messages": system + [m for message in self.messages for m in message.chat_messages()],
            "tools": [chat_tool(t.name, t.description, t.input_schema) for t in self.tools] if self.tools else None,
            "tool_choice": None if choice is None else choice.chat(),
            "parallel_tool_calls": None if choice is None else not choice.disable_parallel_tool_use, **sampling})


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False

    def sampling(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "stop": self.stop_sequences, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "stream": self.stream}


def content_block(block: Block, done: bool) -> dict[str, Any]:
    """A block as a content block: whole when done, else as its content_block_start shows it."""
    if block.kind == "call":
        return {"type": "tool_use", "id": block.call_id, "name": block.name,
                "input": json.loads(block.text or "{}") if done else {}}
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text if done else "", "signature": ""}
    return {"type": "text", "text": block.text if done else ""}


def block_delta(block: Block, text: str) -> dict[str, Any]:
    if block.kind == "call":
        return {"type": "input_json_delta", "partial_json": text}
    if block.kind == "reasoning":
        return {"type": "thinking_delta", "thinking": text}
    return {"type": "text_delta", "text": text}


def stop_reason(finish: Finish) -> tuple[str, str | None]:
    """Anthropic's stop_reason, and the stop sequence that ended the reply."""
    if finish.reason == "tool_calls":
        return "tool_use", None
    if finish.reason == "length":
        return "max_tokens", None
    if isinstance(finish.stop_reason, str):
        return "stop_sequence", finish.stop_reason
    return "end_turn", None


def message_object(run: ChatRun, content: list[dict], finish: Finish | None) -> dict[str, Any]:
    reason, sequence = (None, None) if finish is None else stop_reason(finish)
    return {"id": run.request_id, "type": "message", "role": "assistant", "model": run.model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": run.prompt_tokens,
                      "output_tokens": 0 if finish is None else finish.output_tokens}}


def event(kind: str, **fields: Any) -> str:
    """One of Anthropic's stream events: its type names the event and is in its data."""
    return sse_event(kind, {"type": kind, **fields})


def block_events(e: BlockEvent) -> list[str]:
    if e.type == "start":
        return [event("content_block_start", index=e.index, content_block=content_block(e.block, False))]
    if e.type == "delta":
        return [event("content_block_delta", index=e.index, delta=block_delta(e.block, e.delta))]
    return [event("content_block_stop", index=e.index)]


def stream_events(s: ServedModel, run: ChatRun, path: str) -> AsyncIterator[str]:
    async def events() -> AsyncIterator[str]:
        yield event("message_start", message=message_object(run, [], None))
        pinged = False  # the ping goes after the first block's start (or before the end of an empty reply)
        try:
            async for changes, finish in reply_deltas(s, run):
                for e in changes:
                    for text in block_events(e):
                        yield text
                    if not pinged:
                        pinged = True
                        yield event("ping")
                if finish is not None:
                    if not pinged:
                        yield event("ping")
                    reason, sequence = stop_reason(finish)
                    yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                                usage={"output_tokens": finish.output_tokens})
                    yield event("message_stop")
        except Exception as e:  # the headers are sent: the error is the stream's last event
            yield sse_event("error", exception_body(e, path)[1])

    return events()


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request, s: Served):
    run = await start_chat(body.chat_request(**body.sampling()),
                           s, f"msg_{uuid.uuid4().hex}", request.headers.get(PREFILL_HEADER))
    if body.stream:
        return SSEResponse(stream_events(s, run, request.url.path), lambda: s.close(run.streams))

    async def collect() -> Response:
        final = await s.final_outputs(run.streams)
        blocks, finish = whole_reply(run, final[0])
        return JSONResponse(message_object(run, [content_block(b, True) for b in blocks], finish))

    return await cancel_on_disconnect(request, collect(), lambda: s.close(run.streams))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, s: Served):
    chat = body.chat_request()
    s.check_model(chat.model)
    return {"input_tokens": len((await with_image_tokens(s, await chat_prompt(s, chat))).ids)}
