"""Images as SmolVLM's / Idefics3's processor makes them (transformers' Idefics3ImageProcessor, its PIL
path, step for step in numpy and PIL so that the pixels are the same to the bit), and the text each
image's marker in a prompt expands to (Idefics3Processor's: tiles row by row, each after
<fake_token_around_image><row_r_col_c>, then the global image after <global-img>, image_seq_len image
tokens each).

An image: RGB (transparency composited onto white); its longest edge resized to size.longest_edge
(LANCZOS), then up to whole multiples of max_image_size.longest_edge; split into tiles of that size,
row by row, plus the whole image resized to one tile (the global image); every tile rescaled by
1/255 and normalised with image_mean / image_std. Without do_image_splitting the whole image is one tile.
A request may set do_image_splitting, size and max_image_size (mm_processor_kwargs, transformers' names): the
tile only at the encoder's own size, where each tile becomes image_seq_len tokens. No torch here: the engine's
runner makes tensors.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hearth.errors import ModelLoadError, RequestError
from hearth.vision_config import VisionConfig

IMAGE_MARKER = "<image>"  # an image's place in a prompt, as the chat template writes an image part
_MAX_IMAGE_SIZE = 4096  # transformers' bound on the resized image's edges (Idefics3's MAX_IMAGE_SIZE)
_LANCZOS = 1  # PIL.Image.Resampling.LANCZOS


@dataclass(frozen=True)
class ProcessedImage:
    # what the vision encoder reads: here float32 [tiles, 3, tile, tile], the row-major tiles, then the
    # global image (Qwen3-VL's: hearth/image_processor_qwen.py)
    pixel_values: np.ndarray
    rows: int  # tiles down and across (0, 0: the image is one tile, no global image); Qwen3-VL's: its token grid
    cols: int
    content_hash: bytes  # the image's own pixels and size and the processor's settings that vary: the caches' key
    num_embeds: int  # the text-model rows the encoder makes of it
    grid: tuple[int, int] | None = None  # M-RoPE's grid of those rows (ImageSpan.grid); None: no M-RoPE


def content_hash(rgb, settings: str = "") -> bytes:
    """16 bytes of an RGB PIL image's pixels and size, and `settings`: those of the processor's settings that a
    request may change (mm_processor_kwargs), so that the same image made another way is another cache entry."""
    return hashlib.blake2b(f"{rgb.size}|{settings}|".encode() + rgb.tobytes(), digest_size=16).digest()


def request_options(options: Any, accepted: Sequence[str], family: str) -> dict[str, Any]:
    """A request's mm_processor_kwargs (vLLM's: the image processor's settings for this request's images), checked:
    RequestError naming each key that `family`'s processor does not take from a request."""
    if not isinstance(options, dict):
        raise RequestError(f"mm_processor_kwargs is an object of image processor settings, not "
                           f"{type(options).__name__}")
    unknown = [str(key) for key in options if key not in accepted]
    if unknown:
        raise RequestError(f"mm_processor_kwargs: {', '.join(map(repr, unknown))} is not a setting of {family}'s image "
                           f"processor (it takes {', '.join(accepted)})")
    return options


