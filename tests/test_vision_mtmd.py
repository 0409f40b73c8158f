"""llama.cpp's own multimodal path (libmtmd through llama-cpp-python's mtmd_cpp) on the files `hearth convert --mmproj`
writes from a random Gemma 3 and a random Qwen3-VL (tests/models.py; the Qwen text model of three layers: llama.cpp's
qwen3vl graph adds the deepstack rows after the last layer has kept only its output rows, so it aborts where every
layer takes deepstack, as with two), F32: images already of a size neither llama.cpp nor transformers resizes (so no
resampling filter enters), the prompt tokenized by mtmd_tokenize and run by mtmd_helper_eval_chunks (flash attention
off in the encoder). Skipped where llama-cpp-python or its libmtmd does not load (a wheel built without mtmd, or for
instructions this CPU lacks)."""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import pytest
import torch

from models import make_gemma3_vl, make_qwen_vl
from optional import import_llama_cpp, import_llama_mtmd
from test_vision import _hearth_logits, _image

QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # as Qwen3-VL's chat template writes an image part
# {family: (the folder's maker, hearth's prompt, the same prompt for mtmd, an image size (height, width) neither
# resizes, the logits' tolerance as a fraction of the largest)}. mtmd puts the tokens around an image itself
# (<start_of_image> / <end_of_image>, <|vision_start|> / <|vision_end|>) at its marker; the blank lines
# Gemma3Processor adds around them are the prompt's.
CASES = {"gemma3": (make_gemma3_vl, "user: What is in <start_of_image>? model:",
                    "user: What is in \n\n<__media__>\n\n? model:", (224, 224), 1e-3),
         "qwen3vl": (functools.partial(make_qwen_vl, text={"num_hidden_layers": 3}),
                     f"<|im_start|>user\nWhat is in {QWEN_IMAGE}?<|im_end|>\n<|im_start|>assistant\n",
                     "<|im_start|>user\nWhat is in <__media__>?<|im_end|>\n<|im_start|>assistant\n", (128, 96), 3e-3)}
STEPS = 6


@pytest.mark.parametrize("family", list(CASES))
def test_mtmd_runs_hearths_mmproj_as_hearth(family, tmp_path):
    """mtmd's chunks are hearth's prompt ids (the image's positions where hearth's image tokens stand); the
    next-token logits after the prompt within the case's tolerance of the largest (measured: gemma3 1.2e-4, qwen3vl
    1.7e-3, where llama.cpp's image embeddings and its text-only logits each already differ by ~5e-4 of the largest;
    another image moves them by ~0.3 of it), their five best tokens in the same order, six greedy tokens equal."""
    mtmd = import_llama_mtmd()
    llama_cpp = import_llama_cpp()
    from hearth import LLM, SamplingParams
    from hearth.cli import main

    make, prompt, mtmd_prompt, size, tolerance = CASES[family]
    text, mmproj = tmp_path / "text.gguf", tmp_path / "mmproj.gguf"
    assert main(["convert", str(make(tmp_path / family)), str(text), "--type", "f32", "--mmproj", str(mmproj)]) == 0
    image = _image(5, *size)
    llm = LLM(str(text), mmproj=str(mmproj), progress=False)
    ids, logits = _hearth_logits(llm.engine, prompt, [image])
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [image]}},
                       SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True), use_tqdm=False)
    theirs = llama_cpp.Llama(model_path=str(text), n_ctx=256, n_threads=1, type_k=0, type_v=0, verbose=False)
    their_ids, their_logits, their_tokens = _mtmd_run(mtmd, llama_cpp, theirs, mmproj, mtmd_prompt, image,
                                                      llm.engine.model_config.vision.image_token_id)
    assert their_ids == ids
    assert (their_logits - logits[-1]).abs().max().item() <= tolerance * logits[-1].abs().max().item()
    assert their_logits.topk(5).indices.tolist() == logits[-1].topk(5).indices.tolist()
    assert their_tokens == out[0].outputs[0].token_ids


def _mtmd_run(mtmd, llama_cpp, llm, mmproj, prompt: str, image, image_token_id: int
              ) -> tuple[list[int], torch.Tensor, list[int]]:
    """llama.cpp's prompt ids (image_token_id for each of the image's positions), its logits after the prompt and
    its greedy tokens, through mtmd on `llm`'s context."""
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings, params.warmup = False, 1, False, False
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED  # (its CPU kernel rounds K and V to F16)
    ctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), llm.model, params)
    assert ctx
    rgb = image.convert("RGB").tobytes()  # [height, width, 3]
    bitmap = mtmd.mtmd_bitmap_init(image.width, image.height, (ctypes.c_uint8 * len(rgb)).from_buffer_copy(rgb))
    chunks = mtmd.mtmd_input_chunks_init()
    try:
        text = mtmd.mtmd_input_text(prompt.encode(), len(prompt.encode()), True, True)
        assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
        ids = _chunk_ids(mtmd, chunks, image_token_id)
        n_past = llama_cpp.llama_pos(0)
        assert mtmd.mtmd_helper_eval_chunks(ctx, llm.ctx, chunks, 0, 0, 512, True, ctypes.byref(n_past)) == 0
        logits = _last_logits(llama_cpp, llm)
        tokens = [int(logits.argmax())]
        while len(tokens) < STEPS:
            token = (llama_cpp.llama_token * 1)(tokens[-1])
            assert llama_cpp.llama_decode(llm.ctx, llama_cpp.llama_batch_get_one(token, 1)) == 0
            tokens.append(int(_last_logits(llama_cpp, llm).argmax()))
        return ids, logits, tokens
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
        mtmd.mtmd_free(ctx)


def _chunk_ids(mtmd, chunks, image_token_id: int) -> list[int]:
    ids = []
    for i in range(mtmd.mtmd_input_chunks_size(chunks)):
        chunk = mtmd.mtmd_input_chunks_get(chunks, i)
        if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t()
            tokens = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
            ids += tokens[:n.value]
        else:
            ids += [image_token_id] * mtmd.mtmd_input_chunk_get_n_tokens(chunk)
    return ids


def _last_logits(llama_cpp, llm) -> torch.Tensor:
    row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return torch.from_numpy(np.ctypeslib.as_array(row, (llm.n_vocab(),)).copy())
