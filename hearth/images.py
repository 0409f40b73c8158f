"""Images from untrusted bytes: decoded whole by Pillow, or refused with an ImageError that says why.

An image is read only where its format is one of FORMATS, its size (from the header, before any
pixel is decoded) within `max_pixels`, and its file whole: `verify()` checks what the format can
check without decoding (a PNG's chunk CRCs), then `load()` decodes every pixel, so a truncated file
fails here and not later in a vision encoder. Pillow's decompression-bomb guard stays on behind the
pixel limit. The server (hearth/server/images.py), LLM.chat (hearth/chat_images.py) and the CLI read
images through `decode_image`, files (images' and videos') through `read_file_bytes`; a data URL's bytes come
out of it through `data_url_bytes`.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from hearth.errors import RequestError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what clients send; Pillow reads many more (TIFF, PSD, ICO...)
_DATA_URL = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),", re.IGNORECASE)


class ImageError(RequestError):
    """An image that cannot be read, or one past a limit."""


def decode_image(data: bytes, max_pixels: int, what: str = "the image") -> Image.Image:
    """The image in `data`, every pixel decoded (its first frame, for an animation), in its own mode;
    ImageError for anything else. `what` names the image in the message (e.g. "image 2")."""
    if len(data) < 8:
        raise ImageError(f"{what} is {len(data)} bytes: too short to be an image")
    image = _open(data, what)
    width, height = image.size
    if width * height > max_pixels:
        raise ImageError(f"{what} is {width} x {height} = {width * height:,} pixels; this server's limit is "
                         f"{max_pixels:,} (--max-image-pixels)")
    if width == 0 or height == 0:
        raise ImageError(f"{what} is {width} x {height} pixels: empty")
    try:
        image.verify()  # a fresh open after: verify() leaves the image unusable
        image = _open(data, what)
        image.load()
    except Image.DecompressionBombError as e:
        raise ImageError(f"{what} is refused as a decompression bomb: {e}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # Pillow's ways of saying a file is broken
        raise ImageError(f"{what} is damaged or truncated ({image.format}): {e}") from None
    return image


def _open(data: bytes, what: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise ImageError(f"{what} is refused as a decompression bomb: {e}") from None
    except UnidentifiedImageError:
        raise ImageError(f"{what} is not an image in a format this server reads ({', '.join(FORMATS)})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(f"{what} is damaged: {e}") from None
    if image.format not in FORMATS:
        raise ImageError(f"{what} is {image.format}, a format this server does not take ({', '.join(FORMATS)})")
    return image


def data_url_bytes(url: str, max_bytes: int, what: str, kind: str = "image") -> bytes:
    """The bytes a `data:image/...;base64,` URL holds (kind "video": data:video/...); ImageError for another shape
    or past max_bytes (judged from the text's length, before decoding)."""
    match = _DATA_URL.match(url)
    if match is None:
        raise ImageError(f"{what}: a data URL is data:{kind}/TYPE;base64,DATA (got {url[:40]!r}...)")
    media_type, params = match.group(1).lower(), match.group(2).lower().split(";")
    if not media_type.startswith(f"{kind}/"):
        article = "an" if kind == "image" else "a"
        raise ImageError(f"{what}: the data URL's media type is {media_type or 'missing'!r}, not {article} {kind}'s")
    if "base64" not in params:
        raise ImageError(f"{what}: the data URL is not base64 (data:{media_type};base64,...)")
    payload = url[match.end():]
    if len(payload) // 4 * 3 > max_bytes:
        raise ImageError(f"{what} is about {len(payload) // 4 * 3:,} bytes; this server's limit is {max_bytes:,} "
                         "(--max-image-size)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{what}: the data URL's base64 is broken: {e}") from None


def read_file_bytes(path: Path, what: str) -> bytes:
    """A file's bytes (an image's or a video's, given by path); ImageError where it cannot be read."""
    try:
        return path.read_bytes()
    except OSError as e:
        raise ImageError(f"{what}: cannot read {path}: {e.strerror}") from None


def read_image_file(path: Path, what: str) -> Image.Image:
    """An image file, read and decoded as decode_image does (no pixel limit but Pillow's bomb guard)."""
    return decode_image(read_file_bytes(path, what), Image.MAX_IMAGE_PIXELS, f"{what} ({path})")
