"""Prefill and decode on separate workers: `hearth serve --role prefill|decode`, `--disaggregate`.

A prefill worker computes prompts; a decode worker generates. The router (router.py) sends every
generation request to a decode worker, naming a prefill worker in a header; the decode worker,
once it has the prompt's token ids, asks that prefill worker for the prompt's KV
(POST /kv/prefill with the ids): the prefill worker runs the prompt (its KV computed, one token
sampled) and answers with the K/V of the prompt's full blocks, read from its paged cache, as
safetensors bytes. The decode worker writes them into free blocks of its own paged cache and
enters them into its prefix cache (LLMEngine.import_kv), then adds the request as any other:
the scheduler finds those blocks computed, and the decode worker computes only the prompt's
last, partial block (at least its last token, whose logits give the first output token) before
decoding. So the prefill worker does the prompt's work, the decode worker the generation's, and
what it receives is checked like any prefix-cache hit: the blocks are named by their tokens.

How the bytes travel is a transport's business (the one thing that differs; the export, the
import, the metrics and the fallback are KVPuller's, the same for all), chosen by how the router
names the prefill worker in the header:

- a URL (`--disaggregate` on one machine, or workers started by hand): HTTPTransport posts to
  the prefill worker's /kv/prefill and reads the bytes from the answer's body. It needs no
  process group (whose members are fixed when it starts: a worker that dies and starts again
  could not rejoin) and no Ray.
- ray://GCS_ADDRESS/NAMESPACE/ACTOR (`--ray --disaggregate`): RayTransport, through Ray's object
  store. The replicas are `hearth serve` processes started by Ray actors (ray_replicas.py), and
  only a process that has joined the cluster can call an actor or get an object. So the decode
  worker joins it (on its first pull; as a driver, which starts nothing) and calls prefill_kv on
  the prefill worker's actor; that actor has its replica compute the prompt (POST /kv/prefill on
  its own machine: the same route and bytes as over HTTP) and puts the answer into its
  machine's object store, returning the ObjectRef; the decode worker gets it by that ref, which
  is the transfer: shared memory on one machine, Ray's object transfer between machines. The
  prefill replica need not join the cluster: its ObjectRef has to reach the decode worker
  through a call that Ray sees (a ref sent any other way is not tracked), and its actor's
  method is that call.

Either way it is robust by construction: a failed or partial transfer (the prefill worker or
its actor down, its blocks evicted before they were read, no room in the decode worker's
cache) leaves the decode worker to compute what is missing, with the same result. The cost is
the copies: the cache to host tensors, the bytes over the loopback or through the object store,
and back into the cache (docs/benchmarks.md measures it per prompt token, both transports).

Metrics on the decode worker (the router's /metrics shows them per replica), each labelled with
its transport (http or ray): hearth:kv_transfer_bytes, hearth:kv_transfer_tokens,
hearth:kv_transfer_failures and the histograms hearth:kv_transfer_seconds (from the prefill
worker's answer to the KV written into the cache: the body read, or the object fetched) and
hearth:kv_prefill_seconds (the whole pull, the prefill worker's compute included).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Annotated

import httpx
import safetensors.torch
from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram

from hearth.fleet.kv_route import KV_PATH, RAY_SCHEME, auth_headers, check_kv_answer
from hearth.sampling_params import SamplingParams
from hearth.server.protocol import OpenAIModel
from hearth.server.served import ServedModel, served

logger = logging.getLogger("hearth")
SECONDS_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]

prefill_routes = APIRouter()  # what a prefill worker serves besides the OpenAI API


class PrefillRequest(OpenAIModel):
    prompt_token_ids: list[int]


@prefill_routes.post(KV_PATH)
async def prefill(body: PrefillRequest, s: Annotated[ServedModel, Depends(served)]):
    """Run the prompt (one greedy token) and answer with its full blocks' K/V, safetensors bytes
    {"kv": [layers, 2, tokens, kv_heads, head_dim]} (a hybrid model's: and the state checkpoint at their
    end, hearth/engine/kv_transfer.py)."""
    ids = body.prompt_token_ids
    s.check_token_ids(ids, "prompt token ids")
    s.check_length(len(ids), 1)
    streams = await s.add_all([ids], SamplingParams(temperature=0, max_tokens=1), f"prefill-{uuid.uuid4().hex}")
    await s.final_outputs(streams)
    tensors = await s.engine.export_kv(ids)
    return Response(safetensors.torch.save({name: t.contiguous() for name, t in tensors.items()}),
                    media_type="application/octet-stream")


class HTTPTransport:
    """A prefill worker's KV over HTTP: POST {url}/kv/prefill, the answer's body."""

    name = "http"

    def __init__(self, api_key: str | None) -> None:
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self.headers = auth_headers(api_key)

    async def fetch(self, url: str, ids: list[int]) -> tuple[float, bytes]:
        """When the prefill worker answered (time.perf_counter()) and the answer's body."""
        async with self.client.stream("POST", f"{url}{KV_PATH}", json={"prompt_token_ids": ids},
                                      headers=self.headers) as answer:
            answered = time.perf_counter()
            return answered, check_kv_answer(answer.status_code, await answer.aread())


