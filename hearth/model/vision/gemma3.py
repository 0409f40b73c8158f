"""Gemma 3's vision tower: SigLIP's encoder over the whole image at the size it was trained on (patch
embedding, a learned position per patch, pre-norm layers with a gelu-tanh MLP, a final LayerNorm:
hearth/model/vision/siglip.py's VisionTransformer), then the multi-modal projector: the patches' grid
average-pooled to mm_tokens_per_image, each pooled row normed (Gemma's RMSNorm, weights stored as w - 1)
and projected to the text model's width. Plain torch operations on every backend: it runs once per image.

Module names are the checkpoint's as transformers 5 saves them (model.vision_tower.*,
model.multi_modal_projector.*; hearth/loading/names.py reads the published checkpoints' older names,
vision_tower.vision_model.*, as these).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hearth.backend.base import Backend
from hearth.model.layers import RMSNorm
from hearth.model.vision.siglip import VisionTransformer
from hearth.vision_config import VisionConfig


class MultiModalProjector(nn.Module):
    def __init__(self, config: VisionConfig, text_hidden_size: int):
        super().__init__()
        self.config = config
        # [vision hidden, text hidden]: applied as x @ W (transformers' layout, no transpose)
        self.mm_input_projection_weight = nn.Parameter(torch.empty(config.hidden_size, text_hidden_size),
                                                       requires_grad=False)
        # the reference backend's norm: plain torch, in float32 with (1 + w), as transformers' Gemma3RMSNorm
        self.mm_soft_emb_norm = RMSNorm(config.hidden_size, config.layer_norm_eps, Backend(), weight_offset=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [images, patches, hidden] -> [images, tokens, text hidden]
        images, _, hidden = x.shape
        side = self.config.patches_per_side
        grid = x.transpose(1, 2).reshape(images, hidden, side, side)
        pooled = F.avg_pool2d(grid, self.config.scale_factor).flatten(2).transpose(1, 2)
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


class GemmaVisionTower(nn.Module):
    """Holds vision_tower and multi_modal_projector under the checkpoint's names."""

    def __init__(self, config: VisionConfig, text_hidden_size: int):
        super().__init__()
        self.config = config
        self.vision_tower = VisionTransformer(config)
        self.multi_modal_projector = MultiModalProjector(config, text_hidden_size)

    @torch.inference_mode()
    def encode(self, pixel_values: np.ndarray, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """The processor's image (float32 [1, 3, image_size, image_size], hearth/image_processor_gemma.py) ->
        its mm_tokens_per_image rows [tokens, text hidden] (grid: unused, one size for every image)."""
        weight = self.multi_modal_projector.mm_input_projection_weight
        pixels = torch.from_numpy(pixel_values).to(weight.device, weight.dtype)
        out = self.multi_modal_projector(self.vision_tower(pixels))
        return out.reshape(-1, out.shape[-1])
