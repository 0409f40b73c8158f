"""Images from untrusted bytes: decoded whole by Pillow, or refused with an ImageError that says why.

An image is read only where its format is one of FORMATS, its size (from the header, before any
pixel is decoded) within `max_pixels`, and its file whole: `verify()` checks what the format can
check without decoding (a PNG's chunk CRCs), then `load()` decodes every pixel, so a truncated file
fails here and not later in a vision encoder. Pillow's decompression-bomb guard stays on behind the
pixel limit. The server (hearth/server/images.py) and the CLI read images through `decode_image`.
"""

from __future__ import annotations

import io

from PIL import Image, UnidentifiedImageError

from hearth.errors import RequestError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what clients send; Pillow reads many more (TIFF, PSD, ICO...)


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
