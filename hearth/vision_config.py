"""The image side of a vision-language model's config.json (ModelConfig.vision): its vision encoder
and projector, and the token its images take the place of. hearth implements SmolVLM / Idefics3
(a SigLIP encoder, a pixel-shuffle connector and a linear projector before a llama text model),
Gemma 3 (a SigLIP encoder, an average pool to mm_tokens_per_image, an RMSNorm and a linear projector
before a gemma3 text model, whose image tokens attend to each other both ways) and Qwen3-VL (a ViT
with 2-D rotary positions over dynamic-resolution patches, merged 2 x 2 into tokens, deepstack
features for the first text layers, a qwen3 text model with M-RoPE) and Gemma 4 (a ViT with 2-D rotary
positions over each image at its own aspect, its patches average-pooled k x k into tokens, an RMSNorm and a
linear projector before a gemma4 text model)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hearth.errors import ModelLoadError

# config.json's architectures of the image-text models hearth runs -> their vision family
VISION_ARCHITECTURES = {
    "Idefics3ForConditionalGeneration": "idefics3",
    "SmolVLMForConditionalGeneration": "idefics3",  # transformers' smolvlm: idefics3's model under new names
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl",  # the same encoder before a qwen3_moe text model
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # Qwen3-VL's encoder without deepstack, a hybrid text model
    "Gemma3ForConditionalGeneration": "gemma3",  # SigLIP, pooled to mm_tokens_per_image; images attend both ways
    # (its vision_config: the vision tower; without one, its text model alone; its audio tower never loaded)
    "Gemma4ForConditionalGeneration": "gemma4",
}
_VISION_MODEL_TYPES = {"idefics3": "idefics3", "smolvlm": "idefics3", "qwen3_vl": "qwen3_vl",
                       "qwen3_vl_moe": "qwen3_vl", "qwen3_5": "qwen3_5",
                       "gemma3": "gemma3", "gemma4": "gemma4"}
# each family's text model: config.json's text_config.model_type -> hearth's architecture
_TEXT_MODELS = {"idefics3": {"llama": "llama"},
                "qwen3_vl": {"qwen3_vl_text": "qwen3", "qwen3_vl_moe_text": "qwen3_moe"},
                "qwen3_5": {"qwen3_5_text": "qwen3_5"},
                "gemma3": {"gemma3_text": "gemma3_text"},  # (gemma3_text: model_type gemma3 is the image-text model's)
                "gemma4": {"gemma4_text": "gemma4"}}
# Gemma3TextConfig's defaults, which the published image-text configs leave out of text_config
# (google/gemma-3-4b-it's names its widths and depth only); rope_theta only where no rope_parameters say it
_GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
                         "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                         "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
                         "sliding_window": 4096}
_MROPE_SECTIONS = {"qwen3_vl": [24, 20, 20], "qwen3_5": [11, 11, 10]}  # (transformers' defaults)

# bounds on the encoder's sizes, as ModelConfig has for the text model's: a damaged config must not
# make hearth allocate without limit
_LIMITS = {"hidden_size": 1 << 14, "intermediate_size": 1 << 16, "num_layers": 1 << 8, "num_heads": 1 << 8,
           "image_size": 1 << 13, "patch_size": 1 << 8, "scale_factor": 1 << 4}

_QWEN_LIMITS = {**{name: _LIMITS[name] for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                                                    "patch_size")},
                "temporal_patch_size": 1 << 4, "merge": 1 << 4, "out_hidden_size": 1 << 16,
                "num_position_embeddings": 1 << 16}


def _check_sizes(config: Any, limits: dict[str, int]) -> None:
    for name, most in limits.items():
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
            raise ModelLoadError(f"vision_config.{name} = {value!r}: expected a whole number from 1 to {most:,}")


@dataclass(frozen=True)
class VisionConfig:
    """A SigLIP encoder over tiles of image_size pixels (SmolVLM's, Idefics3's, Gemma 3's), and how its
    patches become text-model rows: scale_factor x scale_factor neighbouring patches one row, side by
    side (Idefics3's pixel shuffle) or averaged (Gemma 3's pool to mm_tokens_per_image)."""

    family: str  # "idefics3" (SmolVLM too), "gemma3"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int  # the tile the encoder was trained on, in pixels a side
    patch_size: int
    scale_factor: int  # the connector's pixel shuffle, or Gemma 3's average pool: scale_factor^2 patches -> one token
    image_token_id: int  # the placeholder token each image row replaces
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    num_channels: int = 3

    def __post_init__(self) -> None:
        _check_sizes(self, _LIMITS)
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

    def describe(self) -> dict[str, Any]:
        """hearth inspect's lines (model_info's "vision")."""
        tiles = (f"images resized to {self.image_size} px" if self.family == "gemma3"
                 else f"tiles of {self.image_size} px")
        return {"family": self.family, "layers": self.num_layers, "hidden_size": self.hidden_size,
                "tile": self.image_size, "patch": self.patch_size, "tokens_per_tile": self.tokens_per_tile,
                "summary": f"SigLIP {self.num_layers} layers x {self.hidden_size}, {tiles} (patches of "
                           f"{self.patch_size}), {self.tokens_per_tile} tokens a tile"}


@dataclass(frozen=True)
class QwenVisionConfig:
    """Qwen3-VL's vision_config: patches of patch_size x patch_size pixels x temporal_patch_size frames (an
    image is its frame twice), merge x merge neighbouring patches one text token; a learned position
    table of num_position_embeddings (a square grid, resampled to each image's); deepstack_layers: the
    encoder layers whose outputs, merged, are added to the first text layers' outputs at the image's rows."""

    family: str  # "qwen3_vl", "qwen3_5"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    merge: int  # spatial_merge_size
    out_hidden_size: int  # the text model's width
    num_position_embeddings: int
    deepstack_layers: tuple[int, ...]
    image_token_id: int
    video_token_id: int | None = None  # the placeholder each row of a video's frame group replaces
    rope_theta: float = 10000.0
    hidden_act: str = "gelu_pytorch_tanh"
    num_channels: int = 3

    def __post_init__(self) -> None:
        _check_sizes(self, _QWEN_LIMITS)
        side = math.isqrt(self.num_position_embeddings)
        if self.hidden_size % (4 * self.num_heads) or side * side != self.num_position_embeddings:
            raise ModelLoadError(f"vision_config: hidden_size {self.hidden_size} over num_heads {self.num_heads} is no "
                                 f"multiple of 4, or num_position_embeddings {self.num_position_embeddings} no square")
        if any(not isinstance(i, int) or not 0 <= i < self.num_layers for i in self.deepstack_layers):
            raise ModelLoadError(f"vision_config.deepstack_visual_indexes = {list(self.deepstack_layers)}: expected "
                                 f"layers below depth {self.num_layers}")
        if self.hidden_act not in ("gelu_pytorch_tanh", "gelu") or self.num_channels != 3:
            raise ModelLoadError(f"vision_config: hidden_act {self.hidden_act!r}, in_channels {self.num_channels!r}: "
                                 "hearth implements gelu / gelu_pytorch_tanh over RGB")

    def describe(self) -> dict[str, Any]:
        return {"family": self.family, "layers": self.num_layers, "hidden_size": self.hidden_size,
                "patch": self.patch_size, "merge": self.merge, "deepstack_layers": list(self.deepstack_layers),
                "summary": f"ViT {self.num_layers} layers x {self.hidden_size}, patches of {self.patch_size} px "
                           f"merged {self.merge} x {self.merge} into a token, dynamic resolution, deepstack into "
                           f"{len(self.deepstack_layers)} text layers"}


def vision_family(hf: dict[str, Any]) -> str | None:
    """The vision family hearth runs this config.json's images with (None: not one of them; a Qwen3.5
    config without vision_config: its text model alone)."""
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    by_type = _VISION_MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    family = next((VISION_ARCHITECTURES[a] for a in (archs if isinstance(archs, list) else [])
                   if a in VISION_ARCHITECTURES), by_type)
    return None if family in ("qwen3_5", "gemma4") and hf.get("vision_config") is None else family


def text_config_of(hf: dict[str, Any]) -> dict[str, Any]:
    """An image-text config.json's text model, as a config.json of its own (its model_type names its
    family; the top level's tie_word_embeddings is the one transformers ties by)."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"text_config = {text!r}: expected an object")
    family = vision_family(hf)
    models = _TEXT_MODELS[family]
    moe = hf.get("model_type") == "qwen3_vl_moe" or \
        "Qwen3VLMoeForConditionalGeneration" in (hf.get("architectures") or [])
    model_type = text.get("model_type", "qwen3_vl_moe_text" if moe else next(iter(models)))
    if model_type not in models:
        raise ModelLoadError(f"text_config.model_type = {model_type!r}: hearth runs {family} with a "
                             f"{' or '.join(models.values())} text model")
    if model_type == "qwen3_vl_moe_text":  # its router always renormalises the chosen experts' weights
        text = {**text, "norm_topk_prob": True}
    if family == "gemma3":
        theta = {} if "rope_parameters" in text or "rope_theta" in text else {"rope_theta": 1_000_000.0}
        text = {**_GEMMA3_TEXT_DEFAULTS, **theta, **text}
    return {**text, "model_type": models[model_type], "architectures": None,
            "tie_word_embeddings": hf.get("tie_word_embeddings", text.get("tie_word_embeddings",
                                                                           family in ("gemma3", "gemma4")))}


