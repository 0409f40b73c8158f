"""POST /v1/embeddings (OpenAI's shape): each input's pooled final hidden state
(hearth/engine/embedding.py says which pooling), as floats or base64 of little-endian float32."""

from __future__ import annotations

import base64
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Depends

from hearth.engine.embedding import CacheFull
from hearth.errors import RequestError
from hearth.server.errors import APIError
from hearth.server.protocol import OpenAIModel
from hearth.server.served import ServedModel, served

router = APIRouter()


class EmbeddingRequest(OpenAIModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        if self.dimensions is not None:
            raise RequestError("dimensions is not supported: the embeddings have the model's hidden size")
        given = self.input
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            return [given]
        if not given:
            raise RequestError("input must not be empty")
        return list(given)


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, s: Annotated[ServedModel, Depends(served)]):
    model = s.check_model(body.model)
    if s.lora_of(model) is not None:
        raise APIError(400, f"embeddings through a LoRA adapter ({model!r}) are not implemented: name the base "
                            f"model ({s.names[0]!r})", "model")
    prompts = []
    for item in body.inputs():
        if isinstance(item, str):
            ids = s.tokenizer.encode(item)
        else:
            ids = list(item)
            s.check_token_ids(ids, "input token ids")
        prompts.append(ids)
    try:
        vectors = (await s.engine.embed(prompts)).numpy()
    except CacheFull as e:
        raise APIError(503, str(e)) from None
    num_tokens = sum(map(len, prompts))
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
