"""The connection layer's limits, enforced by uvicorn itself: how many sockets, and how long a
connection may take to send a request's head.

uvicorn counts open connections and answers 503 to a request that arrives while its
`limit_concurrency` is reached; a connection that sends nothing, or trickles a request line and
headers a byte at a time, would hold its place for ever (uvicorn times out idle keep-alive
connections only after a response, and any byte resets that timer). `HeadDeadlineH11` closes a
connection that has not sent a whole request head within `head_timeout` seconds of opening or of
its last response; a body that arrives too slowly is BodyLimit's (middleware.py) to time out.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from hearth.server.limits import ServerLimits


class HeadDeadlineH11(H11Protocol):
    def __init__(self, *args: Any, head_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timeout = head_timeout
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._start_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._head_deadline is not None:
            self._head_deadline.cancel()

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
    return uvicorn.Config(
        app,
        http=functools.partial(HeadDeadlineH11, head_timeout=limits.header_timeout),
        # uvicorn answers 503 once open connections, the asking one included, reach the limit
        limit_concurrency=limits.max_connections + 1,
        **options,
    )
