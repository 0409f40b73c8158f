"""AsyncEngine: an LLMEngine stepping on its own thread, streaming to asyncio consumers.

One thread owns the engine (the engine is not thread-safe): it takes the queued commands
(add, abort), runs step() while there is work and sleeps on an event otherwise. A step that
raises fails its own requests (RequestFailed, HTTP 500) and the engine goes on; a thread that
dies ends every request (EngineStopped) and `is_running` turns false (/health answers 503). A step
that neither returns nor raises (a kernel that deadlocks, a collective whose peer is gone) is
caught by a watchdog thread after `step_timeout` seconds: the engine is declared stalled, every
request ends with EngineStopped and /health answers 503, so a supervisor restarts the process
instead of clients waiting on it (the stuck thread cannot be stopped from Python). Each request
has an asyncio queue on its consumer's event loop, fed with `loop.call_soon_threadsafe`.

    stream = await async_engine.add_request(prompt_ids, params)   # RequestError, QueueFull
    try:
        async for output in stream: ...     # cumulative RequestOutputs; the last is finished
    finally:
        stream.close()                      # aborts the request if it has not finished

A consumer that is cancelled (its client disconnected) aborts its request, which frees its
KV blocks. `max_queue` bounds the requests queued behind a full running batch (waiting
beyond the free seats of max_num_seqs): past it add_request raises QueueFull at once (the
server answers 503) instead of letting the request hang in the queue.

Other threads never read the LLMEngine's mutable parts: the engine thread publishes an
`EngineStats` snapshot after every command and step, and the model facts a server needs
(tokenizer, context length, vocabulary size) are fixed when the engine is built.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from hearth.engine.cascade import CascadeCounts
from hearth.engine.embedding import embed
from hearth.engine.engine import LLMEngine, StepFailed
from hearth.engine.images import PromptWithImages
from hearth.engine.kv_tiers import TierCounts
from hearth.engine.speculation.stats import SpecDecodeCounts
from hearth.errors import EngineStopped, QueueFull, RequestFailed
from hearth.lora_request import LoRARequest
from hearth.outputs import RequestOutput
from hearth.sampling_params import SamplingParams
from hearth.reasoning import ReasoningFormat
from hearth.tokenizer import Tokenizer

logger = logging.getLogger("hearth")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's state as the engine thread last saw it (replaced whole, never mutated)."""

    num_running: int = 0
    num_waiting: int = 0  # in the scheduler's queue; AsyncEngine.num_waiting adds the adds not applied yet
    kv_cache_usage: float = 0.0
    num_kv_blocks_used: int = 0  # blocks held by requests (of num_kv_blocks)
    num_kv_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_disk_tier: TierCounts = field(default_factory=TierCounts)  # the disk tier's (--kv-cache-dir) totals
    kv_ram_tier: TierCounts = field(default_factory=TierCounts)  # the RAM tier's (--kv-cache-ram) totals
    num_preemptions: int = 0  # totals over the engine's life
    num_generation_tokens: int = 0
    spec_decode: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)
    cascade: CascadeCounts | None = None  # a cascade's (hearth/engine/cascade.py); None: one model


def build_on_passing_thread(build: Callable[[], T]) -> T:
    """build() run on a thread of its own that then exits, for an engine whose steps run on the engine
    thread. On a CPU, every thread that runs an OpenMP parallel region keeps a team of threads; once
    the process holds more of them than it has cores, libgomp (torch's OpenMP) throttles a team's idle
    threads' spin-wait (as OMP_WAIT_POLICY=PASSIVE, measured the same), so each of a decode step's
    ~150 parallel regions wakes them from the kernel: a model loaded on the main thread (its load's regions) and stepped on
    the engine thread decoded SmolLM2 at 2 threads 2.3x slower than on one thread (docs/benchmarks.md).
    A team is let go when its thread exits."""
    built: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            built.append(build())
        except BaseException as e:  # (re-raised on the caller's thread)
            errors.append(e)

    thread = threading.Thread(target=run, name="hearth-load")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return built[0]


