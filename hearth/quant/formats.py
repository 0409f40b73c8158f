"""GGUF block formats: dequantize raw blocks to float32 in vectorized torch, quantize via gguf.

Each format is one function taking `blocks`, a uint8 tensor (n_blocks, type_size), and
returning float32 (n_blocks, block_size). The arithmetic follows gguf.quants (numpy, float32)
operation for operation, so the results are bit-exact against `gguf.quants.dequantize`.
Multi-byte fields are little-endian; "d"/"dmin"/"m" are float16 scales.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, QK_K
from gguf import quants as gguf_quants

from hearth.errors import ModelLoadError

Q = GGMLQuantizationType

# Blocks dequantized per step: bounds the intermediates to a few tens of MB per step.
_CHUNK_ELEMENTS = 1 << 22


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 field at byte `start` of every block, as float32 (n_blocks, 1)."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(x: torch.Tensor) -> torch.Tensor:
    """(..., k) bytes -> (..., 2, k): low nibbles, then high nibbles."""
    return torch.stack([x & 0x0F, x >> 4], dim=-2)


def _crumbs(x: torch.Tensor) -> torch.Tensor:
    """(..., k) bytes -> (..., 4, k): 2-bit fields at shifts 0, 2, 4, 6."""
    return torch.stack([(x >> s) & 0x03 for s in (0, 2, 4, 6)], dim=-2)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """(..., k) bytes -> (..., 8, k): bit 0, bit 1, ... bit 7 of each byte."""
    return torch.stack([(x >> s) & 0x01 for s in range(8)], dim=-2)


# F32 / F16 / BF16: plain little-endian arrays; one "block" is one value.
def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


def _f16_array(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).float()


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.bfloat16).float()


# Q8_0 (34 bytes / 32 values): d f16 | qs int8[32].  x = q * d
def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = blocks[:, 2:].view(torch.int8).float()
    return q * d


# Q4_0 (18 bytes / 32 values): d f16 | qs[16] (value j: low nibble of qs[j], value j+16: high).
# x = d * (q - 8)
def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:]).reshape(-1, 32).float() - 8
    return d * q


# Q4_1 (20 bytes / 32 values): d f16 | m f16 | qs[16] as Q4_0.  x = d * q + m
def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:]).reshape(-1, 32).float()
    return d * q + m


# Q5_0 (22 bytes / 32 values): d f16 | qh u32 (bit j = 5th bit of value j) | qs[16] as Q4_0.
# x = d * (q - 16)
def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    qh = _bits(blocks[:, 2:6]).transpose(1, 2).reshape(-1, 32)
    ql = _nibbles(blocks[:, 6:]).reshape(-1, 32)
    q = (ql | (qh << 4)).float() - 16
    return d * q


# Q5_1 (24 bytes / 32 values): d f16 | m f16 | qh u32 | qs[16] as Q5_0.  x = d * q + m
def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    qh = _bits(blocks[:, 4:8]).transpose(1, 2).reshape(-1, 32)
    ql = _nibbles(blocks[:, 8:]).reshape(-1, 32)
    q = (ql | (qh << 4)).float()
    return d * q + m


# Q2_K (84 bytes / 256 values, 16 sub-blocks of 16):
#   scales[16] (low nibble: scale, high nibble: min) | qs[64] | d f16 | dmin f16.
#   qs: two halves of 32 bytes, each holding 4 crumb planes (shifts 0,2,4,6) of 32 values.
#   x = (d * scale) * q - (dmin * min)
def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    scales = blocks[:, :16]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    dl = (d * (scales & 0x0F).float()).unsqueeze(-1)
    ml = (dmin * (scales >> 4).float()).unsqueeze(-1)
    q = _crumbs(blocks[:, 16:80].reshape(-1, 2, 32)).reshape(-1, 16, 16).float()
    return (dl * q - ml).reshape(-1, QK_K)


# Q3_K (110 bytes / 256 values, 16 sub-blocks of 16):
#   hmask[32] (bit plane b holds the high bit of values 32b..32b+31) | qs[64] (low 2 bits,
#   laid out as Q2_K) | scales[12] (16 6-bit signed scales, offset 32) | d f16.
#   scales: bytes 0-7 give the low 4 bits (low nibbles = scales 0-7, high nibbles = 8-15);
#   bytes 8-11 give the high 2 bits (shift 2k -> scales 4k..4k+3).
#   x = (d * (scale - 32)) * (low - 4 * (1 - high))
def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 108)
    raw = blocks[:, 96:108]
    low = _nibbles(raw[:, :8]).reshape(-1, 16)
    high = _crumbs(raw[:, 8:]).reshape(-1, 16)
    scales = (low | (high << 4)).float() - 32
    dl = (d * scales).unsqueeze(-1)
    ql = _crumbs(blocks[:, 32:96].reshape(-1, 2, 32)).reshape(-1, 16, 16)
    qh = _bits(blocks[:, :32]).reshape(-1, 16, 16)
    q = ql.float() - ((qh ^ 1) << 2).float()
    return (dl * q).reshape(-1, QK_K)


def _k_scale_min(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12 scale bytes -> 8 6-bit scales and 8 6-bit mins, as float32 (n, 8).

    bytes 0-3: scale j low 6 bits (j < 4), top 2 bits -> scale j+4 bits 4-5
    bytes 4-7: min j low 6 bits (j < 4), top 2 bits -> min j+4 bits 4-5
    bytes 8-11: low nibble -> scale j+4 bits 0-3, high nibble -> min j+4 bits 0-3
    """
    d, m, md = raw[:, 0:4], raw[:, 4:8], raw[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


# Q4_K (144 bytes / 256 values, 8 sub-blocks of 32): d f16 | dmin f16 | scales[12] | qs[128].
#   qs: four chunks of 32 bytes; chunk c: low nibbles = sub-block 2c, high = sub-block 2c+1.
#   x = (d * scale) * q - (dmin * min)
def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    dl, ml = (d * sc).unsqueeze(-1), (dmin * mn).unsqueeze(-1)
    q = _nibbles(blocks[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32).float()
    return (dl * q - ml).reshape(-1, QK_K)


# Q5_K (176 bytes / 256 values, 8 sub-blocks of 32):
#   d f16 | dmin f16 | scales[12] | qh[32] (bit b = 5th bit of sub-block b) | qs[128] as Q4_K.
#   x = (d * scale) * q - (dmin * min)
def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    dl, ml = (d * sc).unsqueeze(-1), (dmin * mn).unsqueeze(-1)
    ql = _nibbles(blocks[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    qh = _bits(blocks[:, 16:48])
    q = (ql | (qh << 4)).float()
    return (dl * q - ml).reshape(-1, QK_K)


# Q6_K (210 bytes / 256 values, 16 sub-blocks of 16):
#   ql[128] (two halves of 64 bytes: low nibbles then high nibbles -> 4 rows of 32 per half)
#   | qh[64] (two halves of 32 bytes, crumb planes at shifts 0,2,4,6 -> bits 4-5)
#   | scales int8[16] | d f16.
#   x = (d * scale) * (q - 32)
def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    scales = blocks[:, 192:208].view(torch.int8).float()
    d = _f16(blocks, 208)
    dl = (d * scales).unsqueeze(-1)
    ql = _nibbles(blocks[:, :128].reshape(-1, 2, 64)).reshape(-1, 8, 32)
    qh = _crumbs(blocks[:, 128:192].reshape(-1, 2, 32)).reshape(-1, 8, 32)
    q = (ql | (qh << 4)).reshape(-1, 16, 16).float() - 32
    return (dl * q).reshape(-1, QK_K)


# Ternary formats (BitNet b1.58): every value is d * t, t in {-1, 0, 1}, stored as t + 1.
# TQ2_0 (66 bytes / 256 values): qs[64] (crumbs laid out as Q2_K's) | d f16.
def _tq2_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 64) * (_tq2_0_codes(blocks).float() - 1)


def _tq2_0_codes(blocks: torch.Tensor) -> torch.Tensor:
    return _crumbs(blocks[:, :64].reshape(-1, 2, 32)).reshape(-1, QK_K)


# TQ1_0 (54 bytes / 256 values): qs[48] | qh[4] | d f16, five trits a byte (four in qh) packed as
# a base-3 fraction: trit p of byte x is the top of (x * 3^p mod 256) * 3 / 256. Values: qs[:32]
# give 160 (trit p of byte m: value 32p + m), qs[32:48] the next 80 (16p + m), qh the last 16 (4p + m).
_POWERS_OF_3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8)


def _trits(x: torch.Tensor, count: int) -> torch.Tensor:
    """(n, k) bytes -> (n, count * k): trit p of byte m at p * k + m, each 0..2."""
    shifted = x.unsqueeze(1) * _POWERS_OF_3[:count].view(1, count, 1).to(x.device)  # uint8: mod 256
    return ((shifted.to(torch.int16) * 3) >> 8).to(torch.uint8).reshape(x.shape[0], -1)


def _tq1_0_codes(blocks: torch.Tensor) -> torch.Tensor:
    return torch.cat([_trits(blocks[:, :32], 5), _trits(blocks[:, 32:48], 5), _trits(blocks[:, 48:52], 4)], dim=1)


def _tq1_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 52) * (_tq1_0_codes(blocks).float() - 1)


def tq1_0_to_tq2_0(data: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """TQ1_0 rows (uint8 [rows, bytes]) as TQ2_0 rows: the same trits and scales, two bits a trit,
    which the int8 kernel reads without arithmetic (hearth/quant/kernels/int8_dots.cpp)."""
    blocks = data.reshape(-1, 54)
    codes = _tq1_0_codes(blocks).reshape(-1, 2, 4, 32)  # value 128h + 32s + l: crumb s of byte 32h + l
    packed = codes[:, :, 0] | (codes[:, :, 1] << 2) | (codes[:, :, 2] << 4) | (codes[:, :, 3] << 6)
    return torch.cat([packed.reshape(-1, 64), blocks[:, 52:54]], dim=1).reshape(shape[0], -1)


# ------------------------------------------------------------------ i-quants and MXFP4
# Codebook formats: a 4-bit index into 16 int8 values (IQ4_NL, IQ4_XS, MXFP4), or an index into
# a grid of 4 or 8 values with a sign per value (IQ3_*, IQ2_*; IQ1_*: values -1, 0, 1 plus a
# shift of +-1/8 per sub-block). The grids and the sign table are gguf's own (gguf.quants'
# classes decode them from llama.cpp's tables), not copied here.


@functools.cache
def _table(name: str, device: torch.device) -> torch.Tensor:
    """A gguf table on `device`: a grid as float32 (entries, 4 or 8), the sign patterns (128, 8)
    as float32 +-1, or a codebook as float32 (16,): IQ4_NL's int8 values (IQ4_XS's too), MXFP4's
    e2m1 values doubled (its scale is halved to match)."""
    if name == "ksigns":
        ksigns = torch.frombuffer(bytearray(gguf_quants.IQ2_XXS.ksigns), dtype=torch.uint8)
        table = 1 - 2 * _bits(ksigns.unsqueeze(-1)).squeeze(-1).float()  # (128, 8): bit i set -> -1
    elif name in ("IQ4_NL", "MXFP4"):
        table = torch.tensor(getattr(gguf_quants, name).kvalues, dtype=torch.float32)
    else:
        cls = getattr(gguf_quants, name)
        cls.init_grid()
        table = torch.from_numpy(cls.grid.reshape(cls.grid_shape).copy())
    return table.to(device)


def _sign_bits(x: torch.Tensor) -> torch.Tensor:
    """(n, k) bytes -> (n, k, 8) float32 +-1: bit i of byte j set -> value 8j + i negative."""
    return 1 - 2 * _bits(x).transpose(1, 2).float()


def _u32(x: torch.Tensor) -> torch.Tensor:
    """(..., 4k) little-endian bytes -> (..., k) int64 words."""
    b = x.reshape(*x.shape[:-1], -1, 4).long()
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _u16(x: torch.Tensor) -> torch.Tensor:
    """(..., 2k) little-endian bytes -> (..., k) int64."""
    b = x.reshape(*x.shape[:-1], -1, 2).long()
    return b[..., 0] | (b[..., 1] << 8)


def _lookup(name: str, index: torch.Tensor) -> torch.Tensor:
    return _table(name, index.device)[index.long()]


# IQ4_NL (18 bytes / 32 values): d f16 | qs[16] as Q4_0's nibbles.  x = d * kvalues[q]
def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * _lookup("IQ4_NL", _nibbles(blocks[:, 2:]).reshape(-1, 32))


# IQ4_XS (136 bytes / 256 values, 8 sub-blocks of 32): d f16 | scales_h u16 (2 bits per sub-block)
# | scales_l[4] (nibbles: sub-blocks 2i, 2i + 1) | qs[128] (16 bytes a sub-block, Q4_0's nibbles).
# x = d * (scale - 32) * kvalues[q]
def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    high = _u16(blocks[:, 2:4]) >> torch.arange(0, 16, 2, device=blocks.device) & 3
    low = _nibbles(blocks[:, 4:8]).transpose(1, 2).reshape(-1, 8)
    dl = (d * ((low | (high << 4)) - 32).float()).unsqueeze(-1)
    q = _nibbles(blocks[:, 8:].reshape(-1, 8, 16)).reshape(-1, 8, 32)
    return (dl * _lookup("IQ4_NL", q)).reshape(-1, QK_K)


# MXFP4 (17 bytes / 32 values): e u8 (an e8m0 exponent) | qs[16] as Q4_0's nibbles.
# x = 2^(e - 128) * kvalues[q] (ggml's e8m0_to_fp32_half: subnormal for e < 2)
def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    e = blocks[:, :1].int()
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32) * _lookup("MXFP4", _nibbles(blocks[:, 1:]).reshape(-1, 32))


# IQ2_XXS (66 bytes / 256 values, 8 sub-blocks of 32): d f16 | per sub-block two u32: four grid
# indices (8 values each) | four 7-bit sign-pattern indices, then a 4-bit scale at bit 28.
# x = d * (0.5 + scale) * 0.25 * grid * sign
def _iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    return _grid_with_ksigns(blocks, "IQ2_XXS", 0.25)


# IQ3_XXS (98 bytes / 256 values): d f16 | qs[64] (grid indices, 4 values each) | per sub-block of
# 32 a u32 as IQ2_XXS's second word.  x = d * (0.5 + scale) * 0.5 * grid * sign
def _iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    return _grid_with_ksigns(blocks, "IQ3_XXS", 0.5)


def _grid_with_ksigns(blocks: torch.Tensor, name: str, step: float) -> torch.Tensor:
    d = _f16(blocks, 0)
    if name == "IQ2_XXS":
        words = blocks[:, 2:].reshape(-1, 8, 8)
        index, aux = words[..., :4], _u32(words[..., 4:]).squeeze(-1)
    else:
        index, aux = blocks[:, 2:66].reshape(-1, 8, 8), _u32(blocks[:, 66:98])
    db = d * (0.5 + (aux >> 28).float()) * step  # (n, 8)
    pattern = aux.unsqueeze(-1) >> torch.arange(0, 28, 7, device=blocks.device) & 0x7F  # (n, 8, 4)
    grid = _lookup(name, index).reshape(-1, 8, 4, 8)
    return (db.reshape(-1, 8, 1, 1) * grid * _lookup("ksigns", pattern)).reshape(-1, QK_K)


# IQ2_XS (74 bytes / 256 values, 16 sub-blocks of 16): d f16 | qs u16[32] (9-bit grid index,
# 7-bit sign pattern) | scales[8] (nibbles).  x = d * (0.5 + scale) * 0.25 * grid * sign
def _iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    qs = _u16(blocks[:, 2:66])
    grid = _lookup("IQ2_XS", qs & 511) * _lookup("ksigns", qs >> 9)
    return _times_nibble_scales(_f16(blocks, 0), blocks[:, 66:74], grid)


# IQ2_S (82 bytes / 256 values, 16 sub-blocks of 16): d f16 | qs[32] (grid index, low 8 bits)
# | signs[32] (a bit per value) | qh[8] (2 more index bits per group of 8) | scales[8] (nibbles).
def _iq2_s(blocks: torch.Tensor) -> torch.Tensor:
    qh = _crumbs(blocks[:, 66:74]).transpose(1, 2).reshape(-1, 32)
    index = blocks[:, 2:34].long() | (qh.long() << 8)
    grid = _lookup("IQ2_S", index) * _sign_bits(blocks[:, 34:66])
    return _times_nibble_scales(_f16(blocks, 0), blocks[:, 74:82], grid)


def _times_nibble_scales(d: torch.Tensor, scales: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """grid (n, 32, 8) times d * (0.5 + scale) * 0.25, a 4-bit scale (low nibble first) per 16 values."""
    db = d * (0.5 + _nibbles(scales).transpose(1, 2).reshape(-1, 16).float()) * 0.25
    return (db.reshape(-1, 16, 1, 1) * grid.reshape(-1, 16, 2, 8)).reshape(-1, QK_K)


# IQ3_S (110 bytes / 256 values, 8 sub-blocks of 32): d f16 | qs[64] (grid index, low 8 bits)
# | qh[8] (the 9th bit) | signs[32] | scales[4] (nibbles).  x = d * (1 + 2 scale) * grid * sign
def _iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    high = _bits(blocks[:, 66:74]).transpose(1, 2).reshape(-1, 64)
    grid = _lookup("IQ3_S", blocks[:, 2:66].long() | (high.long() << 8)).reshape(-1, 8, 32)
    db = d * (1 + 2 * _nibbles(blocks[:, 106:110]).transpose(1, 2).reshape(-1, 8)).float()
    return (db.unsqueeze(-1) * grid * _sign_bits(blocks[:, 74:106]).reshape(-1, 8, 32)).reshape(-1, QK_K)


# IQ1_S (50 bytes / 256 values, 8 sub-blocks of 32): d f16 | qs[32] (grid index, low 8 bits)
# | qh u16[8]: 3 more index bits per group of 8, a 3-bit scale at bit 12, the shift's sign at 15.
# x = d * (2 scale + 1) * (grid + shift), shift = +-1/8
def _iq1_s(blocks: torch.Tensor) -> torch.Tensor:
    d, qh = _f16(blocks, 0), _u16(blocks[:, 34:50])  # (n, 8)
    dl = d * (2 * ((qh >> 12) & 7) + 1).float()
    shift = torch.where(qh & 0x8000 == 0, 0.125, -0.125)
    high = (qh.unsqueeze(-1) >> torch.arange(0, 12, 3, device=blocks.device)) & 7
    grid = _lookup("IQ1_S", blocks[:, 2:34].long() | (high.reshape(-1, 32) << 8)).reshape(-1, 8, 32)
    return (dl.unsqueeze(-1) * (grid + shift.unsqueeze(-1))).reshape(-1, QK_K)


# IQ1_M (56 bytes / 256 values, 16 sub-blocks of 16): qs[32] | qh[16] (a nibble per group of 8:
# 3 index bits, the shift's sign) | scales u16[4]: four 3-bit scales each, and in their top nibbles
# the block's f16 d.  x = d * (2 scale + 1) * (grid + shift)
def _iq1_m(blocks: torch.Tensor) -> torch.Tensor:
    sc = _u16(blocks[:, 48:56])  # (n, 4)
    top = (sc & 0xF000) >> torch.tensor([12, 8, 4, 0], device=blocks.device)
    d_bits = (top[:, 0] | top[:, 1] | top[:, 2] | top[:, 3]).to(torch.int16)
    d = d_bits.view(torch.float16).float().unsqueeze(-1)
    scales = (sc.unsqueeze(-1) >> torch.arange(0, 12, 3, device=blocks.device)) & 7
    dl = d * (2 * scales.reshape(-1, 16) + 1).float()
    qh = _nibbles(blocks[:, 32:48]).transpose(1, 2).reshape(-1, 32)
    grid = _lookup("IQ1_M", blocks[:, :32].long() | ((qh & 7).long() << 8))
    shift = torch.where(qh & 8 == 0, 0.125, -0.125)
    return (dl.reshape(-1, 16, 1, 1) * (grid + shift.unsqueeze(-1)).reshape(-1, 16, 2, 8)).reshape(-1, QK_K)


DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.F32: _f32,
    Q.F16: _f16_array,
    Q.BF16: _bf16,
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
    Q.TQ1_0: _tq1_0,
    Q.TQ2_0: _tq2_0,
    Q.IQ4_NL: _iq4_nl,
    Q.IQ4_XS: _iq4_xs,
    Q.MXFP4: _mxfp4,
    Q.IQ3_S: _iq3_s,
    Q.IQ3_XXS: _iq3_xxs,
    Q.IQ2_S: _iq2_s,
    Q.IQ2_XS: _iq2_xs,
    Q.IQ2_XXS: _iq2_xxs,
    Q.IQ1_M: _iq1_m,
    Q.IQ1_S: _iq1_s,
}

SUPPORTED_QTYPES: tuple[GGMLQuantizationType, ...] = tuple(DEQUANTIZERS)
QUANTIZE_QTYPES: tuple[GGMLQuantizationType, ...] = (
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.TQ1_0, Q.TQ2_0,
)


def _names(qtypes: tuple[GGMLQuantizationType, ...]) -> str:
    return ", ".join(q.name for q in qtypes)


def _qtype_name(qtype) -> str:
    return getattr(qtype, "name", str(qtype))


def dequantize(data: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw GGUF blocks (uint8, flat or (rows, bytes_per_row); or an F32/F16/BF16 array) ->
    float32 tensor of the logical `shape`, on the device of `data`."""
    fn = DEQUANTIZERS.get(qtype)
    if fn is None:
        raise ModelLoadError(
            f"unsupported tensor type {_qtype_name(qtype)}; supported: {_names(SUPPORTED_QTYPES)}")
    shape = tuple(int(s) for s in shape)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    cols = shape[-1] if shape else 1
    if cols % block_size != 0:
        raise ModelLoadError(
            f"{qtype.name} tensor of shape {shape}: last dimension {cols} is not a multiple "
            f"of the block size {block_size}")
    n_blocks = math.prod(shape) // block_size
    expected = n_blocks * type_size
    raw = data.contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() != expected:
        raise ModelLoadError(
            f"{qtype.name} tensor of shape {shape}: expected {expected} bytes, got {raw.numel()}")
    blocks = raw.reshape(n_blocks, type_size)
    chunk = max(1, _CHUNK_ELEMENTS // block_size)
    if n_blocks <= chunk:
        return fn(blocks).reshape(shape)
    out = torch.empty(n_blocks, block_size, dtype=torch.float32, device=data.device)
    for start in range(0, n_blocks, chunk):
        out[start:start + chunk] = fn(blocks[start:start + chunk])
    return out.reshape(shape)


def quantize(values: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Float values (..., cols) -> raw GGUF blocks, uint8 (rows, bytes_per_row), via gguf."""
    if qtype not in QUANTIZE_QTYPES:
        raise ModelLoadError(
            f"cannot quantize to {_qtype_name(qtype)}; supported: {_names(QUANTIZE_QTYPES)}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    array = values.detach().to(device="cpu", dtype=torch.float32).numpy()
    array = array.reshape(-1, array.shape[-1] if array.ndim else 1)
    cols = array.shape[-1]
    if cols % block_size != 0:
        raise ModelLoadError(
            f"cannot quantize to {qtype.name}: row length {cols} is not a multiple "
            f"of the block size {block_size}")
    packed = np.ascontiguousarray(gguf_quants.quantize(array, qtype)).view(np.uint8)
    return torch.from_numpy(packed.reshape(array.shape[0], cols // block_size * type_size))
