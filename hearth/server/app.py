"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI).

Routes: /v1/models, /v1/completions, /v1/chat/completions (JSON or server-sent events),
/tokenize and /detokenize (vLLM's shapes), /health, /metrics, /version. Errors are OpenAI's
error JSON `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status.

Each prompt is one engine request; the route turns its cumulative RequestOutputs into
responses or into deltas (the text and tokens not sent yet, per choice). A client that goes
away aborts its requests: streams are cancelled by Starlette, non-streaming requests by a
watcher of the connection.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from hearth.engine.async_engine import AsyncEngine, EngineStopped, QueueFull, RequestStream
from hearth.errors import RequestError
from hearth.outputs import RequestOutput
from hearth.sampling_params import SamplingParams
from hearth.server.metrics import ServerMetrics
from hearth.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_json,
    usage,
)

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "MethodNotAllowedError", 409: "ConflictError",
               422: "UnprocessableEntityError", 429: "RateLimitError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}
PUBLIC_PATHS = ("/health", "/metrics", "/version")  # open without the API key


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {"message": message, "type": ERROR_TYPES.get(status, "APIError"), "param": param, "code": status}
    return JSONResponse({"error": body}, status_code=status)


class BearerAuth:
    """ASGI middleware: every path but PUBLIC_PATHS needs `Authorization: Bearer <api_key>`."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                await error_response(401, "invalid or missing API key (Authorization: Bearer ...)")(scope, receive, send)
                return
        await self.app(scope, receive, send)


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


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _cancel_on_disconnect(request: Request, work: Awaitable[Response], on_close: Callable[[], None]) -> Response:
    """Run a non-streaming handler; if the client disconnects first, cancel it. `on_close` runs in any case."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        on_close()
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening
    return task.result()


def build_app(engine: AsyncEngine, served_model_name: str | list[str], api_key: str | None = None) -> FastAPI:
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    llm = engine.engine
    tokenizer, max_model_len, vocab_size = llm.tokenizer, llm.max_model_len, llm.model_config.vocab_size
    metrics = ServerMetrics(engine, names[0])
    app = FastAPI(title="hearth", docs_url=None, redoc_url=None)
    app.state.engine, app.state.metrics = engine, metrics
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)

    # ---- errors

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        errors = exc.errors()
        parts, param = [], None
        for e in errors[:5]:
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            param = param or (loc[0] if loc else None)
            parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
        if errors and errors[0].get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {errors[0].get('ctx', {}).get('error', '')}")
        return error_response(400, "invalid request: " + "; ".join(parts), param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(APIError)
    async def _api(_, exc: APIError):
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestError)
    async def _bad(_, exc: RequestError):
        return error_response(400, str(exc))

    @app.exception_handler(QueueFull)
    async def _busy(_, exc: QueueFull):
        return error_response(503, str(exc))

    @app.exception_handler(EngineStopped)
    async def _stopped(_, exc: EngineStopped):
        return error_response(503, str(exc))

    @app.exception_handler(Exception)
    async def _bug(_, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    # ---- helpers

    def check_model(name: str | None) -> None:
        if name is not None and name not in names:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    def piece(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    def check_length(num_prompt: int, max_tokens: int | None) -> None:
        if num_prompt > max_model_len:
            raise RequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                f"{num_prompt} tokens. Please reduce the length of the prompt."
            )
        if max_tokens is not None and num_prompt + max_tokens > max_model_len:
            raise RequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} in the completion). "
                "Please reduce the length of the prompt or of max_tokens."
            )

    def render_chat(messages: list[dict], add_generation_prompt: bool, continue_final: bool,
                    tools: list | None, kwargs: dict | None) -> list[int]:
        extra = {**({"tools": tools} if tools is not None else {}), **(kwargs or {})}
        return tokenizer.encode_chat(messages, add_generation_prompt, continue_final, **extra)

    async def add_all(prompts: list[list[int]], params: SamplingParams, request_id: str) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                streams.append(await engine.add_request(ids, params, f"{request_id}-{i}"))
        except BaseException:
            for s in streams:
                s.close()
            raise
        metrics.on_accepted(sum(len(p) for p in prompts))
        return streams

    async def outputs(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as the requests progress; aborts what is unfinished when closed."""
        pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    output = task.result()
                    if output.finished:
                        metrics.on_finished(output)
                    else:
                        pending[asyncio.ensure_future(streams[i].__anext__())] = i
                    yield i, output
        finally:
            for task in pending:
                task.cancel()
            close(streams)

    def close(streams: list[RequestStream]) -> None:
        """Abort (and count) every request of the list that has not finished."""
        for s in streams:
            if not s.finished:
                metrics.on_aborted()
                s.close()

    # ---- routes

    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/version")
    async def version():
        from hearth import __version__

        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "hearth", "root": str(llm.model_path),
             "parent": None, "max_model_len": max_model_len}
            for name in names
        ]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("give either prompt or messages")
        if body.prompt is not None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        else:
            ids = render_chat([m.for_template() for m in body.messages], body.add_generation_prompt is not False,
                              bool(body.continue_final_message), body.tools, body.chat_template_kwargs)
        strs = [tokenizer.id_to_piece(i) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        texts, prompts = [], []
        for p in body.prompts():
            if isinstance(p, str):
                ids = tokenizer.encode(p, add_special_tokens=body.add_special_tokens is not False)
                texts.append(p)
            else:
                ids = list(p)
                bad = [t for t in ids if not 0 <= t < vocab_size]
                if bad:
                    raise RequestError(f"prompt token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
                texts.append(tokenizer.decode(ids) if body.echo else None)  # read only to echo
            ids = body.truncate(ids)
            if not ids:
                raise RequestError("the prompt is empty")
            check_length(len(ids), body.max_tokens)
            prompts.append(ids)
        echo, k = bool(body.echo), body.logprobs
        prompt_k = body.prompt_logprobs
        if echo and k is not None:
            prompt_k = k if prompt_k is None else max(k, prompt_k)
        params = body.sampling_params(body.max_tokens, k, prompt_k)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created, model = int(time.time()), body.model or names[0]
        streams = await add_all(prompts, params, request_id)
        per_prompt = params.n

        def choice(i: int, c, text: str, ids: list[int], entries, offset: int) -> dict:
            return {
                "index": i * per_prompt + c.index, "text": text,
                "logprobs": None if k is None else completion_logprobs(piece, ids, entries, offset),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            }

        def echoed(i: int, output: RequestOutput) -> tuple[list[int], list]:
            entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
            return list(output.prompt_token_ids), list(entries)

        if body.stream:
            async def events() -> AsyncIterator[str]:
                sent: dict[tuple[int, int], tuple[int, int, int]] = {}  # (prompt, choice) -> text, tokens, offset
                final: list[RequestOutput | None] = [None] * len(streams)
                try:
                    async for i, output in outputs(streams):
                        if output.finished:
                            final[i] = output
                        for c in output.outputs:
                            first = (i, c.index) not in sent
                            text_len, num_ids, offset = sent.get((i, c.index), (0, 0, 0))
                            text, ids = c.text[text_len:], c.token_ids[num_ids:]
                            entries = (c.logprobs or [])[num_ids:]
                            if first and echo:
                                prompt_ids, prompt_entries = echoed(i, output)
                                text, ids, entries = texts[i] + text, prompt_ids + ids, prompt_entries + entries
                            if not (text or (k is not None and ids) or c.finish_reason):
                                continue
                            item = choice(i, c, text, ids, entries, offset)
                            sent[(i, c.index)] = (len(c.text), len(c.token_ids), offset + len(text))
                            chunk = {"id": request_id, "object": "text_completion", "created": created,
                                     "model": model, "choices": [item]}
                            if body.include_usage:
                                chunk["usage"] = usage([output]) if body.continuous_usage else None
                            yield _sse(chunk)
                    if body.include_usage:
                        yield _sse({"id": request_id, "object": "text_completion", "created": created,
                                    "model": model, "choices": [], "usage": usage(final)})
                except EngineStopped as e:
                    yield _sse({"error": {"message": str(e), "type": ERROR_TYPES[503], "param": None, "code": 503}})
                yield "data: [DONE]\n\n"

            return SSEResponse(events(), lambda: close(streams))

        async def collect() -> Response:
            final: list[RequestOutput | None] = [None] * len(streams)
            async for i, output in outputs(streams):
                final[i] = output
            choices = []
            for i, output in enumerate(final):
                for c in output.outputs:
                    text, ids, entries = c.text, c.token_ids, c.logprobs or []
                    if echo:
                        prompt_ids, prompt_entries = echoed(i, output)
                        text, ids, entries = texts[i] + text, prompt_ids + ids, prompt_entries + entries
                    item = choice(i, c, text, ids, entries, 0)
                    if body.prompt_logprobs is not None:
                        item["prompt_logprobs"] = prompt_logprobs_json(piece, output)
                    choices.append(item)
            return JSONResponse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                                 "choices": choices, "usage": usage(final)})

        return await _cancel_on_disconnect(request, collect(), lambda: close(streams))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        ids = render_chat(body.conversation(), body.add_generation_prompt is not False,
                          bool(body.continue_final_message), body.tools, body.chat_template_kwargs)
        if body.add_special_tokens and tokenizer.bos_token_id is not None and ids[:1] != [tokenizer.bos_token_id]:
            ids = [tokenizer.bos_token_id] + ids
        ids = body.truncate(ids)
        max_tokens =  body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        check_length(len(ids), max_tokens)
        k = body.num_logprobs()
        params = body.sampling_params(max_tokens, k, body.prompt_logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created, model = int(time.time()), body.model or names[0]
        streams = await add_all([ids], params, request_id)

        if body.stream:
            async def events() -> AsyncIterator[str]:
                sent: dict[int, tuple[int, int]] = {}  # choice -> text, tokens sent
                latest: list[RequestOutput | None] = [None]

                def chunk(index: int, delta: dict, logprobs=None, finish=None, stop_reason=None) -> str:
                    item = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                    if finish is not None:
                        item["stop_reason"] = stop_reason
                    data = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                            "model": model, "choices": [item]}
                    if body.include_usage:
                        data["usage"] = usage(latest) if body.continuous_usage and latest[0] else None
                    return _sse(data)

                try:
                    async for _, output in outputs(streams):
                        latest[0] = output
                        for c in output.outputs:
                            if c.index not in sent:
                                sent[c.index] = (0, 0)
                                yield chunk(c.index, {"role": "assistant", "content": ""})
                            text_len, num_ids = sent[c.index]
                            text, new_ids = c.text[text_len:], c.token_ids[num_ids:]
                            if not (text or (k is not None and new_ids) or c.finish_reason):
                                continue
                            lps = None
                            if k is not None:
                                lps = {"content": chat_logprobs(piece, new_ids, (c.logprobs or [])[num_ids:], k)}
                            sent[c.index] = (len(c.text), len(c.token_ids))
                            yield chunk(c.index, {"content": text} if text else {}, lps, c.finish_reason, c.stop_reason)
                    if body.include_usage:
                        yield _sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                                    "model": model, "choices": [], "usage": usage(latest)})
                except EngineStopped as e:
                    yield _sse({"error": {"message": str(e), "type": ERROR_TYPES[503], "param": None, "code": 503}})
                yield "data: [DONE]\n\n"

            return SSEResponse(events(), lambda: close(streams))

        async def collect() -> Response:
            final = None
            async for _, output in outputs(streams):
                final = output
            choices = []
            for c in final.outputs:
                item = {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": None if k is None else {"content": chat_logprobs(piece, c.token_ids, c.logprobs or [], k)},
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                choices.append(item)
            data = {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                    "choices": choices, "usage": usage([final])}
            if body.prompt_logprobs is not None:
                data["prompt_logprobs"] = prompt_logprobs_json(piece, final)
            return JSONResponse(data)

        return await _cancel_on_disconnect(request, collect(), lambda: close(streams))

    return app

