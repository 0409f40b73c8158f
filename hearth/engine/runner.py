"""ModelRunner: owns the KV cache tensors and turns a step's batch into model inputs.

The only engine module that builds tensors: the scheduler hands it, per sequence, the new
tokens, how many tokens are already cached and the block table; it returns hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hearth.model.attention import AttentionMetadata, PrefillSequence
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
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self._offsets = np.arange(block_size, dtype=np.int64)
        config = model.config
        shape = (num_blocks * block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=kv_dtype, device=device), torch.zeros(shape, dtype=kv_dtype, device=device))
            for _ in range(config.num_layers)
        ]

    def _slots(self, block_table: list[int], end: int) -> np.ndarray:
        """Cache slots of token positions [0, end) of a sequence."""
        blocks = np.asarray(block_table[: -(-end // self.block_size)], dtype=np.int64)
        return (blocks[:, None] * self.block_size + self._offsets).reshape(-1)[:end]

    def prepare(self, entries: list[BatchEntry]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """input_ids [T], positions [T], metadata, and the row of each entry's last token [B]."""
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        slot_mapping: list[np.ndarray] = []
        prefills: list[PrefillSequence] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        last_rows: list[int] = []
        dev = self.device
        for entry in entries:
            start, new = entry.num_computed_tokens, len(entry.token_ids)
            end = start + new
            row = len(input_ids)
            input_ids.extend(entry.token_ids)
            positions.append(np.arange(start, end))
            last_rows.append(row + new - 1)
            if new == 1:  # a decode reads its context through the block table: only the new slot here
                block, offset = divmod(start, self.block_size)
                slot_mapping.append(np.array([entry.block_table[block] * self.block_size + offset]))
                decode_rows.append(row)
                decode_tables.append(entry.block_table)
                decode_lens.append(end)
            else:
                context = self._slots(entry.block_table, end)
                slot_mapping.append(context[start:])
                mask = np.arange(end)[None, :] <= np.arange(start, end)[:, None]  # [new, end] causal
                prefills.append(PrefillSequence(
                    row, row + new, torch.from_numpy(context).to(dev), torch.from_numpy(mask).to(dev)
                ))
        widest = max((-(-n // self.block_size) for n in decode_lens), default=0)
        tables = np.zeros((len(decode_tables), widest), dtype=np.int32)
        for i, (table, n) in enumerate(zip(decode_tables, decode_lens)):
            used = -(-n // self.block_size)
            tables[i, :used] = table[:used]
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_mapping)).to(dev),
            prefills=prefills,
            decode_token_index=torch.tensor(decode_rows, dtype=torch.long, device=dev),
            decode_block_tables=torch.from_numpy(tables).to(dev),
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32, device=dev),
            decode_max_len=max(decode_lens, default=0),
            block_size=self.block_size,
        )
        return (
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.from_numpy(np.concatenate(positions)).to(dev),
            meta,
            torch.tensor(last_rows, dtype=torch.long, device=dev),
        )

    def execute(self, entries: list[BatchEntry]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one step: hidden states of every new token [T, hidden] and each entry's last row [B]."""
        input_ids, positions, meta, last_rows = self.prepare(entries)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return hidden, last_rows
