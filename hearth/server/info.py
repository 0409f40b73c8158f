"""What the server is and how it fares: /health, /version, /metrics, /v1/models."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from hearth.server.served import ServedModel, served

router = APIRouter()
Served = Annotated[ServedModel, Depends(served)]


@router.get("/health")
async def health(s: Served):
    return Response(status_code=200 if s.engine.is_running else 503)


@router.get("/version")
async def version():
    from hearth import __version__

    return {"version": __version__}


@router.get("/metrics")
async def prometheus_metrics(s: Served):
    return Response(s.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(s: Served):
    created = int(time.time())
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": "hearth", "root": str(s.engine.model_path),
         "parent": None, "max_model_len": s.max_model_len}
        for name in s.names
    ] + [  # LoRA adapters, each with the model it adapts (vLLM's listing)
        {"id": name, "object": "model", "created": created, "owned_by": "hearth", "root": path,
         "parent": s.names[0], "max_model_len": s.max_model_len}
        for name, path in s.adapters.items()
    ]}