def mrope_section_of(hf: dict[str, Any]) -> tuple[int, int, int] | None:
    """An image-text model's M-RoPE sections (text_config's rope parameters; Qwen3-VL's and Qwen3.5's are
    interleaved: layers.mrope_axes, which takes sections of any sum as transformers does)."""
    family = vision_family(hf)
    if family not in _MROPE_SECTIONS:
        return None
    text = hf["text_config"]
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = rope.get("mrope_section", _MROPE_SECTIONS[family])
    if not rope.get("mrope_interleaved", True):
        raise ModelLoadError("text_config's mrope_interleaved = false: hearth implements Qwen3-VL's interleaved M-RoPE")
    if not isinstance(section, list) or len(section) != 3 or any(not isinstance(n, int) or n < 0 for n in section):
        raise ModelLoadError(f"text_config's mrope_section = {section!r}: expected three counts of frequencies")
    return tuple(section)


def vision_from_hf(hf: dict[str, Any], text_vocab_size: int) -> VisionConfig | QwenVisionConfig | Gemma4VisionConfig:
    """config.json's vision_config, image_token_id and (Idefics3's / SmolVLM's) scale_factor."""
    vision = hf.get("vision_config")
    if not isinstance(vision, dict):
        raise ModelLoadError(f"vision_config = {vision!r}: expected an object")
    image_token_id = hf.get("image_token_id", hf.get("image_token_index"))  # (gemma3's name: image_token_index)
    if not isinstance(image_token_id, int) or not 0 <= image_token_id < text_vocab_size:
        raise ModelLoadError(f"image_token_id = {image_token_id!r}: expected a token id below {text_vocab_size}")
    family = vision_family(hf)
    if family in _MROPE_SECTIONS:
        video_token_id = hf.get("video_token_id")  # (None: the model takes no videos)
        if video_token_id is not None and not (isinstance(video_token_id, int)
                                               and 0 <= video_token_id < text_vocab_size):
            raise ModelLoadError(f"video_token_id = {video_token_id!r}: expected a token id below {text_vocab_size}")
        return _qwen_vision_from_hf(vision, image_token_id, family, video_token_id)
    if family == "gemma4":
        return _gemma4_vision_from_hf(vision, image_token_id, hf["text_config"])
    gemma = family == "gemma3"  # (SigLIP's own defaults; Idefics3's tower has other ones)
    image_size, patch_size = vision.get("image_size", 224), vision.get("patch_size", 16 if gemma else 32)
    return VisionConfig(
        family=family,
        hidden_size=vision.get("hidden_size", 768 if gemma else 1152),
        intermediate_size=vision.get("intermediate_size", 3072),
        num_layers=vision.get("num_hidden_layers", 12),
        num_heads=vision.get("num_attention_heads", 12 if gemma else 16),
        image_size=image_size,
        patch_size=patch_size,
        scale_factor=_gemma3_pool(hf, image_size, patch_size) if gemma else hf.get("scale_factor", 2),
        image_token_id=image_token_id,
        layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)),
        hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh"),
        num_channels=vision.get("num_channels", 3),
    )


