"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI): the app and its routes.

Routes, one module each by job: completions.py (/v1/completions), chat.py
(/v1/chat/completions, with tools.py for tool calling), embeddings.py (/v1/embeddings),
tokens.py (/tokenize, /detokenize: vLLM's shapes), info.py (/health, /metrics, /version,
/v1/models), lora.py (/v1/load_lora_adapter, /v1/unload_lora_adapter), page.py (the chat page at /). Both generation routes stream through
streaming.py; the state they share is a ServedModel (served.py); errors are OpenAI's error
JSON (errors.py); the limits a public server needs are limits.py's, the middleware before the
routes middleware.py's.
"""

from __future__ import annotations

from fastapi import FastAPI

from hearth.engine.async_engine import AsyncEngine
from hearth.server import chat, completions, embeddings, info, lora, page, tokens
from hearth.server.errors import install_error_handlers
from hearth.server.limits import ServerLimits
from hearth.server.middleware import install_middleware
from hearth.server.served import ServedModel


def build_app(engine: AsyncEngine, served_model_name: str | list[str], api_key: str | None = None,
              limits: ServerLimits | None = None, tool_call_parser: str | None = None) -> FastAPI:
    """A prefill or decode worker of a disaggregated set is this app with its role added by the fleet
    (hearth/fleet/disaggregated.py: add_role)."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    limits = limits or ServerLimits()
    app = FastAPI(title="hearth", docs_url=None, redoc_url=None)
    app.state.served = ServedModel(engine, names, limits, tool_call_parser)
    install_middleware(app, limits, api_key)
    install_error_handlers(app)
    for module in (info, tokens, completions, chat, embeddings, lora, page):
        app.include_router(module.router)
    return app
