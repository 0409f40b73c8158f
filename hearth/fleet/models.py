"""ModelRegistry: several models behind one server (`hearth serve --model NAME=PATH ...`, `--model-dir DIR`).

Each model is an engine of its own (an AsyncEngine under a ServedModel), built the first time a request
names it: the request waits, and every request that comes while it loads waits on the same load. Past
`max_loaded` models the least recently used one with no request in flight is unloaded first; when every
loaded model has requests in flight, a new load waits up to `slot_wait` seconds for one to finish, then is
refused (QueueFull: a 503 with Retry-After). A model that fails to load answers with its name and why
(500); the others serve on, and its next request tries again.

Sleep (vLLM's levels): level 1 gives back the KV cache's memory and keeps the weights in host RAM (on a GPU
they move there: AsyncEngine.sleep); level 2 drops the engine, weights and all, so waking it is a load. A
request for a sleeping model wakes it. With `sleep_idle_seconds`, a model idle that long goes to sleep at level 1.
LoRA adapters belong to their model: a request naming one goes to that model, and the adapters a model
had are loaded with it again when it comes back after an unload.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from hearth.backend.transfer import release_unused_device_memory
from hearth.engine.async_engine import QueueFull
from hearth.errors import RequestError
from hearth.server.errors import APIError
from hearth.server.served import ServedModel

logger = logging.getLogger("hearth")
SLOT_WAIT = 30.0  # seconds a load waits for a loaded model to become idle before it is refused
RETRY_AFTER = 5  # seconds, the Retry-After of that refusal

# name, path, its LoRA adapters (name -> path) -> the served model (run in a worker thread)
Build = Callable[[str, str, dict[str, str]], ServedModel]


class ModelLoadFailed(APIError):
    def __init__(self, name: str, path: str, error: Exception) -> None:
        super().__init__(500, f"the model `{name}` could not be loaded from {path}: {error}", "model")


@dataclass
class ModelEntry:
    name: str
    path: str
    adapters: dict[str, str] = field(default_factory=dict)  # its LoRA adapters, kept over an unload
    served: ServedModel | None = None
    loading: asyncio.Task | None = None  # the load under way, which every request for it awaits
    in_flight: int = 0  # leases open: requests (and batch lines) running on it
    waiting: int = 0  # leases being taken: requests waiting for it to load
    last_used: float = 0.0  # time.monotonic() of its last lease's end (or load)
    sleep_level: int = 0  # 0: awake; 1: KV cache given back; 2: unloaded by a sleep
    error: str | None = None  # why its last load failed

    @property
    def state(self) -> str:
        if self.loading is not None:
            return "loading"
        if self.sleep_level:
            return "sleeping"
        return "unloaded" if self.served is None else "loaded"


class ModelRegistry:
    def __init__(self, paths: dict[str, str], build: Build, max_loaded: int | None = None,
                 sleep_idle_seconds: float | None = None, default_adapters: dict[str, str] | None = None,
                 slot_wait: float = SLOT_WAIT) -> None:
        """paths: each model's name and path, the first the default (a request that names no model);
        default_adapters: the LoRA adapters the default model starts with (--lora)."""
        if not paths:
            raise ValueError("no models to serve")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded must be at least 1 (got {max_loaded})")
        self.entries = {name: ModelEntry(name, str(path)) for name, path in paths.items()}
        self.default = next(iter(self.entries))
        self.entries[self.default].adapters = dict(default_adapters or {})
        self.build, self.max_loaded, self.slot_wait = build, max_loaded, slot_wait
        self.sleep_idle_seconds = sleep_idle_seconds
        self._changed: asyncio.Event | None = None  # set (and replaced) when a lease ends or a model goes

    # ---- which model

    def entry(self, name: str | None) -> ModelEntry:
        """The model a request's `model` names: a model's name or one of its adapters' (None: the
        default); 404 (model_not_found) when it is neither."""
        if name is None:
            return self.entries[self.default]
        if name in self.entries:
            return self.entries[name]
        for entry in self.entries.values():
            if name in entry.adapters:
                return entry
        raise APIError(404, f"The model `{name}` does not exist.", "model", code="model_not_found")

    def model(self, name: str | None) -> ModelEntry:
        """A model by its own name (not an adapter's), for the sleep endpoints."""
        entry = self.entry(name)
        if name is not None and entry.name != name:
            raise APIError(400, f"`{name}` is a LoRA adapter of `{entry.name}`: name the model", "model")
        return entry

    @contextlib.asynccontextmanager
    async def lease(self, name: str | None) -> AsyncIterator[ServedModel]:
        """The served model `name` stands for, loaded (or woken) if need be, never unloaded while leased."""
        entry = self.entry(name)
        served = await self._acquire(entry)
        try:
            yield served
        finally:
            entry.in_flight -= 1
            entry.last_used = time.monotonic()
            self._notify()

    async def _acquire(self, entry: ModelEntry) -> ServedModel:
        entry.waiting += 1  # (a model its requests wait for is not unloaded to make room for another)
        try:
            while True:
                if entry.loading is not None:
                    await asyncio.shield(entry.loading)
                elif entry.served is not None:
                    entry.sleep_level = 0  # level 1 keeps everything but the cache's pages: awake at once
                    entry.in_flight += 1
                    return entry.served
                else:
                    await self._make_room()
                    if entry.loading is None and entry.served is None:  # nobody else started it meanwhile
                        entry.loading = asyncio.get_running_loop().create_task(self._load(entry))
                        entry.loading.add_done_callback(lambda t: t.cancelled() or t.exception())
        finally:
            entry.waiting -= 1

    # ---- loading and unloading

    async def _load(self, entry: ModelEntry) -> None:
        started = time.monotonic()
        try:
            served = await asyncio.to_thread(self.build, entry.name, entry.path, dict(entry.adapters))
        except Exception as e:  # noqa: BLE001 - any failure: this model's requests get why; the others serve on
            entry.error = str(e)
            logger.error("the model %s could not be loaded from %s: %s", entry.name, entry.path, e)
            raise ModelLoadFailed(entry.name, entry.path, e) from None
        finally:
            entry.loading = None
            self._notify()
        entry.served, entry.adapters, entry.error, entry.sleep_level = served, served.adapters, None, 0
        entry.last_used = time.monotonic()
        logger.info("loaded the model %s in %.2f s", entry.name, entry.last_used - started)

    def _occupied(self) -> int:
        return sum(e.served is not None or e.loading is not None for e in self.entries.values())

    async def _make_room(self) -> None:
        """Unload least recently used idle models until one more fits; wait (up to slot_wait) while none is idle."""
        deadline = time.monotonic() + self.slot_wait
        while self.max_loaded is not None and self._occupied() >= self.max_loaded:
            idle = [e for e in self.entries.values()
                    if e.served is not None and e.loading is None and not e.in_flight and not e.waiting]
            if idle:
                await self.unload(min(idle, key=lambda e: e.last_used))
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise QueueFull(f"no model can be unloaded to load another: {self.max_loaded} are loaded "
                                "(--max-loaded-models) and every one has requests in flight; retry later")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changes().wait(), left)

    async def unload(self, entry: ModelEntry, sleep_level: int = 0) -> None:
        """Stop the model's engine and let its memory go (it must have no lease open); sleep_level 2: a
        sleep's unload."""
        served, entry.served, entry.sleep_level = entry.served, None, sleep_level
        if served is None:
            return
        await asyncio.to_thread(served.engine.shutdown)
        del served
        gc.collect()
        release_unused_device_memory()
        logger.info("unloaded the model %s", entry.name)
        self._notify()

    # ---- sleep (vLLM's /sleep, /wake_up)

    async def sleep(self, entry: ModelEntry, level: int) -> None:
        if level not in (1, 2):
            raise APIError(400, f"level must be 1 (give back the KV cache) or 2 (the weights too), got {level}",
                           "level")
        if entry.loading is not None or entry.in_flight:
            raise APIError(409, f"the model `{entry.name}` is loading or has requests in flight: retry once they "
                                "end")
        if entry.served is None:
            return  # not loaded: it holds nothing to give back
        if level == 2:
            await self.unload(entry, sleep_level=2)
        else:  # (set first: a request that comes meanwhile wakes it)
            entry.sleep_level = 1
            try:
                await entry.served.engine.sleep()
            except RequestError:  # a request came and reached the engine first: it is awake
                raise APIError(409, f"the model `{entry.name}` got a request while going to sleep: retry once "
                                    "its requests end") from None
        logger.info("the model %s sleeps (level %d)", entry.name, level)

    async def wake_up(self, entry: ModelEntry) -> None:
        """Wake a sleeping model now (level 1: its weights and KV cache back on the device; level 2: a load),
        rather than at its next request."""
        if entry.sleep_level:
            async with self.lease(entry.name) as served:
                await served.engine.wake_up()

    async def sleep_idle(self) -> None:
        """Put models idle for sleep_idle_seconds to sleep (level 1), until cancelled."""
        idle_for = self.sleep_idle_seconds
        while idle_for:
            await asyncio.sleep(min(1.0, idle_for / 4))
            now = time.monotonic()
            for entry in self.entries.values():
                if (entry.served is not None and not entry.sleep_level and not entry.in_flight
                        and entry.loading is None and now - entry.last_used >= idle_for):
                    with contextlib.suppress(APIError):  # a request came in meanwhile
                        await self.sleep(entry, 1)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """While the app runs: the idle sleeper; then every engine stopped."""
        sleeper = asyncio.get_running_loop().create_task(self.sleep_idle())
        try:
            yield
        finally:
            sleeper.cancel()
            self.shutdown()

    def shutdown(self) -> None:
        """Stop every loaded model's engine (the server stops)."""
        for entry in self.entries.values():
            if entry.served is not None:
                entry.served.engine.shutdown()

    def _changes(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None
