"""`hearth serve`: one server (hearth/server/serve.py), several models in one server (--model NAME=PATH,
--model-dir: model_app.py), or with --data-parallel-size N / --ray / --disaggregate the replicas and then
the router in front.

Each replica is `hearth serve` with the user's own arguments, followed by the ones that make it a
replica (the last occurrence of an option wins): a free port on its machine, a private API key the
router sends, no router of its own, its whole connection limit open to that one client (the router),
and its share of the CPU threads unless --threads was given.
"""

from __future__ import annotations

import os

from hearth.errors import HearthError


def replica_argv(args, host: str, threads: int | None, role: str | None = None) -> list[str]:
    from hearth.engine_args import engine_argv

    argv = list(args.argv[1:])  # the user's `serve` arguments, without the subcommand
    # "--api-key=KEY" in one word: a key that starts with "-" (token_urlsafe makes one in 64) would
    # otherwise read as an option
    argv += ["--host", host, "--port", "0", f"--api-key={args.replica_api_key}", "--data-parallel-size", "1",
             "--no-ray", "--no-disaggregate", "--no-access-log",
             # the router is a replica's one client: it may hold every connection
             "--max-connections-per-client", str(args.max_connections)]
    if role is not None:
        argv += ["--role", role]
    if args.threads is None and threads is not None:
        argv += engine_argv(threads=threads)
    return argv


def serve(args) -> None:
    """`hearth serve`'s command: replicas behind a router, or one server (with its role in a
    disaggregated set, when --role names one)."""
    from hearth.server.serve import run_server

    if args.data_parallel_size < 1:
        raise HearthError(f"--data-parallel-size must be at least 1 (got {args.data_parallel_size})")
    if args.prefill_workers < 1:
        raise HearthError(f"--prefill-workers must be at least 1 (got {args.prefill_workers})")
    if args.models or args.model_dir is not None or args.models_preset is not None:
        run_models(args)
    elif args.data_parallel_size > 1 or args.ray or args.disaggregate:
        run_router(args)
    elif args.role is None:
        run_server(args)
    else:
        from hearth.fleet.disaggregated import add_role

        run_server(args, extend_app=lambda app: add_role(app, args.role, args.api_key))


def run_models(args) -> None:
    """Several models in this one process (model_app.py)."""
    from hearth.fleet.model_app import run_models_server

    if args.model is not None:
        raise HearthError(f"give the models either as MODEL ({args.model}) or with --model/--model-dir, not both")
    if args.data_parallel_size > 1 or args.ray or args.disaggregate or args.role is not None:
        raise HearthError("--model/--model-dir serve several models in one process: not with --data-parallel-size, "
                          "--ray, --disaggregate or --role")
    if args.served_model_name is not None:
        raise HearthError("--served-model-name names the one MODEL: with --model, give the name as NAME=PATH")
    if args.cascade is not None:
        raise HearthError("--cascade serves its two models as one: not with --model/--model-dir")
    run_models_server(args)


def run_router(args) -> None:
    import uvicorn  # noqa: F401 - fail before starting replicas if the server extra is missing

    from hearth.fleet.router import Router, build_router_app, new_replica_key
    from hearth.server.limits import ServerLimits
    from hearth.server.serve import run_uvicorn

    try:
        limits = ServerLimits.from_args(args)
    except ValueError as e:
        raise HearthError(str(e)) from None
    args.replica_api_key = new_replica_key()
    # --disaggregate: the prefill workers first, then the decode workers (disaggregated.py)
    roles = [None] * args.data_parallel_size
    if args.disaggregate:
        roles = ["prefill"] * args.prefill_workers + ["decode"] * args.data_parallel_size
    if args.ray:
        from hearth.fleet.ray_replicas import RayReplicas

        replicas = RayReplicas(args, roles, replica_argv)
    else:
        from hearth.fleet.replicas import LocalReplicas

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // len(roles))
        replicas = LocalReplicas([replica_argv(args, "127.0.0.1", threads, role) for role in roles])
    try:
        urls = replicas.start()
    except RuntimeError as e:
        raise HearthError(str(e)) from None
    for i, url in enumerate(urls):
        print(f"replica {i}  {url}", flush=True)
    router = Router(replicas, policy=args.routing, replica_api_key=args.replica_api_key,
                    prefill_replicas=frozenset(range(args.prefill_workers if args.disaggregate else 0)))
    app = build_router_app(router, api_key=args.api_key, limits=limits)
    run_uvicorn(app, args, limits, on_stop=replicas.stop)
