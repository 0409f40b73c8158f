"""One engine's HTTP server: load the model, start the engine thread, run the HTTP API under uvicorn.

`hearth serve` is the fleet's (hearth/fleet/launch.py): this server, or with --data-parallel-size N
(or --ray, --disaggregate) a router in front of N replicas, each of them this same server started
as a process of its own; the router's app runs under run_uvicorn too.

SIGTERM or Ctrl-C: uvicorn stops accepting connections and lets the open requests finish
for up to --shutdown-timeout seconds, then cancels them (which aborts them in the engine);
the engine thread (or the replicas) is stopped and the command exits with status 0.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable


def run_server(args, extend_app: Callable | None = None) -> None:
    """Serve one engine; extend_app(app), when given, adds to the app before it serves (the fleet's
    additions: a disaggregated worker's role)."""
    from hearth.engine.async_engine import AsyncEngine, build_on_passing_thread
    from hearth.engine_args import build_llm
    from hearth.server.app import build_app
    from hearth.server.batch_store import default_batch_dir
    from hearth.server.limits import ServerLimits

    try:
        limits = ServerLimits.from_args(args)
    except ValueError as e:
        sys.exit(f"hearth serve: {e}")
    engine = build_on_passing_thread(lambda: build_llm(args).engine)  # (the engine thread its only OpenMP team)
    name = args.served_model_name or args.model or engine.model_path.name
    async_engine = AsyncEngine(engine, max_queue=args.max_queue, step_timeout=args.step_timeout)
    batch_dir = args.batch_dir or default_batch_dir()
    app = build_app(async_engine, name, api_key=args.api_key, limits=limits, tool_call_parser=args.tool_call_parser,
                    batch_dir=batch_dir, trust_request_chat_template=args.trust_request_chat_template,
                    allowed_media_domains=tuple(args.allowed_media_domains or ()))
    if extend_app is not None:
        extend_app(app)
    print(f"model      {engine.model_path} (served as {name!r}), {engine.device} {str(engine.dtype).removeprefix('torch.')}")
    print(f"batches    {batch_dir}")
    print(f"KV cache   {engine.kv_cache_tokens:,} tokens ({engine.num_blocks:,} blocks of {engine.config.cache.block_size}, "
          f"{engine.kv_cache_bytes / 2**20:.1f} MiB of {engine.kv_cache_dtype}); context {engine.max_model_len:,} tokens")
    if engine.cascade_totals is not None:
        print(f"cascade    starts on {engine.small.model_path}, moves to {engine.large.model_path} after a token "
              f"drawn with p < {engine.defer_threshold:g}")
    sys.stdout.flush()
    run_uvicorn(app, args, limits, on_stop=async_engine.shutdown)


def log_hearth(level: str) -> None:
    """hearth's own log lines (a cascade's moves, models loaded) on stderr at --log-level, beside uvicorn's
    (without a handler only warnings and errors would show)."""
    log = logging.getLogger("hearth")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     hearth: %(message)s"))
        log.addHandler(handler)
    log.setLevel(level.upper())


def run_uvicorn(app, args, limits, on_stop) -> None:
    """Serve `app` until SIGTERM / Ctrl-C, printing the 'listening' line once bound; then on_stop()."""
    import uvicorn

    from hearth.server.connections import uvicorn_config

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                print(f"listening  http://{host}:{port}/v1  (metrics at /metrics)", flush=True)

    log_hearth(args.log_level)
    config = uvicorn_config(
        app, limits, host=args.host, port=args.port, access_log=args.access_log, log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    # uvicorn handles SIGTERM/SIGINT itself, then re-raises the signal once it has stopped: the
    # shutdown below is the rest of that handling, so the re-raised signal does nothing.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        Server(config).run()
    finally:
        on_stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("stopped", flush=True)
