"""Qwen3-VL's vision tower: a ViT over an image's patches at their own resolution (a learned square table
of positions resampled to the image's grid, 2-D rotary positions in attention), the patches merged
merge x merge into text-model rows (the merger), and the deepstack mergers' rows from chosen encoder
layers, which the text model adds to its first layers' outputs (Transformer.forward's wide embeddings).
Plain torch operations on every backend: it runs once per image.

Module names are the checkpoint's (model.visual.*), so that the text model's load_weights takes these
tensors by name too.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hearth.vision_config import QwenVisionConfig


class PatchEmbed(nn.Module):
    def __init__(self, config: QwenVisionConfig):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.num_channels, config.hidden_size, kernel, kernel)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # [n, C * T * P * P] -> [n, hidden]
        # the convolution over one patch is a matmul: cuBLAS keeps float32 exact, cuDNN's convolutions round
        # float32 to tf32 by default (torch.backends.cudnn.allow_tf32)
        return F.linear(patches.reshape(len(patches), -1), self.proj.weight.flatten(1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, config: QwenVisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [n, hidden]: one image's patches, every one seeing every other; cos, sin [n, head_dim]."""
        q, k, v = self.qkv(x).view(len(x), 3, self.num_heads, -1).unbind(1)  # each [n, heads, head_dim]
        q, k = (_rotate(t, cos, sin).transpose(0, 1) for t in (q, k))
        # (a batch of one: torch's fused CPU kernel takes 4-D inputs, 3-D ones run its math path, ~3x slower)
        out = F.scaled_dot_product_attention(q[None], k[None], v.transpose(0, 1)[None])[0]  # [heads, n, head_dim]
        return self.proj(out.transpose(0, 1).reshape(len(x), -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [n, heads, head_dim] (in float32, as transformers)."""
    half = x.shape[-1] // 2
    x32 = x.float()
    turned = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos[:, None] + turned * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, config: QwenVisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, config: QwenVisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge x merge neighbouring patches (consecutive in the encoder's order) -> one text-model row: a
    LayerNorm (over each patch, or over the merged row: the deepstack mergers'), then a GELU MLP."""

    def __init__(self, config: QwenVisionConfig, norm_after_merge: bool):
        super().__init__()
        width = config.hidden_size * config.merge ** 2
        self.norm_after_merge = norm_after_merge
        self.norm = nn.LayerNorm(width if norm_after_merge else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(width, width)
        self.linear_fc2 = nn.Linear(width, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n / merge^2, out_hidden]
        width = self.linear_fc1.in_features
        x = self.norm(x.reshape(-1, width)) if self.norm_after_merge else self.norm(x).reshape(-1, width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionModel(nn.Module):
    def __init__(self, config: QwenVisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_layers))
        self.merger = PatchMerger(config, norm_after_merge=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(config, norm_after_merge=True)
                                                   for _ in config.deepstack_layers)
        head_dim = config.hidden_size // config.num_heads
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float32, device="cpu") / (head_dim // 2)
        self.register_buffer("inv_freq", 1.0 / config.rope_theta ** quarter, persistent=False)  # [head_dim / 4]

    def forward(self, patches: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """One image's patches [rows * cols, C * T * P * P] in the processor's order (merge blocks row by row,
        each block's patches row by row) -> its text-model rows [n / merge^2, (1 + deepstack) * out_hidden]:
        the merger's, then each deepstack merger's."""
        order = _block_order(rows, cols, self.config.merge, patches.device)  # [n, 2]: each patch's (row, column)
        x = self.patch_embed(patches) + self._positions(order, rows, cols)
        angles = (order[:, :, None].float() * self.inv_freq).flatten(1)  # [n, head_dim / 2]: height's, then width's
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin)
            if index in self.config.deepstack_layers:
                deepstack.append(self.deepstack_merger_list[self.config.deepstack_layers.index(index)](x))
        return torch.cat([self.merger(x), *deepstack], dim=-1)

    def _positions(self, order: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """The learned square table resampled to the rows x cols grid (bilinear, corners aligned: transformers'
        fast_pos_embed_interpolate), each patch's [n, hidden]."""
        side = int(round(self.config.num_position_embeddings ** 0.5))
        h = torch.linspace(0, side - 1, rows, device=order.device)[order[:, 0]]
        w = torch.linspace(0, side - 1, cols, device=order.device)[order[:, 1]]
        h0, w0 = h.int(), w.int()
        h1, w1 = (h0 + 1).clamp(max=side - 1), (w0 + 1).clamp(max=side - 1)
        dh, dw = (h - h0)[:, None], (w - w0)[:, None]
        table = self.pos_embed
        return ((1 - dh) * (1 - dw) * table(h0 * side + w0) + (1 - dh) * dw * table(h0 * side + w1)
                + dh * (1 - dw) * table(h1 * side + w0) + dh * dw * table(h1 * side + w1))


def _block_order(rows: int, cols: int, merge: int, device: torch.device) -> torch.Tensor:
    """The (row, column) of each patch in the processor's order: merge x merge blocks row by row, each
    block's patches row by row. int64 [rows * cols, 2]."""
    r = torch.arange(rows, device=device).view(rows // merge, 1, merge, 1).expand(-1, cols // merge, -1, merge)
    c = torch.arange(cols, device=device).view(1, cols // merge, 1, merge).expand(rows // merge, -1, merge, -1)
    return torch.stack((r.reshape(-1), c.reshape(-1)), dim=1)


class QwenVisionTower(nn.Module):
    """Holds the encoder under the checkpoint's name (visual)."""

    def __init__(self, config: QwenVisionConfig, text_hidden_size: int):
        super().__init__()
        self.config = config
        self.visual = VisionModel(config)

    @torch.inference_mode()
    def encode(self, pixel_values: np.ndarray, grid: tuple[int, int]) -> torch.Tensor:
        """The processor's patches (float32 [n, C * T * P * P], hearth/image_processor_qwen.py) of an image of
        grid (rows, cols) text-model rows -> its rows [rows * cols, (1 + deepstack) * text hidden]."""
        weight = self.visual.patch_embed.proj.weight
        merge = self.config.merge
        patches = torch.from_numpy(pixel_values).to(weight.device, weight.dtype)
        return self.visual(patches, grid[0] * merge, grid[1] * merge)
