"""vLLM's /tokenize, /detokenize and /tokenizer_info: text or a conversation to token ids, back,
and what a remote client (lm-eval's remote tokenizer) needs to know of the tokenizer."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends

from hearth.errors import RequestError
from hearth.server.chat import ChatPrompt, render_chat, with_image_tokens
from hearth.server.protocol import DetokenizeRequest, TokenizeRequest
from hearth.server.served import ServedModel, served

router = APIRouter()
Served = Annotated[ServedModel, Depends(served)]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, s: Served):
    s.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("give either prompt or messages")
    if body.prompt is not None:  # in a thread: a long text must not stall the server
        ids = await asyncio.to_thread(s.tokenizer.encode, body.prompt,
                                      add_special_tokens=body.add_special_tokens is not False)
    else:  # with images, each one's tokens as the engine would run them (read and checked as a chat's are)
        images = await s.images.load([url for m in body.messages for url in m.image_urls()])
        videos = await s.images.load_videos([url for m in body.messages for url in m.video_urls()],
                                            s.engine.video_limits)
        if images or videos:
            s.check_images(body.model)
        text = await asyncio.to_thread(
            render_chat, s, [m.for_template() for m in body.messages], body.add_generation_prompt is not False,
            bool(body.continue_final_message), body.tools, body.chat_template_kwargs)
        ids = await asyncio.to_thread(s.tokenizer.encode_chat_text, text)
        ids = (await with_image_tokens(s, ChatPrompt(ids, text, images, None, videos=videos))).ids
    strs = [s.tokenizer.id_to_piece(i) for i in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": s.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, s: Served):
    s.check_model(body.model)
    s.check_token_ids(body.tokens, "token ids")
    return {"prompt": s.tokenizer.decode(body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(s: Served):
    tok = s.tokenizer
    info = {"tokenizer_class": "PreTrainedTokenizerFast", **tok.special_token_texts,
            "chat_template": tok.chat_template, "model_max_length": s.max_model_len, "add_bos_token": tok.add_bos,
            "vocab_size": tok.vocab_size, "bos_token_id": tok.bos_token_id, "eos_token_ids": tok.eos_token_ids}
    if info.get("eos_token") is None and tok.eos_token_ids:
        info["eos_token"] = tok.id_to_piece(tok.eos_token_ids[0])
    if info.get("bos_token") is None and tok.bos_token_id is not None:
        info["bos_token"] = tok.id_to_piece(tok.bos_token_id)
    return info
