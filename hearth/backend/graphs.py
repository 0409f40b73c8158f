"""Decode steps replayed from CUDA graphs, one per bucketed batch size (and sampling head).

A decode step of a 1B model launches hundreds of small kernels; launched one by one from Python
they leave the GPU idle most of the step. A CUDA graph records the whole forward pass once and
replays it with one launch. A graph's tensors are fixed, so every input lives in the persistent
buffers of decode_inputs.py (tokens, context lengths, block tables, sampling parameters), which
each step changes by a small diff; the positions and slots are computed from them inside the
graph. A batch of b sequences runs the graph of the smallest bucket >= b, its rows past b padded
so that they are harmless (decode_inputs.py); the output rows past b are ignored.

A step may also carry a sampling head (`DecodeSampling`, built by the engine's sampler): then the
graph holds the LM head and the draws too, and one replay turns the buffers into each row's next
token and its logprob, with no host work between the forward pass and the tokens. One graph per
(bucket, head key): a greedy head, a plain temperature head and one with top-k / top-p / min-p
filters are different graphs (the filters' sort costs what a greedy step does not need).

With capture off (`capture=False`: on a CPU, under Triton's interpreter, or `--enforce-eager`'s
tests) the same buffers, padding and heads run eagerly, which is how the tests check this logic
without a GPU.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from hearth.backend.base import DecodeSampling, StepInputs
from hearth.backend.decode_inputs import DecodeInputs


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (and max_batch itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(8, max_batch, 8))[1:] + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, backend, model, kv_caches, max_batch: int, max_blocks: int, block_size: int,
                 capture: bool):
        self.backend, self.model, self.kv_caches = backend, model, kv_caches
        self.buckets = bucket_sizes(max_batch)
        self.max_batch, self.block_size = max_batch, block_size
        self.capture = capture
        self.inputs = DecodeInputs(max_batch, max_blocks, block_size, backend.device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=backend.device)
        self.graphs: dict[tuple[int, Hashable], torch.cuda.CUDAGraph] = {}
        # (bucket, head key) -> the graph's outputs: hidden states [bucket, hidden], or the head's tensors
        self.outputs: dict[tuple[int, Hashable], torch.Tensor | tuple[torch.Tensor, ...]] = {}
        self.pool = None

    def fits(self, step: StepInputs) -> bool:
        return self.inputs.fits(step)

    def bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def _run_model(self, size: int, sampling: DecodeSampling | None):
        """The forward pass over the buffers' first `size` rows, then the sampling head if any."""
        inputs = self.inputs
        positions, slots = inputs.positions_and_slots(size)
        state_slots = inputs.field("state_slots", size) if self.model.config.is_hybrid else None
        if self.model.config.mrope_section is not None:  # a text token's three M-RoPE positions are alike
            positions = positions.expand(3, -1)
        meta = self.backend.metadata(slots, self.query_start_loc[: size + 1], inputs.field("seq_lens", size),
                                     inputs.block_tables(size), self.block_size, 1, state_slots)
        hidden = self.model(inputs.field("input_ids", size), positions, self.kv_caches, meta)
        if sampling is None:
            return hidden
        return sampling.head(self.model.compute_logits(hidden), inputs.params[:, :size])

    def run(self, step: StepInputs, sampling: DecodeSampling | None = None):
        """Hidden states [b, hidden] of a decode step of b <= max_batch sequences; or, given a
        sampling head, its outputs' first b rows."""
        size = self.bucket(step.num_seqs)
        if sampling is None:
            self.inputs.update(step, size)
        else:
            self.inputs.update(step, size, sampling.params, sampling.defaults)
        key = (size, None if sampling is None else sampling.key)
        if not self.capture:
            out = self._run_model(size, sampling)
        else:
            if key not in self.graphs:
                self._capture(key, sampling)
            self.graphs[key].replay()
            out = self.outputs[key]
        b = step.num_seqs
        return out[:b] if isinstance(out, torch.Tensor) else tuple(t[:b] for t in out)

    def _capture(self, key: tuple[int, Hashable], sampling: DecodeSampling | None) -> None:
        """Record the step at batch key[0], after one eager run (`warm_up`) outside the capture."""
        size = key[0]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.warm_up(size, sampling)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[key] = self._run_model(size, sampling)
        self.pool = graph.pool()
        self.graphs[key] = graph

    def warm_up(self, size: int, sampling: DecodeSampling | None) -> None:
        """The step over the buffers' first `size` rows run eagerly before its capture, so that Triton compiles
        its kernels and torch's allocator warms up outside it. The buffers hold a real step (or padding), which
        the replay then runs again: writing its K/V twice to the same slots is harmless, but a hybrid model's
        state rows would advance twice, so they are put back as they were."""
        config, saved = self.model.config, []
        if config.is_hybrid:
            slots = self.inputs.field("state_slots", size).long()
            saved = [(state, state[slots]) for layer, states in enumerate(self.kv_caches) if config.state_shapes(layer)
                     for state in states]
        self._run_model(size, sampling)
        for state, rows in saved:  # (a padding row's slot repeats a live one's: the same rows either way)
            state[slots] = rows
