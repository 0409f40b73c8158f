"""vLLM's runtime LoRA endpoints: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and POST
/v1/unload_lora_adapter {"lora_name"}. A loaded adapter is served under its name (`model: NAME`)
and listed by /v1/models with the model it adapts as its parent."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from hearth.errors import ModelLoadError
from hearth.lora_request import LoRARequest
from hearth.server.errors import APIError
from hearth.server.protocol import OpenAIModel
from hearth.server.served import ServedModel, served

router = APIRouter()
Served = Annotated[ServedModel, Depends(served)]


class LoadLoRAAdapterRequest(OpenAIModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: str


def _check_enabled(s: ServedModel) -> None:
    if not s.engine.lora_enabled:
        raise APIError(400, "this server was started without LoRA adapters: start it with --enable-lora (or "
                            "--lora NAME=PATH)")


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, s: Served):
    _check_enabled(s)
    if body.lora_name in s.names or body.lora_name in s.adapters:
        raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded (or is the served "
                            "model's name).", "lora_name")
    try:
        await s.engine.add_lora(LoRARequest(body.lora_name, 0, body.lora_path))
    except ModelLoadError as e:
        raise APIError(400, str(e), "lora_path") from None
    s.adapters[body.lora_name] = body.lora_path
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, s: Served):
    _check_enabled(s)
    if body.lora_name not in s.adapters:
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name")
    await s.engine.remove_lora(body.lora_name)  # RequestError (400) while requests run with it
    del s.adapters[body.lora_name]
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
