"""llama.cpp's multimodal path (libmtmd) through llama-cpp-python's ctypes bindings (llama_cpp.mtmd_cpp): a text
GGUF loaded by llama.cpp, its mmproj by mtmd, a prompt with mtmd's media marker and an image tokenized by
mtmd_tokenize and run by mtmd_helper_eval_chunks. Shared by tests/test_vision_mtmd.py (against hearth) and
benchmarks/vision_ttft_qwen3vl.py (TTFT); the callers import the modules (tests/optional.py's import_llama_mtmd and
import_llama_cpp, or plain imports)."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

MARKER = "<__media__>"  # where mtmd puts an image's tokens (and the tokens around them that the model's family wants)


class MtmdRunner:
    """A llama.cpp context on `text` (F32 KV cache, flash attention off: the CPU kernel rounds K and V to F16) and
    an mtmd context on `mmproj` (flash attention off in the encoder too), each on `threads` threads; a context
    manager (leaving it frees both)."""

    def __init__(self, mtmd, llama_cpp, text: str, mmproj: str, threads: int = 1, n_ctx: int = 512):
        self.mtmd, self.llama_cpp = mtmd, llama_cpp
        self.llm = llama_cpp.Llama(model_path=text, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   type_k=0, type_v=0, flash_attn=False, verbose=False)
        params = mtmd.mtmd_context_params_default()
        params.use_gpu, params.n_threads, params.print_timings, params.warmup = False, threads, False, False
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = mtmd.mtmd_init_from_file(mmproj.encode(), self.llm.model, params)
        if not self.ctx:
            raise RuntimeError(f"mtmd could not load {mmproj}")

    def prefill(self, prompt: str, image, image_token_id: int) -> list[int]:
        """Runs `prompt` (MARKER where the image goes) with the PIL `image` from an empty KV cache; the prompt's ids
        as mtmd made them, image_token_id for each of the image's positions."""
        mtmd, llama_cpp = self.mtmd, self.llama_cpp
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.llm.ctx), True)
        rgb = image.convert("RGB").tobytes()  # [height, width, 3]
        bitmap = mtmd.mtmd_bitmap_init(image.width, image.height, (ctypes.c_uint8 * len(rgb)).from_buffer_copy(rgb))
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            text = mtmd.mtmd_input_text(prompt.encode(), len(prompt.encode()), True, True)
            bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
            if mtmd.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), bitmaps, 1) != 0:
                raise RuntimeError("mtmd_tokenize failed")
            n_past = llama_cpp.llama_pos(0)
            if mtmd.mtmd_helper_eval_chunks(self.ctx, self.llm.ctx, chunks, 0, 0, self.llm.n_batch, True,
                                            ctypes.byref(n_past)) != 0:
                raise RuntimeError("mtmd_helper_eval_chunks failed")
            return self._chunk_ids(chunks, image_token_id)
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)

    def logits(self) -> torch.Tensor:
        """The last position's logits [vocabulary]."""
        row = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return torch.from_numpy(np.ctypeslib.as_array(row, (self.llm.n_vocab(),)).copy())

    def step(self, token: int) -> None:
        """Decodes one token after what the context holds."""
        tokens = (self.llama_cpp.llama_token * 1)(token)
        if self.llama_cpp.llama_decode(self.llm.ctx, self.llama_cpp.llama_batch_get_one(tokens, 1)) != 0:
            raise RuntimeError("llama_decode failed")

    def __enter__(self) -> MtmdRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.mtmd.mtmd_free(self.ctx)
        self.llm.close()

    def _chunk_ids(self, chunks, image_token_id: int) -> list[int]:
        mtmd, ids = self.mtmd, []
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t()
                tokens = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                ids += tokens[:n.value]
            else:
                ids += [image_token_id] * mtmd.mtmd_input_chunk_get_n_tokens(chunk)
        return ids
