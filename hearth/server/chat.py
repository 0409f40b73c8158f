"""POST /v1/chat/completions: the conversation through the chat template, one engine request."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from hearth.outputs import CompletionOutput
from hearth.server.protocol import ChatCompletionRequest, chat_logprobs, prompt_logprobs_json, usage
from hearth.server.served import PREFILL_HEADER, ServedModel, served
from hearth.server.streaming import Delta, StreamHeader, cancel_on_disconnect, stream_response
from hearth.server.tools import ToolCalling, ToolCallStream, tool_calling

router = APIRouter()


class ChatFormat:
    """A chat choice streams as OpenAI's: a role delta first, then content deltas (and, with tool
    calling, the deltas of its tool calls)."""

    object = "chat.completion.chunk"

    def __init__(self, served: ServedModel, k: int | None, calling: ToolCalling | None = None) -> None:
        self.served, self.k, self.calling = served, k, calling
        self.tool_streams: dict[int, ToolCallStream] = {}  # per choice index

    def message_delta(self, d: Delta) -> dict:
        if self.calling is None:
            return {"content": d.text} if d.text else {}
        stream = self.tool_streams.setdefault(d.choice.index, ToolCallStream(self.calling))
        return stream.delta(d.choice.text, d.choice.finish_reason is not None)

    @staticmethod
    def finish_reason(c: CompletionOutput, called: bool) -> str | None:
        return "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason

    def logprobs(self, ids: list[int], entries: list) -> dict | None:
        return None if self.k is None else {"content": chat_logprobs(self.served.piece, ids, entries, self.k)}

    def items(self, d: Delta) -> list[dict]:
        c = d.choice
        items = [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}] if d.first else []
        delta = self.message_delta(d)
        if delta or (self.k is not None and d.token_ids) or c.finish_reason:
            called = c.index in self.tool_streams and self.tool_streams[c.index].called
            item = {"index": c.index, "delta": delta, "logprobs": self.logprobs(d.token_ids, d.logprobs),
                    "finish_reason": self.finish_reason(c, called)}
            if c.finish_reason is not None:
                item["stop_reason"] = c.stop_reason
            items.append(item)
        return items

    def response_choice(self, c: CompletionOutput) -> dict:
        message = {"role": "assistant", "content": c.text} if self.calling is None else self.calling.message(c.text)
        return {
            "index": c.index,
            "message": message,
            "logprobs": self.logprobs(c.token_ids, c.logprobs or []),
            "finish_reason": self.finish_reason(c, "tool_calls" in message),
            "stop_reason": c.stop_reason,
        }


def render_chat(s: ServedModel, messages: list[dict], add_generation_prompt: bool, continue_final: bool,
                tools: list | None, kwargs: dict | None) -> list[int]:
    extra = {**({"tools": tools} if tools is not None else {}), **(kwargs or {})}
    return s.tokenizer.encode_chat(messages, add_generation_prompt, continue_final, **extra)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, s: Annotated[ServedModel, Depends(served)]):
    model = s.check_model(body.model)
    ids = await asyncio.to_thread(render_chat, s, body.conversation(), body.add_generation_prompt is not False,
                                  bool(body.continue_final_message), body.tools, body.chat_template_kwargs)
    bos = s.tokenizer.bos_token_id
    if body.add_special_tokens and bos is not None and ids[:1] != [bos]:
        ids = [bos] + ids
    ids = body.truncate(ids)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = s.check_length(len(ids), max_tokens)
    k = body.num_logprobs()
    params = body.sampling_params(max_tokens, k, body.prompt_logprobs)
    calling = tool_calling(body.tools, body.tool_choice, body.parallel_tool_calls, s.tool_call_parser)
    if calling is not None:
        params = calling.sampling_params(params)
    request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    streams = await s.add_all([ids], params, request_id, request.headers.get(PREFILL_HEADER), model)
    fmt = ChatFormat(s, k, calling)
    if body.stream:
        header = StreamHeader(request_id, created, model, body.include_usage, body.continuous_usage)
        return stream_response(s, streams, fmt, header)

    async def collect() -> Response:
        final = await s.final_outputs(streams)
        data = {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": [fmt.response_choice(c) for c in final[0].outputs], "usage": usage(final)}
        if body.prompt_logprobs is not None:
            data["prompt_logprobs"] = prompt_logprobs_json(s.piece, final[0])
        return JSONResponse(data)

    return await cancel_on_disconnect(request, collect(), lambda: s.close(streams))
