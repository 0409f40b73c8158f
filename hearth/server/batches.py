"""/v1/batches (OpenAI's Batch API): create, retrieve, list and cancel; batch_runner.py runs them."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from hearth.server.files import Runner, page
from hearth.server.protocol import OpenAIModel

router = APIRouter()


class BatchCreateRequest(OpenAIModel):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


@router.post("/v1/batches")
async def create_batch(body: BatchCreateRequest, runner: Runner):
    return runner.create(body.input_file_id, body.endpoint, body.completion_window, body.metadata)


@router.get("/v1/batches")
async def list_batches(runner: Runner, limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None):
    return page(runner.all(), limit, after)


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(runner: Runner, batch_id: str):
    return runner.get(batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(runner: Runner, batch_id: str):
    return runner.cancel(batch_id)
