"""ServedModel: what every route shares: the AsyncEngine, the served names, the metrics,
the limits, and the checks and bookkeeping of requests in flight.

Routes read the model only through the AsyncEngine's fixed facts (tokenizer, context length,
vocabulary size): never the LLMEngine, which belongs to the engine thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

from fastapi import Request

from hearth.engine.async_engine import AsyncEngine, RequestStream
from hearth.engine.images import PromptWithImages
from hearth.errors import NO_IMAGES, RequestError
from hearth.lora_request import LoRARequest
from hearth.outputs import RequestOutput
from hearth.sampling_params import SamplingParams
from hearth.server.errors import APIError
from hearth.server.images import ImageSources
from hearth.server.limits import ServerLimits
from hearth.server.metrics import ServerMetrics
from hearth.tool_calls import parser_for


# the ServedModel that a model name stands for, held while the context is open (a model with requests in
# flight is not unloaded); None: the default model. One engine's app leases its one model for every name.
Lease = Callable[[str | None], AbstractAsyncContextManager["ServedModel"]]


class RequestTimeout(APIError):
    def __init__(self, seconds: float) -> None:
        super().__init__(408, f"the request ran past this server's limit of {seconds:g} s and was stopped")


class ServedModel:
    def __init__(self, engine: AsyncEngine, names: list[str], limits: ServerLimits,
                 tool_call_parser: str | None = None, trust_request_chat_template: bool = False,
                 allowed_media_domains: tuple[str, ...] = ()) -> None:
        self.engine = engine
        self.names = names
        self.limits = limits
        self.metrics = ServerMetrics(engine, names[0])
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        # the format of tool calls in replies: given, or the one the chat template writes
        self.tool_call_parser = tool_call_parser or parser_for(self.tokenizer.chat_template)
        self.kv_puller = None  # a decode worker's KVPuller (hearth/fleet/disaggregated.py)
        self.reasoning = engine.reasoning  # the model's thinking markers (--reasoning-parser), or None
        self.trust_request_chat_template = trust_request_chat_template
        # LoRA adapters served under their own names (`model: NAME`): name -> path; changed only by the
        # load and unload routes (lora.py), after the engine did so
        self.adapters: dict[str, str] = dict(engine.initial_loras)
        self.images = ImageSources(limits, allowed_media_domains)  # how images in requests are read

    # ---- checks

    def check_model(self, name: str | None) -> str:
        """The served name a request asked for (the first when it named none), a LoRA adapter's among
        them; 404 when unknown."""
        if name is not None and name not in self.names and name not in self.adapters:
            raise APIError(404, f"The model `{name}` does not exist.", "model")
        return name or self.names[0]

    def lora_of(self, name: str) -> LoRARequest | None:
        """The LoRA adapter a checked model name stands for (None: the base model)."""
        return LoRARequest(name, 0, self.adapters[name]) if name in self.adapters else None

    def check_token_ids(self, ids: list[int], what: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"{what} outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")

    def check_sequences(self, num_prompts: int, params: SamplingParams) -> None:
        """A request may start at most max_sequences sequences (prompts x max(n, best_of))."""
        per_prompt = max(params.n, params.best_of or 1)
        if num_prompts * per_prompt > self.limits.max_sequences:
            raise APIError(400, f"this request asks for {num_prompts * per_prompt} sequences ({num_prompts} prompts x "
                                f"n/best_of {per_prompt}); this server's limit is {self.limits.max_sequences}",
                           "best_of" if params.best_of and params.best_of > params.n else "n")

    def check_length(self, num_prompt: int, max_tokens: int | None) -> int | None:
        """Check a prompt's length and max_tokens against the context and the server's caps;
        returns the max_tokens to use (the cap, when the request gave none)."""
        max_prompt, max_output = self.limits.max_prompt_tokens, self.limits.max_output_tokens
        if max_prompt is not None and num_prompt > max_prompt:
            raise RequestError(f"the prompt has {num_prompt} tokens; this server's limit is {max_prompt}")
        if max_output is not None:
            if max_tokens is not None and max_tokens > max_output:
                raise APIError(400, f"max_tokens is {max_tokens}; this server's limit is {max_output}", "max_tokens")
            max_tokens = max_output if max_tokens is None else max_tokens
        limit = self.max_model_len
        if num_prompt > limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{num_prompt} tokens. Please reduce the length of the prompt."
            )
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} in the completion). "
                "Please reduce the length of the prompt or of max_tokens."
            )
        return max_tokens

    def check_images(self, name: str | None) -> None:
        """A request with images needs a model that reads them (the engine refuses them too)."""
        if not self.engine.accepts_images:
            raise APIError(400, f"{NO_IMAGES}: `{self.check_model(name)}` has no vision encoder", "messages")

    def chat_template(self, requested: str | None) -> str | None:
        """A request's own chat template (vLLM's `chat_template`), where the server allows one; None:
        the model's."""
        if requested is not None and not self.trust_request_chat_template:
            raise APIError(400, "this server uses its own chat template: start it with --trust-request-chat-template "
                                "to let requests give theirs", "chat_template")
        return requested

    # ---- reasoning (hearth/reasoning.py)

    def thinking_opened(self, prompt_ids: list[int]) -> bool:
        """The prompt leaves a thinking section open (its template wrote the start marker)."""
        if self.reasoning is None:
            return False
        return self.reasoning.opened_by(self.tokenizer.decode(prompt_ids[-32:], skip_special_tokens=False))

    def reasoning_params(self, params: SamplingParams) -> SamplingParams:
        """With markers that are special tokens (harmony's), the reply is decoded with them."""
        if self.reasoning is not None and self.reasoning.needs_special_tokens:
            return dataclasses.replace(params, skip_special_tokens=False)
        return params

    def piece(self, token_id: int) -> str:
        """A token's own text (special tokens included), as logprobs show it."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ---- requests in flight

    async def add_all(self, prompts: list[list[int]], params: SamplingParams, request_id: str,
                      prefill_source: str | None = None, priority: int = 0, model: str | None = None,
                      with_images: PromptWithImages | None = None, final_only: bool = False) -> list[RequestStream]:
        """One engine request per prompt (ids `{request_id}-{i}`, at `priority`), through the LoRA adapter
        `model` names if it names one; all or none are added. On a decode worker, given a prefill worker
        (its URL or its Ray actor), each prompt's KV is pulled from it first. with_images: a one-prompt
        request's prompt with its images, as the engine expanded it (chat.py's with_image_tokens), given
        to the engine in place of its ids. final_only: the streams yield their finished outputs alone (a
        non-streaming answer)."""
        self.check_sequences(len(prompts), params)
        if with_images is not None and prefill_source is not None:
            raise APIError(400, "images are not taken by disaggregated prefill and decode workers", "messages")
        if prefill_source is not None and self.kv_puller is not None:
            for ids in prompts:
                await self.kv_puller.pull(self, prefill_source, ids)
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                streams.append(await self.engine.add_request(with_images or ids, params, f"{request_id}-{i}",
                                                             priority, self.lora_of(model) if model else None,
                                                             final_only=final_only))
        except BaseException:
            for s in streams:
                s.close()
            raise
        self.metrics.on_accepted(sum(len(p) for p in prompts))
        return streams

    async def outputs(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as the requests progress; aborts what is unfinished when closed,
        or when they run past the server's request_timeout (RequestTimeout)."""
        timeout = self.limits.request_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
        try:
            while pending:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                done, _ = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    raise RequestTimeout(timeout)
                for task in done:
                    i = pending.pop(task)
                    output = task.result()
                    if output.finished:
                        self.metrics.on_finished(output)
                    else:
                        pending[asyncio.ensure_future(streams[i].__anext__())] = i
                    yield i, output
        finally:
            for task in pending:
                task.cancel()
            self.close(streams)

    async def final_outputs(self, streams: list[RequestStream]) -> list[RequestOutput]:
        """Each prompt's finished output."""
        final: list[RequestOutput | None] = [None] * len(streams)
        async for i, output in self.outputs(streams):
            final[i] = output
        return final

    def close(self, streams: list[RequestStream]) -> None:
        """Abort (and count) every request of the list that has not finished."""
        for s in streams:
            if not s.finished:
                self.metrics.on_aborted()
                s.close()


async def served(request: Request) -> ServedModel:
    """The route dependency: the ServedModel the request was routed to by its `model` (request.state.served,
    where the app serves several: hearth/fleet/model_app.py), else the app's one. Async: FastAPI runs a plain
    dependency in its thread pool, a hop for every request."""
    routed = getattr(request.state, "served", None)
    if routed is not None:
        return routed
    if request.app.state.served is None:
        raise APIError(400, "this server serves several models: the request body must be a JSON object that names "
                            "one in `model`", "model")
    return request.app.state.served
