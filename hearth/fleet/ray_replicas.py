"""Replicas as Ray actors (`hearth serve --ray`): Ray places them on its cluster and restarts them.

Each actor runs one replica process (replicas.ReplicaProcess: `hearth serve` on a free port of the
actor's machine, bound to that machine's address so the router can reach it). An actor that dies
is restarted by Ray (max_restarts=-1) and starts its replica again; a replica process that dies
under a living actor is started again by the actor when the router asks for it.

With --disaggregate the actors of prefill workers also hand out prompts' KV through Ray's object
store (disaggregated.py): a decode worker, which joins the cluster for this, calls prefill_kv on
the actor the router names; the actor asks its replica over its machine's network
(POST /kv/prefill) and puts the answer into the object store, from which Ray moves it to the
decode worker's machine.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from hearth.fleet.kv_route import KV_PATH, RAY_SCHEME, auth_headers, check_kv_answer
from hearth.fleet.replicas import ReplicaProcess

START_TIMEOUT = 600.0  # seconds a replica may take to load its model
KV_CONCURRENCY = 64  # prefill_kv calls an actor serves at once (its replica batches their prompts)


def _actor_class():
    import ray

    @ray.remote(max_restarts=-1, concurrency_groups={"kv": KV_CONCURRENCY})
    class ReplicaActor:
        """Starts its replica from __init__ (the actor's main thread) or ensure (the default concurrency
        group's one thread): threads that live as long as the actor, so the replica's parent-death
        signal follows the actor. prefill_kv runs on threads of its own, many at once."""

        def __init__(self, argv: list[str], name: str, api_key: str) -> None:
            host = ray.util.get_node_ip_address()
            self.replica = ReplicaProcess([*argv, "--host", host], name)
            self.api_key = api_key
            self.ensure()

        def ensure(self) -> str:
            """The replica's URL, after starting it again if its process has ended."""
            if not self.replica.alive:
                self.replica.launch()
                self.replica.wait_ready(START_TIMEOUT)
            return self.replica.url

        def pid(self) -> int:
            return self.replica.process.pid

        @ray.method(concurrency_group="kv")
        def prefill_kv(self, ids: list[int]) -> list:
            """A prefill worker's: the prompt computed by the replica and its KV, as POST /kv/prefill
            answers it, put into this machine's object store: [its ObjectRef] (nested, so that the
            caller knows when the prompt is done before the transfer starts)."""
            import httpx

            if not self.replica.alive:
                raise RuntimeError(f"{self.replica.name} is not running")
            answer = httpx.post(f"{self.replica.url}{KV_PATH}", json={"prompt_token_ids": ids},
                                headers=auth_headers(self.api_key), timeout=None)
            return [ray.put(check_kv_answer(answer.status_code, answer.content))]

        def stop(self) -> None:
            """Stop the replica and reap it: killing the actor alone would leave it exiting, or a
            zombie where nothing reaps orphans, after the router has gone."""
            self.replica.stop()

    return ReplicaActor


class RayReplicas:
    def __init__(self, args, roles: list[str | None], replica_argv: Callable[..., list[str]]) -> None:
        """One actor a replica, each started with its role (None, "prefill" or "decode") and the
        arguments replica_argv(args, host, threads, role) gives (launch.py's)."""
        import ray

        self._started_ray = not ray.is_initialized()
        # no address: a new local instance ("local"), never one found through /tmp/ray's record of the
        # latest cluster, which outlives the cluster it names (RAY_ADDRESS, when set, is Ray's own way to name one)
        address = args.ray_address or os.environ.get("RAY_ADDRESS") or "local"
        ray.init(address=address, include_dashboard=False, ignore_reinit_error=True)
        count = len(roles)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        threads = args.threads or max(1, cpus // count)
        context = ray.get_runtime_context()
        # named in this router's own namespace, so that decode workers find the prefill workers' actors
        self.names = [f"replica-{i}" for i in range(count)]
        self._source = f"{RAY_SCHEME}{context.gcs_address}/{context.namespace}/"
        actor = _actor_class()
        self.actors = [actor.options(num_cpus=threads, name=name).remote(
            replica_argv(args, "127.0.0.1", threads, role), f"replica {i}", args.replica_api_key)
            for i, (name, role) in enumerate(zip(self.names, roles))]
        self.urls: list[str | None] = [None] * count
        self.pids: list[int | None] = [None] * count

    def __len__(self) -> int:
        return len(self.actors)

    def start(self) -> list[str]:
        import ray

        try:
            self.urls = ray.get([a.ensure.remote() for a in self.actors], timeout=START_TIMEOUT)
            self.pids = ray.get([a.pid.remote() for a in self.actors], timeout=60)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            self.stop()
            raise RuntimeError(f"the Ray replicas did not start: {e}") from None
        return list(self.urls)

    def url(self, index: int) -> str | None:
        return self.urls[index]

    def pid(self, index: int) -> int | None:
        return self.pids[index]

    def kv_source(self, index: int) -> str | None:
        """Where a decode worker gets a prompt's KV from prefill worker `index`: its actor."""
        return None if self.urls[index] is None else self._source + self.names[index]

    async def recover(self, index: int) -> str:
        """Ask the actor (restarted by Ray if it died) for its replica's URL, starting the replica again."""
        actor = self.actors[index]
        self.urls[index] = None
        url = await asyncio.wait_for(actor.ensure.remote(), START_TIMEOUT)
        self.pids[index] = await asyncio.wait_for(actor.pid.remote(), 60)
        self.urls[index] = url
        return url

    def stop(self) -> None:
        import ray

        try:
            ray.get([a.stop.remote() for a in self.actors], timeout=60)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            pass  # an actor that cannot answer is killed below, its replica with it
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self._started_ray:
            ray.shutdown()
