"""The connection layer's limits, enforced in uvicorn's protocol: how many sockets, how many of them
one client may hold, and how long a connection may take to send a request's head.

A connection is let in while its client address holds fewer than `max_connections_per_client` and the
server fewer than `max_connections` (ConnectionCounts). One past a limit is not counted: it is answered
with OpenAI's error JSON (429 past its client's share, 503 past the server's) on any path but /health
(monitoring sees a busy server as busy, not dead), and closed at once after, or after
REFUSED_HEAD_TIMEOUT if it sends nothing. So a thousand idle sockets from one client hold that client's
share only: /health and the other clients are answered.

A connection that sends nothing, or trickles a request line and headers a byte at a time, would hold
its place for ever (uvicorn times out idle keep-alive connections only after a response, and any byte
resets that timer). `HeadDeadlineH11` closes a connection that has not sent a whole request head within
`header_timeout` seconds of opening or of its last response; a body that arrives too slowly is
BodyLimit's (middleware.py) to time out. A malformed request head gets a 400 in the same JSON.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections import Counter
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from hearth.server.errors import error_body, error_response
from hearth.server.limits import ServerLimits

REFUSED_HEAD_TIMEOUT = 1.0  # seconds a connection past a limit has to send its request (to read the error)
ANSWERED_WHEN_REFUSED = ("/health",)


class ConnectionCounts:
    """The connections let in, in all and per client address (one object per server)."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.total = 0
        self.per_client: Counter[str] = Counter()

    def admit(self, client: str) -> tuple[int, str] | None:
        """Let a new connection in (None, counted), or the status and message that refuse it."""
        held, share = self.per_client[client], self.limits.max_connections_per_client
        if held >= share:
            return 429, (f"this client ({client}) has {held} open connections, this server's limit per client "
                         f"is {share}: close idle ones or retry later")
        if self.total >= self.limits.max_connections:
            return 503, f"the server has {self.total} open connections (limit {self.limits.max_connections}); retry later"
        self.total += 1
        self.per_client[client] += 1
        return None

    def release(self, client: str) -> None:
        self.total -= 1
        self.per_client[client] -= 1
        if not self.per_client[client]:
            del self.per_client[client]


class Refused:
    """The app of a connection past a limit: /health as usual, any other path the error; then closed."""

    def __init__(self, app, status: int, message: str) -> None:
        self.app, self.status, self.message = app, status, message

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] in ANSWERED_WHEN_REFUSED:
            await self.app(scope, receive, send)
            return
        response = error_response(self.status, self.message)
        response.headers["connection"] = "close"
        await response(scope, receive, send)


class HeadDeadlineH11(H11Protocol):
    def __init__(self, *args: Any, head_timeout: float, counts: ConnectionCounts, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timeout = head_timeout
        self.counts = counts
        self._counted_as: str | None = None  # the client address this connection is counted under
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        client = self.client[0] if self.client else ""
        refusal = self.counts.admit(client)
        if refusal is None:
            self._counted_as = client
        else:
            self.app = Refused(self.app, *refusal)
            self.head_timeout = min(self.head_timeout, REFUSED_HEAD_TIMEOUT)
        self._start_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._start_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        if self._counted_as is not None:
            self.counts.release(self._counted_as)
            self._counted_as = None

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a malformed request head, in OpenAI's error JSON rather than plain text."""
        body = json.dumps(error_body(400, msg)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _start_head_deadline(self) -> None:
        waiting_after = self.cycle  # a new request's head replaces the cycle

        def expire() -> None:
            if self.cycle is waiting_after and not self.transport.is_closing():
                self.transport.close()

        if self._head_deadline is not None:  # one pending deadline per connection, not one per response
            self._head_deadline.cancel()
        self._head_deadline = self.loop.call_later(self.head_timeout, expire)


def uvicorn_config(app, limits: ServerLimits, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration for `app` under `limits` (options: host, port, log settings...)."""
    counts = ConnectionCounts(limits)
    return uvicorn.Config(app, http=functools.partial(HeadDeadlineH11, head_timeout=limits.header_timeout,
                                                      counts=counts), **options)
