"""llama.cpp's "qwen3vl_merger" mmproj files: Qwen3-VL's and Qwen3.5's vision tower (hearth/model/vision/qwen3_vl.py)
as convert_hf_to_gguf.py's Qwen3VLVisionModel writes it and clip.cpp reads it.

The file's names: the ViT's blocks by gguf-py's MMPROJ map (v.blk.N.attn_qkv, ffn_up, ln1, ...), the merger's
norm as v.post_ln and its two layers as mm.0 and mm.2, each deepstack merger as v.deepstack.L.{norm,fc1,fc2} with L
the encoder layer it reads (clip.vision.is_deepstack_layers marks those layers), the patch projection (a Conv3d over
two frames) as two kernels, one a frame: v.patch_embd.weight and v.patch_embd.weight.1 [hidden, 3, patch, patch].
The file names no rope theta (clip.cpp's 10000), no activation but clip.use_gelu (the tanh GELU) and as
clip.vision.attention.layer_norm_epsilon the text model's rms_norm_eps (the converter's); hearth's encoder keeps
transformers' 1e-6. Images: Qwen's processor with the file's mean and std, the area between clip.cpp's 8 and 4096
tokens (its limits for Qwen-VL) unless the file names clip.vision.image_min_pixels / image_max_pixels. Videos (the
file holds no video settings: llama.cpp reads none): transformers' Qwen3VLVideoProcessor's defaults, the settings
of the published Qwen3-VL and Qwen3.5 folders (2 frames a second, 4 to 768 of them, a video's frames within 128
to 768 tokens' pixels), normalised with the file's image mean and std, where the text model has <|video_pad|>.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from gguf import MODEL_ARCH, GGUFWriter, Keys, VisionProjectorType, get_tensor_name_map

from hearth.config import ModelConfig
from hearth.errors import ModelLoadError
from hearth.image_processor_qwen import QwenImageProcessor
from hearth.tokenizer import Tokenizer
from hearth.video_processor_qwen import QwenVideoProcessor
from hearth.vision_config import QwenVisionConfig

_V = Keys.ClipVision
PROJECTOR = VisionProjectorType.QWEN3VL
IMAGE_TOKENS = (QwenImageProcessor.image_token, "<|vision_start|>", "<|vision_end|>")
PATCH, PATCH_1, POSITIONS = "v.patch_embd.weight", "v.patch_embd.weight.1", "v.position_embd.weight"
_PATCH_CHECKPOINT = "model.visual.patch_embed.proj.weight"
_TOKEN_LIMITS = (8, 4096)  # clip.cpp's for Qwen-VL: an image's fewest and most tokens
_ROPE_THETA = 10000.0  # clip.cpp's
_MERGER = {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}
_DEEPSTACK = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}


def gguf_names(vision: QwenVisionConfig, checkpoint: str) -> tuple[str, ...]:
    """The file's names of a tower tensor (hearth's checkpoint name): two for the patch projection (a kernel a
    frame), one for the others; ModelLoadError where the converter names none."""
    parts = checkpoint.split(".")
    if checkpoint == _PATCH_CHECKPOINT:
        return PATCH, PATCH_1
    if parts[2] == "merger":
        return (f"{_MERGER[parts[3]]}.{parts[4]}",)
    if parts[2] == "deepstack_merger_list":
        return (f"v.deepstack.{vision.deepstack_layers[int(parts[3])]}.{_DEEPSTACK[parts[4]]}.{parts[5]}",)
    name = get_tensor_name_map(MODEL_ARCH.MMPROJ, vision.num_layers).get_name(checkpoint.removeprefix("model."),
                                                                              try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ModelLoadError(f"tensor {checkpoint}: gguf-py has no mmproj name for it")
    return (name,)


def file_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A tensor's shape in the file (torch order), from the checkpoint's: the Conv3d [hidden, 3, 2, patch, patch]
    one frame's kernel [hidden, 3, patch, patch]."""
    return (shape[0], shape[1], *shape[3:]) if name in (PATCH, PATCH_1) else shape