def normalise(pixels: np.ndarray, rescale_factor: float, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """uint8 [3, H, W] -> float32, rescaled then normalised per channel (transformers' numpy arithmetic)."""
    scaled = (pixels.astype(np.float64) * rescale_factor).astype(np.float32)
    return ((scaled.T - mean) / std).T


class ImageProcessor:
    marker = IMAGE_MARKER  # an image's place in a prompt
    template_part = IMAGE_MARKER  # what the chat template writes for an image part
    image_token = IMAGE_MARKER  # the placeholder each image row replaces

    def __init__(self, vision: VisionConfig, longest_edge: int, tile: int, image_seq_len: int,
                 mean: tuple[float, ...], std: tuple[float, ...], rescale_factor: float = 1 / 255,
                 do_image_splitting: bool = True, resample: int = _LANCZOS):
        self.vision = vision
        self.longest_edge, self.tile, self.image_seq_len = longest_edge, tile, image_seq_len
        self.mean, self.std = np.array(mean, dtype=np.float32), np.array(std, dtype=np.float32)
        self.rescale_factor, self.do_image_splitting, self.resample = rescale_factor, do_image_splitting, resample

    @classmethod
    def from_hf_dir(cls, folder: Path, vision: VisionConfig) -> ImageProcessor:
        """preprocessor_config.json's settings, or processor_config.json's image_processor (as
        transformers 5 saves them), transformers' defaults where a field or both are missing;
        image_seq_len from processor_config.json, else the one the vision config implies."""
        processor = read_optional(folder / "processor_config.json")
        config = read_optional(folder / "preprocessor_config.json") or processor.get("image_processor") or {}
        try:
            tile = int((config.get("max_image_size") or {}).get("longest_edge", vision.image_size))
            longest = int((config.get("size") or {}).get("longest_edge", 4 * tile))
            seq_len = int(processor.get("image_seq_len", vision.tokens_per_tile))
            made = cls(vision, longest, tile, seq_len, tuple(config.get("image_mean", (0.5, 0.5, 0.5))),
                       tuple(config.get("image_std", (0.5, 0.5, 0.5))), float(config.get("rescale_factor", 1 / 255)),
                       bool(config.get("do_image_splitting", True)), int(config.get("resample", _LANCZOS)))
        except (TypeError, ValueError, AttributeError) as e:
            raise ModelLoadError(f"{folder}: malformed image processor settings: {e}") from None
        return made.checked(folder)

    def with_options(self, options: dict[str, Any]) -> ImageProcessor:
        """This processor with a request's mm_processor_kwargs, as transformers' Idefics3ImageProcessor takes them:
        do_image_splitting (true / false), size {"longest_edge": N} (the image's longest edge before it is cut into
        tiles: at most the model's) and max_image_size {"longest_edge": N} (the tile: only the encoder's own, the
        one size whose tiles become image_seq_len tokens; transformers' model refuses others too); RequestError
        naming a key it does not take or a value out of range."""
        request_options(options, ("do_image_splitting", "size", "max_image_size"), "SmolVLM / Idefics3")
        split = options.get("do_image_splitting", self.do_image_splitting)
        if not isinstance(split, bool):
            raise RequestError(f"mm_processor_kwargs: do_image_splitting is true or false, not {split!r}")
        longest, tile = _longest_edge(options, "size", self.longest_edge), _longest_edge(options, "max_image_size",
                                                                                          self.tile)
        if not 0 < longest <= self.longest_edge:
            raise RequestError(f"mm_processor_kwargs: size {{'longest_edge': {longest}}}: expected 1 to "
                               f"{self.longest_edge} pixels (the model's: a request may ask for smaller images, not "
                               "larger)")
        if tile != self.tile:
            raise RequestError(f"mm_processor_kwargs: max_image_size {{'longest_edge': {tile}}}: this model's tiles "
                               f"are {self.tile} pixels, its encoder's image size (a tile of another size would not "
                               f"become the {self.image_seq_len} tokens its prompt gives it)")
        made = copy.copy(self)
        made.do_image_splitting, made.longest_edge = split, longest
        return made

    def checked(self, where: object) -> ImageProcessor:
        """Itself, or ModelLoadError (naming `where`) where its settings do not fit its vision encoder."""
        vision, tile, longest = self.vision, self.tile, self.longest_edge
        if self.image_seq_len != vision.tokens_per_tile or tile % vision.patch_size or not 0 < tile <= longest \
                or self.mean.shape != (3,) or self.std.shape != (3,) or not np.all(self.std > 0):
            raise ModelLoadError(f"{where}: image processor settings (tiles of {tile}, image_seq_len "
                                 f"{self.image_seq_len}, longest edge {longest}, mean {self.mean.tolist()}, std "
                                 f"{self.std.tolist()}) do not fit the vision encoder (patches of {vision.patch_size}, "
                                 f"{vision.tokens_per_tile} tokens a tile)")
        return self

    def process(self, image: Any) -> ProcessedImage:
        """One PIL image -> its tiles' pixel values and layout; RequestError for anything else."""
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise RequestError(f"an image is a PIL.Image.Image, not {type(image).__name__}")
        rgb = to_rgb(image)
        digest = content_hash(rgb, f"split={self.do_image_splitting},longest_edge={self.longest_edge}")
        width, height = rgb.size
        height, width = _longest_edge_to(height, width, self.longest_edge)
        rgb = rgb.resize((width, height), self.resample)
        # then whole tiles to split, or one tile (transformers resizes twice either way)
        height, width = _multiples_of(height, width, self.tile) if self.do_image_splitting else (self.tile,) * 2
        rgb = rgb.resize((width, height), self.resample)
        pixels = np.moveaxis(np.array(rgb), -1, 0)  # CHW uint8
        rows = cols = 0
        tiles = [pixels]
        if height > self.tile or width > self.tile:
            rows, cols = height // self.tile, width // self.tile
            tiles = [pixels[:, r * self.tile:(r + 1) * self.tile, c * self.tile:(c + 1) * self.tile]
                     for r in range(rows) for c in range(cols)]
            tiles.append(np.moveaxis(np.array(rgb.resize((self.tile, self.tile), self.resample)), -1, 0))
        pixel_values = np.stack([normalise(t, self.rescale_factor, self.mean, self.std) for t in tiles])
        return ProcessedImage(pixel_values, rows, cols, digest, len(tiles) * self.image_seq_len)

    def placeholder_text(self, image: ProcessedImage) -> str:
        """The text an image's marker becomes (Idefics3Processor's, token for token)."""
        rows, cols = image.rows, image.cols
        tokens = IMAGE_MARKER * self.image_seq_len
        whole = f"<fake_token_around_image><global-img>{tokens}<fake_token_around_image>"
        if rows == 0 and cols == 0:
            return whole
        grid = "".join("".join(f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>{tokens}" for c in range(cols))
                       + "\n" for r in range(rows))
        return grid + "\n" + whole


def to_rgb(image):
    """RGB, with any transparency composited onto white (transformers' convert_to_rgb)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def _longest_edge(options: dict[str, Any], key: str, default: int) -> int:
    """A request's {"longest_edge": N} setting (size, max_image_size), or `default` where it gives none."""
    if key not in options:
        return default
    value = options[key]
    edge = value.get("longest_edge") if isinstance(value, dict) and set(value) == {"longest_edge"} else None
    if not isinstance(edge, int) or isinstance(edge, bool):
        raise RequestError(f"mm_processor_kwargs: {key} is {{'longest_edge': N}}, N a whole number of pixels; got "
                           f"{value!r}")
    return edge


def _longest_edge_to(height: int, width: int, longest: int) -> tuple[int, int]:
    """The longest edge made `longest`, the other kept in proportion and even; then both within
    transformers' 4096 (Idefics3's get_resize_output_image_size)."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > _MAX_IMAGE_SIZE:
        width, height = _MAX_IMAGE_SIZE, int(_MAX_IMAGE_SIZE / aspect)
    elif height > width and height > _MAX_IMAGE_SIZE:
        height, width = _MAX_IMAGE_SIZE, int(_MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def _multiples_of(height: int, width: int, tile: int) -> tuple[int, int]:
    """Both edges up to whole tiles (Idefics3's resize_for_vision_encoder)."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def read_optional(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data
