"""The images and videos in a conversation LLM.chat takes: OpenAI-style content parts, as vLLM's LLM.chat reads them.

A message's content is a string, or a list of parts: `{"type": "text", "text": ...}` and images as
`{"type": "image_url", "image_url": {"url": URL}}` (or `"image_url": URL`; URL a data URL or a
file:// path: nothing is fetched from the network), `{"type": "image_pil", "image_pil": IMAGE}`
(vLLM's) or `{"type": "image", "image": IMAGE or PATH}` (transformers'); videos (Qwen3-VL's and
Qwen3.5's) as vLLM's `{"type": "video_url", "video_url": {"url": URL}}`, URL a data:video/... URL or a
file:// path, or transformers' `{"type": "video", "video": VIDEO or PATH}` (VIDEO decoded frames or any form
multi_modal_data["video"] takes: hearth/videos.py). The chat template gets each image as an `{"type": "image"}` part in its place and each
video as a `{"type": "video"}` part (transformers' convention, which the templates of vision models
render as their markers, as the server's chat completions do), and the images and the videos come out
in the conversation's order, decoded and checked as the server's are (hearth/images.py,
hearth/videos.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from PIL import Image

from hearth.errors import RequestError
from hearth.images import data_url_bytes, decode_image, read_file_bytes
from hearth.videos import VideoError, VideoLimits, decode_video

_IMAGE_PARTS = ("image_url", "image_pil", "image")
_VIDEO_PARTS = ("video_url", "video")
_MEDIA_PARTS = (*_IMAGE_PARTS, *_VIDEO_PARTS)


def conversation_media(conversation: list[dict[str, Any]], video_limits: VideoLimits | None = None
                       ) -> tuple[list[dict[str, Any]], list[Image.Image], list[Any]]:
    """The conversation as the chat template reads it (each image part an {"type": "image"} part, each video
    part a {"type": "video"} part), its images and its videos in order; a conversation without them as it is.
    video_limits: how the model samples a video file (None: the model takes no videos). RequestError for a
    part that is neither text nor an image or a video, or one that cannot be read."""
    messages, images, videos = [], [], []
    for message in conversation:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_is_media(part) for part in content):
            messages.append(message)
            continue
        parts = []
        for part in content:
            if not _is_media(part):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise RequestError(f"a content part is text, an image ({', '.join(_IMAGE_PARTS)}) or a "
                                       f"video ({', '.join(_VIDEO_PARTS)}), not "
                                       f"{part.get('type') if isinstance(part, dict) else type(part).__name__!r}")
                parts.append(part)
            elif part["type"] in _VIDEO_PARTS:
                videos.append(_read_video(part, f"video {len(videos) + 1}", video_limits))
                parts.append({"type": "video"})
            else:
                images.append(_read_image(part, f"image {len(images) + 1}"))
                parts.append({"type": "image"})
        messages.append({**message, "content": parts})
    return messages, images, videos


def local_video_limits(video_processor: Any) -> VideoLimits | None:
    """How LLM.chat and the CLI sample a video file the user gives: as the model's video processor does, each frame
    within Pillow's pixel guard as the user's image files are (None: a model that takes no videos)."""
    return None if video_processor is None else video_processor.limits(Image.MAX_IMAGE_PIXELS)


def _is_media(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in _MEDIA_PARTS


def _read_image(part: dict[str, Any], what: str) -> Image.Image:
    """The image of one part: a PIL image as it is, a data URL or a file decoded."""
    value = _url_or_value(part)
    if isinstance(value, Image.Image):
        return value
    if not isinstance(value, (str, Path)):
        raise RequestError(f"{what}: a {part['type']} part holds a PIL image, a data URL or a file path, not "
                           f"{type(value).__name__}")
    if isinstance(value, str) and value[:5].lower() == "data:":
        return decode_image(data_url_bytes(value, len(value), what), Image.MAX_IMAGE_PIXELS, what)
    path = Path(value) if isinstance(value, Path) or part["type"] == "image" else _file_path(value, what)
    return decode_image(read_file_bytes(path, what), Image.MAX_IMAGE_PIXELS, f"{what} ({path})")


def _read_video(part: dict[str, Any], what: str, limits: VideoLimits | None) -> Any:
    """The sampled frames of one video part: a data URL or a file decoded (hearth/videos.py), a `video` part's
    frames as they are (the engine checks them)."""
    if limits is None:
        raise VideoError(f"{what}: this model takes no videos ({part['type']}): hearth runs the videos of Qwen3-VL "
                         "and Qwen3.5")
    value = _url_or_value(part)
    if part["type"] == "video" and not isinstance(value, (str, Path)):
        return value
    if not isinstance(value, (str, Path)):
        raise RequestError(f"{what}: a video_url part holds a data URL or a file:// path, not {type(value).__name__}")
    if isinstance(value, str) and value[:5].lower() == "data:":
        return decode_video(data_url_bytes(value, len(value), what, "video"), limits, what)
    path = Path(value) if part["type"] == "video" else _file_path(value, what)
    return decode_video(read_file_bytes(path, what), limits, f"{what} ({path})")


def _url_or_value(part: dict[str, Any]) -> Any:
    """A part's value: an `*_url` part's URL (given as {"url": URL} or as URL), another part's value as it is."""
    value = part.get(part["type"])
    return value.get("url") if isinstance(value, dict) and part["type"].endswith("_url") else value


def _file_path(url: str, what: str) -> Path:
    """The path of a file:// URL; RequestError for any other URL (LLM.chat fetches nothing)."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "file":
        raise RequestError(f"{what}: {url[:60]!r}: LLM.chat reads data URLs, file:// paths and PIL images; it "
                           "fetches nothing from the network")
    return Path(unquote(parts.path))
