"""Images as Qwen3-VL's processor makes them (transformers' Qwen2VLImageProcessor, its PIL path, step for
step in numpy and PIL so that the pixels are the same to the bit), and the text each image's marker
becomes (Qwen3VLProcessor's: the marker <|image_pad|> repeated once per text-model row; the chat
template writes it between <|vision_start|> and <|vision_end|>).

An image: RGB (transparency composited onto white); resized (BICUBIC) to the nearest multiple of
patch_size x merge_size on each side with its area kept within [min_pixels, max_pixels] (smart_resize:
dynamic resolution, no tiles); rescaled by 1/255 and normalised; cut into patches of patch_size, laid out
merge x merge blocks row by row, each patch repeated temporal_patch_size times (an image is a video of
one frame twice). No torch here: the engine's runner makes tensors.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import numpy as np

from hearth.errors import ModelLoadError, RequestError
from hearth.image_processor import ProcessedImage, content_hash, normalise, read_optional, request_options, to_rgb
from hearth.vision_config import QwenVisionConfig

_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC
_MAX_ASPECT = 200  # transformers refuses an image longer than this many times its width, or wider


class QwenImageProcessor:
    marker = "<|image_pad|>"  # an image's place in a prompt (Qwen3VLProcessor's image_token)
    template_part = "<|vision_start|><|image_pad|><|vision_end|>"  # what the chat template writes for an image part
    image_token = marker  # the placeholder each image row replaces

    def __init__(self, vision: QwenVisionConfig, min_pixels: int, max_pixels: int, mean: tuple[float, ...],
                 std: tuple[float, ...], rescale_factor: float = 1 / 255, resample: int = _BICUBIC):
        self.patch, self.merge, self.temporal = vision.patch_size, vision.merge, vision.temporal_patch_size
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.mean, self.std = np.array(mean, dtype=np.float32), np.array(std, dtype=np.float32)
        self.rescale_factor, self.resample = rescale_factor, resample

    @classmethod
    def from_hf_dir(cls, folder: Path, vision: QwenVisionConfig) -> QwenImageProcessor:
        """preprocessor_config.json's settings, or processor_config.json's image_processor (as transformers
        5 saves them); transformers' defaults where one is missing. Its patch, merge and temporal sizes
        must be the encoder's."""
        config = (read_optional(folder / "preprocessor_config.json")
                  or read_optional(folder / "processor_config.json").get("image_processor") or {})
        try:
            size = config.get("size") or {}
            made = cls(vision, int(config.get("min_pixels") or size.get("shortest_edge", 56 * 56)),
                       int(config.get("max_pixels") or size.get("longest_edge", 28 * 28 * 1280)),
                       tuple(config.get("image_mean", (0.48145466, 0.4578275, 0.40821073))),
                       tuple(config.get("image_std", (0.26862954, 0.26130258, 0.27577711))),
                       float(config.get("rescale_factor", 1 / 255)), int(config.get("resample", _BICUBIC)))
            sizes = (int(config.get("patch_size", made.patch)), int(config.get("merge_size", made.merge)),
                     int(config.get("temporal_patch_size", made.temporal)))
        except (TypeError, ValueError, AttributeError) as e:
            raise ModelLoadError(f"{folder}: malformed image processor settings: {e}") from None
        if sizes != (made.patch, made.merge, made.temporal) or not 0 < made.min_pixels <= made.max_pixels \
                or len(made.mean) != 3 or len(made.std) != 3:
            raise ModelLoadError(f"{folder}: image processor settings (patch, merge, temporal sizes {sizes}, pixels "
                                 f"{made.min_pixels} to {made.max_pixels}) do not fit the vision encoder's "
                                 f"{(made.patch, made.merge, made.temporal)}")
        return made

    def with_options(self, options: dict[str, Any]) -> QwenImageProcessor:
        """This processor with a request's mm_processor_kwargs (min_pixels, max_pixels: an image's area bounds, as
        vLLM's Qwen-VL requests give them), within this one's max_pixels (a request may ask for smaller images, not
        larger); RequestError naming a key it does not take or a bound out of range."""
        request_options(options, ("min_pixels", "max_pixels"), "Qwen3-VL")
        least, most = options.get("min_pixels", self.min_pixels), options.get("max_pixels", self.max_pixels)
        if any(not isinstance(n, int) or isinstance(n, bool) for n in (least, most)) \
                or not 0 < least <= most <= self.max_pixels:
            raise RequestError(f"mm_processor_kwargs: min_pixels {least!r} and max_pixels {most!r}: expected whole "
                               f"numbers, 0 < min_pixels <= max_pixels <= {self.max_pixels:,} (the model's)")
        made = copy.copy(self)
        made.min_pixels, made.max_pixels = least, most
        return made

    def with_token_bounds(self, least: int | None, most: int | None) -> QwenImageProcessor:
        """This processor with an image's fewest and most tokens (the engine's image_min_tokens and image_max_tokens,
        llama.cpp's --image-min-tokens / --image-max-tokens) as its area bounds, tokens x (patch x merge)^2 pixels
        each, in place of the folder's (None: the folder's); ModelLoadError where the least passes the most."""
        area = (self.patch * self.merge) ** 2
        made = copy.copy(self)
        made.min_pixels = self.min_pixels if least is None else least * area
        made.max_pixels = self.max_pixels if most is None else most * area
        if made.min_pixels > made.max_pixels:
            least_from = "image_min_tokens" if least is not None else "the processor's min_pixels"
            most_from = "image_max_tokens" if most is not None else "the processor's max_pixels"
            raise ModelLoadError(f"images of at least {made.min_pixels:,} pixels ({least_from}) and at most "
                                 f"{made.max_pixels:,} ({most_from}; a token is {area:,} pixels): the least passes "
                                 "the most (image_min_tokens, --image-min-tokens, sets the least)")
        return made

    def process(self, image: Any) -> ProcessedImage:
        """One PIL image -> its patches [n, 3 * temporal * patch * patch] and token grid; RequestError for
        anything else."""
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise RequestError(f"an image is a PIL.Image.Image, not {type(image).__name__}")
        rgb = to_rgb(image)
        width, height = rgb.size
        if max(height, width) / min(height, width) > _MAX_ASPECT:
            raise RequestError(f"the image is {width} x {height}: its sides differ by more than {_MAX_ASPECT} times")
        height, width = self.smart_resize(height, width)
        pixels = np.moveaxis(np.array(rgb.resize((width, height), self.resample)), -1, 0)  # CHW uint8
        pixels = normalise(pixels, self.rescale_factor, self.mean, self.std)
        p, m = self.patch, self.merge
        rows, cols = height // p, width // p
        blocks = pixels.reshape(3, rows // m, m, p, cols // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        patches = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], self.temporal, p, p))
        grid = (rows // m, cols // m)
        digest = content_hash(rgb, f"pixels={self.min_pixels},{self.max_pixels}")
        return ProcessedImage(np.ascontiguousarray(patches.reshape(rows * cols, -1)), *grid, digest,
                              grid[0] * grid[1], grid)

    def smart_resize(self, height: int, width: int) -> tuple[int, int]:
        """The size an image is resized to: each side a multiple of patch x merge, the area within
        [min_pixels, max_pixels], the aspect kept as near as that allows (transformers' smart_resize)."""
        factor = self.patch * self.merge
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h, w

    def placeholder_text(self, image: ProcessedImage) -> str:
        """The text an image's marker becomes (Qwen3VLProcessor's): the marker once per text-model row."""
        return self.marker * image.num_embeds
