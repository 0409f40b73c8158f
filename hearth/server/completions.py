"""POST /v1/completions: one engine request per prompt, n choices each (index prompt * n + choice)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from hearth.errors import RequestError
from hearth.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from hearth.server.protocol import CompletionRequest, completion_logprobs, hearth_fields, prompt_logprobs_json, usage
from hearth.server.served import ServedModel, served
from hearth.server.streaming import Delta, Started, StreamHeader, respond

router = APIRouter()


class CompletionFormat:
    """A completion choice: its text (the prompt first with echo) and OpenAI's legacy logprobs."""

    object = "text_completion"

    def __init__(self, served: ServedModel, body: CompletionRequest, texts: list[str | None], per_prompt: int) -> None:
        self.served, self.texts, self.per_prompt = served, texts, per_prompt
        self.echo, self.k = bool(body.echo), body.logprobs
        self.offsets: dict[tuple[int, int], int] = {}  # characters of each choice's text sent so far

    def item(self, i: int, c: CompletionOutput, text: str, ids: list[int], entries: list, offset: int) -> dict:
        return {
            "index": i * self.per_prompt + c.index, "text": text,
            "logprobs": None if self.k is None else completion_logprobs(self.served.piece, ids, entries, offset),
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
        }

    def with_echo(self, i: int, output: RequestOutput, text: str, ids: list[int],
                  entries: list[PositionLogprobs | None]) -> tuple[str, list[int], list]:
        """The prompt's text, ids and logprob entries before the completion's."""
        prompt_entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
        return self.texts[i] + text, list(output.prompt_token_ids) + ids, list(prompt_entries) + entries

    def items(self, d: Delta) -> list[dict]:
        text, ids, entries = d.text, d.token_ids, d.logprobs
        if d.first and self.echo:
            text, ids, entries = self.with_echo(d.prompt_index, d.output, text, ids, entries)
        if not (text or (self.k is not None and ids) or d.choice.finish_reason):
            return []
        key = (d.prompt_index, d.choice.index)
        offset = self.offsets.get(key, 0)
        self.offsets[key] = offset + len(text)
        return [self.item(d.prompt_index, d.choice, text, ids, entries, offset)]

    def response_choices(self, final: list[RequestOutput], prompt_logprobs: bool) -> list[dict]:
        choices = []
        for i, output in enumerate(final):
            for c in output.outputs:
                text, ids, entries = c.text, c.token_ids, c.logprobs or []
                if self.echo:
                    text, ids, entries = self.with_echo(i, output, text, ids, entries)
                item = self.item(i, c, text, ids, entries, 0)
                if prompt_logprobs:
                    item["prompt_logprobs"] = prompt_logprobs_json(self.served.piece, output)
                choices.append(item)
        return choices


def _prompts(s: ServedModel, body: CompletionRequest) -> tuple[list[str | None], list[list[int]], int | None]:
    """Each prompt's text (None for token ids unless echoed) and token ids, checked, and the max_tokens to use."""
    requested = body.max_tokens
    if "max_tokens" not in body.model_fields_set and s.limits.max_output_tokens is not None:
        requested = min(requested, s.limits.max_output_tokens)  # OpenAI's default of 16, within the server's cap
    texts, prompts, max_tokens = [], [], requested
    for p in body.prompts():
        if isinstance(p, str):
            ids = s.tokenizer.encode(p, add_special_tokens=body.add_special_tokens is not False)
            texts.append(p)
        else:
            ids = list(p)
            s.check_token_ids(ids, "prompt token ids")
            texts.append(s.tokenizer.decode(ids) if body.echo else None)  # read only to echo
        ids = body.truncate(ids)
        if not ids:
            raise RequestError("the prompt is empty")
        max_tokens = s.check_length(len(ids), requested)
        prompts.append(ids)
    return texts, prompts, max_tokens


async def start(body: CompletionRequest, s: ServedModel, prefill_source: str | None = None) -> Started:
    """The requests in the engine; the route answers from them, and a batch's lines (batches.py) in this process."""
    model = s.check_model(body.model)
    texts, prompts, max_tokens = await asyncio.to_thread(_prompts, s, body)  # a long prompt must not stall the server
    k, prompt_k = body.logprobs, body.prompt_logprobs
    if body.echo and k is not None:
        prompt_k = k if prompt_k is None else max(k, prompt_k)
    params = body.sampling_params(max_tokens, k, prompt_k)
    request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    streams = await s.add_all(prompts, params, request_id, prefill_source, body.priority, model,
                              final_only=not body.stream)
    fmt = CompletionFormat(s, body, texts, params.n)

    def reply(final: list[RequestOutput]) -> dict:
        return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": fmt.response_choices(final, body.prompt_logprobs is not None), "usage": usage(final),
                **hearth_fields(final)}

    header = StreamHeader(request_id, created, model, body.include_usage, body.continuous_usage)
    return Started(streams, header, fmt, reply)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, s: Annotated[ServedModel, Depends(served)]):
    return await respond(request, s, start, body)