def call_in(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Run fn(*args) on a consumer's event loop, from the engine thread."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
        pass


class RequestStream:
    """The outputs of one request, as they come from the engine thread."""

    def __init__(self, owner: "AsyncEngine", request_id: str, loop: asyncio.AbstractEventLoop,
                 final_only: bool = False) -> None:
        self.request_id = request_id
        self.finished = False
        self.final_only = final_only  # the engine thread hands over the finished output only
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.accepted: asyncio.Future[None] = loop.create_future()

    # ---- engine thread side

    def _call(self, fn, *args) -> None:
        call_in(self._loop, fn, *args)

    def _accept(self, error: BaseException | None) -> None:
        def settle() -> None:
            if not self.accepted.done():
                self.accepted.set_result(None) if error is None else self.accepted.set_exception(error)

        self._call(settle)

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._call(self._queue.put_nowait, item)

    # ---- consumer side

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not self._queue.empty():  # outputs are cumulative: the latest one says it all
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request unless it has finished (safe to call more than once)."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue: int | None = None, step_timeout: float | None = None) -> None:
        if max_queue is not None and max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if step_timeout is not None and step_timeout <= 0:
            raise ValueError(f"step_timeout must be positive, got {step_timeout}")
        self.engine = engine
        self.max_queue = max_queue
        # fixed facts of the model, safe to read from any thread
        self.tokenizer: Tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.model_config.vocab_size
        self.reasoning: ReasoningFormat | None = engine.reasoning  # the model's thinking markers, if given
        self.model_path: Path = engine.model_path
        self.max_num_seqs: int = engine.max_num_seqs
        self.lora_enabled = engine.lora is not None
        self.accepts_images: bool = engine.accepts_images  # requests may bring images (multi_modal_data)
        # how the model's processor samples a video file, for a frame's most pixels (None: it takes no videos)
        videos = getattr(engine, "video_processor", None)
        self.video_limits = None if videos is None else videos.limits
        # the LoRA adapters loaded at start (lora_modules), by name: their paths (later loads: add_lora)
        self.initial_loras = {a.name: a.path for a in engine.list_loras()}
        self._grammars = engine.grammars  # thread-safe: compiles off the engine thread
        self._stats = EngineStats()  # replaced by the engine thread, under _lock
        self._lock = threading.Lock()  # guards _commands, _pending_adds, _stopping, _stats
        self._commands: deque[tuple] = deque()
        self._pending_adds = 0
        self._stopping = False
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # the engine thread's own (but for a stalled engine's end)
        self._step_started: float | None = None  # time.monotonic() while a step runs
        self._thread = threading.Thread(target=self._run, name="hearth-engine", daemon=True)
        self._thread.start()
        if step_timeout is not None:
            threading.Thread(target=self._watch, args=(step_timeout,), name="hearth-watchdog", daemon=True).start()

    # ---- numbers (read from any thread)

    def stats(self) -> EngineStats:
        with self._lock:
            return self._stats

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted to the running batch (sequences, for n > 1)."""
        with self._lock:
            return self._pending_adds + self._stats.num_waiting

    @property
    def num_queued(self) -> int:
        """Waiting requests that the running batch has no free seat for."""
        free_seats = self.max_num_seqs - self.num_running
        return max(0, self.num_waiting - max(0, free_seats))

    @property
    def num_running(self) -> int:
        return self.stats().num_running

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # ---- requests

    async def add_request(
        self, prompt: str | list[int] | PromptWithImages, params: SamplingParams, request_id: str | None = None, priority: int = 0,
        lora_request: LoRARequest | None = None, multi_modal_data: dict[str, list] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None, final_only: bool = False,
    ) -> RequestStream:
        """Queue a request (through the LoRA adapter of lora_request, if any; with images in
        multi_modal_data and mm_processor_kwargs, as LLMEngine.add_request takes them) and wait until the engine
        took it; raises
        QueueFull, RequestError, EngineStopped. A lower `priority` is served first (LLMEngine.add_request).
        final_only: the stream yields the finished output alone, for a caller that answers whole (no hand-over
        to the event loop at every step)."""
        if self.max_queue is not None and self.num_queued >= self.max_queue:
            raise QueueFull(
                f"the server is busy: {self.num_queued} requests are queued for a place in the batch "
                f"(max queue {self.max_queue}); retry later"
            )
        if params.structured_outputs is not None:  # a slow grammar holds up this request only: the engine finds it cached
            await asyncio.to_thread(self._grammars.compile, params.structured_outputs)
        if multi_modal_data is not None or mm_processor_kwargs is not None:
            expanded = await self.prompt_with_images(prompt, multi_modal_data, mm_processor_kwargs)
            if expanded is not None:
                prompt, multi_modal_data = expanded, None
        stream = RequestStream(self, request_id or uuid.uuid4().hex, asyncio.get_running_loop(), final_only)
        self._command(("add", stream, prompt, params, priority, lora_request, multi_modal_data))
        try:
            await stream.accepted
        except asyncio.CancelledError:
            stream.close()
            raise
        except BaseException:
            stream.finished = True
            raise
        return stream

    async def prompt_with_images(self, prompt: str | list[int], multi_modal_data: dict[str, list] | None,
                                 mm_processor_kwargs: dict[str, Any] | None = None) -> PromptWithImages | None:
        """The prompt with each image's placeholder tokens as the engine runs it (LLMEngine.prompt_with_images),
        made beside the steps, not between them (images resized, the prompt tokenized); add_request takes it
        as the prompt. RequestError as add_request."""
        return await asyncio.to_thread(self.engine.prompt_with_images, prompt, multi_modal_data, mm_processor_kwargs)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, priority: int = 0,
        multi_modal_data: dict | None = None, mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's cumulative outputs; closing or cancelling the iteration aborts it."""
        stream = await self.add_request(prompt, params, request_id, priority, multi_modal_data=multi_modal_data,
                                        mm_processor_kwargs=mm_processor_kwargs)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    async def embed(self, prompts: list[list[int]]) -> torch.Tensor:
        """The prompts' pooled embeddings [N, hidden] (hearth/engine/embedding.py), computed on the
        engine thread between two steps; RequestError, CacheFull, EngineStopped."""
        return await self._between_steps(embed, self.engine, prompts)

    async def export_kv(self, token_ids: list[int]) -> dict[str, torch.Tensor]:
        """LLMEngine.export_kv, between two steps."""
        return await self._between_steps(self.engine.export_kv, token_ids)

    async def import_kv(self, token_ids: list[int], tensors: dict[str, torch.Tensor]) -> int:
        """LLMEngine.import_kv, between two steps (before any request added after it is scheduled)."""
        return await self._between_steps(self.engine.import_kv, token_ids, tensors)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """LLMEngine.add_lora, between two steps (ModelLoadError, RequestError)."""
        await self._between_steps(self.engine.add_lora, lora_request)

    async def remove_lora(self, lora_name: str) -> None:
        """LLMEngine.remove_lora, between two steps (RequestError)."""
        await self._between_steps(self.engine.remove_lora, lora_name)

    async def sleep(self) -> int:
        """LLMEngine.sleep (level 1), between two steps (RequestError while requests run)."""
        return await self._between_steps(self.engine.sleep)

    async def wake_up(self) -> None:
        """LLMEngine.wake_up, between two steps."""
        await self._between_steps(self.engine.wake_up)

    async def _between_steps(self, fn, *args):
        """fn(*args) on the engine thread between two steps; what it returns or raises."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._command(("call", loop, future, fn, args))
        return await future

    def abort(self, request_id: str) -> None:
        try:
            self._command(("abort", request_id))
        except EngineStopped:
            pass  # shutdown aborts everything anyway

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort every request (their consumers get EngineStopped) and stop the engine thread."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _command(self, command: tuple) -> None:
        with self._lock:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            self._commands.append(command)
            self._pending_adds += command[0] == "add"
        self._wake.set()

    # ---- the engine thread

    def _run(self) -> None:
        try:
            self._loop()
            reason = EngineStopped("the server is shutting down")
        except BaseException as e:  # a dead engine thread: every request ends, /health turns 503
            logger.exception("the engine thread died")
            reason = EngineStopped(f"the engine stopped: {type(e).__name__}: {e}")
        self._stop_taking_commands(reason)
        self._abort_all(reason)
        try:  # (on this thread, which owns the engine: no step runs any more)
            self.engine.save_cache_to_tiers()
        except Exception:  # a full disk, say: the shutdown goes on
            logger.exception("the prefix cache's blocks could not be saved to its tiers")

    def _stop_taking_commands(self, reason: EngineStopped) -> None:
        """Refuse new commands, and end the adds still queued with `reason` (their callers wait on `accepted`)."""
        with self._lock:
            self._stopping = True
            commands, self._commands = list(self._commands), deque()
        for command in commands:
            if command[0] == "add":
                command[1]._accept(reason)

    def _loop(self) -> None:
        engine = self.engine
        while True:
            self._wake.wait()
            self._wake.clear()
            self._apply_commands()
            if self._stopping:
                break
            if not engine.has_unfinished_requests():
                continue
            self._step_started = time.monotonic()
            try:
                outputs = engine.step()
            except StepFailed as e:  # that step's requests fail (aborted already); the others go on
                logger.error("engine step failed for %d requests", len(e.request_ids), exc_info=e.error)
                for request_id in e.request_ids:
                    stream = self._streams.pop(request_id, None)
                    if stream is not None:
                        stream._put(RequestFailed(f"the engine failed while running this request: {e}"))
                self._publish()
                self._wake.set()
                continue
            except Exception as e:  # a bug outside any step's requests: fail every request rather than hang them
                logger.exception("engine step failed")
                self._abort_all(EngineStopped(f"the engine failed: {type(e).__name__}: {e}"))
                continue
            finally:
                self._step_started = None
            self._publish(engine.last_step.num_generated, engine.last_step.num_preempted)
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None and (output.finished or not stream.final_only):
                    stream._put(output)
                    if output.finished:
                        del self._streams[output.request_id]
            self._wake.set()  # keep stepping while there is work

    def _watch(self, step_timeout: float) -> None:
        """The watchdog: end every request and stop serving once one step has run past step_timeout."""
        while self.is_running:
            started = self._step_started
            if started is not None and time.monotonic() - started > step_timeout:
                break
            time.sleep(min(1.0, step_timeout / 4))
        else:
            return
        logger.error("an engine step has run for more than %g s: the engine is stalled", step_timeout)
        reason = EngineStopped(f"the engine stalled: a step ran for more than {step_timeout:g} s")
        self._stop_taking_commands(reason)  # the engine thread, should its step ever return, stops at once
        for stream in list(self._streams.values()):  # not aborted in the engine: its thread holds it
            stream._put(reason)

    def _apply_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                command = self._commands.popleft()
            if command[0] == "abort":
                self.engine.abort_request(command[1])
                self._streams.pop(command[1], None)
                self._publish()
                continue
            if command[0] == "call":
                self._call(*command[1:])
                continue
            _, stream, prompt, params, priority, lora_request, multi_modal_data = command
            try:
                self.engine.add_request(stream.request_id, prompt, params, priority=priority, lora_request=lora_request,
                                        multi_modal_data=multi_modal_data)
            except Exception as e:  # RequestError for bad input; anything else reaches the caller too
                stream._accept(e)
            else:
                self._streams[stream.request_id] = stream
                stream._accept(None)
            finally:
                self._publish(pending_adds=-1)  # counted as waiting until the scheduler holds it

    def _call(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future, fn, args: tuple) -> None:
        try:
            result, error = fn(*args), None
        except Exception as e:  # RequestError, CacheFull; anything else reaches the caller too
            result, error = None, e

        def settle() -> None:
            if not future.done():  # the caller may have gone
                future.set_result(result) if error is None else future.set_exception(error)

        call_in(loop, settle)

    def _publish(self, num_generated: int = 0, num_preempted: int = 0, pending_adds: int = 0) -> None:
        """Replace the stats snapshot (engine thread only), with the queued adds in the same lock."""
        engine, blocks = self.engine, self.engine.block_manager
        with self._lock:
            old = self._stats
            self._stats = EngineStats(
                num_running=engine.scheduler.num_running,
                num_waiting=engine.scheduler.num_waiting,
                kv_cache_usage=blocks.usage,
                num_kv_blocks_used=blocks.num_blocks - blocks.num_free_blocks,
                num_kv_blocks=blocks.num_blocks,
                prefix_cache_queries=blocks.prefix_cache_queries,
                prefix_cache_hits=blocks.prefix_cache_hits,
                kv_disk_tier=engine.kv_disk_totals,
                kv_ram_tier=engine.kv_ram_totals,
                num_preemptions=old.num_preemptions + num_preempted,
                num_generation_tokens=old.num_generation_tokens + num_generated,
                spec_decode=engine.spec_decode_totals.copy(),
                cascade=None if engine.cascade_totals is None else engine.cascade_totals.copy(),
            )
            self._pending_adds += pending_adds

    def _abort_all(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
            stream._put(error)
        self._streams.clear()
        try:
            self._publish()
        except Exception:  # the engine's state may be what broke: the stats stay as they were
            logger.exception("engine stats could not be read")
