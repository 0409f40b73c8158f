"""The gpu backend's matmul module for GGUF blocks: `TritonQuantLinear` (hearth/triton_kernels/quant_matmul.py)."""

from __future__ import annotations

import torch
from torch import nn

from hearth.backend.stored import BoundWeights
from hearth.quant.tensor import QuantTensor
from hearth.triton_kernels.quant_matmul import SUPPORTED_QTYPES, TritonQuantWeight


class TritonQuantLinear(BoundWeights):
    """y = x W^T (+ b) on a GPU with W kept in its GGUF blocks (Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K),
    repacked once into the planar arrays of hearth/triton_kernels/quant_matmul.py (about the file's
    bytes) and multiplied by its Triton kernels: dequantized in registers, never expanded."""

    _ARRAYS = ("q", "qh", "d", "dmin", "sc", "mn")

    @staticmethod
    def supports(weight: QuantTensor) -> bool:
        return weight.qtype in SUPPORTED_QTYPES

    def __init__(self, weight: QuantTensor, bias: torch.Tensor | None, device: torch.device):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.qtype = weight.qtype
        packed = TritonQuantWeight.from_blocks(weight.matrix(), weight.qtype, weight.shape, device)
        for name in self._ARRAYS:  # buffers: counted, moved and freed with the model
            self.register_buffer(name, getattr(packed, name), persistent=False)
        self.bias = nn.Parameter(bias.to(device), requires_grad=False) if bias is not None else None
        self._bind()

    def _bind(self) -> None:
        arrays = {name: getattr(self, name) for name in self._ARRAYS}
        self._weight = TritonQuantWeight(self.qtype, (self.out_features, self.in_features), **arrays)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._weight.matmul(x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._weight.dequantize(dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype.name}, "
                f"bias={self.bias is not None}")
