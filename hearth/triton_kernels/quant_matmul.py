"""GGUF weights kept quantized on an NVIDIA GPU, multiplied by Triton kernels.

GPU memory is the file size, not the bf16 size: `TritonQuantWeight.from_blocks` splits the
file's blocks once, at load, into a few planar arrays (one row per weight row, so every array is
[N, something] and row n starts at n * row_length), and the kernels decode them in registers.

Repacked layouts (K values per row; "bytes" are uint8, byte order within a row as in the file):

- Q8_0 (34 bytes / 32 values, ratio 1.000): `q` [N, K] the int8 codes as uint8; `d` f16 [N, K/32].
- Q4_0 (18 / 32, ratio 1.000): `q` [N, K/2] the nibble bytes (byte j of a block: value j in the
  low nibble, value j + 16 in the high one); `d` f16 [N, K/32].
- Q5_0 (22 / 32, ratio 1.000): `q` and `d` as Q4_0, plus `qh` int32 [N, K/32] each block's 4
  high-bit bytes as one little-endian word, value j's fifth bit at bit j: loaded once per block,
  like a scale, and shifted per value (read as bytes, bit k % 8 of byte k // 8, every value loads
  a byte of its own: on an H100 that made Q5_0 0.57-0.70x Q4_0's speed at one row, 0.06-0.19x at 64).
- Q4_K (144 / 256, ratio 148/144 = 1.028): `q` [N, K/2] the nibble bytes (32-byte chunk c of a
  block: values 64c + i low, 64c + 32 + i high); `d`, `dmin` f16 [N, K/256]; `sc`, `mn` uint8
  [N, K/32]: the 6-bit scale and min of each 32-value sub-block, unpacked from the 12 packed bytes
  (2 bytes per sub-block instead of 1.5, 4 bytes more per 256 values: a sub-block's scale is then
  one byte at a fixed place, not two or three bytes with index-dependent shifts).
- Q5_K (176 / 256, ratio 180/176 = 1.023): as Q4_K, plus `qh` [N, K/8] the high-bit bytes
  (byte i of a block's 32: bit b is the 5th bit of value 32b + i).
- Q6_K (210 / 256, ratio 1.000): `q` [N, K/2] the low-nibble bytes (64-byte half h: values
  128h + i low, 128h + 64 + i high), `qh` [N, K/4] the 2-bit high parts (32-byte quarter h:
  shift 2s holds value 128h + 32s + i), `sc` int8 [N, K/16], `d` f16 [N, K/256].

Every code array is "planar": PLANES * GROUP consecutive values share GROUP consecutive bytes,
value k in byte (k // (PLANES * GROUP)) * GROUP + k % GROUP at bit ((k // GROUP) % PLANES) * BITS
(`_field`). So a thread holding 16 consecutive values reads 16 consecutive bytes (one 128-bit
load), the arrays are 16-byte aligned rows (K is a multiple of 32), and the scales sit apart from
the codes instead of every 18/34/144/176/210 bytes.

Dequantization is exact in float32 and bit-equal to `gguf.quants.dequantize`: d * sc (11-bit
significand times a <= 7-bit integer) and that times the code (<= 6 bits) are exact products (at
most 24 significant bits), so the only rounding is K-quants' final subtraction of dmin * mn, as in
gguf, whether or not the compiler fuses it into an FMA.

Kernels (tiles are [rows, sub-blocks, values per sub-block], so each scale is loaded once per
sub-block, not per value):

- `_gemv_kernel`, M <= GEMV_MAX_M (decode): a program owns block_n rows and a range of K
  (split over K when N alone gives too few programs; the splits' fp32 partial sums are added by
  torch), dequantizes a [block_n, block_k] tile once (128-bit loads of the codes) and
  multiplies it with every row of x in fp32, keeping per-sub-block sums [BLOCK_N, NB, BLOCK_M] in
  the tile's own register layout. Exact weights, fp32 products and sums:
  |y - ref| <= K * 2^-24 * sum |w| |x|.
  Its launch (block_n, block_k, warps, when to split K) is per shape class and format
  (`shape_class`, GEMV_CONFIGS): a small square matrix, a long-row down projection, a wide
  gate/up and an LM head want different tiles and splits; benchmarks/gpu_kernels.py's sweep
  times GEMV_CANDIDATES on a GPU and prints the table.
- `_gemm_kernel`, M > GEMV_MAX_M (prefill): a [GEMM_BLOCK_N, GEMM_BLOCK_K] weight tile dequantized
  to x's dtype (bf16/f16) is the A operand of tl.dot against x^T (for sm_90 Triton emits wgmma with
  A in registers and prefetches the codes and x with cp.async over GEMM_STAGES), fp32
  accumulation; y^T tiles are stored transposed. The weight's rounding to bf16 (f16) costs at most
  2^-8 (2^-11) of sum |w| |x|; float32 x is multiplied in tf32 (Triton's default for f32 tl.dot:
  both operands cut to 10-bit mantissas, possibly truncated), at most about 2^-9 of sum |w| |x|.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, QK_K

from hearth.quant.formats import _k_scale_min

Q = GGMLQuantizationType
SUPPORTED_QTYPES: tuple[GGMLQuantizationType, ...] = (Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)

GEMV_MAX_M = 8  # most rows of x for the GEMV; more take the tl.dot kernel


@dataclass(frozen=True)
class GemvConfig:
    """The GEMV kernel's launch: rows per program, K values per tile, warps, and the programs per SM
    below which K is split (a matrix of few rows gets its K ranges spread over the GPU)."""

    block_n: int = 8
    block_k: int = 512
    warps: int = 4
    programs_per_sm: int = 4


# What a sweep may try (benchmarks/gpu_kernels.py --sections gemv-sweep); tests/test_triton_quant_matmul.py
# runs every (block_n, block_k) of it against gguf's dequantizer, so any entry the sweep picks is correct.
GEMV_CANDIDATES = {"block_n": (4, 8, 16, 32), "block_k": (256, 512, 1024), "warps": (2, 4, 8),
                   "programs_per_sm": (2, 4, 8, 16)}
SHAPE_CLASSES = ("square", "long_rows", "wide", "vocab")


def shape_class(n: int, k: int) -> str:
    """A weight [N, K]'s class for the GEMV's launch: vocab (an LM head, N >= 32768), long_rows
    (K >= 2N: a down projection, few outputs, long dot products), wide (N >= 2K: gate/up), else
    square (attention's q/k/v/o, small models' matrices)."""
    if n >= 32768:
        return "vocab"
    if k >= 2 * n:
        return "long_rows"
    return "wide" if n >= 2 * k else "square"


# (shape class, format name or "*" for any) -> launch; the sweep prints this table (best per cell) to paste
# in. Until a sweep on a GPU fills it, every class takes the one launch tuned before classes existed.
# From benchmarks/gpu_kernels.py --sections gemv-sweep --formats Q4_K on an H100 (2026-11-26,
# benchmarks/results/gpu/sweep-q4k.md): us summed over the class's matrices at M = 1.
GEMV_CONFIGS: dict[tuple[str, str], GemvConfig] = {
    ("square", "Q4_K"): GemvConfig(block_n=4, block_k=512, warps=4, programs_per_sm=2),  # 56.7 us (was 107.4)
    ("long_rows", "Q4_K"): GemvConfig(block_n=4, block_k=1024, warps=8, programs_per_sm=4),  # 57.2 us (was 78.2)
    ("wide", "Q4_K"): GemvConfig(block_n=8, block_k=512, warps=8, programs_per_sm=4),  # 92.9 us (was 124.5)
    ("vocab", "Q4_K"): GemvConfig(block_n=16, block_k=256, warps=4, programs_per_sm=2),  # 137.5 us (was 148.6)
    ("square", "Q5_0"): GemvConfig(block_n=4, block_k=1024, warps=8, programs_per_sm=4),  # 59.9 us (was 155.9)
    ("square", "Q8_0"): GemvConfig(block_n=4, block_k=1024, warps=8, programs_per_sm=4),  # 54.1 us (was 153.6; H200)
    ("long_rows", "Q8_0"): GemvConfig(block_n=4, block_k=512, warps=4, programs_per_sm=4),  # 55.5 us (was 159.1)
    ("wide", "Q8_0"): GemvConfig(block_n=8, block_k=1024, warps=4, programs_per_sm=16),  # 80.2 us (was 88.8)
    ("vocab", "Q8_0"): GemvConfig(block_n=32, block_k=256, warps=4, programs_per_sm=2),  # 109.8 us (was 128.9)
    ("square", "Q6_K"): GemvConfig(block_n=4, block_k=512, warps=2, programs_per_sm=4),  # 75.4 us (was 302.2)
    ("long_rows", "Q6_K"): GemvConfig(block_n=4, block_k=1024, warps=8, programs_per_sm=4),  # 79.7 us (was 154.2)
    ("wide", "Q6_K"): GemvConfig(block_n=4, block_k=1024, warps=4, programs_per_sm=2),  # 126.4 us (was 137.8)
    ("vocab", "Q6_K"): GemvConfig(block_n=16, block_k=256, warps=4, programs_per_sm=8),  # 199.1 us (was 215.9)
    **{(c, "*"): GemvConfig() for c in SHAPE_CLASSES},
}


def gemv_config(qtype: GGMLQuantizationType, n: int, k: int) -> GemvConfig:
    """The GEMV launch for a `qtype` weight [N, K]: GEMV_CONFIGS' entry for its class and format, or
    for its class and any format."""
    cls = shape_class(n, k)
    return GEMV_CONFIGS.get((cls, qtype.name)) or GEMV_CONFIGS[(cls, "*")]
GEMM_BLOCK_N, GEMM_BLOCK_K, GEMM_WARPS, GEMM_STAGES = 64, 64, 4, 3
GEMM_MIN_BLOCK_M, GEMM_MAX_BLOCK_M = 16, 128
DEQUANT_BLOCK_N, DEQUANT_BLOCK_K = 8, 512

# Format codes inside the kernels (tl.constexpr): the GGML type numbers.
_Q8_0 = tl.constexpr(int(Q.Q8_0))
_Q4_0 = tl.constexpr(int(Q.Q4_0))
_Q5_0 = tl.constexpr(int(Q.Q5_0))
_Q5_K = tl.constexpr(int(Q.Q5_K))
_Q6_K = tl.constexpr(int(Q.Q6_K))
# Values per scale (the tile's last axis) and per `d` entry.
_SUB_BLOCK = {Q.Q8_0: 32, Q.Q4_0: 32, Q.Q5_0: 32, Q.Q4_K: 32, Q.Q5_K: 32, Q.Q6_K: 16}
_SUPER_BLOCK = {Q.Q8_0: 32, Q.Q4_0: 32, Q.Q5_0: 32, Q.Q4_K: QK_K, Q.Q5_K: QK_K, Q.Q6_K: QK_K}


@triton.jit
def _field(row_ptr, k, mask, PLANES: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr):
    """The BITS-bit field of value k (int32 >= 0) in a planar code row (module docstring)."""
    byte = tl.load(row_ptr + (k // (PLANES * GROUP)) * GROUP + k % GROUP, mask=mask, other=0)
    return (byte.to(tl.int32) >> ((k // GROUP) % PLANES * BITS)) & ((1 << BITS) - 1)


@triton.jit
def _to_float(q, OFFSET: tl.constexpr):
    """float(q) - OFFSET for int32 0 <= q < 2^23, exact: q's bits as the mantissa of 2^23
    (an OR and a subtraction; int-to-float conversions run at a quarter of the FMA rate)."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)