def _gemma3_pool(hf: dict[str, Any], image_size: Any, patch_size: Any) -> int:
    """Gemma 3's average pool: the side of the square of patches that becomes one of mm_tokens_per_image."""
    tokens = hf.get("mm_tokens_per_image", 256)
    if not all(isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 1 << 16 for n in (tokens, image_size, patch_size)):
        raise ModelLoadError(f"mm_tokens_per_image {tokens!r}, image_size {image_size!r}, patch_size {patch_size!r}: "
                             "expected positive whole numbers")
    side, patches = math.isqrt(tokens), image_size // patch_size
    if side * side != tokens or patches % side:
        raise ModelLoadError(f"mm_tokens_per_image = {tokens}: expected a square whose side divides the {patches} "
                             "patches a side of the image")
    return patches // side


def _qwen_vision_from_hf(vision: dict[str, Any], image_token_id: int, family: str,
                         video_token_id: int | None) -> QwenVisionConfig:
    rope = vision.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ModelLoadError(f"vision_config's rope_type = {rope.get('rope_type')!r}: Qwen3-VL's is axial")
    return QwenVisionConfig(
        family=family,
        hidden_size=vision.get("hidden_size", 1152),
        intermediate_size=vision.get("intermediate_size", 4304),
        num_layers=vision.get("depth", 27),
        num_heads=vision.get("num_heads", 16),
        patch_size=vision.get("patch_size", 16),
        temporal_patch_size=vision.get("temporal_patch_size", 2),
        merge=vision.get("spatial_merge_size", 2),
        out_hidden_size=vision.get("out_hidden_size", 3584),
        num_position_embeddings=vision.get("num_position_embeddings", 2304),
        deepstack_layers=tuple(vision.get("deepstack_visual_indexes", (8, 16, 24) if family == "qwen3_vl" else ())),
        image_token_id=image_token_id,
        video_token_id=video_token_id,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh"),
        num_channels=vision.get("in_channels", 3),
    )


