"""Replicas as Ray actors (`hearth serve --ray`): Ray places them on its cluster and restarts them.

Each actor runs one replica process (replicas.ReplicaProcess: `hearth serve` on a free port of the
actor's machine, bound to that machine's address so the router can reach it). An actor that dies
is restarted by Ray (max_restarts=-1) and starts its replica again; a replica process that dies
under a living actor is started again by the actor when the router asks for it.
"""

from __future__ import annotations

import asyncio

from hearth.distributed.launch import replica_argv
from hearth.distributed.replicas import ReplicaProcess

START_TIMEOUT = 600.0  # seconds a replica may take to load its model


def _actor_class():
    import ray

    @ray.remote(max_restarts=-1)
    class ReplicaActor:
        """Runs on the actor's main thread, so the replica's parent-death signal follows the actor."""

        def __init__(self, argv: list[str], name: str) -> None:
            host = ray.util.get_node_ip_address()
            self.replica = ReplicaProcess([*argv, "--host", host], name)
            self.ensure()

        def ensure(self) -> str:
            """The replica's URL, after starting it again if its process has ended."""
            if not self.replica.alive:
                self.replica.launch()
                self.replica.wait_ready(START_TIMEOUT)
            return self.replica.url

        def pid(self) -> int:
            return self.replica.process.pid

        def stop(self) -> None:
            """Stop the replica and reap it: killing the actor alone would leave it exiting, or a
            zombie where nothing reaps orphans, after the router has gone."""
            self.replica.stop()

    return ReplicaActor


class RayReplicas:
    def __init__(self, args, count: int) -> None:
        import ray

        self._started_ray = not ray.is_initialized()
        ray.init(address=args.ray_address, include_dashboard=False, ignore_reinit_error=True)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        threads = args.threads or max(1, cpus // count)
        argv = replica_argv(args, "127.0.0.1", threads)
        actor = _actor_class()
        self.actors = [actor.options(num_cpus=threads).remote(argv, f"replica {i}") for i in range(count)]
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
