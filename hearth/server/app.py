"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI): the app and its routes.

Routes, one module each by job: completions.py (/v1/completions), chat.py
(/v1/chat/completions, with tools.py for tool calling), embeddings.py (/v1/embeddings),
tokens.py (/tokenize, /detokenize: vLLM's shapes), info.py (/health, /metrics, /version,
/v1/models), page.py (the chat page at /). Both generation routes stream through
streaming.py; the state they share is a ServedModel (served.py); errors are OpenAI's error
JSON (errors.py).
"""

from __future__ import annotations

import secrets

from fastapi import FastAPI

from hearth.engine.async_engine import AsyncEngine
from hearth.server import chat, completions, embeddings, info, page, tokens
from hearth.server.errors import error_response, install_error_handlers
from hearth.server.served import ServedModel

PUBLIC_PATHS = ("/health", "/metrics", "/version", *page.PAGE_PATHS)  # open without the API key


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


def build_app(engine: AsyncEngine, served_model_name: str | list[str], api_key: str | None = None,
              tool_call_parser: str | None = None) -> FastAPI:
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    app = FastAPI(title="hearth", docs_url=None, redoc_url=None)
    app.state.served = ServedModel(engine, names, tool_call_parser)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    install_error_handlers(app)
    for module in (info, tokens, completions, chat, embeddings, page):
        app.include_router(module.router)
    return app
