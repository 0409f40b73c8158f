"""Activation sparsity's matmul modules (docs/sparsity.md): y = mask(x) W^T (+ b), where mask(x) keeps
an activation only if |x| >= the input's calibrated threshold (TEAL's magnitude rule).

- `ThresholdedLinear` (every backend; the readable definition): x masked in torch, then the
  projection's own module. Computes what the sparse kernels compute, reads the whole weight.
- `SparseColumnsLinear` (cpu backend, F32 / F16 / BF16 weights): the weight kept transposed (W^T
  [K, N], each input column's weights contiguous), and for a step of up to SPARSE_MAX_ROWS rows
  hearth/quant/kernels' `sparse_matmul`: the weights of the columns whose activations are all
  masked are never read, which is the speed-up (decode reads weights at the memory's bandwidth).
  More rows (prefill chunks): masked x times W^T in fp32 tiles through torch's GEMM (the chance
  that a column is masked in every one of M rows falls as s^M: nothing is left to skip).
- `SparseBlocksLinear` (cpu backend, Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K weights): in the file a row is
  blocks of 32 or 256 input values, so a masked activation saves no byte unless its whole block is
  masked (s^32 of them at sparsity s). The blocks are re-laid out once, losslessly, column by column
  (the codes of input column k for every output row contiguous, at 4 or 8 bits, the scales apart:
  hearth/quant/kernels/sparse_blocks.cpp) and `sparse_matmul` reads only the kept columns' codes,
  with activations rounded to int8 per 32 (Q6_K: 16) values as the int8 kernels do, for steps of up
  to SPARSE_MAX_ROWS rows; more rows (prefill chunks): the masked input through int8_matmul on the
  blocks as stored (kept too: a view of the file, read only by prefills). Other block formats (and matrices whose N is no multiple of 64):
  the blocks as stored, the masked input through their int8 kernel (nothing skipped), in the same
  module and entry. Packed tiles (AVX-512 VNNI builds, which drop the file's blocks) and anything
  else: `ThresholdedLinear`.

Both sparse modules give the cpu backend's one-call decode path (cpu_decode.py) their operands
(`kernel_weight`, `qtype`, `threshold_pointer`), so a sparse model keeps that path.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType
from torch import nn

from hearth.backend.cpu_linear import Int8Linear
from hearth.backend.stored import BoundWeights
from hearth.quant.tensor import HALF_DTYPES

Q = GGMLQuantizationType
# block formats re-laid out for the sparse kernel: those whose layout is no larger than the file's
# (Q6_K's 6-bit codes go to 8 bits: smaller than the file's 6.56 bits a weight from s = 0.25 on)
SPARSE_BLOCK_QTYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K)
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


class SparseLinear(BoundWeights):
    """mask(x) W^T (+ b) through `sparse_matmul`, W in the layout its qtype names; x float32 [M, K] ->
    float32 [M, N]. Subclasses store the weight and bind `kernel_weight` (its pointer, 0)."""

    def __init__(self, shape: tuple[int, int], bias: torch.Tensor | None, threshold: float, qtype: int, kernels):
        super().__init__()
        self.out_features, self.in_features = shape
        self.threshold, self.qtype, self._kernels = float(threshold), GGMLQuantizationType(qtype), kernels
        # the decode path's layer table points at it (cpu_kernels/decode_layers.cpp reads the float)
        self.register_buffer("threshold_value", torch.tensor([self.threshold], dtype=torch.float32), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def _bind(self) -> None:
        self._matmul = self._kernels.module.sparse_matmul
        self.kernel_weight = (self._weight().data_ptr(), 0, int(self.qtype))  # as Int8Linear's: pointer, no packed terms, type
        self.threshold_pointer = self.threshold_value.data_ptr()

    def _weight(self) -> torch.Tensor:
        raise NotImplementedError

    def _sparse(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.shape[0], self.out_features)
        self._matmul(x.data_ptr(), self.kernel_weight[0], y.data_ptr(), x.shape[0], self.out_features,
                     self.in_features, int(self.qtype), self.threshold, torch.get_num_threads())
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x float32 [M, K]
        y = self._sparse(x.contiguous())
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype.name}, "
                f"threshold={self.threshold:.6g}")


class SparseBlocksLinear(SparseLinear):
    """W's GGUF blocks: `layout` (uint8) re-laid out column by column (sparse_blocks.cpp) where the format
    has that layout, else the blocks as stored (the masked input through int8_matmul); `blocks`, the
    blocks as stored, for steps of more than SPARSE_MAX_ROWS rows (see the module's docstring)."""

    def __init__(self, layout: torch.Tensor, blocks: torch.Tensor, shape: tuple[int, int], bias: torch.Tensor | None,
                 threshold: float, qtype: int, kernels):
        super().__init__(shape, bias, threshold, qtype, kernels)
        self.register_buffer("layout", layout, persistent=False)
        self.register_buffer("blocks", blocks, persistent=False)  # uint8 [N, bytes_per_row]
        self._bind()

    @classmethod
    def of(cls, module: nn.Module, threshold: float, kernels) -> SparseBlocksLinear | None:
        """From an Int8Linear whose weight is GGUF blocks (as stored, or rebuilt from its groups of 8 rows; not
        packed tiles, AVX-512 VNNI builds, nor nibble blocks); None for another module."""
        blocks = module.gguf_blocks() if isinstance(module, Int8Linear) else None
        if blocks is None:
            return None
        return cls.from_blocks(blocks, module.qtype, (module.out_features, module.in_features), module.bias,
                               threshold, kernels)

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, qtype: int, shape: tuple[int, int], bias: torch.Tensor | None,
                    threshold: float, kernels) -> SparseBlocksLinear:
        """GGUF blocks uint8 [N, bytes_per_row] of `shape` (N, K): re-laid out if `qtype` is in
        SPARSE_BLOCK_QTYPES and N a multiple of 64, else kept."""
        skips = qtype in SPARSE_BLOCK_QTYPES and shape[0] % 64 == 0
        layout = kernels.sparse_repack(blocks, qtype, *shape) if skips else blocks
        return cls(layout, blocks, shape, bias, threshold, qtype, kernels)

    @property
    def skips_columns(self) -> bool:
        return self.layout.dim() == 1  # re-laid out (a flat buffer), not the file's [N, row bytes]

    def _weight(self) -> torch.Tensor:
        return self.layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x float32 [M, K]
        x = x.contiguous()
        if x.shape[0] <= SPARSE_MAX_ROWS or not self.skips_columns:
            y = self._sparse(x)
        else:  # a prefill chunk: few columns are masked in every row; the file's blocks, read once
            y = self._kernels.int8_matmul(mask_activations(x, self.threshold), self.blocks, self.qtype, self.out_features)
        return y if self.bias is None else y.add_(self.bias)


