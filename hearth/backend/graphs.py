"""Decode steps replayed from CUDA graphs, one per bucketed batch size.

A decode step of a 1B model launches hundreds of small kernels; launched one by one from Python
they leave the GPU idle most of the step. A CUDA graph records the whole forward pass once and
replays it with one launch. A graph's tensors are fixed, so every input lives in one static
int32 buffer on the device (token ids, positions, slots, context lengths, block tables), filled
from one pinned host buffer by one copy per step; a batch of b sequences runs the graph of the
smallest bucket >= b, its rows past b padded so that they are harmless: slot -1 (the K/V write
is skipped), context length 0 (attention gives zeros), token and position 0. The output rows
past b are ignored.

With capture off (`capture=False`: on a CPU, under Triton's interpreter, or `--enforce-eager`'s
tests) the same buffers and padding run eagerly, which is how the tests check this logic
without a GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from hearth.backend.base import StepInputs


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (and max_batch itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(8, max_batch, 8))[1:] + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, backend, model, kv_caches, max_batch: int, max_blocks: int, block_size: int,
                 capture: bool):
        self.backend, self.model, self.kv_caches = backend, model, kv_caches
        self.buckets = bucket_sizes(max_batch)
        self.max_batch, self.max_blocks, self.block_size = max_batch, max_blocks, block_size
        self.capture = capture
        device = backend.device
        # one int32 buffer: ids [B], positions [B], slots [B], context lens [B], block tables [B, W]
        n = max_batch
        fields = {"input_ids": n, "positions": n, "slot_mapping": n, "seq_lens": n, "block_tables": n * max_blocks}
        self._offsets, start = {}, 0
        for name, size in fields.items():
            self._offsets[name] = (start, start + size)
            start += size
        self.host = torch.zeros(start, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.device_buffer = torch.zeros(start, dtype=torch.int32, device=device)
        self._host_view = self.host.numpy()
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> the graph's hidden states [bucket, hidden]
        self.pool = None

    def fits(self, step: StepInputs) -> bool:
        return step.decode_only and step.num_seqs <= self.max_batch and step.block_tables.shape[1] <= self.max_blocks

    def bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def _field(self, buffer, name: str):
        start, end = self._offsets[name]
        return buffer[start:end]

    def _load(self, step: StepInputs, size: int) -> None:
        """Write the step's rows (and padding up to `size`) into the host buffer, then copy it over."""
        b, width = step.num_seqs, step.block_tables.shape[1]
        host = self._host_view
        on_device = isinstance(step.input_ids, torch.Tensor)  # drawn by the pass before: copied below
        for name, values, pad in (("input_ids", 0 if on_device else step.input_ids, 0), ("positions", step.positions, 0),
                                  ("slot_mapping", step.slot_mapping, -1), ("seq_lens", step.seq_lens, 0)):
            field = self._field(host, name)
            field[:b] = values
            field[b:size] = pad
        tables = self._field(host, "block_tables").reshape(self.max_batch, self.max_blocks)
        tables[:b, :width] = step.block_tables
        tables[:b, width:] = 0
        tables[b:size] = 0
        self.device_buffer.copy_(self.host, non_blocking=True)
        if on_device:
            self._field(self.device_buffer, "input_ids")[:b].copy_(step.input_ids)

    def _run_model(self, size: int) -> torch.Tensor:
        """The forward pass over the static buffers' first `size` rows."""
        buf = self.device_buffer
        tables = self._field(buf, "block_tables").view(self.max_batch, self.max_blocks)[:size]
        meta = self.backend.metadata(
            self._field(buf, "slot_mapping")[:size], self.query_start_loc[: size + 1],
            self._field(buf, "seq_lens")[:size], tables, self.block_size, 1, self.model.config.num_kv_heads,
        )
        return self.model(self._field(buf, "input_ids")[:size], self._field(buf, "positions")[:size],
                          self.kv_caches, meta)

    def run(self, step: StepInputs) -> torch.Tensor:
        """Hidden states [b, hidden] of a decode step of b <= max_batch sequences."""
        size = self.bucket(step.num_seqs)
        self._load(step, size)
        if not self.capture:
            return self._run_model(size)[: step.num_seqs]
        if size not in self.graphs:
            self._capture(size)
        self.graphs[size].replay()
        return self.outputs[size][: step.num_seqs]

    def _capture(self, size: int) -> None:
        """Record the forward pass at batch `size` (after one eager run: Triton compiles its kernels
        and torch's allocator warms up outside the capture). The current buffer contents are a real
        step's (or padding): the warm-up's K/V writes go where that step's own would."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._run_model(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[size] = self._run_model(size)
        self.pool = graph.pool()
        self.graphs[size] = graph
