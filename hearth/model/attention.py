"""Attention of the one decoder (hearth/model/transformer.py): q, k and v projected (and normed, gated, rotated)
as each family has them, K and V written into the layer's cache, the backend's attention over the context."""

from __future__ import annotations

import torch
from torch import nn

from hearth.backend.base import Backend
from hearth.config import ModelConfig
from hearth.model.layers import Linear, MergedLinear, RMSNorm, partial_rotary_order, rms_normalize


class Attention(nn.Module):
    """q, k and v projected from the layer's input; a layer that shares K/V (gemma4's last layers,
    ModelConfig.kv_sources) projects q alone and attends over its source layer's cache, which that layer wrote
    earlier in the same pass; a layer of ModelConfig.k_eq_v_layers takes v from k's projection (no v_proj)."""

    def __init__(self, config: ModelConfig, ops: Backend, index: int):
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.kv_heads_of(index), config.head_dim_of(index)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # qwen3_5: q_proj makes each head's query and then its output gate
        self.output_gate = config.attention_output_gate
        self.shares_kv = config.kv_source(index) != index
        parts = {"q_proj": q_size * (1 + self.output_gate)}
        if not self.shares_kv:
            parts |= {"k_proj": kv_size} | ({} if index in config.k_eq_v_layers else {"v_proj": kv_size})
        self.qkv_proj = MergedLinear(config.hidden_size, parts, config.attention_bias)
        # partial RoPE: q's and k's dimensions reordered so that the backends' rotate-half over the whole
        # head rotates the right pairs (RotaryEmbedding's frequencies are 0 past the rotated share)
        self.register_buffer("rope_order", partial_rotary_order(config), persistent=False)
        # attention_bias puts a bias on o_proj too, except in qwen2 (transformers' definitions)
        o_bias = config.attention_bias and config.architecture not in ("qwen2", "qwen2_moe")
        self.o_proj = Linear(q_size, config.hidden_size, o_bias)
        self.qk_norm = config.qk_norm
        if self.qk_norm:  # over each head, or over the whole projection (k's: none where K/V are shared)
            per_head = self.qk_norm == "head"
            offset = config.norm_weight_offset
            self.q_norm = RMSNorm(self.head_dim if per_head else q_size, config.rms_norm_eps, ops, offset)
            if not self.shares_kv:
                self.k_norm = RMSNorm(self.head_dim if per_head else kv_size, config.rms_norm_eps, ops, offset)
        self.value_norm_eps = config.rms_norm_eps if config.value_norm else None  # gemma4: v normed, no weight
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.softcap = config.attn_logit_softcapping
        self.window = config.sliding_window if config.is_sliding_layer(index) else None
        self.sinks = None  # gpt_oss: [heads], a logit per head in each softmax's denominator
        if config.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        # which of Transformer.ropes rotates q and k: the model's, gemma3's sliding layers' own, or none
        # (smollm3's NoPE layers: the identity rotation, so that every backend's RoPE + cache write serves)
        if index in config.no_rope_layers:
            self.rope_index = 2
        else:
            self.rope_index = int(config.local_rope_theta is not None and config.is_sliding_layer(index))

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rotary,  # RotaryEmbedding's output for the tokens' positions
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # each [num_slots, kv_heads, head_dim]
        meta,  # the backend's attention metadata
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, gate = self.store_kv(x, rotary, kv_cache, meta.slot_mapping)
        out = self.ops.attention(q, kv_cache[0], kv_cache[1], meta, self.scale, self.softcap, self.window, self.sinks)
        out = out.reshape(tokens, -1)
        return self.o_proj(out * torch.sigmoid(gate.reshape(tokens, -1)) if self.output_gate else out)

    def store_kv(self, x: torch.Tensor, rotary, kv_cache: tuple[torch.Tensor, torch.Tensor],
                 slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The projections of x [T, hidden]: K and V (normed and rotated as the model does) written
        to the cache at slot_mapping [T] (none where the layer shares an earlier layer's); returns the
        rotated queries [T, heads, head_dim] and the output gate (qwen3_5; else None)."""
        tokens, gate = x.shape[0], None
        q, *kv = self.qkv_proj(x)  # kv: k and v, k alone (v is k's projection), or none (K/V shared)
        if self.output_gate:
            q, gate = q.view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q = q.reshape(tokens, -1)
        if self.qk_norm == "all":
            q, kv[0] = self.q_norm(q), self.k_norm(kv[0])
        q = q.view(tokens, self.num_heads, self.head_dim)
        if self.qk_norm == "head":
            q = self.q_norm(q)
        if self.rope_order is not None:
            q = q[..., self.rope_order]
        if self.shares_kv:  # the source layer's K/V of these tokens are in the cache already
            return self.ops.rope(q, rotary), gate
        return self._rope_and_store_kv(q, kv[0], kv[-1], rotary, kv_cache, slot_mapping), gate

    def _rope_and_store_kv(self, q, k, v, rotary, kv_cache, slot_mapping: torch.Tensor) -> torch.Tensor:
        """k [T, kv_heads x head_dim] normed and rotated and v (normed where the family does) into the cache;
        q [T, heads, head_dim] rotated."""
        tokens = q.shape[0]
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            k = self.k_norm(k)
        if self.value_norm_eps is not None:
            v = rms_normalize(v, self.value_norm_eps)
        if self.rope_order is not None:
            k = k[..., self.rope_order]
        return self.ops.rope_and_store_kv(q, k, v, rotary, kv_cache, slot_mapping)
