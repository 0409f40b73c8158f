"""One OpenAI endpoint in front of several engine replicas (`hearth serve --data-parallel-size N`, `--ray`).

Every request is forwarded unchanged to one replica, chosen by routing.PrefixRouter from its
prompt (completions) or messages (chat). A request is retried on another replica while nothing
of its answer has reached the client: when the replica cannot be reached, drops the connection,
or answers 503 (its queue is full). What a replica stores (stored responses, files, batches) is
that replica's own: a request that names one (a path under /v1/responses/, /v1/files/ or /v1/batches/,
a `previous_response_id` or an `input_file_id`) and gets a 404 is tried on the other replicas in turn,
and gets the 404 only when none holds it. LoRA adapter loads and unloads go to every replica (each
serves every adapter), answered with the first refusal if any replica refuses. A non-streaming answer is read whole before it is passed on,
so it is always retryable; a stream that breaks after its first bytes ends with an error event.
A health loop polls each replica and starts dead ones again (or, under Ray, waits for Ray to).

/health is 200 while any replica is healthy; /metrics has the router's own counters and every
replica's metrics with a `replica` label; /replicas lists the replicas and their state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Metric, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hearth.fleet.routing import PrefixRouter
from hearth.server.limits import ServerLimits
from hearth.server.middleware import install_middleware
from hearth.server.protocol import PREFILL_HEADER
from hearth.server.errors import error_body, error_response, install_error_handlers

logger = logging.getLogger("hearth")
GENERATION_PATHS = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}
HEALTH_INTERVAL = 0.5  # seconds between polls of each replica's /health
# not passed on from clients (a client must not make a decode worker fetch from a URL of its choosing)
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "host", "authorization",
               PREFILL_HEADER}


# where a replica's stored objects are named: a request naming one goes on past a replica's 404
STORED_PATHS = ("/v1/responses/", "/v1/files/", "/v1/batches/")
STORED_FIELDS = (b'"previous_response_id"', b'"input_file_id"')
EVERY_REPLICA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # sent to each replica


def names_stored_object(path: str, body: bytes) -> bool:
    """The request names something one replica stored (its 404 may be another replica's 200)."""
    return path.startswith(STORED_PATHS) or any(field in body for field in STORED_FIELDS)


def prompt_key(path: str, body: bytes) -> str:
    """The text whose prefix decides the replica: the prompt, or the messages in order ('' if neither)."""
    field = GENERATION_PATHS.get(path)
    if field is None:
        return ""
    try:
        value = json.loads(body).get(field)
    except (ValueError, AttributeError):
        return ""  # the replica will answer the malformed body with its 400
    if isinstance(value, str):
        return value
    return "" if value is None else json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class _ReplicaCollector:
    """Each replica's last scraped metrics, relabelled with its index (filled before each scrape)."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def collect(self):
        return self.families


class Router:
    def __init__(self, replicas, policy: str = "prefix", api_key: str | None = None,
                 replica_api_key: str | None = None, chunk_bytes: int = 256,
                 prefill_replicas: frozenset[int] = frozenset()) -> None:
        """prefill_replicas: the replicas started with --role prefill (disaggregated.py): no request is
        routed to them; each generation request names one to the decode replica it goes to."""
        self.replicas = replicas
        self.prefill_replicas = prefill_replicas
        self._prefill_turn = 0
        self.routing = PrefixRouter(len(replicas), policy, chunk_bytes=chunk_bytes)
        self.replica_headers = {"authorization": f"Bearer {replica_api_key}"} if replica_api_key else {}
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=64))
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("hearth:router_requests", "Requests sent to each replica.", ["replica"], registry=r)
        self.retries = Counter("hearth:router_retries", "Requests sent again to another replica.", registry=r)
        self.prefix_bytes = Counter("hearth:router_prefix_queries", "Prompt bytes routed, in whole chunks.",
                                    registry=r)
        self.prefix_matched = Counter("hearth:router_prefix_hits",
                                      "Routed prompt bytes the chosen replica was sent before.", registry=r)
        self.in_flight = Gauge("hearth:router_in_flight", "Requests open on each replica.", ["replica"], registry=r)
        self.healthy = Gauge("hearth:router_replica_healthy", "1 while a replica answers /health.", ["replica"],
                             registry=r)
        self.replica_metrics = _ReplicaCollector()
        r.register(self.replica_metrics)
        self._recovering: set[int] = set()
        self._health_task: asyncio.Task | None = None

    # ---- replica state -------------------------------------------------------------------

    async def check_health(self) -> None:
        """Poll every replica once; a dead one is marked unhealthy and brought back in the background."""
        async def check(index: int) -> None:
            url = self.replicas.url(index)
            ok = False
            if url is not None:
                with contextlib.suppress(httpx.HTTPError):
                    ok = (await self.client.get(f"{url}/health", timeout=2.0)).status_code == 200
            self.routing.replicas[index].healthy = ok
            self.healthy.labels(str(index)).set(ok)
            if not ok and index not in self._recovering:
                self._recovering.add(index)
                asyncio.get_running_loop().create_task(self._recover(index))

        await asyncio.gather(*(check(i) for i in range(len(self.replicas))))

    async def _recover(self, index: int) -> None:
        try:
            await self.replicas.recover(index)
        except Exception as e:  # noqa: BLE001 - a replica that cannot start again stays unhealthy
            logger.error("replica %d could not be started again: %s", index, e)
            await asyncio.sleep(5.0)
        finally:
            self._recovering.discard(index)

    async def _health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(HEALTH_INTERVAL)

    def _mark_failed(self, index: int) -> None:
        self.routing.replicas[index].healthy = False
        self.healthy.labels(str(index)).set(0)

    # ---- forwarding ----------------------------------------------------------------------

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        path = request.url.path
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        headers.update(self.replica_headers)
        if path in EVERY_REPLICA_PATHS:
            return await self._to_every_replica(request, body, headers)
        key = prompt_key(path, body)
        if self.prefill_replicas and path in GENERATION_PATHS and (prefill := self._prefill_source()):
            headers[PREFILL_HEADER] = prefill
        tried: set[int] = set()
        stored = names_stored_object(path, body)
        refused: Response | None = None  # the last 503 (queue full) or, for a stored object, 404
        while True:
            try:
                route = self.routing.choose(key, exclude=frozenset(tried) | self.prefill_replicas)
            except LookupError:
                return refused or error_response(503, "no replica is available")
            index = route.replica
            tried.add(index)
            self.prefix_bytes.inc(route.total_chunks * self.routing.chunk_bytes)
            self.prefix_matched.inc(route.matched_chunks * self.routing.chunk_bytes)
            url = self.replicas.url(index)
            if url is None:
                self._mark_failed(index)
                continue
            if len(tried) > 1:
                self.retries.inc()
            self.requests.labels(str(index)).inc()
            load = self.routing.replicas[index]
            load.in_flight += 1
            self.in_flight.labels(str(index)).inc()
            upstream_request = self.client.build_request(
                request.method, f"{url}{path}", params=request.query_params, headers=headers, content=body)
            upstream, handed_over = None, False
            try:
                upstream = await self.client.send(upstream_request, stream=True)
                # this replica's queue is full (another may have room), or it does not hold the object named
                if upstream.status_code == 503 or (stored and upstream.status_code == 404):
                    refused = Response(await upstream.aread(), status_code=upstream.status_code,
                                       media_type=upstream.headers.get("content-type"))
                    raise _Refused
                if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
                    content = await upstream.aread()  # whole, so a failure here is still retryable
                    return Response(content, status_code=upstream.status_code,
                                    media_type=upstream.headers.get("content-type"))
                handed_over = True  # _relay closes and releases it
                return StreamingResponse(self._relay(upstream, index), status_code=200, media_type="text/event-stream")
            except _Refused:
                pass
            except httpx.TransportError as e:
                logger.warning("replica %d failed before answering (%s); trying another", index, e)
                self._mark_failed(index)
            finally:
                if not handed_over:
                    if upstream is not None:
                        await upstream.aclose()
                    self._release(index)

    async def _to_every_replica(self, request: Request, body: bytes, headers: dict[str, str]) -> Response:
        """The request sent to every healthy replica at once: the first refusal (or failure) if any, else
        the first answer."""
        urls = [url for i, load in enumerate(self.routing.replicas)
                if load.healthy and i not in self.prefill_replicas and (url := self.replicas.url(i)) is not None]
        if not urls:
            return error_response(503, "no replica is available")

        async def send(url: str) -> Response:
            try:
                upstream = await self.client.request(request.method, f"{url}{request.url.path}", headers=headers,
                                                     content=body)
            except httpx.TransportError as e:
                return error_response(503, f"a replica could not be reached ({e}); the others took the request")
            return Response(upstream.content, status_code=upstream.status_code,
                            media_type=upstream.headers.get("content-type"))

        answers = await asyncio.gather(*(send(url) for url in urls))
        return next((a for a in answers if a.status_code != 200), answers[0])

    def _prefill_source(self) -> str | None:
        """The healthy prefill replicas in turn, as a decode replica reaches them: a URL, or a Ray
        actor (disaggregated.py); None: none is healthy, and the decode replica computes the prompt."""
        sources = [source for i in sorted(self.prefill_replicas)
                   if self.routing.replicas[i].healthy and (source := self.replicas.kv_source(i)) is not None]
        self._prefill_turn += 1
        return sources[self._prefill_turn % len(sources)] if sources else None

    async def _relay(self, upstream: httpx.Response, index: int):
        """The replica's event stream as it comes; a break ends it with an error event."""
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.TransportError as e:
            logger.warning("replica %d failed while streaming (%s)", index, e)
            self._mark_failed(index)
            yield f"data: {json.dumps(error_body(500, 'the replica serving this request failed'))}\n\n".encode()
        finally:
            await upstream.aclose()
            self._release(index)

    def _release(self, index: int) -> None:
        self.routing.replicas[index].in_flight -= 1
        self.in_flight.labels(str(index)).dec()

    async def scrape_replicas(self) -> None:
        async def scrape(index: int) -> list[Metric]:
            url = self.replicas.url(index)
            if url is None or not self.routing.replicas[index].healthy:
                return []
            try:
                text = (await self.client.get(f"{url}/metrics", timeout=5.0)).text
            except httpx.HTTPError:
                return []
            families = []
            for family in text_string_to_metric_families(text):
                metric = Metric(family.name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    metric.add_sample(sample.name, {**sample.labels, "replica": str(index)}, sample.value)
                families.append(metric)
            return families

        results = await asyncio.gather(*(scrape(i) for i in range(len(self.replicas))))
        merged: dict[str, Metric] = {}
        for families in results:
            for family in families:
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = family
        self.replica_metrics.families = list(merged.values())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        await self.client.aclose()


class _Refused(Exception):
    """A replica answered 503, or 404 to a request naming a stored object: try the next one, and answer
    with the last refusal if none takes it."""


def build_router_app(router: Router, api_key: str | None = None, limits: ServerLimits | None = None) -> FastAPI:
    """The router's app: the same limits before a route as a single server's (each replica also
    applies its own per-request ones), then forwarding."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.check_health()
        router._health_task = asyncio.get_running_loop().create_task(router._health_loop())
        yield
        await router.close()

    app = FastAPI(title="hearth router", docs_url=None, redoc_url=None, lifespan=lifespan)
    install_middleware(app, limits or ServerLimits(), api_key)
    install_error_handlers(app)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if any(r.healthy for r in router.routing.replicas) else 503)

    @app.get("/metrics")
    async def metrics():
        await router.scrape_replicas()
        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/replicas")
    async def replicas():
        return {"replicas": [
            {"index": i, "url": router.replicas.url(i), "pid": router.replicas.pid(i), "healthy": load.healthy,
             "in_flight": load.in_flight,
             # a prefill replica: where decode replicas get prompts' KV from it (its URL, or its Ray actor)
             "kv_source": router.replicas.kv_source(i) if i in router.prefill_replicas else None}
            for i, load in enumerate(router.routing.replicas)
        ], "policy": router.routing.policy}

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(request: Request):
        return await router.forward(request)

    return app


def new_replica_key() -> str:
    return secrets.token_urlsafe(24)
