"""Multi-head latent attention (DeepSeek-V2): the KV cache holds one compressed latent per token.

Per token, kv_a_proj_with_mqa makes a latent c (kv_lora_rank wide, normed by kv_a_layernorm) and
a rotated key part k_pe (qk_rope_head_dim) that every head shares; kv_b_proj would expand c into
each head's k_nope and v. The cache keeps [c, k_pe] only: for DeepSeek-V2-Lite 512 + 64 = 576
values per token and layer, where per-head K and V would take 16 x (192 + 128) = 5,120.

Attention runs on the latent with kv_b_proj absorbed (W_UK, W_UV: its rows for k_nope and for v):
q_nope . (W_UK c) = (q_nope W_UK) . c, so each head's query becomes [q_nope W_UK, q_pe] and scores
against the cached [c, k_pe] as multi-query attention with one KV head, keys kv_lora_rank +
qk_rope_head_dim wide and values the c part (a view of the same cache); the weighted sum of c is
projected to the head's v by W_UV. The backend's paged attention does this (the gpu backend's with
kernels of their own: hearth/triton_kernels/latent_attention.py), so chunked prefill, prefix caching
and preemption work as for every other model. Prompts take the same path:
it costs (kv_lora_rank + rope + kv_lora_rank) / (qk_head_dim + v_head_dim) = 3.4x the score and
sum multiply-adds of per-head K/V for Lite's shape, but never expands the context through kv_b_proj
(kv_lora_rank x heads x 256 multiply-adds per context token per chunk); at Lite's size the
difference is under 1% of a token's compute up to a few thousand tokens of context.
"""

from __future__ import annotations

import torch
from torch import nn

from hearth.backend.base import Backend
from hearth.config import ModelConfig
from hearth.model.layers import Linear, RMSNorm, yarn_mscale

# transformers' and DeepSeek's kv_a_layernorm and q_a_layernorm keep RMSNorm's default epsilon, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


class DenseWeight(nn.Module):
    """A weight the model uses as a tensor rather than through a matmul module (loaded dense, whatever
    the checkpoint's storage format)."""

    def __init__(self, rows: int, columns: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, columns), requires_grad=False)


class LatentAttention(nn.Module):
    def __init__(self, config: ModelConfig, ops: Backend, index: int):
        super().__init__()
        self.ops = ops
        self.num_heads, self.rank = config.num_heads, config.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.head_dim, config.v_head_dim
        heads, hidden = self.num_heads, config.hidden_size
        q_size = heads * (self.nope_dim + self.rope_dim)
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank:  # DeepSeek-V2's query through a normed low rank (Lite has none)
            self.q_a_proj = Linear(hidden, self.q_lora_rank, config.attention_bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, ops)
            self.q_b_proj = Linear(self.q_lora_rank, q_size)
        else:
            self.q_proj = Linear(hidden, q_size)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope_dim, config.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, ops)
        self.kv_b_proj = DenseWeight(heads * (self.nope_dim + self.v_dim), self.rank)  # used absorbed, per head
        self.o_proj = Linear(heads * self.v_dim, hidden, config.attention_bias)
        self.scale = (self.nope_dim + self.rope_dim) ** -0.5
        scaling = config.rope_scaling or {}
        if scaling.get("mscale_all_dim"):  # YaRN's temperature on the whole score (transformers' deepseek_v2)
            self.scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
        self.rope_index = 0  # Transformer.ropes[0]: the model's RoPE, over the rotated part only

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rotary,  # RotaryEmbedding's output for the tokens' positions
        kv_cache: tuple[torch.Tensor],  # ([num_slots, 1, kv_lora_rank + rope_dim],): latent, then k_pe
        meta,  # the backend's attention metadata
    ) -> torch.Tensor:
        tokens, heads = x.shape[0], self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q_nope, q_pe = q.view(tokens, heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        cache = kv_cache[0]
        latent_cache, k_pe_cache = cache[..., : self.rank], cache[..., self.rank :]  # views of one tensor
        q_pe = self.ops.rope_and_store_kv(_halves(q_pe), _halves(k_pe.unsqueeze(1)), latent.unsqueeze(1), rotary,
                                          (k_pe_cache, latent_cache), meta.slot_mapping)
        w_uk, w_uv = self.kv_b_proj.weight.view(heads, self.nope_dim + self.v_dim, self.rank).split(
            [self.nope_dim, self.v_dim], dim=1)  # [heads, nope, rank], [heads, v, rank]
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # q_nope absorbed through W_UK
        query = torch.cat([q_latent, q_pe], dim=-1)  # [T, heads, rank + rope_dim]
        out = self.ops.attention(query, cache, latent_cache, meta, self.scale)  # [T, heads, rank]
        out = torch.einsum("thr,hvr->thv", out, w_uv)  # the weighted latents through W_UV: each head's v
        return self.o_proj(out.reshape(tokens, -1))


def _halves(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek rotates adjacent pairs (x0, x1), (x2, x3), ...; the backends' RoPE rotates the halves
    (x_i, x_{i + d/2}). Taking the even dimensions, then the odd ones, turns the one into the other:
    q_pe and k_pe reordered alike keep their dot products. [..., d] -> [..., d] contiguous."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
