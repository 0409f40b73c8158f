"""llama.cpp's "gemma4v" mmproj files: Gemma 4's vision tower (hearth/model/vision/gemma4.py) as
convert_hf_to_gguf.py's Gemma4VisionAudioModel writes it and clip.cpp reads it.

The file names less than config.json: the head size and key/value heads only where they are not clip.cpp's
defaults (clip.vision.attention.head_dim, .head_count_kv, which clip.cpp reads and the converter never writes:
heads of hidden / head_count, each with its own key and value), no rope theta (clip.cpp's 100), the pool as
clip.vision.projector.scale_factor only where it is not clip.cpp's 3, clip.vision.image_size a placeholder (224: each image keeps its aspect), the
position table's length and the standardisation by their tensors (v.position_embd [2, positions, hidden];
v.std_bias, v.std_scale). The patch projection is stored as a convolution's kernel [hidden, 3, patch, patch];
the checkpoint's [hidden, patch * patch * 3] has the channels innermost. Images: Gemma 4's processor (its
rescale, no normalisation where the file's mean and std are 0 and 1) with transformers' budget of 280 soft
tokens, lowered to the largest budget whose longest side the position table holds; llama.cpp sizes images its
own way (70 to 1120 tokens) and is not followed there. The text model's per-layer inputs take token 0's rows at
an image's place, and images attend both ways but on E2B's and E4B's widths (mtmd's rules).
"""

from __future__ import annotations

from typing import Any

import torch
from gguf import GGUFWriter, Keys, VisionProjectorType

from hearth.config import ModelConfig
from hearth.errors import ModelLoadError
from hearth.image_processor_gemma4 import SOFT_TOKENS, Gemma4ImageProcessor
from hearth.vision_config import Gemma4VisionConfig

_V = Keys.ClipVision
# clip.cpp's KEY_N_HEAD_KV and KEY_N_EMBD_HEAD (gguf-py's Keys.ClipVision.Attention.HEAD_COUNT_KV / HEAD_DIM, newer
# than the gguf release hearth pins)
HEAD_COUNT_KV, HEAD_DIM = "clip.vision.attention.head_count_kv", "clip.vision.attention.head_dim"
PROJECTOR = VisionProjectorType.GEMMA4V
IMAGE_TOKENS = (Gemma4ImageProcessor.image_token, Gemma4ImageProcessor.begin, Gemma4ImageProcessor.end)
PATCH, POSITIONS = "v.patch_embd.weight", "v.position_embd.weight"
IMAGE_SIZE = 224  # the converter's placeholder (clip.vision.image_size)
_ROPE_THETA, _POOL = 100.0, 3  # clip.cpp's for gemma4v
_CAUSAL_TEXT_WIDTHS = (1536, 2560)  # mtmd's: E2B and E4B decode their images causally
_BUDGET = 280  # transformers' Gemma4ImageProcessor default (max_soft_tokens)


def published_name(checkpoint: str) -> str:
    """A tower tensor's name as gguf-py's map knows it (the converter's renaming)."""
    name = checkpoint.replace("model.vision_tower.encoder.", "vision_model.model.").replace(".linear.weight", ".weight")
    return name + ".weight" if name.endswith("position_embedding_table") else name


def file_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A tensor's shape in the file, from the checkpoint's."""
    if name != PATCH:
        return shape
    patch = round((shape[1] // 3) ** 0.5)
    return shape[0], 3, patch, patch


def to_file(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The patch projection [hidden, patch * patch * 3] as the file's kernel [hidden, 3, patch, patch]."""
    if name != PATCH:
        return tensor
    hidden, _, patch, _ = file_shape(name, tuple(tensor.shape))
    return tensor.reshape(hidden, patch, patch, 3).permute(0, 3, 1, 2).contiguous()


