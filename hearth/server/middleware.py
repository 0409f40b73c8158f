"""ASGI middleware in front of every route: the API key, the count of requests in flight, the body.

A request body is read here, whole, before any route sees it: past the body limit (declared
in Content-Length or counted as it streams in) it is a 413 at once, and a body slower than the
body timeout is a 408, so a hostile client can neither fill memory nor hold a route. The count
of requests in flight has a bound (503 past it); PUBLIC_PATHS stay outside the count and open
without the key, so that monitoring sees a busy server as busy, not dead.
"""

from __future__ import annotations

import asyncio
import hmac
import time

from hearth.server.errors import error_response
from hearth.server.page import PAGE_PATHS

PUBLIC_PATHS = ("/health", "/metrics", "/version", *PAGE_PATHS)  # the chat page asks for the key itself


class BearerAuth:
    """Every path but PUBLIC_PATHS needs `Authorization: Bearer <api_key>`, or `x-api-key: <api_key>`
    as Anthropic's clients send it (compared in constant time)."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.bearer, self.key = app, f"Bearer {api_key}".encode(), api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            headers = dict(scope["headers"])
            if not (hmac.compare_digest(headers.get(b"authorization", b""), self.bearer)
                    or hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)):
                await error_response(401, "invalid or missing API key (Authorization: Bearer ... or x-api-key: ...)",
                                     path=scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: read the body (at most `max_bytes`, within `timeout` s), then hand it on."""

    def __init__(self, app, max_bytes: int, timeout: float) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit():
            await error_response(400, "the Content-Length header is not a number", path=scope["path"])(
                scope, receive, send)
            return
        if int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks, size, deadline = [], 0, time.monotonic() + self.timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                await error_response(408, f"the request body did not arrive within {self.timeout:g} s",
                                     path=scope["path"])(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, replaying(b"".join(chunks), receive), send)

    async def _too_large(self, scope, receive, send) -> None:
        await error_response(413, f"the request body is larger than this server's limit of {self.max_bytes:,} bytes",
                             "body", scope["path"])(scope, receive, send)


def replaying(body: bytes, receive):
    """An ASGI receive that gives `body` whole first, then what comes after it (the client's disconnect)."""
    replayed = False

    async def replay() -> dict:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class ConcurrencyLimit:
    """ASGI middleware: at most `limit` requests in flight (but PUBLIC_PATHS), a 503 for more."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit, self.in_flight = app, limit, 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            await error_response(503, f"the server is busy: {self.in_flight} requests are in flight "
                                      f"(limit {self.limit}); retry later", path=scope["path"])(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


def install_middleware(app, limits, api_key: str | None) -> None:
    """The limits met before a route (hearth/server/limits.py's ServerLimits) and the API key.
    The last added runs first: count the request, check its key, then read its body."""
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes, timeout=limits.body_timeout)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    app.add_middleware(ConcurrencyLimit, limit=limits.max_concurrent_requests)
