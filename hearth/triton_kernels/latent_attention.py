"""Multi-head latent attention over its paged latent cache, absorbed (hearth/model/latent_attention.py):
split-KV decode and varlen causal prefill.

A layer's cache is one tensor [num_slots, 1, RANK + ROPE]: per token the latent c (kv_lora_rank wide), then
the rotated key part k_pe. A query row is a head's [q_nope W_UK, q_pe] (RANK + ROPE wide); its score against
a token is q_c . c + q_pe . k_pe, its output the softmax-weighted sum of c (RANK wide), which the model then
projects through W_UV. Every head reads the same cache row, so a program takes a block of heads (in prefill,
of query rows x heads) and loads each tile of c once for both of its uses, the scores' keys and the sum's
values: a token costs RANK + ROPE values read, where per-head K and V would cost (qk_head_dim + v_head_dim) x
heads (576 against 5,120 for DeepSeek-V2-Lite). Prompts take the absorbed form too: no context is expanded
through kv_b_proj.

The rest is attention.py's: block tables, context lengths that count this step's tokens, an online softmax
in exp2 with fp32 accumulators, split-KV decode whose partial outputs attention.py's merge kernel combines by
their log-sum-exp, IEEE fp32 dots for float32, nothing read on the host (CUDA-graph safe), padding rows
(context 0, slot -1) harmless. The cache holds the compute dtype (kv_format.check_kv_cache_dtype keeps the
latent to "auto"). DeepSeek's attention has no window, soft cap or sinks, and these kernels none.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hearth.triton_kernels.attention import LOG2E, MAX_SPLITS, _decode_merge_kernel

DECODE_HEADS = 16  # query heads per decode program: the fewest rows of a tl.dot tile on a GPU
PREFILL_ROWS = 32  # query rows (tokens x heads) per prefill program: its fp32 accumulator is [rows, RANK]


def decode_programs(num_heads: int) -> int:
    """Programs per sequence and split of `decode_attention` (what its split count is chosen for)."""
    return triton.cdiv(num_heads, DECODE_HEADS)


@triton.jit
def _load_queries(q_ptr, rows, row_mask, c, c_mask, r, r_mask, RANK: tl.constexpr):
    """Query rows at offsets `rows` [R]: their latent part [R, BLOCK_C] and rotated part [R, BLOCK_R]."""
    at = q_ptr + rows[:, None]
    q_c = tl.load(at + c[None, :], mask=row_mask[:, None] & c_mask[None, :], other=0.0)
    q_r = tl.load(at + RANK + r[None, :], mask=row_mask[:, None] & r_mask[None, :], other=0.0)
    return q_c, q_r


@triton.jit
def _latent_tile(q_c, q_r, m, l, acc, key, end, last, table, cache_ptr, stride_s, c, c_mask, r, r_mask, qk_scale,
                 RANK: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Cache rows at context positions `key` [BLOCK_N] (those below `end`: no other is loaded) folded into the
    online softmax (m, l [R], acc [R, BLOCK_C]) of query rows q_c, q_r; row i sees positions up to last[i]."""
    valid = key < end
    block = tl.load(table + key // BLOCK_SIZE, mask=valid, other=0)
    at = cache_ptr + (block.to(tl.int64) * BLOCK_SIZE + key % BLOCK_SIZE)[:, None] * stride_s
    latent = tl.load(at + c[None, :], mask=valid[:, None] & c_mask[None, :], other=0.0).to(q_c.dtype)
    k_pe = tl.load(at + RANK + r[None, :], mask=valid[:, None] & r_mask[None, :], other=0.0).to(q_c.dtype)
    s = tl.dot(q_c, tl.trans(latent), input_precision=DOT_PRECISION)
    s = tl.dot(q_r, tl.trans(k_pe), acc=s, input_precision=DOT_PRECISION) * qk_scale  # [R, BLOCK_N]
    s = tl.where(valid[None, :] & (key[None, :] <= last[:, None]), s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp2(-inf - -inf) would be NaN
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q_c.dtype), latent, input_precision=DOT_PRECISION)
    return m_new, l, acc


