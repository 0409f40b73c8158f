"""Paged attention: K/V written into cache slots, read back through block tables.

The KV cache of one layer is two tensors [num_slots, kv_heads, head_dim] (slot = block
id x block_size + offset). The runner turns each step's batch into AttentionMetadata once;
every layer uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    decode_slots: torch.Tensor  # [D, L] cache slots to read (padded)
    decode_mask: torch.Tensor  # [D, 1, 1, L] bool, True = a real slot

    @property
    def num_decodes(self) -> int:
        return self.decode_token_index.numel()


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, heads, head_dim]
    k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
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
        # [D, heads, 1, head_dim] against [D, kv_heads, L, head_dim]
        query = q[meta.decode_token_index].unsqueeze(2)
        keys = k_cache[meta.decode_slots].transpose(1, 2).to(q.dtype)
        values = v_cache[meta.decode_slots].transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa
        )
        out[meta.decode_token_index] = o.squeeze(2)
    return out
