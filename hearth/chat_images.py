"""The images in a conversation LLM.chat takes: OpenAI-style content parts, as vLLM's LLM.chat reads them.

A message's content is a string, or a list of parts: `{"type": "text", "text": ...}` and images as
`{"type": "image_url", "image_url": {"url": URL}}` (or `"image_url": URL`; URL a data URL or a
file:// path: nothing is fetched from the network), `{"type": "image_pil", "image_pil": IMAGE}`
(vLLM's) or `{"type": "image", "image": IMAGE or PATH}` (transformers'). The chat template gets each
image as an `{"type": "image"}` part in its place (transformers' convention, which the templates of
vision models render as their image marker), and the images come out in the conversation's order,
decoded and checked as the server's are (hearth/images.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from PIL import Image

from hearth.errors import RequestError
from hearth.images import data_url_bytes, decode_image, read_image_file

_IMAGE_PARTS = ("image_url", "image_pil", "image")


def conversation_images(conversation: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """The conversation as the chat template reads it (each image part an {"type": "image"} part) and
    its images in order; a conversation without image parts as it is. RequestError for a part that is
    neither text nor an image, or an image that cannot be read."""
    messages, images = [], []
    for message in conversation:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_is_image(part) for part in content):
            messages.append(message)
            continue
        parts = []
        for part in content:
            if not _is_image(part):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise RequestError(f"a content part is text or an image ({', '.join(_IMAGE_PARTS)}), not "
                                       f"{part.get('type') if isinstance(part, dict) else type(part).__name__!r}")
                parts.append(part)
                continue
            images.append(_read(part, f"image {len(images) + 1}"))
            parts.append({"type": "image"})
        messages.append({**message, "content": parts})
    return messages, images


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in _IMAGE_PARTS


def _read(part: dict[str, Any], what: str) -> Image.Image:
    """The image of one part: a PIL image as it is, a data URL or a file decoded."""
    value = part.get(part["type"])
    if isinstance(value, dict) and part["type"] == "image_url":
        value = value.get("url")
    if isinstance(value, Image.Image):
        return value
    if not isinstance(value, (str, Path)):
        raise RequestError(f"{what}: a {part['type']} part holds a PIL image, a data URL or a file path, not "
                           f"{type(value).__name__}")
    if isinstance(value, str) and value[:5].lower() == "data:":
        return decode_image(data_url_bytes(value, len(value), what), Image.MAX_IMAGE_PIXELS, what)
    if isinstance(value, Path) or part["type"] == "image":
        return read_image_file(Path(value), what)
    url = urlsplit(value)
    if url.scheme.lower() != "file":
        raise RequestError(f"{what}: {value[:60]!r}: LLM.chat reads data URLs, file:// paths and PIL images; it "
                           "fetches nothing from the network")
    return read_image_file(Path(unquote(url.path)), what)

