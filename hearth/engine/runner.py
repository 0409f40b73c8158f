"""ModelRunner: owns the KV cache tensors and runs a step's batch through the model's backend.

The only engine module that builds tensors: the scheduler hands it, per sequence, the new
tokens, how many tokens are already cached and the block table; it lays them out as one
`StepInputs` (host arrays) and the backend (chosen once per engine, hearth/backend) turns that
into its tensors and metadata, runs the model, and returns hidden states.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np
import torch

from hearth.backend import StepInputs
from hearth.model.transformer import Transformer


@dataclass
class BatchEntry:
    token_ids: list[int]  # the new tokens of this sequence this step
    num_computed_tokens: int  # tokens already in the cache before them
    block_table: list[int]


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kv_dtype: torch.dtype,
    ):
        self.model = model
        self.backend = model.backend
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        config = model.config
        shape = (num_blocks * block_size, config.num_kv_heads, config.head_dim)
        caches = zeroed((2 * config.num_layers, *shape), kv_dtype, device)
        self.kv_caches = [(caches[2 * i], caches[2 * i + 1]) for i in range(config.num_layers)]

    def prepare(self, entries: list[BatchEntry]) -> StepInputs:
        """The step's batch as host arrays: every entry's new tokens end to end."""
        query_lens = np.array([len(e.token_ids) for e in entries], dtype=np.int32)
        starts = np.array([e.num_computed_tokens for e in entries], dtype=np.int64)
        ends = starts + query_lens
        query_start_loc = np.zeros(len(entries) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        # position of every row: its sequence's start + its index among the sequence's new rows
        seq_of_row = np.repeat(np.arange(len(entries)), query_lens)
        positions = starts[seq_of_row] + np.arange(len(seq_of_row)) - query_start_loc[seq_of_row]
        used_blocks = -(-ends // self.block_size)
        block_tables = np.zeros((len(entries), int(used_blocks.max())), dtype=np.int32)
        for i, (entry, used) in enumerate(zip(entries, used_blocks)):
            block_tables[i, :used] = entry.block_table[:used]
        slot_mapping = (block_tables[seq_of_row, positions // self.block_size].astype(np.int64) * self.block_size
                        + positions % self.block_size)
        return StepInputs(
            input_ids=np.fromiter((t for e in entries for t in e.token_ids), dtype=np.int64, count=len(positions)),
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=ends.astype(np.int32),
            block_tables=block_tables,
            block_size=self.block_size,
        )

    def execute(self, entries: list[BatchEntry]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one step: hidden states of every new token [T, hidden] and each entry's last row [B]."""
        step = self.prepare(entries)
        hidden = self.backend.forward(self.model, step, self.kv_caches)
        return hidden, torch.from_numpy(step.last_rows).to(hidden.device)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor whose pages are not touched up front. On a CPU: an anonymous memory map,
    which the OS fills with zeros page by page on first use, so a KV cache sized for a long context
    costs nothing until tokens are written (torch.zeros would write every page at start-up). On a
    GPU: torch.zeros (a device memset, milliseconds). Unused slots read as zeros either way, so a
    masked attention weight of 0 never meets a NaN left in memory."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = max(1, int(np.prod(shape)) * dtype.itemsize)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=int(np.prod(shape))).view(shape)
