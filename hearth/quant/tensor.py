"""QuantTensor: a weight kept in its GGUF block format, rows independent."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from hearth.quant.formats import dequantize


@dataclass
class QuantTensor:
    """A 2-D weight of shape (rows, cols) stored as raw GGUF blocks.

    data: uint8 of shape (rows, bytes_per_row); a row holds cols / block_size blocks,
    so rows can be permuted or sliced without touching the blocks.
    """

    data: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.data, self.qtype, self.shape).to(dtype)

    def rows(self, index: torch.Tensor) -> "QuantTensor":
        """The rows at `index`, still quantized."""
        return QuantTensor(self.data[index], self.qtype, (len(index), self.shape[1]))
