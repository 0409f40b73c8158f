"""Gemma 4's vision tower (transformers' Gemma4VisionModel and Gemma4MultimodalEmbedder): an image's patches
(at its own aspect, hearth/image_processor_gemma4.py) mapped from [0, 1] to [-1, 1] and projected, plus a
learned embedding of each patch's column and of its row; layers with Gemma's sandwich of RMSNorms (x w, no
offset) around attention and a gated MLP; in attention q and k RMS-normed per head (with weights), v without,
scores unscaled, every patch seeing every other, and 2-D RoPE: the first half of each head rotated by the
patch's column, the second by its row. Then the patches average-pooled k x k into the image's soft tokens,
times sqrt(hidden), standardised where the config says (std_bias, std_scale), RMS-normed without a weight and
projected to the text model's width (embed_vision). Plain torch operations on every backend: it runs once per
image.

Module names are the checkpoint's (model.vision_tower.*, model.embed_vision.*; each linear's weight under
.linear, Gemma4ClippableLinear's).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hearth.model.layers import rms_normalize
from hearth.vision_config import Gemma4VisionConfig


def _weight(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ClippableLinear(nn.Module):
    """A linear map without bias whose weight sits one level down (transformers' Gemma4ClippableLinear without
    clipping: configs with use_clipped_linears are refused)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Norm(nn.Module):
    """Gemma 4's RMSNorm: x / sqrt(mean(x^2) + eps) times its weight, in float32."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, _weight(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x.float(), self.eps) * self.weight.float()).to(x.dtype)


class PatchEmbedder(nn.Module):
    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        self.input_proj = nn.Linear(3 * config.patch_size ** 2, config.hidden_size, bias=False)
        # [2, positions, hidden]: a column's embedding, then a row's
        self.position_embedding_table = _weight(2, config.position_embedding_size, config.hidden_size)

    def forward(self, patches: torch.Tensor, columns: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """patches [n, 3 * patch^2] in [0, 1], each one's column and row [n] -> [n, hidden]."""
        table = self.position_embedding_table
        return self.input_proj(2 * (patches - 0.5)) + (table[0][columns] + table[1][rows])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head_dim]: each half rotated rotate-half style by its own angles (cos, sin [n, head_dim],
    each half [a, a] of the column's or the row's angles a)."""
    parts = []
    for half, c, s in zip(x.chunk(2, dim=-1), cos.chunk(2, dim=-1), sin.chunk(2, dim=-1)):
        a, b = half.chunk(2, dim=-1)
        parts.append(half * c[:, None] + torch.cat((-b, a), dim=-1) * s[:, None])
    return torch.cat(parts, dim=-1)


class Attention(nn.Module):
    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        width, heads, kv_heads, head_dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, config.rms_norm_eps
        self.q_proj, self.o_proj = ClippableLinear(width, heads * head_dim), ClippableLinear(heads * head_dim, width)
        self.k_proj = ClippableLinear(width, kv_heads * head_dim)
        self.v_proj = ClippableLinear(width, kv_heads * head_dim)
        self.q_norm, self.k_norm = Norm(head_dim, config.rms_norm_eps), Norm(head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [n, hidden]
        n = len(x)
        q = _rotate(self.q_norm(self.q_proj(x).view(n, self.heads, -1)), cos, sin)
        k = _rotate(self.k_norm(self.k_proj(x).view(n, self.kv_heads, -1)), cos, sin)
        v = rms_normalize(self.v_proj(x).view(n, self.kv_heads, -1), self.eps)
        # (a batch of one: torch's fused CPU kernel takes 4-D inputs, 3-D ones run its math path, ~3x slower)
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, n, head_dim]
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0, enable_gqa=self.heads != self.kv_heads)[0]
        return self.o_proj(out.transpose(0, 1).reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        width, inner = config.hidden_size, config.intermediate_size
        self.gate_proj, self.up_proj = ClippableLinear(width, inner), ClippableLinear(width, inner)
        self.down_proj = ClippableLinear(inner, width)
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate=self.approximate) * self.up_proj(x))


class EncoderLayer(nn.Module):
    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        width, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn, self.mlp = Attention(config), MLP(config)
        self.input_layernorm, self.post_attention_layernorm = Norm(width, eps), Norm(width, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = Norm(width, eps), Norm(width, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Encoder(nn.Module):
    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))


class VisionModel(nn.Module):
    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embedder, self.encoder = PatchEmbedder(config), Encoder(config)
        if config.standardize:
            self.std_bias, self.std_scale = _weight(config.hidden_size), _weight(config.hidden_size)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [rows, cols, 3 * patch^2] -> soft tokens [rows / k * cols / k, hidden] (float32)."""
        rows, cols, _ = patches.shape
        row = torch.arange(rows, device=patches.device).repeat_interleave(cols)
        column = torch.arange(cols, device=patches.device).repeat(rows)
        x = self.patch_embedder(patches.reshape(rows * cols, -1), column, row)
        quarter = self.config.head_dim // 4  # the column's frequencies, then the row's, each over half a head
        inv_freq = 1.0 / self.config.rope_theta ** (torch.arange(quarter, device=patches.device) / quarter)
        angles = [p[:, None].float() * inv_freq for p in (column, row)]
        cos = torch.cat([a.cos() for a in angles for _ in range(2)], dim=-1).to(x.dtype)
        sin = torch.cat([a.sin() for a in angles for _ in range(2)], dim=-1).to(x.dtype)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin)
        k = self.config.pooling_kernel_size
        pooled = F.avg_pool2d(x.float().T.reshape(1, -1, rows, cols), k).flatten(2)[0].T  # row-major tokens
        pooled = pooled * self.config.hidden_size ** 0.5
        if self.config.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return pooled


class MultimodalEmbedder(nn.Module):
    def __init__(self, config: Gemma4VisionConfig, text_hidden_size: int):
        super().__init__()
        self.eps = config.rms_norm_eps
        self.embedding_projection = nn.Linear(config.hidden_size, text_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(rms_normalize(x, self.eps))


class Gemma4VisionTower(nn.Module):
    """Holds vision_tower and embed_vision under the checkpoint's names."""

    def __init__(self, config: Gemma4VisionConfig, text_hidden_size: int):
        super().__init__()
        self.config = config
        self.vision_tower = VisionModel(config)
        self.embed_vision = MultimodalEmbedder(config, text_hidden_size)

    @torch.inference_mode()
    def encode(self, pixel_values: np.ndarray, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """The processor's patches (float32 [rows, cols, 3 * patch^2], hearth/image_processor_gemma4.py) -> the
        image's soft tokens [tokens, text hidden] (grid: unused, the patches' shape says it)."""
        weight = self.embed_vision.embedding_projection.weight
        patches = torch.from_numpy(pixel_values).to(weight.device, weight.dtype)
        return self.embed_vision(self.vision_tower(patches).to(weight.dtype))