def to_file(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The tensor the file stores under `name`: the patch projection's kernel of frame 0 or 1."""
    return tensor[:, :, int(name == PATCH_1)].contiguous() if name in (PATCH, PATCH_1) else tensor


def from_file(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The file's tensors by llama.cpp's name with the two frames' kernels one Conv3d kernel again (PATCH)."""
    frames = torch.stack((tensors[PATCH], tensors[PATCH_1]), dim=2)
    return {**{name: t for name, t in tensors.items() if name != PATCH_1}, PATCH: frames}


def vision_config(md: dict[str, Any], shapes: dict[str, tuple[int, ...]], text: ModelConfig,
                  image_token_id: int) -> QwenVisionConfig:
    """The encoder's config from the file's keys and tensor shapes (torch order); a Qwen3.5 text model's
    encoder has no deepstack."""
    def get(key: str) -> Any:
        if key not in md:
            raise ModelLoadError(f"missing metadata key {key}")
        return md[key]

    if md.get(_V.USE_GELU) is not True:
        raise ModelLoadError(f"{_V.USE_GELU} is not true: hearth's Qwen3-VL encoder runs GELU")
    if POSITIONS not in shapes or len(shapes[POSITIONS]) != 2:
        raise ModelLoadError(f"missing tensor {POSITIONS} [positions, hidden]")
    layers = get(_V.BLOCK_COUNT)
    deepstack = md.get(_V.IS_DEEPSTACK_LAYERS) or []
    if not isinstance(deepstack, list) or len(deepstack) not in (0, layers):
        raise ModelLoadError(f"{_V.IS_DEEPSTACK_LAYERS} = {deepstack!r}: expected one flag per layer ({layers})")
    return QwenVisionConfig(
        family="qwen3_5" if text.architecture == "qwen3_5" else "qwen3_vl", hidden_size=get(_V.EMBEDDING_LENGTH),
        intermediate_size=get(_V.FEED_FORWARD_LENGTH), num_layers=layers, num_heads=get(_V.Attention.HEAD_COUNT),
        patch_size=get(_V.PATCH_SIZE), temporal_patch_size=2, merge=md.get(_V.SPATIAL_MERGE_SIZE, 2),
        out_hidden_size=get(_V.PROJECTION_DIM), num_position_embeddings=shapes[POSITIONS][0],
        deepstack_layers=tuple(i for i, flag in enumerate(deepstack) if flag), image_token_id=image_token_id,
        rope_theta=_ROPE_THETA)


def image_processor(md: dict[str, Any], vision: QwenVisionConfig) -> QwenImageProcessor:
    area = (vision.patch_size * vision.merge) ** 2
    least, most = (md.get(key, tokens * area) for key, tokens in zip((_V.IMAGE_MIN_PIXELS, _V.IMAGE_MAX_PIXELS),
                                                                      _TOKEN_LIMITS))
    if not 0 < least <= most:
        raise ModelLoadError(f"{_V.IMAGE_MIN_PIXELS} {least!r} and {_V.IMAGE_MAX_PIXELS} {most!r}: expected "
                             "0 < min <= max")
    return QwenImageProcessor(vision, least, most, tuple(md.get(_V.IMAGE_MEAN, (0.5,) * 3)),
                              tuple(md.get(_V.IMAGE_STD, (0.5,) * 3)))


def with_videos(vision: QwenVisionConfig, image_processor: QwenImageProcessor, tokenizer: Tokenizer
                ) -> tuple[QwenVisionConfig, QwenVideoProcessor | None]:
    """The encoder's config with the text model's video placeholder <|video_pad|> and the videos' processor
    (transformers' Qwen3VLVideoProcessor's defaults, the images' mean and std); without that token (a text model
    that has none as one special token), the config as it is and no videos."""
    ids = tokenizer.encode(QwenVideoProcessor.video_token, add_special_tokens=False)
    if len(ids) != 1 or not tokenizer.is_special(ids[0]):
        return vision, None
    vision = dataclasses.replace(vision, video_token_id=ids[0])
    return vision, QwenVideoProcessor(vision, mean=tuple(image_processor.mean.tolist()),
                                      std=tuple(image_processor.std.tolist()))


def image_size(vision: QwenVisionConfig) -> int:
    """clip.vision.image_size: the side of the position table's square of patches, in pixels (the converter's)."""
    return math.isqrt(vision.num_position_embeddings) * vision.patch_size


def add_metadata(writer: GGUFWriter, vision: QwenVisionConfig, processor: QwenImageProcessor, text_rms_norm_eps: float,
                 where: str) -> None:
    """Qwen3VLVisionModel's keys but the encoder's sizes (mmproj.write_mmproj's); ModelLoadError for an encoder the
    file cannot hold (clip.cpp would run another)."""
    if vision.rope_theta != _ROPE_THETA or vision.temporal_patch_size != 2:
        raise ModelLoadError(f"{where}: a Qwen3-VL vision tower with rope_theta {vision.rope_theta}, "
                             f"temporal_patch_size {vision.temporal_patch_size}: llama.cpp's qwen3vl_merger file holds "
                             f"neither (clip.cpp turns its heads at {_ROPE_THETA}, over 2 frames)")
    writer.add_vision_image_mean(processor.mean.tolist())
    writer.add_vision_image_std(processor.std.tolist())
    writer.add_clip_projector_type(PROJECTOR)
    writer.add_vision_use_gelu(True)
    writer.add_vision_spatial_merge_size(vision.merge)
    writer.add_vision_attention_layernorm_eps(text_rms_norm_eps)
    writer.add_vision_is_deepstack_layers([i in vision.deepstack_layers for i in range(vision.num_layers)])