_GEMMA4_LIMITS = {**{name: _LIMITS[name] for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                                                      "patch_size")},
                  "num_kv_heads": 1 << 8, "head_dim": 1 << 10, "pooling_kernel_size": 1 << 4,
                  "position_embedding_size": 1 << 16}


@dataclass(frozen=True)
class Gemma4VisionConfig:
    """Gemma 4's vision_config: a ViT over an image's patches of patch_size at the image's own aspect (2-D
    rotary positions, a learned table of position_embedding_size per axis), pre- and post-norms in each layer
    (Gemma's RMSNorm), q/k normed, v normed without a weight, scores unscaled; the patches average-pooled
    pooling_kernel_size x pooling_kernel_size into tokens, times sqrt(hidden_size), standardised (std_bias,
    std_scale) where `standardize`, then embed_vision: an RMSNorm without a weight and a linear map to the text
    model's width. bidirectional: an image's tokens attend to each other both ways on the text model's
    sliding-window layers (text_config.use_bidirectional_attention "vision"); pad_token_id: the token whose
    per-layer embedding an image row takes."""

    family: str  # "gemma4"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    image_token_id: int
    pad_token_id: int
    bidirectional: bool
    standardize: bool = False
    rope_theta: float = 100.0
    rms_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self) -> None:
        _check_sizes(self, _GEMMA4_LIMITS)
        if self.num_heads % self.num_kv_heads or self.head_dim % 4:
            raise ModelLoadError(f"vision_config: num_attention_heads {self.num_heads} is no multiple of "
                                 f"num_key_value_heads {self.num_kv_heads}, or head_dim {self.head_dim} of 4")
        if not math.isfinite(self.rms_norm_eps) or self.rms_norm_eps <= 0 or not math.isfinite(self.rope_theta):
            raise ModelLoadError(f"vision_config: rms_norm_eps {self.rms_norm_eps!r}, rope_theta {self.rope_theta!r}: "
                                 "expected positive numbers")
        if self.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise ModelLoadError(f"vision_config.hidden_activation = {self.hidden_act!r} is not implemented by hearth")

    def describe(self) -> dict[str, Any]:
        k = self.pooling_kernel_size
        return {"family": self.family, "layers": self.num_layers, "hidden_size": self.hidden_size,
                "patch": self.patch_size, "pool": k,
                "summary": f"ViT {self.num_layers} layers x {self.hidden_size}, patches of {self.patch_size} px at "
                           f"the image's aspect, 2-D RoPE, {k} x {k} patches pooled into a token"}


def _gemma4_vision_from_hf(vision: dict[str, Any], image_token_id: int, text: Any) -> Gemma4VisionConfig:
    rope = vision.get("rope_parameters") or {}
    text = text if isinstance(text, dict) else {}
    if rope.get("rope_type", "axial") != "axial" or vision.get("use_clipped_linears"):
        raise ModelLoadError(f"vision_config: rope_type {rope.get('rope_type')!r}, use_clipped_linears "
                             f"{vision.get('use_clipped_linears')!r}: hearth implements Gemma 4's axial RoPE without "
                             "clipped linears")
    heads = vision.get("num_attention_heads", 12)
    return Gemma4VisionConfig(
        family="gemma4",
        hidden_size=vision.get("hidden_size", 768),
        intermediate_size=vision.get("intermediate_size", 3072),
        num_layers=vision.get("num_hidden_layers", 16),
        num_heads=heads,
        num_kv_heads=vision.get("num_key_value_heads", heads),
        head_dim=vision.get("head_dim", 64),
        patch_size=vision.get("patch_size", 16),
        pooling_kernel_size=vision.get("pooling_kernel_size", 3),
        position_embedding_size=vision.get("position_embedding_size", 10 * 1024),
        image_token_id=image_token_id,
        pad_token_id=int(text.get("pad_token_id", 0) or 0),
        bidirectional=text.get("use_bidirectional_attention") == "vision",
        standardize=bool(vision.get("standardize", False)),
        rope_theta=float(rope.get("rope_theta", 100.0)),
        rms_norm_eps=float(vision.get("rms_norm_eps", 1e-6)),
        hidden_act=vision.get("hidden_activation", "gelu_pytorch_tanh"),
    )
