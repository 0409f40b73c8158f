"""The limits a public server needs (ServerLimits), and their `hearth serve` options.

connections.py enforces those of the sockets (how many, how many per client, how long a request's
head may take); middleware.py those met before a route (body size and time, requests in flight);
ServedModel checks the rest per request (prompt and output tokens, sequences, time), images.py those of images.
Only the standard library is imported: the CLI imports this to build its parser.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_body_bytes: int = 4 * 2**20  # a context of 128k tokens, as text or as ids, is ~1 MiB
    body_timeout: float = 30.0  # seconds to receive a request's whole body
    max_prompt_tokens: int | None = None  # None: the model's context length
    max_output_tokens: int | None = None  # cap on max_tokens (and its value when a request gives none)
    max_sequences: int = 64  # sequences one request may start: prompts x max(n, best_of)
    request_timeout: float | None = 600.0  # seconds from arrival to the last token (None: no limit)
    max_concurrent_requests: int = 512  # requests in flight, streaming ones included
    max_connections: int = 1000  # open sockets, idle keep-alive ones included (a process has ~1,024 files)
    header_timeout: float = 5.0  # seconds a connection has to send a request's head (line and headers)
    max_connections_per_client: int = 256  # open sockets of one client address
    # images in requests (hearth/server/images.py): each one's bytes and pixels (25 MP: a phone's photo; Pillow's
    # own guard is at 89 MP), how many one request may bring, and how long a remote one may take to fetch
    max_image_bytes: int = 10 * 2**20
    max_image_pixels: int = 25_000_000
    max_images_per_request: int = 8
    image_fetch_timeout: float = 10.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value <= 0:
                raise ValueError(f"{f.name} must be positive, got {value}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerLimits":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


_HELP = {
    "max_body_bytes": ("--max-body-size", "largest request body in bytes, or e.g. 8MiB"),
    "body_timeout": ("--body-timeout", "seconds a client has to send a request's body"),
    "max_prompt_tokens": ("--max-prompt-tokens", "longest prompt in tokens (none: the context)"),
    "max_output_tokens": ("--max-output-tokens",
                          "largest max_tokens, and its value when a request gives none (none: the context)"),
    "max_sequences": ("--max-sequences", "sequences one request may start: prompts x max(n, best_of)"),
    "request_timeout": ("--request-timeout", "seconds a request may run before it is stopped with a 408"),
    "max_concurrent_requests": ("--max-concurrent-requests", "requests in flight, streams included, before 503s"),
    "max_connections": ("--max-connections", "open connections, idle ones included, before 503s"),
    "max_connections_per_client": ("--max-connections-per-client",
                                   "open connections of one client address, idle ones included, before 429s"),
    "header_timeout": ("--header-timeout",
                       "seconds a connection has to send a request's head, from its opening or its last response"),
    "max_image_bytes": ("--max-image-size", "largest image in bytes (a data URL's, or fetched), or e.g. 20MiB"),
    "max_image_pixels": ("--max-image-pixels", "largest image in pixels, width x height, read from its header"),
    "max_images_per_request": ("--max-images-per-request", "images one request may bring"),
    "image_fetch_timeout": ("--image-fetch-timeout",
                            "seconds to fetch a remote image (from --allowed-media-domains only)"),
}


def add_limit_arguments(p: argparse.ArgumentParser, parse_size) -> None:
    """One option per ServerLimits field, with its default; `parse_size` reads '8MiB'."""
    g = p.add_argument_group("limits (past one: an OpenAI-shaped 4xx error, or a 503 while busy)")
    for f in fields(ServerLimits):
        flag, text = _HELP[f.name]
        kind = parse_size if f.name.endswith("_bytes") else (float if "timeout" in f.name else int)
        g.add_argument(flag, dest=f.name, type=kind, default=f.default, help=text + " (default %(default)s)".replace("None", "none"))