def from_file(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.permute(0, 2, 3, 1).reshape(len(tensor), -1) if name == PATCH else tensor


def vision_config(md: dict[str, Any], shapes: dict[str, tuple[int, ...]], text: ModelConfig,
                  image_token_id: int) -> Gemma4VisionConfig:
    """The encoder's config from the file's keys and tensor shapes (torch order)."""
    def get(key: str) -> Any:
        if key not in md:
            raise ModelLoadError(f"missing metadata key {key}")
        return md[key]

    hidden, heads = get(_V.EMBEDDING_LENGTH), get(_V.Attention.HEAD_COUNT)
    if POSITIONS not in shapes or len(shapes[POSITIONS]) != 3:
        raise ModelLoadError(f"missing tensor {POSITIONS} [2, positions, hidden]")
    if HEAD_DIM not in md and (not isinstance(hidden, int) or not isinstance(heads, int) or heads < 1
                               or hidden % heads):
        raise ModelLoadError(f"{_V.EMBEDDING_LENGTH} {hidden!r} is not a multiple of {_V.Attention.HEAD_COUNT} "
                             f"{heads!r}, and no {HEAD_DIM} says the heads' size")
    return Gemma4VisionConfig(
        family="gemma4", hidden_size=hidden, intermediate_size=get(_V.FEED_FORWARD_LENGTH),
        num_layers=get(_V.BLOCK_COUNT), num_heads=heads, num_kv_heads=md.get(HEAD_COUNT_KV, heads),
        head_dim=md.get(HEAD_DIM, hidden // heads),
        patch_size=get(_V.PATCH_SIZE), pooling_kernel_size=md.get(_V.Projector.SCALE_FACTOR, _POOL),
        position_embedding_size=shapes[POSITIONS][1], image_token_id=image_token_id, pad_token_id=0,
        bidirectional=text.hidden_size not in _CAUSAL_TEXT_WIDTHS, standardize="v.std_bias" in shapes,
        rope_theta=_ROPE_THETA, rms_norm_eps=float(md.get(_V.Attention.LAYERNORM_EPS, 1e-6)))


def image_processor(md: dict[str, Any], vision: Gemma4VisionConfig) -> Gemma4ImageProcessor:
    mean, std = tuple(md.get(_V.IMAGE_MEAN, (0.0,) * 3)), tuple(md.get(_V.IMAGE_STD, (1.0,) * 3))
    budget = max([b for b in SOFT_TOKENS if b <= _BUDGET and b * vision.pooling_kernel_size
                  <= vision.position_embedding_size], default=SOFT_TOKENS[0])
    identity = mean == (0.0,) * 3 and std == (1.0,) * 3
    return Gemma4ImageProcessor(vision, budget, *(() if identity else (mean, std)))


def add_metadata(writer: GGUFWriter, vision: Gemma4VisionConfig, processor: Gemma4ImageProcessor, where: str) -> None:
    """The converter's keys but the encoder's sizes (mmproj.write_mmproj's), and the heads' where they are not
    clip.cpp's defaults; ModelLoadError for an encoder the file cannot hold (clip.cpp would run another)."""
    if vision.rope_theta != _ROPE_THETA:
        raise ModelLoadError(f"{where}: a Gemma 4 vision tower with rope_theta {vision.rope_theta}: llama.cpp's gemma4v "
                             f"file holds no rope theta (clip.cpp turns its heads at {_ROPE_THETA})")
    normalised = processor.std is not None
    writer.add_vision_image_mean(processor.mean.tolist() if normalised else [0.0] * 3)
    writer.add_vision_image_std(processor.std.tolist() if normalised else [1.0] * 3)
    writer.add_clip_vision_projector_type(PROJECTOR)
    writer.add_vision_attention_layernorm_eps(vision.rms_norm_eps)
    if vision.pooling_kernel_size != _POOL:
        writer.add_vision_projector_scale_factor(vision.pooling_kernel_size)
    if vision.num_kv_heads != vision.num_heads:
        writer.add_uint32(HEAD_COUNT_KV, vision.num_kv_heads)
    if vision.head_dim * vision.num_heads != vision.hidden_size:
        writer.add_uint32(HEAD_DIM, vision.head_dim)
