"""Activation sparsity's matmul modules (docs/sparsity.md): y = mask(x) W^T (+ b), where mask(x) keeps
an activation only if |x| >= the input's calibrated threshold (TEAL's magnitude rule).

- `ThresholdedLinear` (every backend; the readable definition): x masked in torch, then the
  projection's own module. Computes what the sparse kernel computes, reads the whole weight.
- `SparseColumnsLinear` (cpu backend, F32 / F16 / BF16 weights): the weight kept transposed (W^T
  [K, N], each input column's weights contiguous), and for a step of up to SPARSE_MAX_ROWS rows
  hearth/quant/kernels' `sparse_matmul`: the weights of the columns whose activations are all
  masked are never read, which is the speed-up (decode reads weights at the memory's bandwidth).
  More rows (prefill chunks): masked x times W^T in fp32 tiles through torch's GEMM (the chance
  that a column is masked in every one of M rows falls as s^M: nothing is left to skip).

GGUF block formats are not skipped: their rows are blocks of 32 values along the input, so a masked
activation saves no byte unless its whole block is masked (s^32 of them at sparsity s); they take
`ThresholdedLinear` over their int8 kernel (the quality of the sparse model, not its speed).
"""

from __future__ import annotations

import torch
from torch import nn

from hearth.backend.stored import BoundWeights
from hearth.quant.tensor import HALF_DTYPES

# rows up to which the sparse kernel runs (decodes, short verifications); past them torch's GEMM
SPARSE_MAX_ROWS = 8
_TILE_ROWS = 1024  # rows of W^T widened to fp32 per GEMM in a prefill: a bounded temporary


def mask_activations(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """x where |x| >= threshold, else 0."""
    return torch.where(x.abs() >= threshold, x, torch.zeros((), dtype=x.dtype, device=x.device))


class ThresholdedLinear(nn.Module):
    """mask(x) through `inner` (any projection module: x [..., K] -> [..., N])."""

    def __init__(self, inner: nn.Module, threshold: float):
        super().__init__()
        self.inner, self.threshold = inner, float(threshold)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(mask_activations(x, self.threshold))

    def extra_repr(self) -> str:
        return f"threshold={self.threshold:.6g}"


class SparseColumnsLinear(BoundWeights):
    """mask(x) W^T (+ b) with W^T stored (`weight_t`, [in_features, out_features] in W's storage dtype);
    x float32 [M, K] -> float32 [M, N] (see the module's docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, threshold: float, kernels):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.threshold, self._kernels = float(threshold), kernels
        self.register_buffer("weight_t", weight.t().contiguous(), persistent=False)  # [K, N]
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self._bind()

    @classmethod
    def of(cls, module: nn.Module, threshold: float, kernels) -> SparseColumnsLinear | None:
        """From a dense Linear (fp32) or the cpu backend's HalfLinear (F16 / BF16 bytes); None for another module."""
        qtype = getattr(module, "qtype", None)
        if qtype in HALF_DTYPES and hasattr(module, "qweight"):
            weight = module.qweight.view(HALF_DTYPES[qtype])
        elif isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dtype == torch.float32:
            weight = module.weight.detach()
        else:
            return None
        return cls(weight, module.bias, threshold, kernels)

    def _bind(self) -> None:
        self._matmul = self._kernels.module.sparse_matmul
        self._qtype = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}[self.weight_t.dtype]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x float32 [M, K]
        x = x.contiguous()
        if x.shape[0] > SPARSE_MAX_ROWS:
            y = self._dense(mask_activations(x, self.threshold))
        else:
            y = torch.empty(x.shape[0], self.out_features)
            self._matmul(x.data_ptr(), self.weight_t.data_ptr(), y.data_ptr(), x.shape[0], self.out_features,
                         self.in_features, self._qtype, self.threshold, torch.get_num_threads())
        return y if self.bias is None else y.add_(self.bias)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_t.dtype == torch.float32:
            return x @ self.weight_t
        y = torch.zeros(x.shape[0], self.out_features)
        for k in range(0, self.in_features, _TILE_ROWS):
            y.addmm_(x[:, k:k + _TILE_ROWS], self.weight_t[k:k + _TILE_ROWS].float())
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"dtype={str(self.weight_t.dtype).removeprefix('torch.')}, threshold={self.threshold:.6g}")
