"""Images as Gemma 4's processor makes them (transformers' Gemma4ImageProcessorPil, step for step in numpy and
PIL so that the pixels are the same to the bit), and the text each image's marker becomes (Gemma4Processor's).

An image: RGB (transparency composited onto white); resized (BICUBIC) keeping its aspect to the largest size
whose sides are multiples of patch_size x pooling_kernel_size and whose patches number at most
max_soft_tokens x pooling_kernel_size^2 (a side that would round to nothing: one such multiple, the other
its aspect's whole multiples of it); rescaled by 1/255 (not normalised: the encoder maps [0, 1] to [-1, 1]
itself); cut into patches of patch_size, row by row, each patch's pixels row by row with the channels
innermost. transformers pads every image's patches to max_patches (position -1): hearth keeps an image's
own. The marker <|image|> (what Gemma 4's chat template writes for an image part) becomes <|image>, the
image's soft tokens (its patches / pooling_kernel_size^2) and <image|>. No torch here: the runner makes tensors.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import numpy as np

from hearth.errors import ModelLoadError, RequestError
from hearth.image_processor import ProcessedImage, content_hash, normalise, read_optional, request_options, to_rgb
from hearth.vision_config import Gemma4VisionConfig

_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC
SOFT_TOKENS = (70, 140, 280, 560, 1120)  # the budgets transformers' processor takes (_SUPPORTED_SOFT_TOKENS)


class Gemma4ImageProcessor:
    marker = "<|image|>"  # an image's place in a prompt (Gemma4Processor's image_token, as the chat template writes it)
    template_part = marker
    image_token = marker  # the placeholder each image row replaces (config.json's image_token_id)
    begin, end = "<|image>", "<image|>"

    def __init__(self, vision: Gemma4VisionConfig, max_soft_tokens: int = 280, rescale_factor: float = 1 / 255,
                 resample: int = _BICUBIC, mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None):
        self.patch, self.pool = vision.patch_size, vision.pooling_kernel_size
        self.positions = vision.position_embedding_size
        self.max_soft_tokens, self.rescale_factor, self.resample = max_soft_tokens, rescale_factor, resample
        self.mean = None if mean is None else np.array(mean, dtype=np.float32)
        self.std = None if std is None else np.array(std, dtype=np.float32)
        problem = self.budget_problem(max_soft_tokens)
        if problem:
            raise ModelLoadError(problem)
        if self.std is not None and (self.mean.shape != (3,) or self.std.shape != (3,) or not np.all(self.std > 0)):
            raise ModelLoadError(f"image_mean {self.mean.tolist()}, image_std {self.std.tolist()}: expected three "
                                 "values each, the stds positive")

    @classmethod
    def from_hf_dir(cls, folder: Path, vision: Gemma4VisionConfig) -> Gemma4ImageProcessor:
        """preprocessor_config.json's settings, or processor_config.json's image_processor (as transformers 5
        saves them); transformers' defaults where one is missing. Its patch and pooling sizes must be the
        encoder's."""
        config = (read_optional(folder / "preprocessor_config.json")
                  or read_optional(folder / "processor_config.json").get("image_processor") or {})
        if config.get("do_resize") is False or config.get("do_rescale") is False:
            raise ModelLoadError(f"{folder}: image processor settings without resizing or rescaling are not "
                                 "implemented by hearth")
        try:
            sizes = (int(config.get("patch_size", 16)), int(config.get("pooling_kernel_size", 3)))
            normalise_too = bool(config.get("do_normalize", False))
            made = cls(vision, int(config.get("max_soft_tokens", 280)), float(config.get("rescale_factor", 1 / 255)),
                       int(config.get("resample", _BICUBIC)),
                       *((tuple(config.get("image_mean", (0.0,) * 3)), tuple(config.get("image_std", (1.0,) * 3)))
                         if normalise_too else ()))
        except (TypeError, ValueError, AttributeError) as e:
            raise ModelLoadError(f"{folder}: malformed image processor settings: {e}") from None
        except ModelLoadError as e:
            raise ModelLoadError(f"{folder}: {e}") from None
        if sizes != (made.patch, made.pool):
            raise ModelLoadError(f"{folder}: image processor settings (patch_size, pooling_kernel_size {sizes}) do not "
                                 f"fit the vision encoder's {(made.patch, made.pool)}")
        return made

    def budget_problem(self, max_soft_tokens: Any) -> str | None:
        """Why an image token budget cannot be this encoder's (None: it can)."""
        if max_soft_tokens not in SOFT_TOKENS or isinstance(max_soft_tokens, bool):
            return (f"max_soft_tokens = {max_soft_tokens!r}: transformers' Gemma 4 processor takes "
                    f"{', '.join(map(str, SOFT_TOKENS))}")
        if max_soft_tokens * self.pool > self.positions:  # (an image's longest side, in patches)
            return (f"max_soft_tokens = {max_soft_tokens}: an image {max_soft_tokens * self.pool} patches long would "
                    f"pass the encoder's {self.positions} positions")
        return None

    def with_options(self, options: dict[str, Any]) -> Gemma4ImageProcessor:
        """This processor with a request's mm_processor_kwargs (max_soft_tokens, as Gemma4ImageProcessor takes it);
        RequestError naming a key it does not take or a budget it cannot."""
        request_options(options, ("max_soft_tokens",), "Gemma 4")
        tokens = options.get("max_soft_tokens", self.max_soft_tokens)
        problem = self.budget_problem(tokens)
        if problem:
            raise RequestError(f"mm_processor_kwargs: {problem}")
        made = copy.copy(self)
        made.max_soft_tokens = tokens
        return made

    def process(self, image: Any) -> ProcessedImage:
        """One PIL image -> its patches float32 [rows, cols, patch * patch * 3] and its soft tokens; RequestError
        for anything else."""
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise RequestError(f"an image is a PIL.Image.Image, not {type(image).__name__}")
        rgb = to_rgb(image)
        width, height = rgb.size
        target = self.target_size(height, width)
        if target != (height, width):
            rgb = rgb.resize(target[::-1], self.resample)
        pixels = np.moveaxis(np.array(rgb), -1, 0)  # CHW uint8
        if self.std is None:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        else:
            pixels = normalise(pixels, self.rescale_factor, self.mean, self.std)
        p = self.patch
        rows, cols = target[0] // p, target[1] // p
        patches = pixels.reshape(3, rows, p, cols, p).transpose(1, 3, 2, 4, 0).reshape(rows, cols, -1)
        grid = (rows // self.pool, cols // self.pool)
        digest = content_hash(rgb, f"max_soft_tokens={self.max_soft_tokens}")
        return ProcessedImage(np.ascontiguousarray(patches), *grid, digest, grid[0] * grid[1])

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """The size an image is resized to (transformers' get_aspect_ratio_preserving_size)."""
        max_patches = self.max_soft_tokens * self.pool ** 2
        side = self.pool * self.patch
        factor = math.sqrt(max_patches * self.patch ** 2 / (height * width))
        h, w = math.floor(factor * height / side) * side, math.floor(factor * width / side) * side
        longest = (max_patches // self.pool ** 2) * side
        if h == 0:
            h, w = side, min(math.floor(width / height) * side, longest)
        elif w == 0:
            h, w = min(math.floor(height / width) * side, longest), side
        return h, w

    def placeholder_text(self, image: ProcessedImage) -> str:
        """The text an image's marker becomes (Gemma4Processor's replace_image_token)."""
        return f"{self.begin}{self.image_token * image.num_embeds}{self.end}"
