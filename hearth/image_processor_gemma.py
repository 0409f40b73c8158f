"""Images as Gemma 3's processor makes them (transformers' Gemma3ImageProcessorPil, step for step in numpy and
PIL so that the pixels are the same to the bit), and the text each image's marker becomes (Gemma3Processor's).

An image: RGB (transparency composited onto white); resized to size.height x size.width (the encoder's
image_size a side, the aspect not kept; BILINEAR); rescaled by 1/255 and normalised. One image is one
tile: mm_tokens_per_image text-model rows. With pan and scan (do_pan_and_scan in the folder's image processor
settings, off unless they say so, or in a request's mm_processor_kwargs), an image longer than
pan_and_scan_min_ratio_to_activate times its width (or wider) is also cut into 2 to pan_and_scan_max_num_crops
crops along its long side, each at least pan_and_scan_min_crop_size pixels a side, and each crop is a tile of its
own after the whole image (Gemma3ImageProcessorPil.pan_and_scan). No torch here: the engine's runner makes tensors.
"""

from __future__ import annotations

import copy
import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np

from hearth.errors import ModelLoadError, RequestError
from hearth.image_processor import ProcessedImage, content_hash, normalise, read_optional, request_options, to_rgb
from hearth.vision_config import VisionConfig

_BILINEAR = 2  # PIL.Image.Resampling.BILINEAR
_STEPS = ("do_resize", "do_rescale", "do_normalize")  # (None in a config: transformers' default, on)
# pan and scan's settings and Gemma3Processor's defaults for them (a config's None: the default)
_PAN_AND_SCAN = {"pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
                 "pan_and_scan_min_ratio_to_activate": 1.2}
_REQUEST_OPTIONS = ("do_pan_and_scan", *_PAN_AND_SCAN)  # what a request's mm_processor_kwargs may set
_MOST_CROPS = 16  # a request's bound on pan_and_scan_max_num_crops: each crop is a whole image's tokens


