"""Videos in: the forms a request gives a video in, as one shape (VideoFrames), and video files from untrusted
bytes, decoded by PyAV (the `video` extra: `pip install hearth[video]`) or refused with a VideoError that says why.

A video reaches a processor as its frames (uint8 [T, H, W, 3], RGB), the frame rate of its source (None where
unknown) and each frame's index in its source (the frame timestamps Qwen3-VL writes into the prompt come from
these two). vLLM's forms: a numpy array [T, H, W, 3], a list of PIL images, either one with its metadata as a
pair `(frames, {"fps": ...})`. A file (mp4, webm, mkv, ...) is sampled as transformers' Qwen3VLVideoProcessor
samples one (sample_indices: `fps` frames a second, at least min_frames, at most max_frames) and only those
frames are kept. Every limit is checked from the container's header before a frame is decoded where the header
says it, and again while decoding where it does not.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from hearth.errors import RequestError


class VideoError(RequestError):
    """A video that cannot be read, or one past a limit."""


@dataclass(frozen=True)
class VideoFrames:
    frames: np.ndarray  # uint8 [T, H, W, 3], RGB
    fps: float | None  # the source's frames a second (None: unknown)
    indices: np.ndarray  # int64 [T]: each frame's index in the source


@dataclass(frozen=True)
class VideoLimits:
    """What a video may hold: pixels a frame, frames in the file, frames kept (sampled), and how it is sampled."""

    max_pixels: int  # a frame's width x height
    max_total_pixels: int  # the kept frames' pixels together (what is held decoded)
    max_source_frames: int = 10_000  # frames in the file, decoded (at most) to find the sampled ones
    max_frames: int = 768  # frames kept
    fps: float = 2.0  # frames kept a second of video (transformers' Qwen3VLVideoProcessor: 2)
    min_frames: int = 4


def sample_indices(total: int, source_fps: float | None, fps: float, min_frames: int, max_frames: int) -> np.ndarray:
    """The frames of a video of `total` frames kept (transformers' Qwen3VLVideoProcessor.sample_frames): `fps` a
    second (the source's rate 24 where unknown), within [min_frames, max_frames] and at most all, evenly spread."""
    count = int(total / (source_fps or 24) * fps)
    count = min(max(count, min_frames), max_frames, total)
    return np.linspace(0, total - 1, count).round().astype(np.int64)


def video_frames(value: Any, what: str = "the video") -> VideoFrames:
    """One video of multi_modal_data["video"] as VideoFrames; VideoError for another shape."""
    from PIL import Image

    if isinstance(value, VideoFrames):
        return value
    metadata: dict = {}
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        value, metadata = value
    fps = metadata.get("fps")
    if fps is not None and (not isinstance(fps, (int, float)) or isinstance(fps, bool) or not 0 < fps < 1e4):
        raise VideoError(f"{what}: its metadata's fps is {fps!r}; expected a positive number of frames a second")
    if isinstance(value, (list, tuple)) and value and all(isinstance(f, Image.Image) for f in value):
        from hearth.image_processor import to_rgb

        sizes = {f.size for f in value}
        if len(sizes) > 1:
            raise VideoError(f"{what}: its frames differ in size ({', '.join(map(str, sorted(sizes)))}); a video's "
                             "frames share one size")
        value = np.stack([np.asarray(to_rgb(f)) for f in value])
    if not isinstance(value, np.ndarray) or value.dtype != np.uint8 or value.ndim != 4 or value.shape[-1] != 3 \
            or 0 in value.shape:
        shape = f"{value.dtype} {list(value.shape)}" if isinstance(value, np.ndarray) else type(value).__name__
        raise VideoError(f"{what} is a uint8 numpy array [frames, height, width, 3] or a list of PIL images (either "
                         f"one alone or with its metadata: (frames, {{'fps': ...}})), not {shape}")
    return VideoFrames(value, None if fps is None else float(fps), np.arange(len(value), dtype=np.int64))


def decode_video(data: bytes, limits: VideoLimits, what: str = "the video") -> VideoFrames:
    """The sampled frames of a video file; VideoError for anything that is not a whole video within `limits`
    (a stream that ends early gives the sampled frames that decode)."""
    try:
        import av
    except ImportError:
        raise VideoError(f"{what}: this hearth reads no video files: PyAV is not installed "
                         "(pip install 'hearth[video]')") from None
    if len(data) < 16:
        raise VideoError(f"{what} is {len(data)} bytes: too short to be a video")
    try:
        total, fps, pixels = _count_frames(av, data, limits, what)
        keep = sample_indices(total, fps, limits.fps, limits.min_frames, limits.max_frames)
        if len(keep) * pixels > limits.max_total_pixels:
            raise VideoError(f"{what}'s {len(keep)} sampled frames are {len(keep) * pixels:,} pixels together; this "
                             f"server's limit is {limits.max_total_pixels:,}")
        wanted, indices, kept = set(keep.tolist()), [], []
        with av.open(io.BytesIO(data), mode="r") as container:
            for n, frame in enumerate(container.decode(container.streams.video[0])):
                _check_frame_size(frame.width, frame.height, limits, what)
                if n in wanted:
                    indices.append(n)
                    kept.append(frame.to_ndarray(format="rgb24"))
                if n >= keep[-1]:
                    break
    except VideoError:
        raise
    except (av.FFmpegError, ValueError, OSError, EOFError, IndexError) as e:  # PyAV's ways of saying a file is broken
        raise VideoError(f"{what} is damaged, truncated or not a video: {e}") from None
    if len(kept) < 2:
        raise VideoError(f"{what} has {len(kept)} frame(s) that decode; a video needs at least 2")
    return VideoFrames(np.stack(kept), fps, np.array(indices, dtype=np.int64))


def _count_frames(av, data: bytes, limits: VideoLimits, what: str) -> tuple[int, float | None, int]:
    """The frames of the file's first video stream (its header's count, else counted by decoding them), its
    frame rate and a frame's pixels; VideoError past the limits, judged from the header where it says them."""
    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.video:
            raise VideoError(f"{what} holds no video stream")
        stream = container.streams.video[0]
        _check_frame_size(stream.codec_context.width, stream.codec_context.height, limits, what)
        total, fps = stream.frames, float(stream.average_rate) if stream.average_rate else None
        if not total:  # (webm, mkv: no count in the header)
            for total, frame in enumerate(container.decode(stream), 1):
                _check_frame_size(frame.width, frame.height, limits, what)
                if total > limits.max_source_frames:
                    break
    if total > limits.max_source_frames:
        raise VideoError(f"{what} has {total:,}{'+' * (not stream.frames)} frames; this server's limit is "
                         f"{limits.max_source_frames:,}")
    return total, fps, stream.codec_context.width * stream.codec_context.height


def _check_frame_size(width: int, height: int, limits: VideoLimits, what: str) -> None:
    if width * height > limits.max_pixels:
        raise VideoError(f"{what}'s frames are {width} x {height} = {width * height:,} pixels; this server's limit "
                         f"is {limits.max_pixels:,} (--max-image-pixels)")
    if width <= 0 or height <= 0:
        raise VideoError(f"{what}'s frames are {width} x {height} pixels: empty")
