"""vLLM's /tokenize and /detokenize: text or a conversation to token ids, and back."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from hearth.errors import RequestError
from hearth.server.chat import render_chat
from hearth.server.protocol import DetokenizeRequest, TokenizeRequest
from hearth.server.served import ServedModel, served

router = APIRouter()
Served = Annotated[ServedModel, Depends(served)]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, s: Served):
    s.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("give either prompt or messages")
    if body.prompt is not None:
        ids = s.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    else:
        ids = render_chat(s, [m.for_template() for m in body.messages], body.add_generation_prompt is not False,
                          bool(body.continue_final_message), body.tools, body.chat_template_kwargs)
    strs = [s.tokenizer.id_to_piece(i) for i in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": s.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, s: Served):
    s.check_model(body.model)
    s.check_token_ids(body.tokens, "token ids")
    return {"prompt": s.tokenizer.decode(body.tokens)}
