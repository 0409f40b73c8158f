"""Images in requests: where each comes from (a data URL, or a remote URL of an allowed domain),
read within the server's limits and decoded (hearth/images.py), in the order the messages give them.

Every API's image part comes here as one URL: OpenAI's `image_url` parts (chat completions),
`input_image` items (responses.py) and Anthropic's `image` blocks (messages.py; a base64 source
as a data URL). A remote URL is fetched only from the hosts named by `--allowed-media-domains`
(exactly, as vLLM's option), redirects not followed, within --image-fetch-timeout and
--max-image-size; otherwise it gets a 400 that says so. Every failure is an ImageError: a 400 in
the route's own API shape, raised before anything reaches the engine. Videos (vLLM's `video_url` parts of
chat completions) come the same ways and are decoded by hearth/videos.py (a VideoError, a 400 too).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx
from PIL import Image

from hearth.images import ImageError, data_url_bytes, decode_image
from hearth.server.limits import ServerLimits
from hearth.videos import VideoError, VideoFrames, VideoLimits, decode_video


class ImageSources:
    """How this server reads the images of a request: its limits, and the hosts it may fetch from."""

    def __init__(self, limits: ServerLimits, allowed_media_domains: tuple[str, ...] = ()) -> None:
        self.limits = limits
        self.allowed_media_domains = frozenset(d.lower() for d in allowed_media_domains)

    async def load(self, urls: list[str]) -> list[Image.Image]:
        """The images, decoded in a thread each, in order; ImageError at the first that fails."""
        limit = self.limits.max_images_per_request
        if len(urls) > limit:
            raise ImageError(f"this request has {len(urls)} images; this server's limit is {limit} "
                             "(--max-images-per-request)")
        images = []
        for i, url in enumerate(urls, 1):
            what = f"image {i}" if len(urls) > 1 else "the image"
            data = await self.read(url, what)
            images.append(await asyncio.to_thread(decode_image, data, self.limits.max_image_pixels, what))
        return images

    async def load_videos(self, urls: list[str], limits: Callable[[int], VideoLimits] | None) -> list[VideoFrames]:
        """The videos (vLLM's `video_url` parts), each decoded in a thread and sampled as the model's processor
        samples (`limits`: its VideoLimits for a frame's most pixels; None: the model takes no videos), in order;
        VideoError at the first that fails. They count against --max-images-per-request and --max-image-size."""
        if not urls:
            return []
        if limits is None:
            raise VideoError("this model takes no videos (video_url): hearth runs the videos of Qwen3-VL and Qwen3.5")
        if len(urls) > self.limits.max_images_per_request:
            raise VideoError(f"this request has {len(urls)} videos; this server's limit is "
                             f"{self.limits.max_images_per_request} (--max-images-per-request)")
        videos = []
        for i, url in enumerate(urls, 1):
            what = f"video {i}" if len(urls) > 1 else "the video"
            data = await self.read(url, what, "video")
            videos.append(await asyncio.to_thread(decode_video, data, limits(self.limits.max_image_pixels), what))
        return videos

    async def read(self, url: str, what: str, kind: str = "image") -> bytes:
        if url[:5].lower() == "data:":
            return data_url_bytes(url, self.limits.max_image_bytes, what, kind)
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise ImageError(f"{what}: {url[:60]!r} is neither a data URL (data:image/png;base64,...) "
                             "nor an http(s) URL")
        if parts.hostname.lower() not in self.allowed_media_domains:
            raise ImageError(f"{what}: this server does not fetch images from {parts.hostname} (send the image as a "
                             "data URL, or start the server with --allowed-media-domains naming that host)")
        try:
            async with asyncio.timeout(self.limits.image_fetch_timeout):
                return await self._fetch(url, what)
        except TimeoutError:
            raise ImageError(f"{what}: {url[:80]} did not arrive within {self.limits.image_fetch_timeout:g} s "
                             "(--image-fetch-timeout)") from None
        except httpx.HTTPError as e:
            raise ImageError(f"{what}: fetching {url[:80]} failed: {type(e).__name__}: {e}") from None

    async def _fetch(self, url: str, what: str) -> bytes:
        max_bytes = self.limits.max_image_bytes
        too_big = ImageError(f"{what}: {url[:80]} is larger than this server's limit of {max_bytes:,} bytes "
                             "(--max-image-size)")
        async with httpx.AsyncClient(follow_redirects=False) as client, client.stream("GET", url) as response:
            if response.status_code != 200:
                raise ImageError(f"{what}: {url[:80]} answered HTTP {response.status_code}")
            if int(response.headers.get("content-length") or 0) > max_bytes:
                raise too_big
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > max_bytes:
                    raise too_big
            return bytes(data)
