"""SmolVLM's / Idefics3's vision tower: a SigLIP encoder over each tile's patches (Gemma 3's too:
hearth/model/vision/gemma3.py), then the connector
(pixel shuffle: scale_factor^2 neighbouring patches side by side in one row, then a linear projection
to the text model's width). Plain torch operations on every backend: it runs once per image.

Module names are the checkpoint's (model.vision_model.*, model.connector.*), so that the text model's
load_weights takes these tensors by name too.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hearth.vision_config import VisionConfig


class VisionEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size, config.patch_size)
        # from an empty weight: nn.Embedding's random init on the meta device imports torch._dynamo (seconds)
        self.position_embedding = nn.Embedding.from_pretrained(torch.empty(config.patches_per_side ** 2,
                                                                       config.hidden_size))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [tiles, 3, H, W] -> [tiles, patches, hidden]
        size = self.config.patch_size
        rows, cols = pixels.shape[2] // size, pixels.shape[3] // size
        # the strided convolution as a matmul over each patch's pixels [tiles, rows x cols, 3 x P x P]: cuBLAS
        # keeps float32 exact, cuDNN's convolutions round float32 to tf32 by default
        patches = pixels.unfold(2, size, size).unfold(3, size, size).permute(0, 2, 3, 1, 4, 5).reshape(
            len(pixels), rows * cols, -1)
        conv = self.patch_embedding
        embedded = F.linear(patches, conv.weight.flatten(1), conv.bias)
        return embedded + self.position_embedding(self.position_ids(rows, cols, pixels.device))

    def position_ids(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """The trained grid's position of each patch of a rows x cols tile: SigLIP's own (Gemma 3's images,
        always of the trained size) 0, 1, 2, ...; Idefics3's NaViT fractional coordinates, bucketed as
        transformers does (float rounding moves some buckets even at the trained size: 19 patches a side)."""
        if self.config.family == "gemma3":
            return torch.arange(rows * cols, device=device)
        side = self.config.patches_per_side
        boundaries = torch.arange(1 / side, 1.0, 1 / side, device=device)

        def buckets(n: int) -> torch.Tensor:
            fractions = torch.arange(n, device=device, dtype=torch.float32) * (1.0 / torch.tensor(n, device=device))
            return torch.bucketize(fractions.clamp(max=1.0 - 1e-6), boundaries, right=True)

        return (buckets(rows)[:, None] * side + buckets(cols)[None, :]).reshape(-1)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        width = config.hidden_size
        self.num_heads = config.num_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tiles, patches, hidden]: every patch sees its tile's
        tiles, patches, width = x.shape

        def heads(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(tiles, patches, self.num_heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj), heads(self.k_proj), heads(self.v_proj))
        return self.out_proj(out.transpose(1, 2).reshape(tiles, patches, width))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class EncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))


class VisionTransformer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.embeddings = VisionEmbeddings(config)
        self.encoder = Encoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [tiles, 3, H, W] -> [tiles, patches, hidden]
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class ModalityProjection(nn.Module):
    def __init__(self, config: VisionConfig, text_hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(config.hidden_size * config.scale_factor ** 2, text_hidden_size, bias=False)


class Connector(nn.Module):
    def __init__(self, config: VisionConfig, text_hidden_size: int):
        super().__init__()
        self.scale_factor = config.scale_factor
        self.modality_projection = ModalityProjection(config, text_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tiles, patches, hidden] -> [tiles, tokens, text hidden]
        return self.modality_projection.proj(pixel_shuffle(x, self.scale_factor))


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[tiles, side*side, d] -> [tiles, (side/scale)^2, d*scale^2]: each token the scale x scale block of
    patches at its place, in Idefics3's order (a row's scale neighbours, then the next row's)."""
    tiles, patches, dim = x.shape
    side = int(patches ** 0.5)
    x = x.reshape(tiles, side, side // scale, dim * scale).permute(0, 2, 1, 3)
    x = x.reshape(tiles, side // scale, side // scale, dim * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(tiles, patches // scale ** 2, dim * scale * scale)


class VisionTower(nn.Module):
    """Holds vision_model and connector under the checkpoint's names."""

    def __init__(self, config: VisionConfig, text_hidden_size: int):
        super().__init__()
        self.config = config
        self.vision_model = VisionTransformer(config)
        self.connector = Connector(config, text_hidden_size)

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [tiles, 3, H, W] -> [tiles * tokens, text hidden]
        weight = self.connector.modality_projection.proj.weight
        out = self.connector(self.vision_model(pixels.to(weight.device, weight.dtype)))
        return out.reshape(-1, out.shape[-1])

    def encode(self, pixel_values: np.ndarray, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """The processor's tiles (float32 [tiles, 3, H, W], hearth/image_processor.py) -> their embeddings
        (grid: a Qwen3-VL image's, QwenVisionTower.encode; the tiles' layout is their shape)."""
        return self(torch.from_numpy(pixel_values))