@triton.jit
def _dequant(q_ptr, qh_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, q_stride, qh_stride, d_stride, sc_stride,
             n, sb, mask, FMT: tl.constexpr, BS: tl.constexpr, SUPER: tl.constexpr):
    """Weights of rows n (int64 [BN, 1]) in sub-blocks sb ([1, NB]): float32 [BN, NB, BS], exact;
    0 where mask ([BN, NB]) is off. Scales are loaded as [BN, NB] (once per sub-block)."""
    k = (sb * BS)[:, :, None] + tl.arange(0, BS)[None, None, :]  # [1, NB, BS] value index in the row
    q_row = (q_ptr + n * q_stride)[:, :, None]  # [BN, 1, 1]
    mask3 = mask[:, :, None]
    d = tl.load(d_ptr + n * d_stride + sb // (SUPER // BS), mask=mask, other=0.0).to(tl.float32)  # [BN, NB]
    if FMT == _Q8_0:
        q = _to_float(_field(q_row, k, mask3, 1, BS, 8) ^ 0x80, 128.0)  # int8 bits ^ 0x80 = code + 128
        w = q * d[:, :, None]
    elif FMT == _Q4_0:
        w = _to_float(_field(q_row, k, mask3, 2, 16, 4), 8.0) * d[:, :, None]
    elif FMT == _Q5_0:  # the block's fifth bits, one int32 word [BN, NB]
        words = tl.load(qh_ptr + n * qh_stride + sb, mask=mask, other=0)
        high = (words[:, :, None] >> tl.arange(0, BS)[None, None, :]) & 1
        w = _to_float(_field(q_row, k, mask3, 2, 16, 4) | (high << 4), 16.0) * d[:, :, None]
    elif FMT == _Q6_K:
        qh_row = (qh_ptr + n * qh_stride)[:, :, None]
        q = _field(q_row, k, mask3, 2, 64, 4) | (_field(qh_row, k, mask3, 4, 32, 2) << 4)
        sc = tl.load(sc_ptr + n * sc_stride + sb, mask=mask, other=0).to(tl.float32)
        w = (d * sc)[:, :, None] * _to_float(q, 32.0)
    else:  # Q4_K, Q5_K
        q = _field(q_row, k, mask3, 2, 32, 4)
        if FMT == _Q5_K:
            q = q | (_field((qh_ptr + n * qh_stride)[:, :, None], k, mask3, 8, 32, 1) << 4)
        dmin = tl.load(dmin_ptr + n * d_stride + sb // (SUPER // BS), mask=mask, other=0.0).to(tl.float32)
        sc = tl.load(sc_ptr + n * sc_stride + sb, mask=mask, other=0).to(tl.float32)
        mn = tl.load(mn_ptr + n * sc_stride + sb, mask=mask, other=0).to(tl.float32)
        w = (d * sc)[:, :, None] * _to_float(q, 0.0) - (dmin * mn)[:, :, None]
    return w


@triton.jit
def _dequantize_kernel(out_ptr, q_ptr, qh_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr,
                       q_stride, qh_stride, d_stride, sc_stride, N, K,
                       FMT: tl.constexpr, BS: tl.constexpr, SUPER: tl.constexpr,
                       BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """out [N, K] = the weight, a [BLOCK_N, NB * BS] tile per program."""
    n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None]  # [BN, 1]
    sb = (tl.program_id(1) * NB + tl.arange(0, NB))[None, :]  # [1, NB]
    mask = (n < N) & (sb < K // BS)
    w = _dequant(q_ptr, qh_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, q_stride, qh_stride, d_stride, sc_stride,
                 n, sb, mask, FMT, BS, SUPER)  # [BN, NB, BS]
    offs = (n * K + sb * BS)[:, :, None] + tl.arange(0, BS)[None, None, :]
    tl.store(out_ptr + offs, w.to(out_ptr.dtype.element_ty), mask=mask[:, :, None])


@triton.jit
def _gemv_kernel(x_ptr, y_ptr, q_ptr, qh_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr,
                 q_stride, qh_stride, d_stride, sc_stride, M, N, K, stride_xm, stride_ys, stride_ym,
                 tiles_per_split,
                 FMT: tl.constexpr, BS: tl.constexpr, SUPER: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """y[split] [M, N] = x [M, K] @ W^T over this split's K tiles; one [BLOCK_N, NB * BS] weight
    tile is dequantized once and multiplied with all M rows of x (M <= BLOCK_M)."""
    split = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n = rn.to(tl.int64)[:, None]  # [BN, 1]
    rm = tl.arange(0, BLOCK_M)  # [BM]
    n_sub = K // BS
    # per-sub-block partial sums, [BN, NB, BM]: laid out as the weight tile, rows of x last
    acc = tl.zeros((BLOCK_N, NB, BLOCK_M), dtype=tl.float32)
    first = split * tiles_per_split
    for t in range(first, tl.minimum(first + tiles_per_split, tl.cdiv(n_sub, NB))):
        sb = t * NB + tl.arange(0, NB)  # [NB]
        w = _dequant(q_ptr, qh_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, q_stride, qh_stride, d_stride, sc_stride,
                     n, sb[None, :], (n < N) & (sb[None, :] < n_sub), FMT, BS, SUPER)  # [BN, NB, BS]
        x_offs = sb[:, None] * BS + tl.arange(0, BS)[None, :]  # [NB, BS]
        for m in range(M):
            xm = tl.load(x_ptr + m * stride_xm + x_offs, mask=sb[:, None] < n_sub, other=0.0).to(tl.float32)
            part = tl.sum(w * xm[None, :, :], axis=2)  # [BN, NB]
            acc = tl.where(rm[None, None, :] == m, acc + part[:, :, None], acc)
    y = tl.sum(acc, axis=1)  # [BN, BM]
    y_ptrs = y_ptr + split * stride_ys + rm[None, :] * stride_ym + rn[:, None]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=(rm[None, :] < M) & (rn[:, None] < N))


@triton.jit
def _gemm_kernel(x_ptr, y_ptr, q_ptr, qh_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr,
                 q_stride, qh_stride, d_stride, sc_stride, M, N, K, stride_xm, stride_ym,
                 FMT: tl.constexpr, BS: tl.constexpr, SUPER: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """y [M, N] = x [M, K] @ W^T, a [BLOCK_M, BLOCK_N] tile per program, computed as
    y^T = W x^T with the dequantized weight tile as tl.dot's first operand."""
    BLOCK_K: tl.constexpr = NB * BS
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = tl.program_id(0) % num_m  # the programs sharing a weight tile run side by side
    pid_n = tl.program_id(0) // num_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n = rn.to(tl.int64)[:, None]  # [BN, 1]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    n_sub = K // BS
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # y^T tile
    for t in range(tl.cdiv(n_sub, NB)):
        sb = t * NB + tl.arange(0, NB)[None, :]  # [1, NB]
        w = _dequant(q_ptr, qh_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, q_stride, qh_stride, d_stride, sc_stride,
                     n, sb, (n < N) & (sb < n_sub), FMT, BS, SUPER)  # [BN, NB, BS]
        k = t * BLOCK_K + rk
        xt = tl.load(x_rows + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)  # [BM, BK]
        acc = tl.dot(tl.reshape(w, (BLOCK_N, BLOCK_K)).to(xt.dtype), tl.trans(xt), acc)  # [BN, BM]
    y_ptrs = y_ptr + rm.to(tl.int64)[None, :] * stride_ym + rn[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rm[None, :] < M) & (rn[:, None] < N))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _f16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block: blocks uint8 [N, B, size] -> f16 [N, B]."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).squeeze(-1)


def _codes(blocks: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Bytes start:end of every block, a row's blocks end to end: uint8 [N, B * (end - start)]."""
    return blocks[..., start:end].reshape(blocks.shape[0], -1).contiguous()


class TritonQuantWeight:
    """A GGUF-quantized weight [N, K] on a GPU in the planar layout of the module docstring."""

    def __init__(self, qtype: GGMLQuantizationType, shape: tuple[int, int], q: torch.Tensor, d: torch.Tensor,
                 qh: torch.Tensor | None = None, dmin: torch.Tensor | None = None,
                 sc: torch.Tensor | None = None, mn: torch.Tensor | None = None):
        self.qtype, self.shape = qtype, shape
        self.q, self.d, self.qh, self.dmin, self.sc, self.mn = q, d, qh, dmin, sc, mn  # None: not in this format
        self.gemv_config = gemv_config(qtype, *shape)  # (the table is read once, when the weight is made)

    @classmethod
    def from_blocks(cls, data: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int],
                    device: torch.device | str) -> "TritonQuantWeight":
        """data: the file's blocks, uint8 [N, bytes_per_row] (rows independent) -> the planar arrays
        on `device` (repacked there with torch ops, once)."""
        if qtype not in SUPPORTED_QTYPES:
            raise ValueError(f"{getattr(qtype, 'name', qtype)} is not supported by the Triton kernels; "
                             f"supported: {', '.join(t.name for t in SUPPORTED_QTYPES)}")
        n, k = (int(s) for s in shape)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        if k % block_size or data.dtype != torch.uint8 or data.numel() != n * (k // block_size) * type_size:
            raise ValueError(f"{qtype.name} weight of shape {(n, k)}: expected uint8 blocks "
                             f"[{n}, {k // block_size * type_size}], got {data.dtype} {tuple(data.shape)}")
        blocks = data.to(device).reshape(n, k // block_size, type_size)  # [N, B, type_size]
        if qtype in (Q.Q8_0, Q.Q4_0):
            return cls(qtype, (n, k), q=_codes(blocks, 2, type_size), d=_f16_field(blocks, 0))
        if qtype == Q.Q5_0:
            return cls(qtype, (n, k), q=_codes(blocks, 6, type_size), qh=_codes(blocks, 2, 6).view(torch.int32),
                       d=_f16_field(blocks, 0))
        if qtype == Q.Q6_K:
            return cls(qtype, (n, k), q=_codes(blocks, 0, 128), qh=_codes(blocks, 128, 192),
                       sc=_codes(blocks, 192, 208).view(torch.int8), d=_f16_field(blocks, 208))
        sc, mn = _k_scale_min(blocks[..., 4:16].reshape(-1, 12))  # float32 [N * B, 8], integers 0..63
        qh = _codes(blocks, 16, 48) if qtype == Q.Q5_K else None
        return cls(qtype, (n, k), q=_codes(blocks, 48 if qtype == Q.Q5_K else 16, type_size), qh=qh,
                   d=_f16_field(blocks, 0), dmin=_f16_field(blocks, 2),
                   sc=sc.to(torch.uint8).reshape(n, -1), mn=mn.to(torch.uint8).reshape(n, -1))

    @property
    def nbytes(self) -> int:
        arrays = (self.q, self.qh, self.d, self.dmin, self.sc, self.mn)
        return sum(t.numel() * t.element_size() for t in arrays if t is not None)

    @property
    def device(self) -> torch.device:
        return self.q.device

    def _weight_args(self) -> tuple:
        """The arrays and their row lengths, as the kernels take them: an array the format lacks is
        passed as `q` (never read), the dmin/mn rows are as long as the d/sc rows."""
        arrays = [t if t is not None else self.q for t in (self.q, self.qh, self.d, self.dmin, self.sc, self.mn)]
        rows = [0 if t is None else t.stride(0) for t in (self.q, self.qh, self.d, self.sc)]
        return (*arrays, *rows)

    def _format_args(self) -> dict:
        return dict(FMT=int(self.qtype), BS=_SUB_BLOCK[self.qtype], SUPER=_SUPER_BLOCK[self.qtype])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight, [N, K] in `dtype` (exact in float32; for tests and tools)."""
        n, k = self.shape
        out = torch.empty(n, k, dtype=dtype, device=self.device)
        nb = DEQUANT_BLOCK_K // _SUB_BLOCK[self.qtype]
        grid = (triton.cdiv(n, DEQUANT_BLOCK_N), triton.cdiv(k // _SUB_BLOCK[self.qtype], nb))
        _dequantize_kernel[grid](out, *self._weight_args(), n, k, **self._format_args(),
                                 BLOCK_N=DEQUANT_BLOCK_N, NB=nb)
        return out

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (float32, bfloat16 or float16) @ W^T -> [M, N] in x's dtype: the GEMV for
        M <= GEMV_MAX_M, the tl.dot kernel for more rows."""
        return self.gemv(x) if x.shape[0] <= GEMV_MAX_M else self.gemm(x)

    def _check(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.shape[1] or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"x must be float32/bfloat16/float16 [M, {self.shape[1]}], "
                             f"got {x.dtype} {tuple(x.shape)}")
        return x if x.stride(1) == 1 else x.contiguous()

    def gemv(self, x: torch.Tensor, split_k: int | None = None, config: GemvConfig | None = None) -> torch.Tensor:
        """The small-M kernel (meant for M <= GEMV_MAX_M: it holds M x block_n x 16 partial sums)
        with `config` (None: the weight's, from GEMV_CONFIGS); split_k: K ranges per block of rows,
        None to fill the GPU (config.programs_per_sm programs per SM)."""
        x = self._check(x)
        config = config or self.gemv_config
        (m, k), n = x.shape, self.shape[0]
        nb = config.block_k // _SUB_BLOCK[self.qtype]
        row_blocks, tiles = triton.cdiv(n, config.block_n), triton.cdiv(k // _SUB_BLOCK[self.qtype], nb)
        if split_k is None:  # the interpreter (CPU tensors) has no SMs to fill
            split_k = config.programs_per_sm * _sm_count(x.device) // row_blocks if x.device.type == "cuda" else 1
        tiles_per_split = triton.cdiv(tiles, min(max(split_k, 1), tiles))
        splits = triton.cdiv(tiles, tiles_per_split)  # none empty
        y = torch.empty(splits, m, n, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
        if m > 0:
            _gemv_kernel[(row_blocks, splits)](
                x, y, *self._weight_args(), m, n, k, x.stride(0), y.stride(0), y.stride(1), tiles_per_split,
                **self._format_args(), BLOCK_M=triton.next_power_of_2(m), BLOCK_N=config.block_n, NB=nb,
                num_warps=config.warps)
        return y[0] if splits == 1 else y.sum(0).to(x.dtype)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """The tl.dot kernel (any M; matmul's choice for M > GEMV_MAX_M)."""
        x = self._check(x)
        (m, k), n = x.shape, self.shape[0]
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        block_m = min(max(triton.next_power_of_2(m), GEMM_MIN_BLOCK_M), GEMM_MAX_BLOCK_M)
        if m > 0:
            grid = (triton.cdiv(m, block_m) * triton.cdiv(n, GEMM_BLOCK_N),)
            _gemm_kernel[grid](x, y, *self._weight_args(), m, n, k, x.stride(0), y.stride(0),
                               **self._format_args(), BLOCK_M=block_m, BLOCK_N=GEMM_BLOCK_N,
                               NB=GEMM_BLOCK_K // _SUB_BLOCK[self.qtype],
                               num_warps=GEMM_WARPS, num_stages=GEMM_STAGES)
        return y
