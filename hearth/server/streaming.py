"""The one streaming path of both generation routes, and the transport under it.

`stream_response` turns the cumulative RequestOutputs of a route's requests into server-sent
events: per choice, what it gained since its last event (a `Delta`); the route's `ChunkFormat`
says how a delta reads as choice items (a completion's text and echo, a chat message's role
and content). Usage, the error event and `[DONE]` are the same for both.

A route starts its requests (a `Started`) and `respond` answers with the stream or, whole, the
JSON; `final_json` is the same JSON for a caller in this process (a batch's lines, batches.py).
A client that goes away aborts its requests: a stream is cancelled by Starlette, a
non-streaming request by `cancel_on_disconnect`'s watcher of the connection.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hearth.engine.async_engine import RequestStream
from hearth.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from hearth.server.errors import exception_body
from hearth.server.protocol import PREFILL_HEADER, hearth_fields, usage
from hearth.server.served import ServedModel


class SSEResponse(StreamingResponse):
    """Server-sent events; `on_close` runs however the response ends (even if it never started)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.on_close()


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def cancel_on_disconnect(request: Request, work: Awaitable[Response], on_close: Callable[[], None]) -> Response:
    """Run a non-streaming handler; if the client disconnects first, cancel it. `on_close` runs in any case."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():  # the client went first: cancel the work and let the cancellation land
            task.cancel()
            await asyncio.wait({task})
    finally:
        watcher.cancel()
        task.cancel()  # (nothing once done; here if this handler itself was cancelled)
        on_close()
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening
    return task.result()


@dataclass
class Delta:
    """What one choice gained since its last event."""

    prompt_index: int
    output: RequestOutput
    choice: CompletionOutput
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs]
    first: bool  # nothing of this choice was sent yet


class ChunkFormat(Protocol):
    object: str  # the chunks' "object"

    def items(self, delta: Delta) -> list[dict]:
        """The choice items this delta sends, one chunk each; none: wait for more."""


@dataclass
class StreamHeader:
    """The fields every chunk of a response repeats, and its usage options."""

    request_id: str
    created: int
    model: str
    include_usage: bool
    continuous_usage: bool


@dataclass
class Started:
    """A route's requests, in the engine: how they stream (header, fmt) and their whole JSON answer (reply)."""

    streams: list[RequestStream]
    header: StreamHeader
    fmt: ChunkFormat
    reply: Callable[[list[RequestOutput]], dict]  # the final outputs -> the non-streaming response's JSON


async def respond(request: Request, served: ServedModel, start: Callable[..., Awaitable[Started]], body) -> Response:
    """A generation route's HTTP answer: its requests started (`start(body, served, prefill source)`), then
    server-sent events, or the whole JSON once every request has finished."""
    started = await start(body, served, request.headers.get(PREFILL_HEADER))
    if body.stream:
        return stream_response(served, started.streams, started.fmt, started.header)

    async def collect() -> Response:
        return JSONResponse(started.reply(await served.final_outputs(started.streams)))

    return await cancel_on_disconnect(request, collect(), lambda: served.close(started.streams))


async def final_json(served: ServedModel, started: Started) -> dict:
    """The non-streaming answer's JSON, for a caller in this process; cancelling it aborts the requests."""
    try:
        return started.reply(await served.final_outputs(started.streams))
    finally:
        served.close(started.streams)


def stream_response(served: ServedModel, streams: list[RequestStream], fmt: ChunkFormat,
                    header: StreamHeader) -> SSEResponse:
    def chunk(choices: list[dict], usage_value: dict | None, extension: dict | None = None) -> str:
        data = {"id": header.request_id, "object": fmt.object, "created": header.created, "model": header.model,
                "choices": choices}
        if header.include_usage:
            data["usage"] = usage_value
        return sse(data | (extension or {}))

    async def events() -> AsyncIterator[str]:
        sent: dict[tuple[int, int], tuple[int, int]] = {}  # (prompt, choice) -> characters, tokens sent
        final: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, output in served.outputs(streams):
                if output.finished:
                    final[i] = output
                for c in output.outputs:
                    key = (i, c.index)
                    text_len, num_ids = sent.get(key, (0, 0))
                    delta = Delta(i, output, c, c.text[text_len:], c.token_ids[num_ids:],
                                  (c.logprobs or [])[num_ids:], key not in sent)
                    items = fmt.items(delta)
                    if not items:
                        continue
                    sent[key] = (len(c.text), len(c.token_ids))
                    for item in items:
                        yield chunk([item], usage([output]) if header.continuous_usage else None)
            extension = hearth_fields(final)  # a cascade's records: in the last chunk, as usage is
            if header.include_usage or extension:
                yield chunk([], usage(final), extension)
        except Exception as e:  # the headers are sent: the error is the stream's last event
            yield sse(exception_body(e)[1])
        yield "data: [DONE]\n\n"

    return SSEResponse(events(), lambda: served.close(streams))
