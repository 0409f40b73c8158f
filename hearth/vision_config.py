"""The image side of a vision-language model's config.json (ModelConfig.vision): its vision encoder
and projector, and the token its images take the place of. hearth implements SmolVLM / Idefics3
(a SigLIP encoder, a pixel-shuffle connector and a linear projector before a llama text model)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hearth.errors import ModelLoadError

# config.json's architectures of the image-text models hearth runs -> their vision family
VISION_ARCHITECTURES = {
    "Idefics3ForConditionalGeneration": "idefics3",
    "SmolVLMForConditionalGeneration": "idefics3",  # transformers' smolvlm: idefics3's model under new names
}
_VISION_MODEL_TYPES = {"idefics3": "idefics3", "smolvlm": "idefics3"}

# bounds on the encoder's sizes, as ModelConfig has for the text model's: a damaged config must not
# make hearth allocate without limit
_LIMITS = {"hidden_size": 1 << 14, "intermediate_size": 1 << 16, "num_layers": 1 << 8, "num_heads": 1 << 8,
           "image_size": 1 << 13, "patch_size": 1 << 8, "scale_factor": 1 << 4}


@dataclass(frozen=True)
class VisionConfig:
    family: str  # "idefics3" (SmolVLM too)
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int  # the tile the encoder was trained on, in pixels a side
    patch_size: int
    scale_factor: int  # the connector's pixel shuffle: scale_factor^2 patches -> one token
    image_token_id: int  # the placeholder token each image row replaces
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    num_channels: int = 3

    def __post_init__(self) -> None:
        for name, most in _LIMITS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
                raise ModelLoadError(f"vision_config.{name} = {value!r}: expected a whole number from 1 to {most:,}")
        if self.hidden_size % self.num_heads:
            raise ModelLoadError(f"vision_config: hidden_size {self.hidden_size} is not a multiple of "
                                 f"num_attention_heads {self.num_heads}")
        if self.image_size % self.patch_size or self.patches_per_side % self.scale_factor:
            raise ModelLoadError(f"vision_config: image_size {self.image_size} is not a whole number of patches of "
                                 f"{self.patch_size} that scale_factor {self.scale_factor} divides")
        if not math.isfinite(self.layer_norm_eps) or self.layer_norm_eps <= 0:
            raise ModelLoadError(f"vision_config.layer_norm_eps = {self.layer_norm_eps!r}: expected a positive number")
        if self.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise ModelLoadError(f"vision_config.hidden_act = {self.hidden_act!r} is not implemented by hearth")
        if self.num_channels != 3:
            raise ModelLoadError(f"vision_config.num_channels = {self.num_channels!r}: hearth reads RGB images")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        """The text-model rows one tile of image_size x image_size pixels becomes."""
        return (self.patches_per_side // self.scale_factor) ** 2


def vision_family(hf: dict[str, Any]) -> str | None:
    """The vision family hearth runs this config.json's images with (None: not one of them)."""
    archs = hf.get("architectures") or []
    for arch in archs if isinstance(archs, list) else []:
        if arch in VISION_ARCHITECTURES:
            return VISION_ARCHITECTURES[arch]
    model_type = hf.get("model_type")
    return _VISION_MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None


def text_config_of(hf: dict[str, Any]) -> dict[str, Any]:
    """An image-text config.json's text model, as a config.json of its own (its model_type names its
    family; the top level's tie_word_embeddings is the one transformers ties by)."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"text_config = {text!r}: expected an object")
    if text.get("model_type", "llama") != "llama":
        raise ModelLoadError(f"text_config.model_type = {text.get('model_type')!r}: hearth runs {vision_family(hf)} "
                             "with a llama text model")
    return {**text, "model_type": "llama", "architectures": None,
            "tie_word_embeddings": hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}


def vision_from_hf(hf: dict[str, Any], text_vocab_size: int) -> VisionConfig:
    """config.json's vision_config, scale_factor and image_token_id (Idefics3's / SmolVLM's fields)."""
    vision = hf.get("vision_config")
    if not isinstance(vision, dict):
        raise ModelLoadError(f"vision_config = {vision!r}: expected an object")
    image_token_id = hf.get("image_token_id")
    if not isinstance(image_token_id, int) or not 0 <= image_token_id < text_vocab_size:
        raise ModelLoadError(f"image_token_id = {image_token_id!r}: expected a token id below {text_vocab_size}")
    return VisionConfig(
        family="idefics3",
        hidden_size=vision.get("hidden_size", 1152),
        intermediate_size=vision.get("intermediate_size", 3072),
        num_layers=vision.get("num_hidden_layers", 12),
        num_heads=vision.get("num_attention_heads", 16),
        image_size=vision.get("image_size", 224),
        patch_size=vision.get("patch_size", 32),
        scale_factor=hf.get("scale_factor", 2),
        image_token_id=image_token_id,
        layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)),
        hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh"),
        num_channels=vision.get("num_channels", 3),
    )
