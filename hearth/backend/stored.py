"""Weights kept in their storage format: the reference backend's modules for them, and the swap
that puts a backend's modules into a loaded model.

Loading (Transformer.load_weights) leaves the weight of a Linear or an Embedding as a QuantTensor
where the checkpoint stores it as GGUF blocks or as an F16/BF16 matrix; `Backend.prepare` then
replaces each such module, once, by the module its backend multiplies that format with
(`swap_stored_weights`): the kernel is chosen there, never inside a forward pass.

The reference modules are dequantize-then-matmul in torch, on any device and dtype: `DequantLinear`
dequantizes a tile of the weight's rows at a time and multiplies it with `F.linear` (never the whole
weight at once); `QuantEmbedding` dequantizes only the rows looked up.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hearth.quant.kernels.memory import mappings_snapshot
from hearth.quant.tensor import QuantTensor, dequantize_rows

# Rows of the weight dequantized per step of DequantLinear: bounds its temporary to ~16 MB fp32.
_TILE_ELEMENTS = 1 << 22


def swap_stored_weights(model: nn.Module, make: Callable[[nn.Module, QuantTensor], nn.Module | None],
                        dtype: torch.dtype) -> None:
    """Every module of `model` whose weight is a QuantTensor replaced by make(module, weight), or,
    where that gives None, kept with its weight dense (a Parameter of the compute dtype `dtype`)."""
    # by name, holding no module: each replaced module and its weight go as soon as their replacement is made (a
    # list of the modules kept every merged projection's buffer alive beside the copies made of them: +55% of a
    # bf16 model at its load's peak)
    names = [name for name, module in model.named_modules() if isinstance(module.__dict__.get("weight"), QuantTensor)]
    with mappings_snapshot():  # (a repacking module releases its weight's file pages: one read of the maps)
        for name in names:
            _swap(model, name, model.get_submodule(name), make, dtype)


def _swap(model: nn.Module, name: str, module: nn.Module, make, dtype: torch.dtype) -> None:
    weight = module.__dict__.get("weight")
    if not isinstance(weight, QuantTensor):
        return
    replacement = make(module, weight)
    if replacement is None:
        del module.weight
        module.weight = nn.Parameter(weight.dequantize(dtype), requires_grad=False)
        return
    if weight.column_order is not None:
        replacement = ReorderedInput(replacement, weight.column_order, weight.shape[0])
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, replacement)


class ReorderedInput(nn.Module):
    """A projection whose weight's columns are stored in `order` (QuantTensor.column_order): its
    input's columns taken in that order, then multiplied by the stored matrix."""

    def __init__(self, inner: nn.Module, order: torch.Tensor, out_features: int) -> None:
        super().__init__()
        self.inner, self.in_features, self.out_features = inner, len(order), out_features  # (read by LoRA's wrapper)
        self.register_buffer("order", order, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.index_select(-1, self.order))


def tiled_linear(x: torch.Tensor, out_features: int, rows_of: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """x [M, K] @ W^T -> float32 [M, out_features], W given a tile of rows at a time:
    rows_of(start, end) -> float32 [end - start, K]."""
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    step = max(32, _TILE_ELEMENTS // x.shape[-1] // 32 * 32)
    for start in range(0, out_features, step):
        end = min(out_features, start + step)
        out[:, start:end] = F.linear(x, rows_of(start, end).to(x.dtype))
    return out


class BoundWeights(nn.Module):
    """A module that looks up something of its tensors once (`_bind`: their pointers, a kernel's
    operands), and again whenever they move: only through _apply (.to, .cuda, ...)."""

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        self._bind()
        return module

    def _bind(self) -> None:
        raise NotImplementedError


class DequantLinear(nn.Module):
    """y = x W^T (+ b) with W in its storage format: dequantized a tile of rows at a time, then
    multiplied in x's dtype (any device, any leading dimensions)."""

    def __init__(self, weight: QuantTensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.qtype = weight.qtype
        self.out_features, self.in_features = weight.shape
        self.register_buffer("qweight", weight.matrix(), persistent=False)  # uint8 [out_features, bytes_per_row]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tiled_linear(x.reshape(-1, self.in_features), self.out_features, self._dequantize_rows).to(x.dtype)
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def _dequantize_rows(self, start: int, end: int) -> torch.Tensor:
        return dequantize_rows(self.qweight[start:end], self.qtype, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight as a dense matrix (for tests and tools, not the forward pass)."""
        return self._dequantize_rows(0, self.out_features).to(dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype.name}, "
                f"bias={self.bias is not None}")


class QuantEmbedding(nn.Module):
    """Token embeddings kept in their storage format: only the rows looked up are dequantized."""

    def __init__(self, weight: QuantTensor, dtype: torch.dtype,
                 dequantize: Callable[[torch.Tensor, int, int], torch.Tensor] = dequantize_rows):
        super().__init__()
        self.qtype = weight.qtype
        self.num_embeddings, self.embedding_dim = weight.shape
        self.register_buffer("qweight", weight.matrix(), persistent=False)  # uint8 [rows, bytes_per_row]
        self.dtype = dtype
        self.dequantize_rows = dequantize  # (rows, qtype, columns) -> float32 [rows, columns], as dequantize_rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight[ids.reshape(-1)]
        return self.dequantize_rows(rows, self.qtype, self.embedding_dim).to(self.dtype).reshape(*ids.shape, -1)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype.name}"
