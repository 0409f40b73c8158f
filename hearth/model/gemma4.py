"""Gemma 4's decoder layer and per-layer embeddings (transformers' Gemma4TextDecoderLayer and Gemma4TextModel).

A layer is gemma3's sandwich (norms before and after attention and the MLP) with Gemma 4's additions:
- attention (hearth/model/attention.py) with plain-weight q/k norms, v normed without a weight, scores
  unscaled (scale 1); full layers wider (their own head_dim and KV heads) and, with attention_k_eq_v, v
  taken from k's projection; the last num_kv_shared_layers reading an earlier layer's cache (kv_sources);
- the MLP twice as wide on those sharing layers with use_double_wide_mlp;
- with enable_moe_block, experts beside the MLP: a router over the stream before the MLP (RMS-normed without a
  weight, times a learned scale and hidden^-1/2; softmax, top k renormalised, times each chosen expert's scale),
  the experts on pre_feedforward_layernorm_2 of that stream, the MLP's and the experts' outputs each normed
  (post_feedforward_layernorm_1 / _2) and added before post_feedforward_layernorm;
- with per-layer embeddings (hidden_size_per_layer_input), the layer's slice of them gated into the stream:
  stream + norm(projection(act(gate(stream)) * per_layer_input));
- the whole stream times the layer's learned scalar at the end.
The stream leaves each layer whole (the other decoders hand on their last addition and the stream apart).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hearth.backend.base import Backend
from hearth.config import ModelConfig
from hearth.model.attention import Attention
from hearth.model.layers import ExpertMixture, GatedMLP, Linear, RMSNorm, rms_normalize


class Gemma4Router(nn.Module):
    """Each token's experts and their weights [T, k], from the stream x [T, hidden] before the MLP."""

    def __init__(self, config: ModelConfig, ops: Backend):
        super().__init__()
        self.eps, self.top_k = config.rms_norm_eps, config.num_experts_per_tok
        self.root = config.hidden_size ** -0.5
        self.proj = Linear(config.hidden_size, config.num_experts)
        self.scale = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.empty(config.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.proj(rms_normalize(x, self.eps) * self.scale * self.root)
        weights, chosen = torch.softmax(scores, dim=-1, dtype=torch.float32).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[chosen].float(), chosen


class Gemma4DecoderLayer(nn.Module):
    """One Gemma 4 layer (the module's docstring), under transformers' checkpoint names."""

    def __init__(self, config: ModelConfig, ops: Backend, index: int):
        super().__init__()
        self.ops = ops

        def norm(width: int = config.hidden_size) -> RMSNorm:
            return RMSNorm(width, config.rms_norm_eps, ops)

        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Attention(config, ops, index)
        wide = 2 if index in config.double_wide_mlp_layers else 1
        self.mlp = GatedMLP(config, ops, wide * config.intermediate_size)
        self.router = self.experts = None
        if config.num_experts:
            self.router, self.experts = Gemma4Router(config, ops), ExpertMixture(config, ops)
            self.pre_feedforward_layernorm_2 = norm()
            self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2 = norm(), norm()
        self.per_layer_input_gate = None
        if config.per_layer_input_size:
            self.per_layer_input_gate = Linear(config.hidden_size, config.per_layer_input_size)
            self.per_layer_projection = Linear(config.per_layer_input_size, config.hidden_size)
            self.post_per_layer_input_norm = norm()
            self.activation = self.mlp.activation  # the MLP's (transformers' act_fn)
        self.layer_scalar = nn.Parameter(torch.empty(1), requires_grad=False)

    def forward(self, x, residual, rotaries, kv_cache, meta, per_layer_input: torch.Tensor | None = None):
        """x: the stream (residual, None for gemma4's own layers, is added to it first); per_layer_input
        [T, per_layer_input_size]: this layer's. Returns (the stream after the layer, None)."""
        stream = x if residual is None else x + residual
        attention = self.self_attn
        h = attention(self.input_layernorm(stream), rotaries[attention.rope_index], kv_cache, meta)
        h, stream = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), stream)
        h = self.mlp(h)
        if self.experts is not None:
            routed = self.experts.mix(self.pre_feedforward_layernorm_2(stream), *self.router(stream))
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        stream = stream + self.post_feedforward_layernorm(h)
        if self.per_layer_input_gate is not None:
            gated = self.ops.act_and_mul(self.per_layer_input_gate(stream), per_layer_input, self.activation)
            stream = stream + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return stream * self.layer_scalar, None


class PerLayerInputs(nn.Module):
    """Gemma 4's per-layer embeddings [T, layers, width] of tokens [T] and their embeddings x [T, hidden]:
    (norm(projection(x) / sqrt(hidden)) + table(token) x sqrt(width)) / sqrt(2), per layer."""

    def __init__(self, config: ModelConfig, ops: Backend):
        super().__init__()
        self.layers, self.width, self.hidden = config.num_layers, config.per_layer_input_size, config.hidden_size
        # from an empty weight, as Transformer's own embeddings (nn.Embedding's init on the meta device is slow)
        self.embed_tokens_per_layer = nn.Embedding.from_pretrained(torch.empty(config.per_layer_vocab_size,
                                                                               self.layers * self.width))
        self.per_layer_model_projection = Linear(config.hidden_size, self.layers * self.width)
        self.per_layer_projection_norm = RMSNorm(self.width, config.rms_norm_eps, ops)

    def forward(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[0], self.layers, self.width)
        tokens = self.embed_tokens_per_layer(input_ids) * torch.tensor(math.sqrt(self.width), dtype=x.dtype)
        projected = self.per_layer_model_projection(x) * torch.tensor(self.hidden ** -0.5, dtype=x.dtype)
        return (self.per_layer_projection_norm(projected.view(shape)) + tokens.view(shape)) * 2 ** -0.5
