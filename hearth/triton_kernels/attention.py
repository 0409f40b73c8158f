"""Paged attention over one layer's KV cache: split-KV decode and varlen (causal or masked) prefill.

Cache layout: `k_cache`, `v_cache` [num_slots, num_kv_heads, head_dim], slot = block_id *
block_size + offset; `block_tables` int32 [num_seqs, max_blocks] (padded with 0); context lengths
int32 count the tokens in the cache after this step (this step's K/V are already stored). Query
head h reads KV head h // (num_heads // num_kv_heads) (GQA; MQA is one KV head).

Both kernels read K/V in place through the block table (no gather into a dense copy) and give
one program all the query heads of a KV group, so each K/V row is loaded once per group: scores
are a tl.dot of [group rows, D] @ [D, BLOCK_N] tiles, with an online softmax (exp2, log2(e)
folded into the scale) and an fp32 accumulator.

- `decode_attention` (one query per sequence): flash-decoding. A sequence's context is cut into
  `num_splits` equal ranges (rounded to BLOCK_N) computed by separate programs, so a small batch
  still fills the GPU; a second small kernel merges the splits' partial outputs by their
  log-sum-exp. With one split the first kernel writes the output itself.
- `prefill_attention` (any mix of prompts, chunks and decodes): variable-length and causal,
  bottom-right aligned: the new rows of a sequence are its last query_len positions, so a chunk
  attends to its cached prefix. Given `RowMasks`, each row sees up to an end of its own (an image's
  rows that attend both ways: the image's end) and, in a token tree's region, only its ancestors
  (a bit per tree position), its sliding window counted back from its own position.

Attention sinks (gpt-oss: a logit per head in each softmax's denominator, with no value) start a
row's online softmax at max = the sink and sum = 1; the split decode kernel gives them to split 0
only, so the merge's log-sum-exp weights count each sink once.

A q8_0 cache (hearth/kv_format.py: int8 codes [num_slots, num_kv_heads, head_dim] and
float16 scales [num_slots, num_kv_heads, head_dim / 32]) is read the same way, each tile
dequantized as it is loaded (code x its block's scale, in float32). An fp8 cache
(float8_e4m3fn [num_slots, num_kv_heads, head_dim] and one scale per tensor) is loaded as fp8 and
converted to the query's dtype (exact: e4m3's values are bfloat16's, float16's and float32's too);
its scales are folded into the score scale (K's) and the output (V's). Keys before the first
position any row of a program sees are never loaded: the blocks a sliding window has left behind
may have been freed (their block-table entries are placeholders).

CUDA-graph safe: nothing reads a tensor's values on the host; grids come from shapes and host
ints (`num_splits`, `max_query_len`). Padding rows are harmless: context length 0 gives zeros,
never NaN, and splits past a sequence's end do no work. float32 inputs are multiplied in IEEE
fp32 (not tf32), so they match a float64 reference to ~1e-6; bf16/fp16 use the tensor cores'
native dot with fp32 accumulation, the probabilities rounded to the input dtype for P @ V.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hearth.kv_format import KV_Q8_0, Q8_BLOCK, KVCache, cache_operands

LOG2E = math.log2(math.e)
MAX_SPLITS = 64  # the merge kernel holds every split of a head in one tile
_Q8_BLOCK = tl.constexpr(Q8_BLOCK)
_Q8_0 = tl.constexpr(KV_Q8_0)
_LOG2E = tl.constexpr(LOG2E)
_NO_WINDOW = 1 << 30  # the window of full attention: longer than any context
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in partial writes than it gains
PROGRAMS_PER_SM = 2  # decode splits aim at this many programs per SM
PREFILL_ROWS = 64  # query rows (tokens x heads of a group) per prefill program, at least


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int = 132) -> int:
    """Split-KV parts for a decode step: enough programs (sequences x KV heads x splits) for about
    PROGRAMS_PER_SM per SM, at most one split per MIN_SPLIT_TOKENS of the longest possible
    context, at most MAX_SPLITS, at least 1. Host values only, so a CUDA graph can fix it."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, programs)
    return max(1, min(wanted, triton.cdiv(max_context, MIN_SPLIT_TOKENS), MAX_SPLITS))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H100's count: the interpreter runs the same grids as the GPU would
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tile_sizes(head_dim: int, dtype: torch.dtype) -> tuple[int, int, str]:
    """(BLOCK_D, BLOCK_N, dot precision): K/V tiles of about 16 KB (so pipelined stages fit in
    shared memory even in float32), and IEEE dots for float32."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = max(16, min(64, 16384 // (block_d * dtype.itemsize)))
    return block_d, block_n, "ieee" if dtype == torch.float32 else "tf32"


def _check(q: torch.Tensor, k_cache: KVCache, v_cache: KVCache, out: torch.Tensor | None) -> torch.Tensor:
    """The output tensor (new, contiguous, or `out`) after checking the layouts the kernels assume."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == head_dim, "k/v cache [slots, kv_heads, head_dim]"
    assert num_heads % k_cache.shape[1] == 0, "query heads must be a multiple of KV heads"
    for cache in (k_cache, v_cache):
        operands = cache_operands(cache)
        assert operands.values.stride(2) == 1 and operands.block_scales.stride(2) == 1, "head_dim must be contiguous"
    assert q.stride(2) == 1, "head_dim must be contiguous"
    if out is None:
        return q.new_empty(q.shape)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    return out


