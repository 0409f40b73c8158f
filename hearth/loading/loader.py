"""Load a model from disk: a GGUF file or a Hugging Face folder, to a Transformer and Tokenizer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hearth.backend import Backend, choose_backend
from hearth.config import ModelConfig
from hearth.engine_config import SparsityConfig
from hearth.default_model import resolve_model
from hearth.errors import ModelLoadError, RequestError
from hearth.image_processor import ImageProcessor
from hearth.image_processor_gemma import GemmaImageProcessor
from hearth.image_processor_gemma4 import Gemma4ImageProcessor
from hearth.image_processor_qwen import QwenImageProcessor
from hearth.vision_config import QwenVisionConfig
from hearth.video_processor_qwen import QwenVideoProcessor
from hearth.loading.activation_thresholds import sparsify_model
from hearth.loading.gguf import mrope_section_of
from hearth.loading.gguf_reader import read_gguf
from hearth.loading.mmproj import Mmproj, read_mmproj
from hearth.model.transformer import Transformer
from hearth.tokenizer import Tokenizer

if TYPE_CHECKING:
    from hearth.distributed.pipeline_parallel import PipelineShard
    from hearth.distributed.tensor_parallel import TensorShard


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path
    # an image-text model's (hearth/image_processor.py, image_processor_qwen.py, image_processor_gemma.py,
    # image_processor_gemma4.py)
    image_processor: ImageProcessor | QwenImageProcessor | GemmaImageProcessor | Gemma4ImageProcessor | None = None
    video_processor: QwenVideoProcessor | None = None  # Qwen3-VL's and Qwen3.5's (hearth/video_processor_qwen.py)


# each image-text family's image processor (the rest: SmolVLM's / Idefics3's)
_IMAGE_PROCESSORS = {"qwen3_vl": QwenImageProcessor, "qwen3_5": QwenImageProcessor, "gemma3": GemmaImageProcessor,
                     "gemma4": Gemma4ImageProcessor}


def read_model(path: str | Path | None, progress: bool = True) -> tuple[ModelConfig, dict, Tokenizer]:
    """Config, weights by HF name (memory-mapped, maybe quantized) and tokenizer. path: see resolve_model
    (None: the default model)."""
    path = resolve_model(path)
    if path.is_dir():
        from hearth.loading.safetensors import load_hf_folder

        config, weights = load_hf_folder(path, progress)
        if not (path / "tokenizer.json").exists():
            raise ModelLoadError(f"{path}: no tokenizer.json")
        return config, weights, Tokenizer.from_hf_dir(path)
    if path.is_file():
        from hearth.loading.gguf import load_gguf

        config, weights, metadata = load_gguf(path, progress)
        return config, weights, Tokenizer.from_gguf_metadata(metadata)
    raise ModelLoadError(f"{path}: no such file or folder")


def load_model(
    path: str | Path | None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
    progress: bool = True,
    backend: Backend | None = None,
    shard: TensorShard | PipelineShard | None = None,
    sparsity: SparsityConfig | None = None,
    mmproj: str | Path | None = None,
    image_max_tokens: int | None = None,
    image_min_tokens: int | None = None,
) -> LoadedModel:
    """backend: the kernels the model runs (None: choose_backend's choice for device and dtype).
    sparsity: activation sparsity (hearth/loading/activation_thresholds.py; None: dense).
    shard: this process's part of a model split over processes (hearth/engine/workers.py):
    a tensor-parallel slice (its config is the slice's) or a pipeline stage (its layers).
    mmproj: llama.cpp's mmproj file, the vision tower of a text model (hearth/loading/mmproj.py).
    image_max_tokens, image_min_tokens: the most (Gemma 4's max_soft_tokens; Qwen's max_pixels in tokens) and the
    fewest (Qwen's min_pixels) tokens an image becomes, in place of the processor's."""
    path = resolve_model(path)
    device = torch.device(device)
    backend = backend or choose_backend(device, dtype)
    config, weights, tokenizer = read_model(path, progress)
    image_processor = None
    if config.vision is not None:
        image_processor = _IMAGE_PROCESSORS.get(config.vision.family, ImageProcessor).from_hf_dir(path, config.vision)
    video_processor = None
    if getattr(config.vision, "video_token_id", None) is not None:  # (Qwen3-VL's and Qwen3.5's)
        video_processor = QwenVideoProcessor.from_hf_dir(path, config.vision)
    if mmproj is not None:
        projector = read_mmproj(mmproj, config, tokenizer)
        config = dataclasses.replace(config, vision=projector.vision,
                                     mrope_section=config.mrope_section or _text_mrope_section(path, projector))
        image_processor, video_processor = projector.image_processor, projector.video_processor
        weights = weights | projector.weights
    if image_max_tokens is not None or image_min_tokens is not None:
        image_processor = _with_image_tokens(image_processor, image_min_tokens, image_max_tokens, path, config)
    if shard is not None and config.vision is not None:
        raise ModelLoadError(f"{path}: an image-text model split over processes is not implemented by hearth: run it "
                             "with tensor_parallel_size and pipeline_parallel_size 1")
    if shard is not None:
        config, weights = shard.config(config), shard.weights(weights, config)
    with torch.device("meta"):  # no memory until load_weights puts the real tensors in
        model = Transformer(config, max_positions, backend)
    if shard is not None:
        shard.select(model)
    model.load_weights(weights, dtype)
    backend.prepare(model, dtype)  # weights kept in their storage format: the backend's modules
    sparsify_model(model, config, sparsity)
    if shard is not None:
        shard.wrap(model)
    model.to(device)
    # `weights` goes out of scope here: un-permuted Q/K copies and other load-time temporaries
    # are freed once the model holds its own tensors (peak memory while serving).
    return LoadedModel(model.eval(), tokenizer, config, path, image_processor, video_processor)


def _text_mrope_section(path: Path, projector: Mmproj) -> tuple[int, int, int] | None:
    """A Qwen3.5 text GGUF's M-RoPE sections (qwen35.rope.dimension_sections), for an mmproj file's images: read only
    then, as the HF folder's are only with its vision tower (a text token's three positions are one: plain RoPE)."""
    if not isinstance(projector.vision, QwenVisionConfig):
        return None
    if not path.is_file():
        raise ModelLoadError(f"{path}: a Qwen3-VL / Qwen3.5 mmproj file goes with a GGUF text model (its M-RoPE "
                             "sections); run the image-text folder itself")
    metadata = read_gguf(path).metadata
    return mrope_section_of(metadata, metadata.get("general.architecture"), str(path))


def _with_image_tokens(processor, least: int | None, most: int | None, path: Path, config: ModelConfig):
    """The image processor with the engine's image token bounds (image_min_tokens, image_max_tokens); ModelLoadError
    for a model whose processor has no such bound, or bounds it cannot take."""
    if isinstance(processor, QwenImageProcessor):
        try:
            return processor.with_token_bounds(least, most)
        except ModelLoadError as e:
            raise ModelLoadError(f"{path}: {e}") from None
    if isinstance(processor, Gemma4ImageProcessor) and least is None:
        try:
            return processor.with_options({"max_soft_tokens": most})
        except RequestError as e:
            raise ModelLoadError(f"image_max_tokens = {most}: {str(e).removeprefix('mm_processor_kwargs: ')}") from None
    family = "a model without a vision encoder" if config.vision is None else f"{config.vision.family}'s"
    flag, models = (("image_min_tokens (--image-min-tokens)", "Qwen3-VL's and Qwen3.5's images (min_pixels)")
                    if least is not None else ("image_max_tokens (--image-max-tokens)", "Gemma 4's images (its "
                                               "processor's max_soft_tokens) and Qwen3-VL's and Qwen3.5's (max_pixels)"))
    raise ModelLoadError(f"{path}: {flag} is implemented for {models}, not for {family}")
