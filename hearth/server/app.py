"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI): the app and its routes.

Routes, one module each by job: completions.py (/v1/completions), chat.py
(/v1/chat/completions, with tools.py for tool calling), responses.py (OpenAI's /v1/responses)
and messages.py (Anthropic's /v1/messages), both run as chat requests and shaped by turns.py,
embeddings.py (/v1/embeddings), tokens.py (/tokenize, /detokenize: vLLM's shapes), info.py
(/health, /metrics, /version, /v1/models), lora.py (/v1/load_lora_adapter, /v1/unload_lora_adapter),
page.py (the chat page at /), files.py and batches.py
(/v1/files, /v1/batches: OpenAI's Files and Batch APIs, run by batch_runner.py on the state in
batch_store.py). Completions and chat completions stream through streaming.py; the state they share
is a ServedModel (served.py), one per engine (the fleet's several models: hearth/fleet/model_app.py);
errors are OpenAI's error JSON, Anthropic's on its routes (errors.py); the limits a public server
needs are limits.py's, the middleware before the routes middleware.py's; images in
requests are read by images.py.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI

from hearth.engine.async_engine import AsyncEngine
from hearth.server import batches, chat, completions, embeddings, files, info, lora, messages, page, responses, tokens
from hearth.server.batch_runner import BatchRunner
from hearth.server.errors import APIError, install_error_handlers
from hearth.server.limits import ServerLimits
from hearth.server.middleware import install_middleware
from hearth.server.served import Lease, ServedModel


def build_app(engine: AsyncEngine, served_model_name: str | list[str], api_key: str | None = None,
              limits: ServerLimits | None = None, tool_call_parser: str | None = None,
              batch_dir: Path | None = None, trust_request_chat_template: bool = False,
              allowed_media_domains: tuple[str, ...] = ()) -> FastAPI:
    """One engine's app. A prefill or decode worker of a disaggregated set is this app with its role added by
    the fleet (hearth/fleet/disaggregated.py: add_role). batch_dir: where the files and batches live, their
    unfinished batches taken up when the app starts (None: a temporary directory made on first use).
    allowed_media_domains: the hosts images may be fetched from by URL (none: data URLs only; hearth/server/images.py)."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    limits = limits or ServerLimits()
    served = ServedModel(engine, names, limits, tool_call_parser, trust_request_chat_template, allowed_media_domains)

    @contextlib.asynccontextmanager
    async def lease(_: str | None):  # every request is this engine's (its routes check the name)
        yield served

    app = api_app(lease, engine.max_num_seqs, batch_dir)
    app.state.served = served
    app.include_router(info.router)
    install_middleware(app, limits, api_key)
    return app


def api_app(lease: Lease, batch_window: int, batch_dir: Path | None = None,
            lifespan_hook: Callable[[], contextlib.AbstractAsyncContextManager] | None = None) -> FastAPI:
    """The routes every app serves, without info.py's (/health, /metrics, /v1/models: one engine's, or the
    fleet's over several) and without the middleware (install_middleware, after the caller's own). lease:
    the model a batch line names (served.py); batch_window: 2x that many lines run at once.
    lifespan_hook: entered while the app runs (the fleet's models)."""
    runner = BatchRunner(lease, 2 * batch_window, batch_dir)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        async with lifespan_hook() if lifespan_hook is not None else contextlib.nullcontext():
            if batch_dir is not None:
                try:
                    runner.resume()
                except APIError as e:  # another server holds the directory: this one serves without batches
                    logging.getLogger("hearth").warning("%s", e.message)
            yield
            await runner.stop()

    app = FastAPI(title="hearth", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.served, app.state.batches = None, runner
    app.state.responses = responses.ResponseStore()
    install_error_handlers(app)
    for module in (tokens, completions, chat, responses, messages, embeddings, lora, files, batches, page):
        app.include_router(module.router)
    return app
