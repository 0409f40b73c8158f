"""Rotary embedding of q and k fused with the KV cache write, a few tokens per program (their heads as tile rows).

HF's rotate-half RoPE: with x1 = x[:D/2], x2 = x[D/2:] and cos/sin the float32 tables' rows at the
token's position, out[:D/2] = x1 cos - x2 sin and out[D/2:] = x2 cos + x1 sin, in float32. The
rotated k and the unrotated v go straight into their cache slot (cast to the cache's dtype); a
slot < 0 (a CUDA graph's padding row) stores nothing. q comes back rotated as a new contiguous
tensor. q, k and v may be strided views of one merged projection output: heads are contiguous
within a token's row, rows are addressed by their own stride. v may be of another width than k
(multi-head latent attention: the latent, beside its rotated key part; hearth/model/latent_attention.py).

A q8_0 cache (hearth/kv_format.py) gets each head row of k and v quantized in the kernel:
the rotated k is built as whole rows (each value with its rotation partner) so that a row's
blocks of 32 are whole, then d = max|x| / 127 per block and codes round(x / d), halves away from
zero, as llama.cpp's quantize_row_q8_0_ref.

An fp8 cache gets x / scale (the cache's per-tensor scale) saturated to +-448 and rounded to the
nearest e4m3 value, ties to even, as torch's cast. The kernel rounds in float32 itself (`_e4m3`),
so the cast that follows is exact: Triton's interpreter's fp8 cast rounds ties up and lets a
mantissa carry corrupt the exponent, and one rounding written here gives the same bytes on a GPU
and under the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hearth.kv_format import FP8_MAX, KV_FP8, KV_Q8_0, Q8_BLOCK, KVCache, cache_operands

_Q8_BLOCK = tl.constexpr(Q8_BLOCK)
_Q8_0 = tl.constexpr(KV_Q8_0)
_FP8 = tl.constexpr(KV_FP8)
_FP8_MAX = tl.constexpr(FP8_MAX)
TILE_ROWS = 32  # query head rows per program, at least (a program takes several tokens where heads are few)


@triton.jit
def _rope_rows(rows, cos, sin, mask, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The rotated halves, each [R, BLOCK_HALF] in float32, of head rows starting at the pointers `rows` [R, 1]."""
    i = tl.arange(0, BLOCK_HALF)[None, :]
    x1 = tl.load(rows + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(rows + HALF + i, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _store_q8_0(codes, scales_at, x, d, stored, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """x [ROWS, BLOCK_D] float32 (columns from HEAD_DIM, a multiple of 32, on: 0) quantized as q8_0: each
    row's codes at its pointer `codes` [ROWS, 1] + d, its scales at `scales_at` [ROWS, 1] + block; rows
    `stored` [ROWS, 1] only."""
    blocks = tl.reshape(x, (ROWS, BLOCK_D // _Q8_BLOCK, _Q8_BLOCK))
    scale = tl.max(tl.abs(blocks), 2) / 127.0  # [ROWS, BLOCK_D / 32]
    inverse = tl.where(scale == 0.0, 0.0, 1.0 / tl.where(scale == 0.0, 1.0, scale))  # no division by 0
    y = blocks * inverse[:, :, None]
    a = tl.abs(y)
    whole = tl.floor(a)
    rounded = whole + tl.floor(2.0 * (a - whole))  # half away from zero, as roundf
    values = tl.reshape(tl.where(y < 0, -rounded, rounded), (ROWS, BLOCK_D))
    tl.store(codes + d, values.to(tl.int8), mask=stored & (d < HEAD_DIM))
    b = tl.arange(0, BLOCK_D // _Q8_BLOCK)[None, :]
    tl.store(scales_at + b, scale.to(tl.float16), mask=stored & (b < HEAD_DIM // _Q8_BLOCK))


@triton.jit
def _e4m3(x):
    """float32 x -> the nearest e4m3 value (ties to even) of x saturated to +-448, in float32. With
    u the e4m3 spacing at |x| (2^(e - 3) for |x| in [2^e, 2^(e + 1)), 2^-9 below 2^-6), adding and
    taking away 1.5 * 2^23 * u makes float32's own round-to-nearest-even round |x| to a multiple of u."""
    y = tl.minimum(tl.maximum(x, -_FP8_MAX), _FP8_MAX)
    bits = y.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # e4m3's subnormals are spaced as [2^-6, 2^-5)
    spacing = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = spacing * 12582912.0  # 1.5 * 2^23
    rounded = (tl.abs(y) + magic) - magic
    return (rounded.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)  # x's sign, -0 too


@triton.jit
def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, ks_ptr, vs_ptr, slots_ptr,
    q_out_ptr, num_tokens, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_table,
    stride_kcs, stride_kch, stride_vcs, stride_vch, stride_kss, stride_ksh, stride_vss, stride_vsh,
    k_inverse_scale, v_inverse_scale,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_V: tl.constexpr, KV_FORMAT: tl.constexpr,
):
    """Program: BLOCK_T tokens, their heads as tile rows (row r: token r // heads' block, head r % it)."""
    i = tl.arange(0, BLOCK_HALF)[None, :]
    r = tl.arange(0, BLOCK_T * BLOCK_H)[:, None]
    t = (tl.program_id(0) * BLOCK_T + r // BLOCK_H).to(tl.int64)  # [R, 1] each row's token
    h = r % BLOCK_H
    mask = (t < num_tokens) & (h < NUM_HEADS) & (i < HALF)  # [R, BLOCK_HALF]
    position = tl.load(positions_ptr + t, mask=t < num_tokens, other=0).to(tl.int64)
    cos = tl.load(cos_ptr + position * stride_table + i, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + position * stride_table + i, mask=mask, other=0.0)
    out1, out2 = _rope_rows(q_ptr + t * stride_qt + h * stride_qh, cos, sin, mask, HALF, BLOCK_HALF)
    q_out = q_out_ptr + t * (NUM_HEADS * 2 * HALF) + h * (2 * HALF) + i
    tl.store(q_out, out1.to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(q_out + HALF, out2.to(q_out_ptr.dtype.element_ty), mask=mask)

    r = tl.arange(0, BLOCK_T * BLOCK_KVH)[:, None]
    t = (tl.program_id(0) * BLOCK_T + r // BLOCK_KVH).to(tl.int64)
    h = r % BLOCK_KVH
    slot = tl.load(slots_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)  # [R, 1]
    stored = (h < NUM_KV_HEADS) & (slot >= 0)  # a padding row (slot < 0) stores nothing
    position = tl.load(positions_ptr + t, mask=t < num_tokens, other=0).to(tl.int64)
    d, dv = tl.arange(0, 2 * BLOCK_HALF)[None, :], tl.arange(0, BLOCK_V)[None, :]  # [1, D], [1, V_DIM]
    live = (t < num_tokens) & (h < NUM_KV_HEADS)
    row_mask = live & (d < 2 * HALF)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + dv, mask=live & (dv < V_DIM), other=0.0)
    k_rows = k_ptr + t * stride_kt + h * stride_kh
    if KV_FORMAT == _Q8_0:
        # whole rows: value d with its partner d +- D/2, cos and sin at d mod D/2
        first = d < HALF
        j = tl.where(first, d, d - HALF)
        c = tl.load(cos_ptr + position * stride_table + j, mask=row_mask, other=0.0)
        s = tl.load(sin_ptr + position * stride_table + j, mask=row_mask, other=0.0)
        x = tl.load(k_rows + d, mask=row_mask, other=0.0).to(tl.float32)
        partner = tl.load(k_rows + tl.where(first, d + HALF, j), mask=row_mask, other=0.0).to(tl.float32)
        k_rotated = tl.where(first, x * c - partner * s, x * c + partner * s)
        _store_q8_0(k_cache_ptr + slot * stride_kcs + h * stride_kch, ks_ptr + slot * stride_kss + h * stride_ksh,
                    k_rotated, d, stored, 2 * HALF, BLOCK_T * BLOCK_KVH, 2 * BLOCK_HALF)
        _store_q8_0(v_cache_ptr + slot * stride_vcs + h * stride_vch, vs_ptr + slot * stride_vss + h * stride_vsh,
                    v.to(tl.float32), dv, stored, V_DIM, BLOCK_T * BLOCK_KVH, BLOCK_V)
    else:
        mask = live & (i < HALF)  # [R, BLOCK_HALF]
        cos = tl.load(cos_ptr + position * stride_table + i, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + position * stride_table + i, mask=mask, other=0.0)
        out1, out2 = _rope_rows(k_rows, cos, sin, mask, HALF, BLOCK_HALF)
        if KV_FORMAT == _FP8:
            out1, out2 = _e4m3(out1 * k_inverse_scale), _e4m3(out2 * k_inverse_scale)
            v = _e4m3(v.to(tl.float32) * v_inverse_scale)
        k_out = k_cache_ptr + slot * stride_kcs + h * stride_kch + i
        tl.store(k_out, out1.to(k_cache_ptr.dtype.element_ty), mask=stored & (i < HALF))
        tl.store(k_out + HALF, out2.to(k_cache_ptr.dtype.element_ty), mask=stored & (i < HALF))
        tl.store(v_cache_ptr + slot * stride_vcs + h * stride_vch + dv, v.to(v_cache_ptr.dtype.element_ty),
                 mask=stored & (dv < V_DIM))


def rope_and_store_kv(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, DV]
    positions: torch.Tensor,  # int [T]
    cos_table: torch.Tensor,  # float32 [max_positions, D / 2]
    sin_table: torch.Tensor,  # float32 [max_positions, D / 2]
    k_cache: KVCache,  # [num_slots, KVH, D] values, q8_0 (head_dim a multiple of 32) or fp8
    v_cache: KVCache,  # [num_slots, KVH, DV] values, q8_0 or fp8
    slot_mapping: torch.Tensor,  # int [T]; < 0: not stored
) -> torch.Tensor:
    """Stores rope(k) and v at their slots; returns rope(q) as a new contiguous [T, H, D] in q.dtype."""
    (k_cache, k_scales, k_scale, kv_format), (v_cache, v_scales, v_scale, _) = (cache_operands(k_cache),
                                                                              cache_operands(v_cache))
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    v_dim = v.shape[2]
    assert head_dim % 2 == 0 and k.shape == (tokens, num_kv_heads, head_dim) and v.shape[:2] == (tokens, num_kv_heads)
    assert k_cache.shape[1:] == (num_kv_heads, head_dim) and v_cache.shape[1:] == (num_kv_heads, v_dim)
    assert cos_table.shape == sin_table.shape and cos_table.shape[1] == half and cos_table.stride(1) == 1
    assert cos_table.stride() == sin_table.stride()
    for x in (q, k, v, k_cache, v_cache):
        assert x.stride(2) == 1, "head_dim must be contiguous"
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_out
    block_h = triton.next_power_of_2(num_heads)
    block_t = max(1, TILE_ROWS // block_h)
    _rope_store_kernel[(triton.cdiv(tokens, block_t),)](
        q, k, v, positions, cos_table, sin_table, k_cache, v_cache, k_scales, v_scales, slot_mapping, q_out, tokens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_table.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        k_scales.stride(0), k_scales.stride(1), v_scales.stride(0), v_scales.stride(1), 1.0 / k_scale, 1.0 / v_scale,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, V_DIM=v_dim, BLOCK_T=block_t,
        BLOCK_H=block_h, BLOCK_KVH=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_V=triton.next_power_of_2(v_dim), KV_FORMAT=kv_format,
        num_warps=4,
    )
    return q_out