@triton.jit
def _decode_kernel(
    q_ptr, cache_ptr, tables_ptr, lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    stride_qb, stride_qh, stride_s, stride_tb, stride_ob, stride_oh, qk_scale,
    NUM_HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (sequence, block of heads, split): the heads' one query row against one range of the context."""
    seq = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    context = tl.load(lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(context, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, context)  # <= start: nothing to do (past the end, or padding)

    c, r = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_R)
    c_mask, r_mask, h_mask = c < RANK, r < ROPE, heads < NUM_HEADS
    q_c, q_r = _load_queries(q_ptr, seq * stride_qb + heads * stride_qh, h_mask, c, c_mask, r, r_mask, RANK)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    table = tables_ptr + seq * stride_tb
    last = tl.zeros([BLOCK_H], tl.int32) + end - 1  # every row sees the whole range
    for tile in range(start, end, BLOCK_N):
        m, l, acc = _latent_tile(q_c, q_r, m, l, acc, tile + tl.arange(0, BLOCK_N), end, last, table, cache_ptr,
                                 stride_s, c, c_mask, r, r_mask, qk_scale, RANK, BLOCK_SIZE, DOT_PRECISION)

    l = tl.where(l > 0, l, 1.0)  # an empty range (m = -inf) leaves zeros
    o = acc / l[:, None]
    store_mask = h_mask[:, None] & c_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + c[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=store_mask)
    else:  # partials [B, H, NUM_SPLITS, RANK] and their log2-sum-exp2 [B, H, NUM_SPLITS], as attention.py's
        row = (seq * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * RANK + c[None, :], o, mask=store_mask)
        tl.store(part_lse_ptr + row, m + tl.log2(l), mask=h_mask)


@triton.jit
def _prefill_kernel(
    q_ptr, cache_ptr, tables_ptr, starts_ptr, lens_ptr, out_ptr,
    stride_qt, stride_qh, stride_s, stride_tb, stride_ot, stride_oh, qk_scale,
    NUM_HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (query block, sequence, block of heads): BLOCK_Q new rows of a sequence x BLOCK_H heads, as
    tile rows (row i: query i // BLOCK_H, head i % BLOCK_H), causal and bottom-right aligned."""
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    q_start = tl.load(starts_ptr + seq)
    q_len = tl.load(starts_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    context = tl.load(lens_ptr + seq)

    i = tl.arange(0, BLOCK_Q * BLOCK_H)
    query = q_block * BLOCK_Q + i // BLOCK_H  # [R] row among the sequence's new ones
    heads = tl.program_id(2) * BLOCK_H + i % BLOCK_H
    row_mask = (query < q_len) & (heads < NUM_HEADS)
    tokens = (q_start + query).to(tl.int64)
    c, r = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_R)
    c_mask, r_mask = c < RANK, r < ROPE
    q_c, q_r = _load_queries(q_ptr, tokens * stride_qt + heads * stride_qh, row_mask, c, c_mask, r, r_mask, RANK)
    m = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_C], tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_tb
    pos = context - q_len + query  # [R] each row's position: it sees positions 0..pos
    end = context - q_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)  # the block's last position + 1
    for tile in range(0, end, BLOCK_N):
        m, l, acc = _latent_tile(q_c, q_r, m, l, acc, tile + tl.arange(0, BLOCK_N), end, pos, table, cache_ptr,
                                 stride_s, c, c_mask, r, r_mask, qk_scale, RANK, BLOCK_SIZE, DOT_PRECISION)

    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + c[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & c_mask[None, :])


def _shapes(q: torch.Tensor, cache: torch.Tensor, rank: int) -> tuple[int, int, int, int, str]:
    """(BLOCK_C, BLOCK_R, BLOCK_N, num_warps, dot precision) after checking the layouts the kernels assume."""
    width = q.shape[2]
    assert isinstance(cache, torch.Tensor) and cache.dim() == 3 and cache.shape[1:] == (1, width), \
        "latent cache [slots, 1, rank + rope] of values, as wide as the query rows"
    assert 0 < rank < width and cache.dtype == q.dtype and q.stride(2) == 1 and cache.stride(2) == 1
    block_c = max(16, triton.next_power_of_2(rank))
    block_n = max(16, min(64, 32768 // (block_c * q.dtype.itemsize)))  # a tile of c of at most 32 KB
    return (block_c, max(16, triton.next_power_of_2(width - rank)), block_n, 4 if block_c <= 128 else 8,
            "ieee" if q.dtype == torch.float32 else "tf32")


def decode_attention(
    q: torch.Tensor,  # [B, H, RANK + ROPE]: each head's absorbed query, one row per sequence
    cache: torch.Tensor,  # [num_slots, 1, RANK + ROPE] the latents, then the rotated key parts
    rank: int,  # RANK: kv_lora_rank
    block_tables: torch.Tensor,  # int32 [B, max_blocks]
    context_lens: torch.Tensor,  # int32 [B], this token included; 0 for padding rows
    scale: float,
    block_size: int,
    num_splits: int,  # split-KV parts (at most MAX_SPLITS): GpuMetadata.num_splits(decode_programs(H))
) -> torch.Tensor:
    """Paged split-KV decode attention over the latent: [B, H, RANK] in q.dtype, each head's weighted latents."""
    block_c, block_r, block_n, warps, precision = _shapes(q, cache, rank)
    batch, num_heads, _ = q.shape
    out = q.new_empty(batch, num_heads, rank)
    if batch == 0:
        return out
    assert 1 <= num_splits <= MAX_SPLITS
    part_out = part_lse = out  # (unused with one split)
    if num_splits > 1:
        part_out = torch.empty(batch, num_heads, num_splits, rank, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, decode_programs(num_heads), num_splits)](
        q, cache, block_tables, context_lens, out, part_out, part_lse,
        q.stride(0), q.stride(1), cache.stride(0), block_tables.stride(0), out.stride(0), out.stride(1),
        scale * LOG2E, NUM_HEADS=num_heads, RANK=rank, ROPE=q.shape[2] - rank, BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits, BLOCK_H=DECODE_HEADS, BLOCK_C=block_c, BLOCK_R=block_r, BLOCK_N=block_n,
        DOT_PRECISION=precision, num_warps=warps,
    )
    if num_splits > 1:
        _decode_merge_kernel[(batch, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_heads, HEAD_DIM=rank, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_c, num_warps=1 if block_c <= 128 else 4,
        )
    return out


def prefill_attention(
    q: torch.Tensor,  # [T, H, RANK + ROPE]: the new tokens of S sequences end to end
    cache: torch.Tensor,  # [num_slots, 1, RANK + ROPE]
    rank: int,
    block_tables: torch.Tensor,  # int32 [S, max_blocks]
    query_start_loc: torch.Tensor,  # int32 [S + 1]: sequence s owns q rows [start[s], start[s + 1])
    seq_lens: torch.Tensor,  # int32 [S], tokens in the cache after this step (prefix included)
    scale: float,
    block_size: int,
    max_query_len: int,  # host int: the longest query_len (sizes the grid)
) -> torch.Tensor:
    """Paged varlen causal attention over the latent: [T, H, RANK] in q.dtype. Row i of sequence s is at
    position seq_lens[s] - query_len_s + i and attends to positions 0..that one."""
    block_c, block_r, block_n, warps, precision = _shapes(q, cache, rank)
    tokens, num_heads, _ = q.shape
    out = q.new_empty(tokens, num_heads, rank)
    if tokens == 0 or max_query_len == 0:
        return out
    block_h = min(triton.next_power_of_2(num_heads), PREFILL_ROWS)
    block_q = PREFILL_ROWS // block_h
    grid = (triton.cdiv(max_query_len, block_q), seq_lens.shape[0], triton.cdiv(num_heads, block_h))
    _prefill_kernel[grid](
        q, cache, block_tables, query_start_loc, seq_lens, out,
        q.stride(0), q.stride(1), cache.stride(0), block_tables.stride(0), out.stride(0), out.stride(1),
        scale * LOG2E, NUM_HEADS=num_heads, RANK=rank, ROPE=q.shape[2] - rank, BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, BLOCK_H=block_h, BLOCK_C=block_c, BLOCK_R=block_r, BLOCK_N=block_n,
        DOT_PRECISION=precision, num_warps=warps,
    )
    return out
