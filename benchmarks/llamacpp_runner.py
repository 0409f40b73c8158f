"""llama.cpp through llama-cpp-python's low-level API: prefill and (batched) decode timings.

The low-level API (llama_batch with one sequence id per token) is what llama.cpp's own
llama-batched-bench uses; the high-level `Llama` class decodes one sequence only.
"""

from __future__ import annotations

import time


class LlamaCpp:
    def __init__(self, path: str, threads: int, n_ctx: int, n_seq_max: int = 1, n_batch: int = 512,
                 clock=time.perf_counter):
        """clock: what timings count (time.process_time: CPU seconds, for 1-thread runs)."""
        import llama_cpp as L

        self.L = L
        self.clock = clock
        L.llama_backend_init()
        self._log = L.llama_log_callback(lambda level, text, data: None)  # kept alive: llama.cpp calls it
        L.llama_log_set(self._log, None)
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = L.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = n_seq_max
        params.n_threads = threads
        params.n_threads_batch = threads
        params.kv_unified = True
        self.ctx = L.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_batch = n_batch
        self.batch = L.llama_batch_init(n_batch, 0, n_seq_max)

    def clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants logits)."""
        b = self.batch
        b.n_tokens = len(items)
        for i, (token, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def prefill(self, tokens: list[int], seq: int = 0, start: int = 0) -> float:
        """Seconds to evaluate `tokens` as one sequence, in chunks of n_batch (logits of the last)."""
        t0 = self.clock()
        for i in range(0, len(tokens), self.n_batch):
            chunk = tokens[i : i + self.n_batch]
            last = i + len(chunk) == len(tokens)
            self._decode([(t, start + i + j, seq, last and j == len(chunk) - 1) for j, t in enumerate(chunk)])
        return self.clock() - t0

    def decode(self, prompts: list[list[int]], steps: int, token: int = 42) -> float:
        """Prefill every prompt (untimed), then `steps` steps of one token for each sequence at once;
        returns the seconds of those steps."""
        self.clear()
        for seq, prompt in enumerate(prompts):
            self.prefill(prompt, seq)
        t0 = self.clock()
        for step in range(steps):
            self._decode([(token, len(p) + step, seq, True) for seq, p in enumerate(prompts)])
        return self.clock() - t0

    def close(self) -> None:
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)
