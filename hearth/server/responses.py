"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request translates into a chat completions request (`instructions` and the `input` items into
messages, `input_image` parts as image_url parts, the flat function tools into chat tools,
`text.format` into a response_format) and runs as one (chat.py's start_chat); the reply's blocks
(turns.py) become output items: a `message` with one output_text part, `function_call`s, and a
`reasoning` item where the reply has reasoning.
Streamed, each item is told by OpenAI's typed events, numbered by `sequence_number`.

With `store` (the default) a finished response and the conversation it ends are kept in memory,
the last STORED_RESPONSES of them, for GET and for a later request's `previous_response_id`
(whose conversation the new input continues; `instructions` are not carried over, as OpenAI's).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Discriminator, Field, Tag

from hearth.errors import RequestError
from hearth.server.chat import ChatRun, start_chat
from hearth.server.errors import APIError, exception_body
from hearth.server.protocol import PREFILL_HEADER, ChatCompletionRequest, OpenAIModel, chat_content
from hearth.server.served import ServedModel, served
from hearth.server.streaming import SSEResponse, cancel_on_disconnect
from hearth.server.structured import JsonSchemaFormat
from hearth.server.tools import FunctionDefinition
from hearth.server.turns import (Block, BlockEvent, Finish, chat_tool, reply_deltas, sse_event, template_call,
                                whole_reply)

router = APIRouter()
STORED_RESPONSES = 1000  # responses kept for GET and previous_response_id, the oldest forgotten first


class TextPart(OpenAIModel):
    type: Literal["input_text", "output_text"]  # output_text: an earlier reply given back
    text: str


class ImagePart(OpenAIModel):
    """An image (hearth/server/images.py reads it): a data URL, or a URL; not an uploaded file's id."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides the size

    def url(self) -> str:
        if self.image_url is None:
            raise APIError(400, "an input_image needs its image_url (a data URL, or http(s)); file_id is not "
                                "taken by this server", "input")
        return self.image_url


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


def _content(content: str | list[ContentPart]) -> str | list[dict]:
    if isinstance(content, str):
        return content
    return chat_content([("text", p.text) if isinstance(p, TextPart) else ("image", p.url()) for p in content], "")


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningItem(OpenAIModel):
    """An earlier reply's reasoning given back: chat templates leave past reasoning out, so does this."""

    type: Literal["reasoning"]


def _item_type(item: Any) -> str:
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type)]


class FunctionTool(FunctionDefinition):
    """A function tool in the Responses API's flat shape: chat completions' function with its type."""

    type: Literal["function"]


class FunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(JsonSchemaFormat):
    type: Literal["text", "json_object", "json_schema"] = "text"


class TextConfig(OpenAIModel):
    format: TextFormat | None = None


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    store: bool | None = True  # null: the default
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    stream: bool | None = False

    def input_messages(self) -> list[dict[str, Any]]:
        """The input items as chat messages: a function call joins the assistant's message before it."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": _content(item.content)})
            elif isinstance(item, FunctionCallItem):
                if not messages or messages[-1]["role"] != "assistant":
                    messages.append({"role": "assistant", "content": ""})
                messages[-1].setdefault("tool_calls", []).append(template_call(item.call_id, item.name, item.arguments))
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _content(item.output)})
        return messages

    def response_format(self) -> dict[str, Any] | None:
        f = self.text.format if self.text is not None else None
        if f is None or f.type == "text":
            return None
        if f.type == "json_object":
            return {"type": "json_object"}
        if f.schema_ is None:
            raise RequestError("text.format of type json_schema needs a schema")
        return {"type": "json_schema", "json_schema": {"name": f.name, "schema": f.schema_, "strict": f.strict}}

    def chat_request(self, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = {"type": "function", "function": {"name": choice.name}}
        elif choice == "auto" and not self.tools:
            choice = None  # OpenAI's Responses API takes "auto" without tools (chat completions does not)
        system = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        tools = [chat_tool(t.name, t.description, t.parameters) for t in self.tools] if self.tools else None
        return ChatCompletionRequest.model_validate({
            "model": self.model, "messages": system + conversation, "tools": tools, "tool_choice": choice,
            "parallel_tool_calls": self.parallel_tool_calls, "response_format": self.response_format(),
            "max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "stream": self.stream})


class ResponseStore:
    """Finished responses and the conversations they end, the last `capacity` of them."""

    def __init__(self, capacity: int = STORED_RESPONSES) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        self.entries[response["id"]] = (response, conversation)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> tuple[dict, list[dict]]:
        if response_id not in self.entries:
            raise APIError(404, f"Response with id '{response_id}' not found.", param)
        return self.entries[response_id]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self.entries[response_id]


def store(request: Request) -> ResponseStore:
    return request.app.state.responses


_ITEM_PREFIX = {"text": "msg", "call": "fc", "reasoning": "rs"}


def output_item(block: Block, item_id: str, done: bool) -> dict[str, Any]:
    """A block as an output item: whole when done, else as its output_item.added event shows it."""
    status, text = ("completed", block.text) if done else ("in_progress", "")
    if block.kind == "call":
        return {"type": "function_call", "id": item_id, "call_id": block.call_id, "name": block.name,
                "arguments": text, "status": status}
    if block.kind == "reasoning":
        return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}] if done else []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [output_text(text)] if done else []}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reply_message(blocks: list[Block]) -> dict[str, Any]:
    """The reply as the conversation's next assistant message (for previous_response_id)."""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(b.text for b in blocks if b.kind == "text")}
    calls = [template_call(b.call_id, b.name, b.text) for b in blocks if b.kind == "call"]
    if calls:
        message["tool_calls"] = calls
    return message


