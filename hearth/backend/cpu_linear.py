"""The cpu backend's matmul modules: weights kept in their storage format, multiplied by hearth/quant/kernels' C++ kernels.

`CpuBackend.prepare` gives each Linear whose weight loading left in its storage format the module
for that format, its kernel and weight pointers bound once (docs/quantized-matmul.md has the
measurements behind each choice):

- every GGUF block format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, TQ2_0; TQ1_0 rewritten to TQ2_0
  at load) and the codebook formats (IQ4_NL, IQ4_XS, MXFP4: 4-bit indices into 16 int8 values, looked
  up by one shuffle per 32 values and read as Q8_0's signed codes; the grid i-quants IQ3_S, IQ3_XXS,
  IQ2_S, IQ2_XS, IQ2_XXS, IQ1_S, IQ1_M: rewritten once at load into nibble blocks, each signed grid
  value a 4-bit code (IQ3_*: 4.6 bits a weight) or, for the 6-value grids IQ2_* and IQ1_*, a 3-bit one
  (3.6 bits) (`grid_nibbles`: the same weights, read about as fast as Q4_K: 4x faster than loading the
  grid entries per call); the 32-value formats, IQ4_XS, Q4_K and Q5_K on AVX2 builds without VNNI
  tiles: repacked once into groups of 8 rows whose codes one maddubs multiplies 4 of each row's values
  at a time (`rows8_repack`: 1.4-3.8x the blocks in place at one row)): `Int8Linear`, activations
  rounded to int8 per block of the weight's format (256 values for K-quants read in place or packed:
  llama.cpp's q8_K; 32 for the others and for any format in groups: q8_0) and integer dot products (AVX2 maddubs)
  against the blocks where they lie: their layout already puts a sub-block's codes in consecutive
  bytes, one vector load per 32 weights. With AVX-512 VNNI, every format but TQ2_0 (the grid
  formats from their nibble blocks) is instead repacked once, at load, into tiles of 32 rows (the codes at
  their own bits, IQ4_NL's, IQ4_XS's, MXFP4's and the nibble blocks' indices looked up per call by one byte shuffle;
  the block's scales as stored: about the file's size) that one VNNI instruction multiplies 16 rows of, with no decoding per call at any batch
  size; the file's pages are then released from this process (they stay in
  the page cache). On a build with neither (no AVX2), Q5_0 / Q5_1 past WIDENED_PAST_ROWS rows (prefill
  chunks) take tiles of the weight widened to fp32 and torch's fp32 GEMM instead, as F16/BF16 do.
- F16/BF16 matrices: `HalfLinear`, `half_matmul` up to HALF_MAX_ROWS rows (decode steps), the
  weight read as stored and widened to fp32 in registers (fp32 FMA); past those (prefill chunks),
  tiles converted to fp32 and torch's fp32 GEMM. Where bf16 pairs pay (AMD's AVX512_BF16:
  `half_bf16_min_rows`), BF16 weights are laid out once at load as pairs of 16 rows (bf16_pairs.py) and
  take `half_matmul` at every size: one row in fp32, from 2 rows the activations rounded to bf16 and
  AVX512_BF16's dot products (2x the fp32 FMA's FLOPs there; fp32 results; as fast as oneDNN's bf16 GEMM).
- anything else, or no compiled kernels: the reference's DequantLinear (stored.py).

The cpu backend computes in float32: these modules take x float32 [M, K] (what the model's layers
pass) and return float32 [M, N].

Error of the int8-activation kernels: |y - ref| <= sum over activation blocks b of
(amax_b / 254) sum_b |w| (each activation is off by at most half its block's step amax_b / 127),
plus fp32 rounding.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType
from torch import nn

from hearth.backend.stored import BoundWeights, DequantLinear, tiled_linear
from hearth.quant import kernels
from hearth.quant.formats import tq1_0_to_tq2_0
from hearth.quant.kernels.bf16_pairs import pairs_layout, rows_of_pairs
from hearth.quant.kernels.memory import release_pages
from hearth.quant.tensor import HALF_DTYPES, QuantTensor, dequantize_rows

Q = GGMLQuantizationType
# multiplied by `int8_matmul` (activations as llama.cpp's q8_K / q8_0)
CODEBOOK_QTYPES = (Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4, *kernels.GRID_FORMATS)
INT8_QTYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.TQ2_0,
               *CODEBOOK_QTYPES)
# of those, repacked at load where the build has AVX-512 VNNI (TQ2_0 read in place; the grid formats from their
# nibble blocks)
PACKED_QTYPES = tuple(q for q in INT8_QTYPES if q != Q.TQ2_0)
# Most activation rows that `int8_matmul` takes against Q5_0 / Q5_1 blocks read in place (builds with neither
# AVX-512 VNNI nor AVX2): past them (prefill chunks) tiles of the weight widened to fp32 by the kernels'
# `dequantize_rows` and torch's fp32 GEMM win, the widening spread over the rows. Measured on AVX2 before its
# groups of 8 rows (1 thread, CPU ms, docs/benchmarks.md): at 128 rows on 1536 x 576 and 3072 x 1024 Q5_0 / Q5_1
# 1.00-1.23x faster widened, at 512 rows 1.18-1.58x; the groups beat the widening at 1-512 rows (1.2-2.3x).
# Activations are then not rounded to int8.
WIDENED_PAST_ROWS = {Q.Q5_0: 96, Q.Q5_1: 96}
# Most activation rows that `half_matmul` takes against F16/BF16 weights (decode steps): past them
# (prefill chunks) tiles of the weight converted to fp32 and torch's fp32 GEMM win, the conversion
# spread over the rows; torch's bf16 GEMM is slower than both at every size on the Intel Xeon
# measured (docs/quantized-matmul.md). Not for BF16 where the kernels take bf16 pairs: there half_matmul
# runs 2.5x the fp32 tiles at every size (~380-425 GFLOP/s at 512-2048 rows on EPYC-512, 2 threads).
HALF_MAX_ROWS = 128


def cpu_linear(weight: QuantTensor, bias: torch.Tensor | None = None) -> nn.Module:
    """The module that multiplies by `weight` as stored (see the module's docstring)."""
    ext = kernels.extension()
    if ext is not None and weight.qtype in HALF_DTYPES:
        return HalfLinear(weight, bias, ext)
    if ext is not None and weight.qtype in (*INT8_QTYPES, Q.TQ1_0):
        return Int8Linear(weight, bias, ext)
    return DequantLinear(weight, bias)


class Int8Linear(BoundWeights):
    """y = x W^T (+ b), W GGUF blocks: `qweight` (uint8 [out_features, bytes_per_row], the blocks as
    stored; the grid formats' as nibble blocks, of type `kernel_qtype`) or, for PACKED_QTYPES with
    AVX-512 VNNI, `codes` and `terms` (the packed tiles); either way `int8_matmul`, called straight
    from forward with `kernel_weight`, its operands (blocks or packed codes; packed terms or 0; the
    type) bound once (BoundWeights): at batch 1 a call's Python overhead is a visible share of its time."""

    def __init__(self, weight: QuantTensor, bias: torch.Tensor | None, ext: kernels.Kernels):
        super().__init__()
        data, self.qtype = weight.matrix(), weight.qtype
        self.out_features, self.in_features = weight.shape
        if self.qtype == Q.TQ1_0:  # the same trits two bits apiece: read by the int8 kernel with no base-3 decoding
            data, self.qtype = tq1_0_to_tq2_0(data, weight.shape), Q.TQ2_0
        ext._check(torch.empty(0, self.in_features), data, self.qtype, self.out_features)
        self._kernel, self.kernel_qtype, self._ext = ext.module.int8_matmul, int(self.qtype), ext
        if self.qtype in kernels.GRID_FORMATS:  # the same weights as 4-bit codes (nibble blocks)
            nibbles, self.kernel_qtype = ext.grid_nibbles(data, self.qtype, self.out_features, self.in_features)
            release_pages([data])
            data = nibbles
        elif (self.qtype in kernels.ROWS8_QTYPES and "avx2" in ext.int8_paths
              and not (self.qtype in PACKED_QTYPES and ext.vnni)):  # groups of 8 rows (rows8.cpp)
            groups, self.kernel_qtype = ext.rows8_repack(data, self.qtype, self.out_features, self.in_features)
            release_pages([data])
            data = groups
        if self.qtype in PACKED_QTYPES and ext.vnni:  # the tiles pay only with VNNI
            codes, terms = ext.repack(data, self.kernel_qtype, self.out_features, self.in_features)
            release_pages([data])
            self.qweight = None
            self.register_buffer("codes", codes, persistent=False)  # uint8 [tiles, codes of 32 rows]
            self.register_buffer("terms", terms, persistent=False)  # uint8 [tiles, their scales]
        else:
            self.codes = self.terms = None
            # uint8 [out_features, bytes_per_row]; the ROWS8 types' [ceil(out_features / 8), rows8_bytes]
            self.register_buffer("qweight", data, persistent=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        # blocks in place on a build without VNNI: prefill chunks past these rows as fp32 tiles (None: never)
        in_place = self.codes is None and self.kernel_qtype == int(self.qtype)
        self.widened_past_rows = WIDENED_PAST_ROWS.get(self.qtype) if in_place and not ext.vnni else None
        self._bind()

    def _bind(self) -> None:
        weight = self.qweight if self.codes is None else self.codes
        self.kernel_weight = (weight.data_ptr(), 0 if self.terms is None else self.terms.data_ptr(), self.kernel_qtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x float32 [M, K]
        if self.widened_past_rows is not None and x.shape[0] > self.widened_past_rows:  # fp32 tiles, torch's GEMM
            y = tiled_linear(x, self.out_features, self._widened_rows)
            return y if self.bias is None else y.add_(self.bias)
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.out_features)
        weight, terms, qtype = self.kernel_weight
        self._kernel(x.data_ptr(), weight, terms, y.data_ptr(), x.shape[0], self.out_features,
                     self.in_features, qtype, 0, torch.get_num_threads())  # path 0: the fastest
        return y if self.bias is None else y.add_(self.bias)

    def _widened_rows(self, start: int, end: int) -> torch.Tensor:
        """Rows start..end - 1 of the weight (blocks in place) as float32, the kernels' own decoding."""
        return self._ext.dequantize_rows(self.qweight[start:end], self.kernel_qtype, self.in_features)

    def gguf_blocks(self) -> torch.Tensor | None:
        """The weight as GGUF blocks, uint8 [out_features, bytes_per_row] (those in place, or a copy rebuilt
        from the groups of 8 rows), or None: packed tiles, a grid format's nibble blocks."""
        if self.codes is not None or self.kernel_qtype not in (int(self.qtype), kernels.ROWS8 + int(self.qtype)):
            return None
        if self.kernel_qtype == int(self.qtype):
            return self.qweight
        return self._ext.rows8_blocks(self.qweight, self.kernel_qtype, self.out_features, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight as a dense matrix (for tests and tools, not the forward pass)."""
        if self.kernel_qtype > kernels.ROWS8:  # groups of 8 rows: the blocks rebuilt, the kernels' own decoding
            return self._ext.dequantize_rows(self.gguf_blocks(), self.qtype, self.in_features).to(dtype)
        if self.codes is not None:  # packed tiles (a grid format's from its nibble blocks)
            rows = self._ext.dequantize_packed(self.codes, self.terms, self.kernel_qtype, self.in_features)
            return rows[: self.out_features].to(dtype)
        if self.kernel_qtype != self.qtype:  # nibble blocks: the kernels' own decoding (bit-exact)
            return self._ext.dequantize_rows(self.qweight, self.kernel_qtype, self.in_features).to(dtype)
        return dequantize_rows(self.qweight, self.qtype, self.in_features).to(dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype.name}, "
                f"packed={self.codes is not None}, bias={self.bias is not None}")


class HalfLinear(BoundWeights, DequantLinear):
    """y = x W^T (+ b), W an F16/BF16 matrix (`qweight`, its bytes): `half_matmul` for a decode step's few
    rows, the reference's fp32 tiles and torch's GEMM for more (HALF_MAX_ROWS). Where bf16 pairs pay
    (`half_bf16_min_rows`), a BF16 W is laid out once as pairs of 16 rows (bf16_pairs.py) and half_matmul
    takes every size."""

    def __init__(self, weight: QuantTensor, bias: torch.Tensor | None, ext: kernels.Kernels):
        super().__init__(weight, bias)
        self._kernel, self._qtype, self._max_rows = ext.module.half_matmul, int(self.qtype), HALF_MAX_ROWS
        if self.qtype == Q.BF16 and ext.module.half_bf16_min_rows() > 0:
            rows = self.qweight
            self.qweight = pairs_layout(rows, self.out_features, self.in_features)  # uint8 [groups of 16 rows, ...]
            release_pages([rows])
            self._qtype, self._max_rows = kernels.BF16_PAIRS, None
        self._bind()

    def _bind(self) -> None:  # as Int8Linear's: the weight's pointer, no packed terms, the type the kernel reads
        self.kernel_weight = (self.qweight.data_ptr(), 0, self._qtype)

    def half_rows(self) -> torch.Tensor:
        """The weight's bytes as rows, uint8 [out_features, 2 in_features] (a copy where laid out in pairs)."""
        if self._qtype == kernels.BF16_PAIRS:
            return rows_of_pairs(self.qweight, self.out_features, self.in_features)
        return self.qweight

    def _dequantize_rows(self, start: int, end: int) -> torch.Tensor:
        return dequantize_rows(self.half_rows()[start:end], self.qtype, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x float32 [M, K]
        if self._max_rows is not None and x.shape[0] > self._max_rows:  # a prefill chunk: the conversion spread over its rows
            return super().forward(x)
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.out_features)
        self._kernel(x.data_ptr(), self.kernel_weight[0], y.data_ptr(), x.shape[0], self.out_features,
                     self.in_features, self.qweight.shape[1], self._qtype, False, False, torch.get_num_threads())
        return y if self.bias is None else y.add_(self.bias)
