"""Quantized layers: weights stay in their GGUF storage format, matmuls read them where they lie.

`QuantLinear` replaces `Linear` (and `QuantEmbedding` replaces `nn.Embedding`) when a weight
comes as GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K) or, on a CPU, as an F16/BF16
array; `quantized_module` is the one place that decides. Nothing is expanded at load: a weight
stays a uint8 buffer [out_features, bytes_per_row] over the file's memory map, or (every block
format but TQ2_0, on a CPU with AVX-512 VNNI) the same codes and scales repacked once.

The kernels (docs/quantized-matmul.md has the measurements behind each choice):

- CPU, every block format, every batch size: `int8_matmul`, activations rounded to int8 per block
  of the weight's format (256 values for K-quants: llama.cpp's q8_K; 32 for the others: q8_0)
  and integer dot products (AVX2 maddubs) against the GGUF blocks where they lie: their layout
  already puts a sub-block's codes in consecutive bytes, one vector load per 32 weights.
  With AVX-512 VNNI, every block format but TQ2_0 is instead repacked once, at load, into tiles
  of 32 rows (the codes at their own bits, the block's scales as stored: about the file's size)
  that one VNNI instruction multiplies 16 rows of, with no decoding per call at any batch size;
  the file's pages are then released from this process (they stay in the page cache).
- CPU, F16/BF16 arrays: `half_matmul` up to HALF_MAX_ROWS rows (decode steps), the weight read as
  stored and widened to fp32 in registers (fp32 FMA), against fp32 or bf16 activations (bf16
  compute, widened once); past those (prefill chunks), tiles converted to fp32 and torch's fp32 GEMM.
- The gpu backend (hearth/backend/gpu.py), Q8_0, Q4_0, Q4_K, Q5_K, Q6_K: `TritonQuantLinear`,
  the blocks repacked once into planar arrays and multiplied by Triton kernels that dequantize
  in registers (hearth/triton_kernels/quant_matmul.py).
- Anywhere else (the reference backend off a CPU, another format, or no C++ compiler): the
  weight dequantized a tile of rows at a time, then `F.linear` (never the whole weight at once).

Error of the int8-activation kernels: |y - ref| <= sum over activation blocks b of
(amax_b / 254) sum_b |w| (each activation is off by at most half its block's step amax_b / 127),
plus fp32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from hearth.quant import kernels
from hearth.quant.formats import dequantize, tq1_0_to_tq2_0
from hearth.quant.kernels.memory import release_mappings, release_pages
from hearth.quant.tensor import QuantTensor

Q = GGMLQuantizationType
# multiplied by `int8_matmul` on a CPU (activations as llama.cpp's q8_K / q8_0)
INT8_QTYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.TQ2_0)
# of those, repacked at load where the build has AVX-512 VNNI (TQ2_0 is read in place)
PACKED_QTYPES = tuple(q for q in INT8_QTYPES if q != Q.TQ2_0)
HALF_QTYPES = {torch.float16: Q.F16, torch.bfloat16: Q.BF16}
_HALF_DTYPES = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}

# Most activation rows that `half_matmul` takes against F16/BF16 weights (decode steps): past them
# (prefill chunks) tiles of the weight converted to fp32 and torch's fp32 GEMM win, the conversion
# spread over the rows; torch's bf16 GEMM is slower than both at every size (measured,
# docs/quantized-matmul.md).
HALF_MAX_ROWS = 128
# Rows of the weight dequantized per step of the torch path: bounds its temporary to ~16 MB fp32.
_TILE_ELEMENTS = 1 << 22


def quant_matmul(x: torch.Tensor, data: torch.Tensor, qtype: GGMLQuantizationType, out_features: int,
                 kernel: str = "auto") -> torch.Tensor:
    """x [M, K] @ W^T -> [M, out_features] float32, W = GGUF blocks `data` uint8 [out_features, row_bytes].

    kernel: "auto" (choose), "half" (F16/BF16), "int8" (block formats; both compiled, CPU) or "torch"
    (tile by tile). x float32 (or, for "half", bfloat16: bf16 compute)."""
    ext = kernels.extension() if data.device.type == "cpu" else None
    if kernel == "auto":
        kernel = choose_kernel(qtype, x.shape[0], ext is not None)
    if kernel == "torch":
        return _torch_matmul(x, data, qtype, out_features)
    if ext is None:
        raise RuntimeError("hearth's compiled quantized kernels are not available here")
    if kernel == "half":
        return ext.half_matmul(_half_activations(x), data, int(qtype), out_features)
    return ext.int8_matmul(x.float().contiguous(), data, int(qtype), out_features)


def choose_kernel(qtype: GGMLQuantizationType, rows: int, compiled: bool) -> str:
    """The kernel for `rows` activation rows against a `qtype` weight."""
    if not compiled:
        return "torch"
    if qtype in _HALF_DTYPES:
        return "half" if rows <= HALF_MAX_ROWS else "torch"
    return "int8"


def _half_activations(x: torch.Tensor) -> torch.Tensor:
    """x as `half_matmul` takes it: float32 or bfloat16 as they come (f16 widened), contiguous."""
    return (x if x.dtype in (torch.float32, torch.bfloat16) else x.float()).contiguous()


def _torch_matmul(x: torch.Tensor, data: torch.Tensor, qtype: GGMLQuantizationType, out_features: int) -> torch.Tensor:
    """The portable path: dequantize a tile of rows, multiply, next tile."""
    cols = x.shape[-1]
    return _tiled_linear(x, out_features, lambda start, end: _dequantize_rows(data[start:end], qtype, cols))


def _tiled_linear(x: torch.Tensor, out_features: int, rows_of) -> torch.Tensor:
    """x @ W^T with W given a tile of rows at a time: rows_of(start, end) -> float32 [end - start, K]."""
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    step = max(32, _TILE_ELEMENTS // x.shape[-1] // 32 * 32)
    for start in range(0, out_features, step):
        end = min(out_features, start + step)
        out[:, start:end] = F.linear(x, rows_of(start, end).to(x.dtype))
    return out


def _raw(weight: QuantTensor | torch.Tensor) -> tuple[torch.Tensor, GGMLQuantizationType, int, int]:
    """(uint8 [rows, bytes_per_row], qtype, rows, cols) of a QuantTensor or an F16/BF16 matrix."""
    if isinstance(weight, QuantTensor):
        rows, cols = weight.shape
        return weight.data.reshape(rows, -1), weight.qtype, rows, cols
    rows, cols = weight.shape
    return weight.contiguous().view(torch.uint8).reshape(rows, -1), HALF_QTYPES[weight.dtype], rows, cols


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W kept in its storage format (GGUF blocks, or an F16/BF16 array).

    Holds either `qweight` (uint8 [out_features, bytes_per_row], the blocks as stored) or, for
    PACKED_QTYPES on a CPU with AVX-512 VNNI, `codes` and `terms` (the packed tiles). On a CPU with
    the compiled kernels, blocks in place and packed tiles alike run `int8_matmul`, called
    straight from forward."""

    def __init__(self, weight: QuantTensor | torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        super().__init__()
        data, self.qtype, self.out_features, self.in_features = _raw(weight)
        if pack and self.qtype == Q.TQ1_0 and data.device.type == "cpu" and kernels.extension() is not None:
            # the same trits two bits apiece: read by the int8 kernel with no base-3 decoding
            data, self.qtype = tq1_0_to_tq2_0(data, (self.out_features, self.in_features)), Q.TQ2_0
        compiled = kernels.extension() if pack and data.device.type == "cpu" else None
        ext = compiled if self.qtype in INT8_QTYPES else None
        # F16/BF16 arrays: half_matmul at every batch size, on the weight as stored
        self._half_kernel = compiled.module.half_matmul if compiled is not None and self.qtype in _HALF_DTYPES else None
        self._kernel = self._qtype = None
        if ext is not None:
            ext._check(torch.empty(0, self.in_features), data, self.qtype, self.out_features)
            self._kernel, self._qtype = ext.module.int8_matmul, int(self.qtype)
        if ext is not None and self.qtype in PACKED_QTYPES and ext.vnni:  # the tiles pay only with VNNI
            codes, terms = ext.repack(data, self.qtype, self.out_features, self.in_features)
            release_pages(data)
            self.qweight = None
            self.register_buffer("codes", codes, persistent=False)  # uint8 [tiles, codes of 32 rows]
            self.register_buffer("terms", terms, persistent=False)  # uint8 [tiles, their scales]
        else:
            self.codes = self.terms = None
            self.register_buffer("qweight", data, persistent=False)  # uint8 [out_features, bytes_per_row]
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self._bind_int8_kernel()

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        self._bind_int8_kernel()
        return module

    def _bind_int8_kernel(self) -> None:
        """The int8 kernel's weight pointers (blocks, or packed codes; packed terms or 0), looked up once (buffers
        only move through _apply): at batch 1 a call's Python overhead is a visible share of its time."""
        weight = self.qweight if self.codes is None else self.codes
        if self._kernel is None or weight.device.type != "cpu":
            self._int8_weight = None
        else:
            self._int8_weight = (weight.data_ptr(), 0 if self.terms is None else self.terms.data_ptr())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._int8_weight is not None and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous():
            y = self._int8_matmul(x)  # the decode hot path: straight to the kernel
            return y if self.bias is None else y.add_(self.bias)
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self._int8_weight is not None:
            y = self._int8_matmul(x2.float().contiguous())
        elif self.codes is None:
            kernel = choose_kernel(self.qtype, x2.shape[0],
                                   self._half_kernel is not None and self.qweight.device.type == "cpu")
            if kernel == "half":
                y = self._half_matmul(_half_activations(x2))
            else:  # F16/BF16 (on a CPU) in fp32 tiles, whatever the compute dtype: faster than its GEMM
                y = quant_matmul(x2.float() if self.qtype in _HALF_DTYPES else x2, self.qweight, self.qtype,
                                 self.out_features, kernel)
        else:  # moved to a GPU after packing
            y = _tiled_linear(x2, self.out_features, self._dequantize_rows)
        if self.bias is not None:
            y += self.bias
        y = y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def _int8_matmul(self, x: torch.Tensor) -> torch.Tensor:  # x float32 [M, K], contiguous
        y = torch.empty(x.shape[0], self.out_features)
        self._kernel(x.data_ptr(), *self._int8_weight, y.data_ptr(), x.shape[0], self.out_features,
                     self.in_features, self._qtype, 0, torch.get_num_threads())  # path 0: the fastest
        return y

    def _half_matmul(self, x: torch.Tensor) -> torch.Tensor:  # x float32 or bfloat16 [M, K], contiguous
        y = torch.empty(x.shape[0], self.out_features)
        self._half_kernel(x.data_ptr(), self.qweight.data_ptr(), y.data_ptr(), x.shape[0], self.out_features,
                          self.in_features, self.qweight.shape[1], int(self.qtype), x.dtype == torch.bfloat16, False,
                          torch.get_num_threads())
        return y

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight as a dense matrix (for tests and tools, not the forward pass)."""
        return self._dequantize_rows(0, self.out_features).to(dtype)

    def _dequantize_rows(self, start: int, end: int) -> torch.Tensor:
        if self.codes is None:
            return _dequantize_rows(self.qweight[start:end], self.qtype, self.in_features)
        first, last = start // 32, -(-end // 32)  # whole tiles, unpacked by the kernels on the CPU
        rows = kernels.extension().dequantize_packed(self.codes[first:last].cpu(), self.terms[first:last].cpu(),
                                                     self.qtype, self.in_features)
        return rows[start - 32 * first:end - 32 * first].to(self.codes.device)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"qtype={self.qtype.name}, packed={self.codes is not None}, bias={self.bias is not None}")


class TritonQuantLinear(nn.Module):
    """y = x W^T (+ b) on a GPU with W kept in its GGUF blocks (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K),
    repacked once into the planar arrays of hearth/triton_kernels/quant_matmul.py (about the file's
    bytes) and multiplied by its Triton kernels: dequantized in registers, never expanded."""

    _ARRAYS = ("q", "qh", "d", "dmin", "sc", "mn")

    @staticmethod
    def supports(module: nn.Module, weight) -> bool:
        from hearth.model.layers import Linear
        from hearth.triton_kernels.quant_matmul import SUPPORTED_QTYPES

        return isinstance(module, Linear) and isinstance(weight, QuantTensor) and weight.qtype in SUPPORTED_QTYPES

    def __init__(self, weight: QuantTensor, bias: torch.Tensor | None, device: torch.device):
        from hearth.triton_kernels.quant_matmul import TritonQuantWeight

        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.qtype = weight.qtype
        packed = TritonQuantWeight.from_blocks(weight.data.reshape(self.out_features, -1), weight.qtype,
                                               weight.shape, device)
        for name in self._ARRAYS:  # buffers: counted, moved and freed with the model
            self.register_buffer(name, getattr(packed, name), persistent=False)
        self.bias = nn.Parameter(bias.to(device), requires_grad=False) if bias is not None else None
        self._bind()

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        self._bind()
        return module

    def _bind(self) -> None:
        from hearth.triton_kernels.quant_matmul import TritonQuantWeight

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


class QuantEmbedding(nn.Module):
    """Token embeddings kept in their storage format: only the rows looked up are dequantized."""

    def __init__(self, weight: QuantTensor | torch.Tensor, dtype: torch.dtype):
        super().__init__()
        data, self.qtype, self.num_embeddings, self.embedding_dim = _raw(weight)
        self.register_buffer("qweight", data, persistent=False)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight[ids.reshape(-1)]
        return _dequantize_rows(rows, self.qtype, self.embedding_dim).to(self.dtype).reshape(*ids.shape, -1)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype.name}"


def _dequantize_rows(data: torch.Tensor, qtype: GGMLQuantizationType, cols: int) -> torch.Tensor:
    if qtype in _HALF_DTYPES:
        return data.view(_HALF_DTYPES[qtype]).float()
    return dequantize(data, qtype, (data.shape[0], cols))


def release_file_pages(weights) -> None:
    """Before repacking a GGUF file's weights: drop the pages of its mapping that loading touched
    (reordered Q/K rows were copied out of it), so that resident memory never holds both."""
    release_mappings([w.data for w in weights if isinstance(w, QuantTensor)])


def quantized_module(module: nn.Module, weight, bias: torch.Tensor | None, dtype: torch.dtype,
                     device: torch.device | str = "cpu") -> nn.Module | None:
    """The replacement for `module` (a Linear or an nn.Embedding) that keeps `weight` in its storage
    format, or None where the dense module is the better choice.

    GGUF blocks: always kept (on a GPU the tile-by-tile torch path runs). F16/BF16 matrices: kept
    on a CPU, where decode reads half the bytes of fp32 and the GEMV converts in registers; on a
    GPU the dense module in the compute dtype is what its matmuls want."""
    from hearth.model.layers import Linear

    on_cpu = torch.device(device).type == "cpu"
    half = isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype in HALF_QTYPES
    if not (isinstance(weight, QuantTensor) or (half and on_cpu)):
        return None
    if isinstance(module, Linear):
        return QuantLinear(weight, None if bias is None else bias.to(dtype), pack=on_cpu)
    if isinstance(module, nn.Embedding):
        return QuantEmbedding(weight, dtype)
    return None