class ResponseShape:
    """One response's object as it goes from created to completed: the request's settings echoed,
    its output items (ids given as the blocks start), usage."""

    def __init__(self, body: ResponsesRequest, run: ChatRun, created: int) -> None:
        self.body, self.run, self.created = body, run, created
        self.item_ids: list[str] = []

    def item_id(self, index: int, block: Block) -> str:
        if index == len(self.item_ids):
            self.item_ids.append(f"{_ITEM_PREFIX[block.kind]}_{uuid.uuid4().hex}")
        return self.item_ids[index]

    def snapshot(self, status: str, output: list[dict], finish: Finish | None = None) -> dict[str, Any]:
        b = self.body
        usage = None if finish is None else {
            "input_tokens": finish.input_tokens, "input_tokens_details": {"cached_tokens": finish.cached_tokens},
            "output_tokens": finish.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": finish.input_tokens + finish.output_tokens}
        choice = b.tool_choice.model_dump() if isinstance(b.tool_choice, FunctionChoice) else b.tool_choice or "auto"
        text_format = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else None
        return {
            "id": self.run.request_id, "object": "response", "created_at": self.created, "status": status,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.run.model,
            "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": b.store is not False, "temperature": b.temperature,
            "text": {"format": text_format or {"type": "text"}},
            "tool_choice": choice, "tools": [t.model_dump() for t in b.tools or []], "top_p": b.top_p,
            "truncation": "disabled", "usage": usage, "metadata": b.metadata or {}}

    def finished(self, blocks: list[Block], finish: Finish) -> dict[str, Any]:
        output = [output_item(block, self.item_id(i, block), True) for i, block in enumerate(blocks)]
        return self.snapshot("incomplete" if finish.reason == "length" else "completed", output, finish)


class ResponseEvents:
    """A streamed response's typed events, in OpenAI's order, numbered from 0."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape, self.sequence, self.blocks = shape, 0, []

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse_event(kind, data)

    def block(self, e: BlockEvent) -> list[str]:
        index, block = e.index, e.block
        item_id = self.shape.item_id(index, block)
        at = {"item_id": item_id, "output_index": index}
        part = {**at, "content_index": 0}
        if e.type == "start":
            self.blocks.append(block)
            events = [self.event("response.output_item.added", output_index=index,
                                 item=output_item(block, item_id, False))]
            if block.kind == "text":
                events.append(self.event("response.content_part.added", **part, part=output_text("")))
            return events
        if e.type == "delta":
            if block.kind == "call":
                return [self.event("response.function_call_arguments.delta", **at, delta=e.delta)]
            if block.kind == "reasoning":
                return [self.event("response.reasoning_text.delta", **part, delta=e.delta)]
            return [self.event("response.output_text.delta", **part, delta=e.delta, logprobs=[])]
        if block.kind == "call":
            events = [self.event("response.function_call_arguments.done", **at, name=block.name, arguments=block.text)]
        elif block.kind == "reasoning":
            events = [self.event("response.reasoning_text.done", **part, text=block.text)]
        else:
            events = [self.event("response.output_text.done", **part, text=block.text, logprobs=[]),
                      self.event("response.content_part.done", **part, part=output_text(block.text))]
        return events + [self.event("response.output_item.done", output_index=index,
                                    item=output_item(block, item_id, True))]


def _keep(responses: ResponseStore, body: ResponsesRequest, data: dict, conversation: list[dict],
          blocks: list[Block]) -> None:
    if body.store is not False:
        responses.put(data, conversation + [reply_message(blocks)])


def stream_events(s: ServedModel, run: ChatRun, shape: ResponseShape, responses: ResponseStore,
                  conversation: list[dict]) -> AsyncIterator[str]:
    async def events() -> AsyncIterator[str]:
        writer = ResponseEvents(shape)
        yield writer.event("response.created", response=shape.snapshot("in_progress", []))
        yield writer.event("response.in_progress", response=shape.snapshot("in_progress", []))
        try:
            async for block_events, finish in reply_deltas(s, run):
                for e in block_events:
                    for event in writer.block(e):
                        yield event
                if finish is not None:
                    data = shape.finished(writer.blocks, finish)
                    _keep(responses, shape.body, data, conversation, writer.blocks)
                    kind = "response.incomplete" if data["status"] == "incomplete" else "response.completed"
                    yield writer.event(kind, response=data)
        except Exception as e:  # the headers are sent: the error is the stream's last event
            error = exception_body(e)[1]["error"]
            yield writer.event("error", code=str(error["code"]), message=error["message"], param=error["param"])

    return events()


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, s: Annotated[ServedModel, Depends(served)],
                          responses: Annotated[ResponseStore, Depends(store)]):
    conversation = []
    if body.previous_response_id is not None:
        conversation = list(responses.get(body.previous_response_id, "previous_response_id")[1])
    conversation += body.input_messages()
    run = await start_chat(body.chat_request(conversation),
                           s, f"resp_{uuid.uuid4().hex}", request.headers.get(PREFILL_HEADER))
    shape = ResponseShape(body, run, int(time.time()))
    if body.stream:
        return SSEResponse(stream_events(s, run, shape, responses, conversation), lambda: s.close(run.streams))

    async def collect() -> Response:
        final = await s.final_outputs(run.streams)
        blocks, finish = whole_reply(run, final[0])
        data = shape.finished(blocks, finish)
        _keep(responses, body, data, conversation, blocks)
        return JSONResponse(data)

    return await cancel_on_disconnect(request, collect(), lambda: s.close(run.streams))


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, responses: Annotated[ResponseStore, Depends(store)]):
    return responses.get(response_id)[0]


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, responses: Annotated[ResponseStore, Depends(store)]):
    responses.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