def _sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The kernels' sinks operand: float32 [heads] contiguous, or (none) any pointer, never read."""
    if sinks is None:
        return q
    assert sinks.shape == (q.shape[1],), "a sink logit per query head"
    return sinks.float().contiguous()


# ---- one tile of keys, shared by both kernels ----------------------------------------------


@triton.jit
def _load_rows(ptr, scale_ptr, slot, kv_head, d, mask, stride_s, stride_h, stride_ss, stride_sh,
               KV_FORMAT: tl.constexpr):
    """Cache rows [BLOCK_N, BLOCK_D] of one KV head at `slot`: values (fp8's unscaled), or q8_0
    codes x their scales."""
    # (other=0.0: Triton casts no integer constant to fp8)
    rows = tl.load(ptr + slot[:, None] * stride_s + kv_head * stride_h + d[None, :], mask=mask, other=0.0)
    if KV_FORMAT == _Q8_0:
        scales = tl.load(scale_ptr + slot[:, None] * stride_ss + kv_head * stride_sh + (d // _Q8_BLOCK)[None, :],
                         mask=mask, other=0.0)
        rows = rows.to(tl.float32) * scales.to(tl.float32)
    return rows  # one return: the compiler refuses a second one of another type


@triton.jit
def _attend_tile(q, m, l, acc, key, begin, end, pos, row_end, tree_begin, tree_mask, table, k_ptr, v_ptr, ks_ptr,
                 vs_ptr, kv_head, d, d_mask,
                 stride_ks, stride_kh, stride_vs, stride_vh, stride_kss, stride_ksh, stride_vss, stride_vsh,
                 qk_scale, softcap, window,
                 BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, KV_FORMAT: tl.constexpr,
                 TREES: tl.constexpr):
    """Keys at context positions `key` [BLOCK_N] (those in [begin, end): no other is loaded) folded
    into the online softmax (m, l [R], acc [R, BLOCK_D]) of query rows q [R, BLOCK_D]; row r sees
    keys from pos[r] - window + 1 up to row_end[r] - 1 (causal: row_end = pos + 1). TREES: of the keys
    at tree_begin + j (j < 64), row r sees those whose bit j is set in tree_mask[r] (int64). SOFTCAP:
    scores capped as softcap * tanh(score / softcap) (both in the log2-scaled units). KV_FORMAT: what the
    caches hold (hearth/kv_format.py); q8_0's block scales at ks_ptr / vs_ptr. A row may see no key of a
    tile: its m stays as it was (-inf before any key, or its sink), its sums unchanged."""
    valid = (key >= begin) & (key < end)
    block = tl.load(table + key // BLOCK_SIZE, mask=valid, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + key % BLOCK_SIZE
    kv_mask = valid[:, None] & d_mask[None, :]
    k = _load_rows(k_ptr, ks_ptr, slot, kv_head, d, kv_mask, stride_ks, stride_kh, stride_kss, stride_ksh, KV_FORMAT)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale  # [R, BLOCK_N]
    if SOFTCAP:  # tanh(x) = 2 sigmoid(2x) - 1
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
    seen = valid[None, :] & (key[None, :] < row_end[:, None]) & (key[None, :] > pos[:, None] - window)
    if TREES:  # a token tree's keys: the row's ancestors and itself
        offset = key[None, :] - tree_begin
        bit = (tree_mask[:, None] >> tl.minimum(tl.maximum(offset, 0), 63).to(tl.int64)) & 1
        seen = seen & ((offset < 0) | ((bit != 0) & (offset < 64)))
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp2(-inf - -inf) would be NaN
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, 1)
    v = _load_rows(v_ptr, vs_ptr, slot, kv_head, d, kv_mask, stride_vs, stride_vh, stride_vss, stride_vsh, KV_FORMAT)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return m_new, l, acc


@triton.jit
def _sink_start(sinks_ptr, heads, has_sink, ROWS: tl.constexpr, SINKS: tl.constexpr):
    """The online softmax's running max m and sum l [ROWS] before any key: -inf and 0, or, SINKS, for the
    rows `has_sink`, the head's sink logit (float32 sinks_ptr[heads], in log2 units) and its exp2(0) = 1."""
    m = tl.full([ROWS], float("-inf"), tl.float32)  # running max of the log2-scaled scores
    l = tl.zeros([ROWS], tl.float32)  # running sum of exp2(score - m)
    if SINKS:
        sink = tl.load(sinks_ptr + heads, mask=has_sink, other=0.0).to(tl.float32) * _LOG2E
        m = tl.where(has_sink, sink, m)
        l = tl.where(has_sink, 1.0, l)
    return m, l


# ---- decode ------------------------------------------------------------------------------


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, lens_ptr, sinks_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_kss, stride_ksh, stride_vss, stride_vsh,
    stride_tb, stride_ob, stride_oh,
    num_heads, qk_scale, v_scale, softcap, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, KV_FORMAT: tl.constexpr, SINKS: tl.constexpr,
):
    """Program (sequence, KV head, split): the group's query heads against one range of the context
    (and, SINKS, in split 0, each head's sink logit)."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(lens_ptr + seq)
    first = tl.maximum(context - window, 0)  # the window's first position
    split_len = tl.cdiv(tl.cdiv(context - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, context)  # <= start: nothing to do (past the end, or padding)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + g  # [BLOCK_G]
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    m, l = _sink_start(sinks_ptr, heads, g_mask & (g * 0 + split == 0), BLOCK_G, SINKS)  # the sink counted once
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = tables_ptr + seq * stride_tb
    last = tl.zeros([BLOCK_G], tl.int32) + end - 1  # every row sees the whole range
    for tile in range(start, end, BLOCK_N):  # every tile has a valid position: m stays finite
        m, l, acc = _attend_tile(q, m, l, acc, tile + n, start, end, last, last + 1, 0, 0, table, k_ptr, v_ptr,
                                 ks_ptr, vs_ptr, kv_head, d, d_mask, stride_ks, stride_kh, stride_vs, stride_vh,
                                 stride_kss, stride_ksh, stride_vss, stride_vsh, qk_scale, softcap, window,
                                 BLOCK_SIZE, DOT_PRECISION, SOFTCAP, KV_FORMAT, False)

    l = tl.where(l > 0, l, 1.0)  # an empty range (m = -inf) leaves zeros
    o = acc / l[:, None] * v_scale
    store_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        # partials [B, H, NUM_SPLITS, HEAD_DIM] and their log2-sum-exp2 [B, H, NUM_SPLITS]
        row = (seq * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=store_mask)
        tl.store(part_lse_ptr + row, m + tl.log2(l), mask=g_mask)  # -inf for an empty range


@triton.jit
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh, num_heads,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (sequence, head): the splits' partial outputs weighted by exp2(lse - max lse)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row = (seq * num_heads + head) * NUM_SPLITS + sp  # [BLOCK_S]
    lse = tl.load(part_lse_ptr + row, mask=sp < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # empty splits: 0
    parts = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
                    mask=(sp < NUM_SPLITS)[:, None] & (d < HEAD_DIM)[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    total = tl.sum(weight, 0)
    o = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)  # no context: zeros
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def decode_attention(
    q: torch.Tensor,  # [B, H, D], one new token per sequence
    k_cache: KVCache,  # [num_slots, KVH, D] values, q8_0 or fp8
    v_cache: KVCache,  # [num_slots, KVH, D] values, q8_0 or fp8
    block_tables: torch.Tensor,  # int32 [B, max_blocks]
    context_lens: torch.Tensor,  # int32 [B], this token included; 0 for padding rows
    scale: float,
    block_size: int,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # [B, H, D] in q.dtype
    softcap: float | None = None,  # scores capped as softcap * tanh(score / softcap)
    window: int | None = None,  # the query sees only the last `window` positions (sliding window)
    sinks: torch.Tensor | None = None,  # float32 [H]: a logit per head in each softmax, with no value (gpt-oss)
) -> torch.Tensor:
    """Paged split-KV decode attention; returns [B, H, D] in q.dtype. `num_splits` defaults to
    choose_num_splits over the block table's width (fixed by shapes, so graph-capturable)."""
    out = _check(q, k_cache, v_cache, out)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, block_tables.shape[1] * block_size, _num_sms(q.device))
    assert 1 <= num_splits <= MAX_SPLITS
    group = num_heads // num_kv_heads
    block_d, block_n, precision = _tile_sizes(head_dim, q.dtype)
    if num_splits == 1:
        part_out = part_lse = out  # unused
    else:
        part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    (k, k_scales, k_scale, kv_format), (v, v_scales, v_scale, _) = cache_operands(k_cache), cache_operands(v_cache)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k, v, k_scales, v_scales, block_tables, context_lens, _sinks(sinks, q), out, part_out, part_lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_scales.stride(0), k_scales.stride(1), v_scales.stride(0), v_scales.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        num_heads, scale * k_scale * LOG2E, v_scale, (softcap or 1.0) * LOG2E, window or _NO_WINDOW,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        DOT_PRECISION=precision, SOFTCAP=softcap is not None, KV_FORMAT=kv_format, SINKS=sinks is not None,
        num_warps=4,
    )
    if num_splits > 1:
        _decode_merge_kernel[(batch, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
            num_warps=1 if block_d <= 128 else 2,
        )
    return out


# ---- prefill (and mixed batches) ---------------------------------------------------------


@triton.jit
def _row_spans(spans_ptr, tree_start_ptr, tree_masks_ptr, seq, tokens, row_mask, pos, context,
               MASKED: tl.constexpr, TREES: tl.constexpr):
    """Tile rows' window anchors and visible ends [R] (causal: pos and pos + 1; MASKED: int32 spans_ptr
    [T, 2] at the rows' tokens), and their token tree: its first position and each row's int64 mask
    (TREES: tree_start_ptr [S], tree_masks_ptr [T]; else the context's end and 0, never read)."""
    row_end = pos + 1
    if MASKED:
        pos = tl.load(spans_ptr + 2 * tokens, mask=row_mask, other=0)
        row_end = tl.load(spans_ptr + 2 * tokens + 1, mask=row_mask, other=0)
    tree_begin = context
    tree_mask = tl.zeros(tokens.shape, tl.int64)
    if TREES:
        tree_begin = tl.load(tree_start_ptr + seq)
        tree_mask = tl.load(tree_masks_ptr + tokens, mask=row_mask, other=0)
    return pos, row_end, tree_begin, tree_mask


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, starts_ptr, lens_ptr, sinks_ptr, spans_ptr, tree_start_ptr,
    tree_masks_ptr, out_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_kss, stride_ksh, stride_vss, stride_vsh,
    stride_tb, stride_ot, stride_oh,
    qk_scale, v_scale, softcap, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, KV_FORMAT: tl.constexpr, SINKS: tl.constexpr,
    MASKED: tl.constexpr, TREES: tl.constexpr,
):
    """Program (query block, sequence, KV head): BLOCK_Q new rows of a sequence x the group's heads,
    as BLOCK_Q * BLOCK_G tile rows (row-major: row r is query r // BLOCK_G, head r % BLOCK_G)."""
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(starts_ptr + seq)
    q_len = tl.load(starts_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    context = tl.load(lens_ptr + seq)

    r = tl.arange(0, BLOCK_Q * BLOCK_G)
    query = q_block * BLOCK_Q + r // BLOCK_G  # [R] row among the sequence's new ones
    g = r % BLOCK_G
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_mask = d < HEAD_DIM
    row_mask = (query < q_len) & (g < GROUP)
    tokens = (q_start + query).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [R, BLOCK_D]
    # [R] each row's position (causal: the sequence's last q_len ones) and the keys it sees: pos - window + 1 on,
    # before row_end (and in its token tree's region, its ancestors only)
    pos, row_end, tree_begin, tree_mask = _row_spans(spans_ptr, tree_start_ptr, tree_masks_ptr, seq, tokens,
                                                     row_mask, context - q_len + query, context, MASKED, TREES)

    m, l = _sink_start(sinks_ptr, heads, row_mask, BLOCK_Q * BLOCK_G, SINKS)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    end = tl.max(tl.where(row_mask, row_end, 0), 0)  # one past the last key any row of the block sees
    table = tables_ptr + seq.to(tl.int64) * stride_tb
    # from the first key any row sees (with no window, key 0: every tile after has keys)
    first = tl.maximum(tl.min(tl.where(row_mask, pos, context), 0) - window + 1, 0)
    for tile in range(first // BLOCK_N * BLOCK_N, end, BLOCK_N):
        m, l, acc = _attend_tile(q, m, l, acc, tile + n, first, end, pos, row_end, tree_begin, tree_mask, table,
                                 k_ptr, v_ptr, ks_ptr, vs_ptr, kv_head, d, d_mask, stride_ks, stride_kh, stride_vs,
                                 stride_vh, stride_kss, stride_ksh, stride_vss, stride_vsh, qk_scale, softcap, window,
                                 BLOCK_SIZE, DOT_PRECISION, SOFTCAP, KV_FORMAT, TREES)

    o = acc / tl.where(l > 0, l, 1.0)[:, None] * v_scale  # padding rows past a window see no key
    tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


@dataclass
class RowMasks:
    """Which keys a prefill kernel's rows see where that is not plain causal (bottom-right aligned)."""

    # int32 [T, 2] each row's position (a sliding window counts back from it) and one past the last key it
    # sees (causal: position + 1; a row of an image that attends both ways: the image's end)
    spans: torch.Tensor
    # token trees: int32 [S] where each sequence's tree region begins (none: its context length) and int64 [T]
    # each row's ancestors there (bit j: the key at tree_start + j; StepInputs.tree_masks); None: no trees
    tree_start: torch.Tensor | None = None
    tree_masks: torch.Tensor | None = None


def prefill_attention(
    q: torch.Tensor,  # [T, H, D], the new tokens of S sequences end to end
    k_cache: KVCache,  # [num_slots, KVH, D] values, q8_0 or fp8
    v_cache: KVCache,  # [num_slots, KVH, D] values, q8_0 or fp8
    block_tables: torch.Tensor,  # int32 [S, max_blocks]
    query_start_loc: torch.Tensor,  # int32 [S + 1]: sequence s owns q rows [start[s], start[s + 1])
    seq_lens: torch.Tensor,  # int32 [S], tokens in the cache after this step (prefix included)
    scale: float,
    block_size: int,
    max_query_len: int,  # host int: the longest query_len (sizes the grid)
    out: torch.Tensor | None = None,  # [T, H, D] in q.dtype
    softcap: float | None = None,  # scores capped as softcap * tanh(score / softcap)
    window: int | None = None,  # a row sees only the last `window` positions, itself included
    sinks: torch.Tensor | None = None,  # float32 [H]: a logit per head in each softmax, with no value (gpt-oss)
    masks: RowMasks | None = None,  # rows that see other keys than causal ones (images both ways, token trees)
) -> torch.Tensor:
    """Paged varlen attention; returns [T, H, D] in q.dtype. Row i of sequence s is at position
    seq_lens[s] - query_len_s + i and attends to positions 0..that one, unless `masks` say otherwise."""
    out = _check(q, k_cache, v_cache, out)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    num_seqs = seq_lens.shape[0]
    if q.shape[0] == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    block_g = triton.next_power_of_2(group)
    block_q = max(1, PREFILL_ROWS // block_g)
    block_d, block_n, precision = _tile_sizes(head_dim, q.dtype)
    (k, k_scales, k_scale, kv_format), (v, v_scales, v_scale, _) = cache_operands(k_cache), cache_operands(v_cache)
    trees = None if masks is None or masks.tree_masks is None else (masks.tree_start, masks.tree_masks)
    assert masks is None or masks.spans.shape == (q.shape[0], 2) and masks.spans.is_contiguous()
    _prefill_kernel[(triton.cdiv(max_query_len, block_q), num_seqs, num_kv_heads)](
        q, k, v, k_scales, v_scales, block_tables, query_start_loc, seq_lens, _sinks(sinks, q),
        q if masks is None else masks.spans, *((q, q) if trees is None else trees), out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_scales.stride(0), k_scales.stride(1), v_scales.stride(0), v_scales.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        scale * k_scale * LOG2E, v_scale, (softcap or 1.0) * LOG2E, window or _NO_WINDOW,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
        DOT_PRECISION=precision, SOFTCAP=softcap is not None, KV_FORMAT=kv_format, SINKS=sinks is not None,
        MASKED=masks is not None, TREES=trees is not None, num_warps=4 if block_d <= 128 else 8,
    )
    return out
