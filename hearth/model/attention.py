"""Paged attention: K/V written into cache slots, read back through block tables.

The KV cache of one layer is two tensors [num_slots, kv_heads, head_dim] (slot = block
id x block_size + offset). The runner turns each step's batch into AttentionMetadata once;
every layer uses it. Prefill chunks run SDPA per sequence over their gathered context with a
causal mask. Decodes on a CPU in float32 run cpu_kernels.cpp: K/V read in place through the
block tables, the context split (flash-decoding) when the sequences alone would leave threads
idle (docs/benchmarks.md, "Decode attention"); elsewhere one batched SDPA over padded gathers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hearth.model.layers import apply_rope, cpu_kernels

MIN_SPLIT_LEN = 256  # shorter splits cost more in merging and scheduling than they gain


@dataclass
class PrefillSequence:
    """A sequence with several new tokens this step (a prompt or a chunk of one)."""

    token_start: int  # first of its rows in the flattened batch
    token_end: int
    context_slots: torch.Tensor  # [context_len] cache slots of all its tokens so far, new ones included
    causal_mask: torch.Tensor  # [query_len, context_len] bool, True = may attend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V go
    prefills: list[PrefillSequence]
    decode_token_index: torch.Tensor  # [D] rows of the batch that are single-token decodes
    decode_block_tables: torch.Tensor  # [D, max_blocks] int32, padded with 0
    decode_context_lens: torch.Tensor  # [D] int32, new token included
    decode_max_len: int
    block_size: int

    @property
    def num_decodes(self) -> int:
        return self.decode_token_index.numel()

    @functools.cached_property
    def decode_slots_and_mask(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For the SDPA path: cache slots [D, L] (padded) and [D, 1, 1, L] True where real."""
        offsets = torch.arange(self.block_size, device=self.decode_block_tables.device)
        slots = (self.decode_block_tables.long()[:, :, None] * self.block_size + offsets).flatten(1)
        slots = slots[:, : self.decode_max_len]
        positions = torch.arange(self.decode_max_len, device=slots.device)
        return slots, (positions < self.decode_context_lens[:, None])[:, None, None, :]


def decode_split_len(num_decodes: int, num_kv_heads: int, max_len: int, threads: int) -> int:
    """Tokens per split: whole contexts when sequences x KV heads already give every thread work
    twice over, else as many splits as make up the difference, none shorter than MIN_SPLIT_LEN."""
    splits = -(-2 * threads // (num_decodes * num_kv_heads))
    return max(MIN_SPLIT_LEN, -(-max_len // splits))


def decode_attention(
    q: torch.Tensor,  # [D, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    split_len: int | None = None,  # None: decode_split_len's choice
) -> torch.Tensor:  # [D, heads, head_dim]
    kernel = cpu_kernels() if q.is_cpu and q.dtype == k_cache.dtype == torch.float32 else None
    if kernel is None:
        return decode_attention_sdpa(q, k_cache, v_cache, meta, scale)
    q = q.contiguous()
    num_decodes, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    threads = torch.get_num_threads()
    if split_len is None:
        split_len = decode_split_len(num_decodes, kv_heads, meta.decode_max_len, threads)
    out = torch.empty_like(q)
    tables, lens = meta.decode_block_tables, meta.decode_context_lens
    kernel.decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
        num_decodes, heads, kv_heads, head_dim, meta.block_size, tables.shape[1], scale, split_len, threads,
    )
    return out


def decode_attention_sdpa(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Decode attention in torch (any device, any dtype): one batched SDPA over padded gathers."""
    # [D, heads, 1, head_dim] against [D, kv_heads, L, head_dim]
    slots, mask = meta.decode_slots_and_mask
    keys = k_cache[slots].transpose(1, 2).to(q.dtype)
    values = v_cache[slots].transpose(1, 2).to(q.dtype)
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k_cache.shape[1]
    )
    return o.squeeze(2)


def rope_and_store_kv(
    q: torch.Tensor,  # [T, heads, head_dim], rows may be strided (views of a merged projection)
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor],  # RotaryEmbedding's (cos, sin), each [T, 1, head_dim / 2]
    kv_cache: tuple[torch.Tensor, torch.Tensor],  # each [num_slots, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64
) -> torch.Tensor:  # q rotated, [T, heads, head_dim]
    """RoPE on q and k; k and v written into their cache slots. On a CPU in float32 one kernel
    call does it all (k rotated straight into the cache); elsewhere torch's ops."""
    k_cache, v_cache = kv_cache
    cos, sin = rotary  # in q's dtype
    kernel = cpu_kernels() if q.is_cpu and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32 else None
    fits = (_heads_contiguous(q) and _heads_contiguous(k) and _heads_contiguous(v) and k_cache.is_contiguous()
            and v_cache.is_contiguous() and slot_mapping.dtype == torch.int64)
    if kernel is None or not fits:
        k_cache.index_copy_(0, slot_mapping, apply_rope(k, rotary).to(k_cache.dtype))
        v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
        return apply_rope(q, rotary)
    tokens, heads, head_dim = q.shape
    q_out = torch.empty(tokens, heads, head_dim)
    cos, sin = cos.contiguous(), sin.contiguous()
    kernel.rope_and_store_kv(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), v.stride(0), cos.data_ptr(),
        sin.data_ptr(), slot_mapping.data_ptr(), q_out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        tokens, heads, k.shape[1], head_dim, torch.get_num_threads(),
    )
    return q_out


def _heads_contiguous(x: torch.Tensor) -> bool:
    """[T, heads, head_dim] with each token's heads side by side (tokens may be strided)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim], rotated
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim], this step's K/V already stored
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, heads, head_dim]
    if not meta.prefills:  # decodes only (most steps): every row is a decode, in order
        return decode_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_cache.shape[1]
    for seq in meta.prefills:
        # [1, heads, query_len, head_dim] against [1, kv_heads, context_len, head_dim]
        query = q[seq.token_start : seq.token_end].transpose(0, 1).unsqueeze(0)
        keys = k_cache[seq.context_slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
        values = v_cache[seq.context_slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
        o = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=seq.causal_mask, scale=scale, enable_gqa=gqa
        )
        out[seq.token_start : seq.token_end] = o[0].transpose(0, 1)
    if meta.num_decodes:
        out[meta.decode_token_index] = decode_attention(q[meta.decode_token_index], k_cache, v_cache, meta, scale)
    return out
