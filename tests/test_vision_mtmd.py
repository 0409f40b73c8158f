"""llama.cpp's own multimodal path (libmtmd through llama-cpp-python's mtmd_cpp) on the files `hearth convert --mmproj`
writes: a random Gemma 3 (tests/models.py) as a gemma3 text GGUF and a gemma3 mmproj, an image already at the
encoder's 224 x 224 (llama.cpp and transformers both copy it unresized, so no resampling filter enters), the prompt
tokenized by mtmd_tokenize and run by mtmd_helper_eval_chunks. Skipped where llama-cpp-python or its libmtmd does
not load (a wheel built without mtmd, or for instructions this CPU lacks)."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from models import make_gemma3_vl
from optional import import_llama_cpp, import_llama_mtmd
from test_vision import _hearth_logits, _image

HEARTH = "user: What is in <start_of_image>? model:"  # as Gemma 3's chat template writes an image part
# the same prompt as Gemma3Processor expands it, llama.cpp's marker for the image: mtmd adds <start_of_image> and
# <end_of_image> around the image's 64 embeddings itself, the blank lines around them it leaves to the prompt
MTMD = "user: What is in \n\n<__media__>\n\n? model:"
STEPS = 6


def test_mtmd_runs_hearths_mmproj_as_hearth(tmp_path):
    """mtmd's chunks are hearth's prompt ids (the image's 64 positions where hearth's image tokens stand); the
    next-token logits after the prompt within 1e-3 of the largest (its KV cache F32 here; measured 1.4e-4, where
    another image moves them by ~0.3 of the largest), their five best tokens in the same order, and six greedy
    tokens equal."""
    mtmd = import_llama_mtmd()
    llama_cpp = import_llama_cpp()
    from hearth import LLM, SamplingParams
    from hearth.cli import main

    text, mmproj = tmp_path / "text.gguf", tmp_path / "mmproj.gguf"
    assert main(["convert", str(make_gemma3_vl(tmp_path / "gemma3_vl")), str(text), "--type", "f32",
                 "--mmproj", str(mmproj)]) == 0
    image = _image(5, 224, 224)
    llm = LLM(str(text), mmproj=str(mmproj), progress=False)
    ids, logits = _hearth_logits(llm.engine, HEARTH, [image])
    out = llm.generate({"prompt": HEARTH, "multi_modal_data": {"image": [image]}},
                       SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True), use_tqdm=False)
    theirs = llama_cpp.Llama(model_path=str(text), n_ctx=256, n_threads=1, type_k=0, type_v=0, verbose=False)
    their_ids, their_logits, their_tokens = _mtmd_run(mtmd, llama_cpp, theirs, mmproj, image,
                                                      llm.engine.model_config.vision.image_token_id)
    assert their_ids == ids
    assert (their_logits - logits[-1]).abs().max().item() <= 1e-3 * logits[-1].abs().max().item()
    assert their_logits.topk(5).indices.tolist() == logits[-1].topk(5).indices.tolist()
    assert their_tokens == out[0].outputs[0].token_ids


def _mtmd_run(mtmd, llama_cpp, llm, mmproj, image, image_token_id: int) -> tuple[list[int], torch.Tensor, list[int]]:
    """llama.cpp's prompt ids (image_token_id for each of the image's positions), its logits after the prompt and
    its greedy tokens, through mtmd on `llm`'s context."""
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings, params.warmup = False, 1, False, False
    ctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), llm.model, params)
    assert ctx
    rgb = image.convert("RGB").tobytes()  # [height, width, 3]
    bitmap = mtmd.mtmd_bitmap_init(image.width, image.height, (ctypes.c_uint8 * len(rgb)).from_buffer_copy(rgb))
    chunks = mtmd.mtmd_input_chunks_init()
    try:
        prompt = MTMD.encode()
        text = mtmd.mtmd_input_text(prompt, len(prompt), True, True)
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