class GemmaImageProcessor:
    # an image's place in a prompt: what Gemma 3's chat template writes for an image part (its boi token)
    marker = "<start_of_image>"
    template_part = marker
    image_token = "<image_soft_token>"  # the placeholder each image row replaces (config.json's image_token_index)
    end_token = "<end_of_image>"

    def __init__(self, vision: VisionConfig, size: tuple[int, int], image_seq_length: int, mean: tuple[float, ...],
                 std: tuple[float, ...], rescale_factor: float = 1 / 255, resample: int = _BILINEAR,
                 pan_and_scan: tuple[int, int, float] = tuple(_PAN_AND_SCAN.values()), do_pan_and_scan: bool = False):
        """pan_and_scan: (min crop size, max crops, min ratio to activate), what do_pan_and_scan cuts by."""
        self.size, self.image_seq_length = size, image_seq_length
        self.pan_and_scan, self.do_pan_and_scan = pan_and_scan, do_pan_and_scan
        self.mean, self.std = np.array(mean, dtype=np.float32), np.array(std, dtype=np.float32)
        self.rescale_factor, self.resample = rescale_factor, resample
        side = vision.image_size
        if size != (side, side) or image_seq_length != vision.tokens_per_tile or self.mean.shape != (3,) \
                or self.std.shape != (3,) or not np.all(self.std > 0):
            raise ModelLoadError(f"image processor settings (size {size[0]} x {size[1]}, image_seq_length "
                                 f"{image_seq_length}, mean {self.mean.tolist()}, std {self.std.tolist()}) do not fit "
                                 f"the vision encoder (images of {side} x {side}, {vision.tokens_per_tile} tokens each)")

    @classmethod
    def from_hf_dir(cls, folder: Path, vision: VisionConfig) -> GemmaImageProcessor:
        """preprocessor_config.json's settings, or processor_config.json's image_processor (as transformers 5
        saves them); transformers' defaults where one is missing; image_seq_length from processor_config.json
        or preprocessor_config.json, else mm_tokens_per_image."""
        processor = read_optional(folder / "processor_config.json")
        config = read_optional(folder / "preprocessor_config.json") or processor.get("image_processor") or {}
        off = [name for name in _STEPS if config.get(name) is False]
        if off:
            raise ModelLoadError(f"{folder}: image processor settings {off} are not implemented by hearth (it resizes, "
                                 "rescales and normalises each image and crop, as transformers does by default)")
        try:
            size = config.get("size") or {}
            seq_len = processor.get("image_seq_length", config.get("image_seq_length", vision.tokens_per_tile))
            pan = {name: config.get(name) or default for name, default in _PAN_AND_SCAN.items()}
            pan_and_scan = (int(pan["pan_and_scan_min_crop_size"]), int(pan["pan_and_scan_max_num_crops"]),
                            float(pan["pan_and_scan_min_ratio_to_activate"]))
            return cls(vision, (int(size.get("height", vision.image_size)), int(size.get("width", vision.image_size))),
                       int(seq_len), tuple(config.get("image_mean", (0.5, 0.5, 0.5))),
                       tuple(config.get("image_std", (0.5, 0.5, 0.5))), float(config.get("rescale_factor", 1 / 255)),
                       int(config.get("resample", _BILINEAR)), pan_and_scan, bool(config.get("do_pan_and_scan")))
        except (TypeError, ValueError, AttributeError) as e:
            raise ModelLoadError(f"{folder}: malformed image processor settings: {e}") from None
        except ModelLoadError as e:
            raise ModelLoadError(f"{folder}: {e}") from None

    def with_options(self, options: dict[str, Any]) -> GemmaImageProcessor:
        """This processor with a request's mm_processor_kwargs (do_pan_and_scan and pan and scan's three settings,
        as Gemma3ImageProcessor takes them; the others this one's); RequestError naming a key it does not take or
        a value out of bounds."""
        request_options(options, _REQUEST_OPTIONS, "Gemma 3")
        least, most, ratio = (options.get(name, value) for name, value in zip(_PAN_AND_SCAN, self.pan_and_scan))
        do = options.get("do_pan_and_scan", self.do_pan_and_scan)
        whole = [(name, value) for name, value in (("pan_and_scan_min_crop_size", least),
                                                   ("pan_and_scan_max_num_crops", most))
                 if not isinstance(value, int) or isinstance(value, bool) or value < 1]
        if not isinstance(do, bool) or whole or not 1 <= most <= _MOST_CROPS or isinstance(ratio, bool) \
                or not isinstance(ratio, (int, float)) or not 0 < ratio < math.inf:
            raise RequestError(f"mm_processor_kwargs: do_pan_and_scan {do!r} (true or false), "
                               f"pan_and_scan_min_crop_size {least!r} (pixels, at least 1), pan_and_scan_max_num_crops "
                               f"{most!r} (1 to {_MOST_CROPS}), pan_and_scan_min_ratio_to_activate {ratio!r} (a positive "
                               "number)")
        made = copy.copy(self)
        made.pan_and_scan, made.do_pan_and_scan = (least, most, float(ratio)), do
        return made

    @property
    def settings(self) -> str:
        """The settings a request may change that change its images (content_hash's): pan and scan's, when on."""
        return f"pan_and_scan={self.pan_and_scan}" if self.do_pan_and_scan else ""

    def process(self, image: Any) -> ProcessedImage:
        """One PIL image -> its pixel values float32 [1, 3, height, width]; RequestError for anything else."""
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise RequestError(f"an image is a PIL.Image.Image, not {type(image).__name__}")
        rgb = to_rgb(image)
        height, width = self.size
        tiles = [rgb, *self.crops(rgb)]
        pixels = [np.moveaxis(np.array(tile.resize((width, height), self.resample)), -1, 0) for tile in tiles]  # CHW
        return ProcessedImage(np.stack([normalise(p, self.rescale_factor, self.mean, self.std) for p in pixels]),
                              len(tiles) - 1, 0, content_hash(rgb, self.settings), len(tiles) * self.image_seq_length)

    def crops(self, rgb: Any) -> list:
        """Pan and scan's crops of an RGB image, left to right or top to bottom (none: off, or the image not
        long enough, or its crops would be narrower than the least crop size)."""
        if not self.do_pan_and_scan:
            return []
        least, most, ratio = self.pan_and_scan
        width, height = rgb.size
        long, short = max(width, height), min(width, height)
        if long / short < ratio:
            return []
        count = max(2, min(math.floor(long / least), math.floor(long / short + 0.5)))
        count = min(most, count)
        across, down = (count, 1) if width >= height else (1, count)
        crop_w, crop_h = math.ceil(width / across), math.ceil(height / down)
        if min(crop_w, crop_h) < least:
            return []
        return [rgb.crop((left, top, min(left + crop_w, width), min(top + crop_h, height)))
                for top, left in itertools.product(range(0, crop_h * down, crop_h), range(0, crop_w * across, crop_w))]

    def placeholder_text(self, image: ProcessedImage) -> str:
        """The text an image's marker becomes (Gemma3Processor's full_image_sequence; with crops (image.rows of
        them) its replace_image_token's sentence around the whole image's and the crops' sequences)."""
        full = f"\n\n{self.marker}{self.image_token * self.image_seq_length}{self.end_token}\n\n"
        if not image.rows:
            return full
        return (f"Here is the original image {full} and here are some crops to help you see better "
                + " ".join([full] * image.rows))
