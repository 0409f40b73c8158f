"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI): the app and its routes.

Routes, one module each by job: completions.py (/v1/completions), chat.py
(/v1/chat/completions), tokens.py (/tokenize, /detokenize: vLLM's shapes), info.py (/health,
/metrics, /version, /v1/models). Both generation routes stream through streaming.py; the
state they share is a ServedModel (served.py); errors are OpenAI's error JSON (errors.py); the
limits a public server needs are limits.py's, the middleware before the routes middleware.py's.
"""

from __future__ import annotations

from fastapi import FastAPI

from hearth.engine.async_engine import AsyncEngine
from hearth.server import chat, completions, info, tokens
from hearth.server.errors import install_error_handlers
from hearth.server.limits import ServerLimits
from hearth.server.middleware import BearerAuth, BodyLimit, ConcurrencyLimit
from hearth.server.served import ServedModel


def build_app(engine: AsyncEngine, served_model_name: str | list[str], api_key: str | None = None,
              limits: ServerLimits | None = None) -> FastAPI:
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    limits = limits or ServerLimits()
    app = FastAPI(title="hearth", docs_url=None, redoc_url=None)
    app.state.served = ServedModel(engine, names, limits)
    # the last added runs first: count the request, check its key, then read its body
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes, timeout=limits.body_timeout)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    app.add_middleware(ConcurrencyLimit, limit=limits.max_concurrent_requests)
    install_error_handlers(app)
    for module in (info, tokens, completions, chat):
        app.include_router(module.router)
    return app