class RayTransport:
    """A prefill worker's KV through Ray's object store (`hearth serve --ray --disaggregate`).

    The source, ray://GCS_ADDRESS/NAMESPACE/ACTOR, names the prefill worker's actor
    (ray_replicas.py). This process joins that Ray cluster (on its first pull) and calls the
    actor's prefill_kv: the actor has its replica compute the prompt and puts the answer into
    the object store of its machine, returning the ObjectRef; getting it here is the transfer,
    which Ray makes (shared memory on one machine, its object transfer between machines)."""

    name = "ray"

    def __init__(self) -> None:
        self._actors: dict[str, object] = {}  # source -> actor handle (a handle outlives Ray's restarts)
        self._joining: asyncio.Lock | None = None

    async def _actor(self, source: str):
        # SIGTERM is how this server is stopped: no stack dump from Ray's handler for it (read on import)
        os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
        import ray

        if source not in self._actors:
            address, namespace, name = source.removeprefix(RAY_SCHEME).split("/")
            self._joining = self._joining or asyncio.Lock()
            async with self._joining:
                if not ray.is_initialized():
                    # off the main thread: there ray.init would replace uvicorn's SIGTERM handler
                    await asyncio.to_thread(ray.init, address=address, logging_level=logging.ERROR,
                                            log_to_driver=False)
            self._actors[source] = await asyncio.to_thread(ray.get_actor, name, namespace)
        return self._actors[source]

    async def fetch(self, source: str, ids: list[int]) -> tuple[float, bytes]:
        """When the prefill worker's actor answered (the KV in its object store) and the KV's bytes."""
        actor = await self._actor(source)
        (kv_ref,) = await actor.prefill_kv.remote(ids)
        answered = time.perf_counter()
        return answered, await kv_ref


class KVPuller:
    """A decode worker's side: fetch a prompt's KV from a prefill worker into the engine's cache.

    How the bytes travel is the transport's business (`fetch(source, ids)`: when the prefill worker
    answered, and the safetensors bytes); reading them into the cache, the metrics and the
    fallback on failure are the same for every transport."""

    def __init__(self, registry: CollectorRegistry, api_key: str | None) -> None:
        self.http = HTTPTransport(api_key)
        self.ray = RayTransport()
        r, by = registry, ["transport"]
        self.bytes = Counter("hearth:kv_transfer_bytes", "KV bytes received from prefill workers.", by, registry=r)
        self.tokens = Counter("hearth:kv_transfer_tokens", "Prompt tokens whose KV was received.", by, registry=r)
        self.failures = Counter("hearth:kv_transfer_failures",
                                "Pulls that failed (the prompt was computed here instead).", by, registry=r)
        self.transfer_seconds = Histogram("hearth:kv_transfer_seconds",
                                          "A prefill worker's answer read and written into the cache.", by,
                                          buckets=SECONDS_BUCKETS, registry=r)
        self.prefill_seconds = Histogram("hearth:kv_prefill_seconds",
                                         "A whole pull: the prefill worker's compute and the transfer.", by,
                                         buckets=SECONDS_BUCKETS, registry=r)
        for transport in (self.http, self.ray):  # every series shown from the start, at 0
            for metric in (self.bytes, self.tokens, self.failures, self.transfer_seconds, self.prefill_seconds):
                metric.labels(transport.name)

    def transport(self, source: str) -> HTTPTransport | RayTransport:
        return self.ray if source.startswith(RAY_SCHEME) else self.http

    async def pull(self, s: ServedModel, source: str, ids: list[int]) -> int:
        """The prompt's KV from the prefill worker `source` names, entered into this engine's
        prefix cache; returns the tokens entered (0 when the pull failed: logged and counted)."""
        start = time.perf_counter()
        transport = self.transport(source)
        try:
            answered, body = await transport.fetch(source, ids)
            tensors = safetensors.torch.load(body)
            entered = await s.engine.import_kv(ids, tensors)
        except Exception as e:  # noqa: BLE001 - any failure: this worker computes the prompt itself
            logger.warning("KV pull from %s failed (%s); computing the prompt here", source, e)
            self.failures.labels(transport.name).inc()
            return 0
        done = time.perf_counter()
        self.bytes.labels(transport.name).inc(len(body))
        self.tokens.labels(transport.name).inc(tensors["kv"].shape[2])
        self.transfer_seconds.labels(transport.name).observe(done - answered)
        self.prefill_seconds.labels(transport.name).observe(done - start)
        return entered


def add_role(app: FastAPI, role: str, api_key: str | None = None) -> FastAPI:
    """A server's app (hearth.server.app.build_app) made a worker of a disaggregated set: "prefill"
    (it also serves prompts' KV at /kv/prefill) or "decode" (it pulls a prompt's KV from the prefill
    worker the router names, sending api_key: the key the set's replicas share)."""
    if role == "prefill":
        app.include_router(prefill_routes)
    else:
        app.state.served.kv_puller = KVPuller(app.state.served.metrics.registry, api_key)
    return app
