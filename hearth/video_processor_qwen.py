"""Videos as Qwen3-VL's (and Qwen3.5's) processor makes them: transformers' Qwen3VLVideoProcessor's arithmetic
in numpy and PIL, and the text each video's marker becomes (Qwen3VLProcessor's replace_video_token).

A video (hearth/videos.py's VideoFrames: frames as given, or a file's frames sampled at `fps`): every frame
resized (BICUBIC) to one size, each side a multiple of patch_size x merge_size with the pixels of all its frames
within [min_pixels, max_pixels] (smart_resize with the frame count); rescaled and normalised; an odd count of
frames padded with its last; each pair of frames (temporal_patch_size) a group of patches laid out as an image's
(merge x merge blocks row by row), each patch its two frames' pixels. transformers resizes video frames with
torchvision (not installed here): its pixels may differ from these by the two libraries' bicubic filters.

The encoder attends within a group (transformers' cu_seqlens split a video by frame groups), so each group is
encoded, cached and placed as an image of its own (a ProcessedImage). A video's marker
`<|vision_start|><|video_pad|><|vision_end|>` (as the chat template writes a video part) becomes, per group,
`<T seconds><|vision_start|><|video_pad|> x rows x cols<|vision_end|>`, T its two frames' mean time in the source
(index / fps, 24 frames a second where the source's rate is unknown, as transformers assumes): vLLM's layout,
and that of Qwen's own processor. (transformers 5.24's processor replaces the <|video_pad|> alone, which leaves
the template's <|vision_start|> and <|vision_end|> around the timestamps too.)
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hearth.errors import ModelLoadError
from hearth.image_processor import ProcessedImage, normalise, read_optional
from hearth.videos import VideoError, VideoFrames, VideoLimits, video_frames
from hearth.vision_config import QwenVisionConfig

_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC
_MAX_ASPECT = 200
_UNKNOWN_FPS = 24.0  # transformers' assumption for frames without metadata


@dataclass(frozen=True)
class ProcessedVideo:
    groups: list[ProcessedImage]  # each pair of frames, encoded as an image of its own
    timestamps: list[float]  # each group's time in seconds


class QwenVideoProcessor:
    marker = "<|vision_start|><|video_pad|><|vision_end|>"  # a video's place in a prompt (its chat template's)
    video_token = "<|video_pad|>"  # the placeholder each of its rows replaces

    def __init__(self, vision: QwenVisionConfig, min_pixels: int = 128 * 32 * 32, max_pixels: int = 768 * 32 * 32,
                 mean: tuple[float, ...] = (0.5, 0.5, 0.5), std: tuple[float, ...] = (0.5, 0.5, 0.5),
                 rescale_factor: float = 1 / 255, resample: int = _BICUBIC, fps: float = 2.0, min_frames: int = 4,
                 max_frames: int = 768):
        self.patch, self.merge, self.temporal = vision.patch_size, vision.merge, vision.temporal_patch_size
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.mean, self.std = np.array(mean, dtype=np.float32), np.array(std, dtype=np.float32)
        self.rescale_factor, self.resample = rescale_factor, resample
        self.fps, self.min_frames, self.max_frames = fps, min_frames, max_frames

    @classmethod
    def from_hf_dir(cls, folder: Path, vision: QwenVisionConfig) -> QwenVideoProcessor:
        """video_preprocessor_config.json's settings, or processor_config.json's video_processor; transformers'
        Qwen3VLVideoProcessor's defaults where missing. Its patch, merge and temporal sizes must be the encoder's."""
        config = (read_optional(folder / "video_preprocessor_config.json")
                  or read_optional(folder / "processor_config.json").get("video_processor") or {})
        made = cls(vision)
        try:
            size = config.get("size") or {}
            made = cls(vision, int(size.get("shortest_edge", made.min_pixels)),
                       int(size.get("longest_edge", made.max_pixels)), tuple(config.get("image_mean", (0.5,) * 3)),
                       tuple(config.get("image_std", (0.5,) * 3)), float(config.get("rescale_factor", 1 / 255)),
                       int(config.get("resample", _BICUBIC)), float(config.get("fps") or 2.0),
                       int(config.get("min_frames", 4)), int(config.get("max_frames", 768)))
            sizes = (int(config.get("patch_size", made.patch)), int(config.get("merge_size", made.merge)),
                     int(config.get("temporal_patch_size", made.temporal)))
        except (TypeError, ValueError, AttributeError) as e:
            raise ModelLoadError(f"{folder}: malformed video processor settings: {e}") from None
        if sizes != (made.patch, made.merge, made.temporal) or not 0 < made.min_pixels <= made.max_pixels \
                or len(made.mean) != 3 or len(made.std) != 3 or not 1 <= made.min_frames <= made.max_frames \
                or not 0 < made.fps < 1e4:
            raise ModelLoadError(f"{folder}: video processor settings (patch, merge, temporal sizes {sizes}, pixels "
                                 f"{made.min_pixels} to {made.max_pixels}, frames {made.min_frames} to "
                                 f"{made.max_frames}, fps {made.fps}) do not fit the vision encoder's "
                                 f"{(made.patch, made.merge, made.temporal)}")
        return made

    def limits(self, max_pixels: int) -> VideoLimits:
        """How a file's frames are sampled for this model (hearth/videos.py), each frame within max_pixels, the
        sampled ones within 4 x max_pixels together."""
        return VideoLimits(max_pixels, 4 * max_pixels, max_frames=self.max_frames, fps=self.fps,
                           min_frames=self.min_frames)

    def process(self, value: Any, what: str = "the video") -> ProcessedVideo:
        """One video (VideoFrames or vLLM's forms) -> its frame groups' patches and timestamps; VideoError for a
        video of fewer than two frames, more than max_frames, or sides more than 200 times apart."""
        from PIL import Image

        video = video_frames(value, what)
        count, height, width = video.frames.shape[:3]
        if not self.temporal <= count <= self.max_frames:
            raise VideoError(f"{what} has {count} frames; this model takes {self.temporal} to {self.max_frames}")
        height, width = self.smart_resize(count, height, width, what)
        frames = [np.moveaxis(np.asarray(Image.fromarray(f).resize((width, height), self.resample)), -1, 0)
                  for f in video.frames]
        frames += frames[-1:] * (-count % self.temporal)
        pixels = np.stack([normalise(f, self.rescale_factor, self.mean, self.std) for f in frames])  # [T, 3, H, W]
        p, m, t = self.patch, self.merge, self.temporal
        rows, cols = height // p, width // p
        patches = pixels.reshape(len(frames) // t, t, 3, rows // m, m, p, cols // m, m, p)
        patches = np.ascontiguousarray(patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)).reshape(len(frames) // t,
                                                                                             rows * cols, -1)
        grid = (rows // m, cols // m)
        groups = [ProcessedImage(group, *grid, hashlib.blake2b(group.tobytes(), digest_size=16).digest(),
                                 grid[0] * grid[1], grid) for group in patches]
        return ProcessedVideo(groups, self.timestamps(video.indices, video.fps))

    def timestamps(self, indices: np.ndarray, fps: float | None) -> list[float]:
        """Each frame group's time: its first and last frames' mean (Qwen3VLProcessor._calculate_timestamps)."""
        indices = indices.tolist()
        indices += indices[-1:] * (-len(indices) % self.temporal)
        seconds = [i / (fps or _UNKNOWN_FPS) for i in indices]
        return [(seconds[i] + seconds[i + self.temporal - 1]) / 2 for i in range(0, len(seconds), self.temporal)]

    def smart_resize(self, count: int, height: int, width: int, what: str) -> tuple[int, int]:
        """The size every frame is resized to (transformers' video smart_resize): sides multiples of patch x merge,
        the pixels of all frames (counted in whole frame groups) within [min_pixels, max_pixels]."""
        factor = self.patch * self.merge
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        if max(height, width) / min(height, width) > _MAX_ASPECT:
            raise VideoError(f"{what}'s frames are {width} x {height}: their sides differ by more than {_MAX_ASPECT} "
                             "times")
        h, w = round(height / factor) * factor, round(width / factor) * factor
        t = round(count / self.temporal) * self.temporal
        if t * h * w > self.max_pixels:
            beta = math.sqrt(count * height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif t * h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (count * height * width))
            h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h, w

    def placeholder_text(self, video: ProcessedVideo) -> str:
        """The text a video's marker becomes: per frame group its timestamp, then its rows between
        <|vision_start|> and <|vision_end|>."""
        return "".join(f"<{t:.1f} seconds><|vision_start|>{self.video_token * g.num_embeds}<|vision_end|>"
                       for g, t in zip(video.groups, video.timestamps))