class SparseColumnsLinear(SparseLinear):
    """W^T stored (`weight_t`, [in_features, out_features] in W's storage dtype); see the module's docstring."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, threshold: float, kernels):
        qtype = {torch.float32: Q.F32, torch.float16: Q.F16, torch.bfloat16: Q.BF16}[weight.dtype]
        super().__init__(tuple(weight.shape), bias, threshold, qtype, kernels)
        self.register_buffer("weight_t", weight.t().contiguous(), persistent=False)  # [K, N]
        self._bind()

    @classmethod
    def of(cls, module: nn.Module, threshold: float, kernels) -> SparseColumnsLinear | None:
        """From a dense Linear (fp32) or the cpu backend's HalfLinear (F16 / BF16 bytes); None for another module."""
        qtype = getattr(module, "qtype", None)
        if qtype in HALF_DTYPES and hasattr(module, "half_rows"):
            weight = module.half_rows().view(HALF_DTYPES[qtype])
        elif isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dtype == torch.float32:
            weight = module.weight.detach()
        else:
            return None
        return cls(weight, module.bias, threshold, kernels)

    def _weight(self) -> torch.Tensor:
        return self.weight_t

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x float32 [M, K]
        x = x.contiguous()
        y = self._dense(mask_activations(x, self.threshold)) if x.shape[0] > SPARSE_MAX_ROWS else self._sparse(x)
        return y if self.bias is None else y.add_(self.bias)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_t.dtype == torch.float32:
            return x @ self.weight_t
        y = torch.zeros(x.shape[0], self.out_features)
        for k in range(0, self.in_features, _TILE_ROWS):
            y.addmm_(x[:, k:k + _TILE_ROWS], self.weight_t[k:k + _TILE_ROWS].float())
        return y
