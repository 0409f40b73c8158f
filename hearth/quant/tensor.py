"""QuantTensor: a weight kept in its storage format (GGUF blocks, or an F16/BF16 matrix as read), rows independent."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from hearth.quant.formats import dequantize

Q = GGMLQuantizationType
HALF_DTYPES = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}  # the storage formats that are plain arrays
HALF_QTYPES = {dtype: qtype for qtype, dtype in HALF_DTYPES.items()}


@dataclass
class QuantTensor:
    """A 2-D weight of shape (rows, cols) stored as raw GGUF blocks (F16 and BF16: one value a block).

    data: uint8 of shape (rows, bytes_per_row); a row holds cols / block_size blocks,
    so rows can be permuted or sliced without touching the blocks.
    column_order: None, or int64 [cols]: the blocks hold the columns in this order (stored column j is
    the weight's column column_order[j]; GPTQ's act-order, hearth/loading/library_quant.py), so a
    matmul takes its input's columns in that order first.
    """

    data: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, int]
    column_order: torch.Tensor | None = None

    @classmethod
    def of_half(cls, matrix: torch.Tensor) -> QuantTensor:
        """An F16 / BF16 matrix as it is stored (its bytes, no copy)."""
        rows, cols = matrix.shape
        return cls(matrix.contiguous().view(torch.uint8).reshape(rows, -1), HALF_QTYPES[matrix.dtype], (rows, cols))

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    def matrix(self) -> torch.Tensor:
        """The bytes as uint8 [rows, bytes_per_row]."""
        return self.data.reshape(self.shape[0], -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense matrix in `dtype`, its columns in the weight's order (an F16/BF16 matrix of that
        dtype: its own bytes, no copy)."""
        if self.qtype in HALF_DTYPES:
            return self.matrix().view(HALF_DTYPES[self.qtype]).to(dtype)
        stored = dequantize(self.data, self.qtype, self.shape).to(dtype)
        if self.column_order is None:
            return stored
        dense = torch.empty_like(stored)
        dense[:, self.column_order] = stored
        return dense

    def row_range(self, start: int, size: int) -> QuantTensor:
        """Rows start..start+size-1, still quantized (a view: rows are whole blocks)."""
        return replace(self, data=self.matrix()[start:start + size], shape=(size, self.shape[1]))

    def rows(self, index: torch.Tensor) -> QuantTensor:
        """The rows at `index`, still quantized. Gathered by numpy: torch's index kernel forks its
        threads for a copy of a few hundred kilobytes, tens of milliseconds a call on a busy machine."""
        data = torch.from_numpy(self.matrix().numpy()[index.numpy()]) if self.data.is_cpu else self.matrix()[index]
        return replace(self, data=data, shape=(len(index), self.shape[1]))


def dequantize_rows(data: torch.Tensor, qtype: GGMLQuantizationType, cols: int) -> torch.Tensor:
    """float32 [rows, cols] of the rows `data` (uint8 [rows, bytes_per_row]) of a `qtype` weight."""
    if qtype in HALF_DTYPES:
        return data.view(HALF_DTYPES[qtype]).float()
    return dequantize(data, qtype, (data.shape[0], cols))


def stack_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Tensors of one dtype and trailing shape, laid out end to end by rows in one new buffer:
    each part written into its place once (numpy's copy, one thread: torch's parallel copy costs
    its threads' wake-up per call, most of a merged projection's load time on a busy machine)."""
    out = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype)
    flat, start = _bytes(out), 0
    for part in parts:
        source = _bytes(part)
        np.copyto(flat[start:start + len(source)], source)
        start += len(source)
    return out


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as a flat numpy array (a view where it is contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
