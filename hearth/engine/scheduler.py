"""Which requests run in the next step and how many tokens each computes. No tensors.

As in vLLM v1 there is no prefill or decode phase: a request has num_computed_tokens and
num_tokens, and a step hands out (request, num_new_tokens) pairs under a token budget. A
decode is a request one token behind; a prefill chunk is one further behind; a prefix
cache hit or a preemption (recompute) just moves num_computed_tokens.

One step, as the engine drives it:
    out = scheduler.schedule()
    runner.execute(out.scheduled)        # reads num_computed_tokens / block_table as is
    scheduler.update_after_step(out)     # advance num_computed_tokens, fill the prefix cache
    for request, _ in out.scheduled:     # a request that reached its end yields tokens:
        request.append_output_token(...); maybe scheduler.finish_request(...)
        scheduler.accept_spec_tokens(request, number of its guesses accepted)
    ... and report out.finished (requests the scheduler ended for lack of room).

With asynchronous scheduling (engine/overlap.py) the next step is scheduled before the host has read
the tokens the step in flight draws: a request's pending token (Request.num_pending_tokens) counts
as one to compute, its input taken on the device from the draw.

Speculative decoding is the same mechanism: a request caught up with its tokens and
carrying k guesses (request.spec_token_ids) is scheduled for 1 + k tokens; the guesses'
K/V count as computed only once accept_spec_tokens says how many were right, and the
blocks of the rejected ones are given back.

Decisions:
  * Every queue is kept in one order: by priority (vLLM's: a lower value first, 0 by default),
    then by the order requests reached the scheduler. With all priorities equal that is
    first-come first-served.
  * Running requests go first, in that order. When blocks run out, the last running request
    in it (the lowest priority, latest among equals: vLLM's victim under its "priority"
    policy) is preempted (blocks freed, num_computed_tokens = 0, back in the waiting queue at
    its place, recomputed later from prompt + output tokens). If that is the request being
    scheduled, it preempts itself and the step's running part ends. A step that preempted
    admits no waiting request (it would only take the freed blocks back).
  * Waiting requests are admitted in that order; the first one that does not fit (budget,
    max_num_seqs, blocks) stops admission for this step. A preempted request keeps its place,
    ahead of every later request of its priority: no starvation among equals. A request of
    a better priority that arrives later is admitted first, but never preempts one already
    running to get a seat (as in vLLM).
  * With chunked prefill off, a request whose remaining tokens exceed the remaining budget
    waits for a later step; if nothing at all has been scheduled in the step it runs
    whole, over the budget, so that a prompt longer than the budget never hangs.
  * Guesses are the first thing to give way: they are scheduled last, from the budget that
    the running requests' tokens and the admitted prompts leave, trimmed to it, and dropped
    (never a reason to preempt anyone) when their blocks cannot be had. So guessing never
    moves where a prompt's chunks end: with the kernels' arithmetic per row (a row's result
    does not depend on the rows beside it), greedy outputs in a batch stay plain decoding's.
  * With a model whose every layer attends through a window of W positions (kv_window), a
    request's blocks wholly before its last W - 1 computed tokens are freed each time it is
    scheduled (BlockManager.free_outside_window; at admission, prefix-cache hits behind the
    window): the blocks it holds stay bounded by the window however long it runs.
  * A hybrid model's request also needs a state slot (state_slots.py): admission stops when none
    is free, as when blocks run out; a preempted or finished request gives its slot back, and a
    preempted one recomputes its state with its K/V when it is admitted again. With prefix caching,
    its prefix hits end where a state checkpoint is (BlockManager.get_computed_blocks), which is copied
    into its slot at admission; a step of it ends at its next checkpoint boundary, if one comes first
    (a prompt's chunk is cut there, its guesses too), and its state is checkpointed after the step that
    reaches one (with guesses: once they are accepted up to it).
  * Images: a chunk that reaches an image's tokens needs the image's embeddings, and an image is
    encoded whole (hearth/engine/images.py). The encoder work a step takes (the images its chunks
    reach that the encoder cache lacks, in embeddings) is held to max_num_encoder_tokens: a chunk
    ends before the first image past that budget, unless that image would be the step's first
    encoder work (so that an image larger than the budget is still encoded, alone). Where an image's
    tokens attend to each other both ways (whole_images: Gemma 3), a chunk never ends inside one: its
    first rows need the K/V of its last, which a later chunk would make too late. A chunk that would
    is cut before the image, or, where it starts at or inside the image (the part before from the
    prefix cache, made with the whole image in view), runs to the image's end, over the token budget
    if need be (as a prompt longer than the budget does unchunked), so that it always moves on.
  * A sequence that cannot fit even in the whole cache (blocks_needed > num_blocks) is
    finished with FINISHED_LENGTH ("length": no room left for it) and listed in
    SchedulerOutput.finished; add_request refuses prompts that cannot fit at all. So a
    lone request always gets its blocks (everything else is free or evictable), and the
    scheduler never loops forever or deadlocks.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field

from hearth.engine.kv_cache import BlockManager
from hearth.engine.request import Request, RequestStatus
from hearth.engine.state_slots import StateSlots
from hearth.errors import RequestError


@dataclass(slots=True)
class SchedulerOutput:
    # (request, num_new_tokens) in batch order: running requests first, then admissions.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # this step, now waiting
    finished: list[Request] = field(default_factory=list)  # ended by the scheduler (FINISHED_LENGTH)
    num_batched_tokens: int = 0
    # Numbers for metrics, as of the end of schedule().
    kv_cache_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    prefix_cache_queries: int = 0  # tokens looked up by this step's admissions
    prefix_cache_hits: int = 0  # of those, tokens found in the cache

    @property
    def num_scheduled_requests(self) -> int:
        return len(self.scheduled)

    @property
    def num_preemptions(self) -> int:
        return len(self.preempted)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, long_prefill_token_threshold: int = 0,
                 clock: Callable[[], float] = time.monotonic, kv_window: int | None = None,
                 state_slots: StateSlots | None = None, encoder_cache: Container[bytes] = (),
                 max_num_encoder_tokens: int | None = None, whole_images: bool = False):
        """kv_window: the window every layer of the model attends through (None: some layer sees all).
        state_slots: a hybrid model's state cache (None: the model keeps no state per sequence).
        encoder_cache: the content hashes of the images whose embeddings are cached (images.py);
        max_num_encoder_tokens: the image embeddings a step may encode (None: max_num_batched_tokens);
        whole_images: no chunk ends inside an image (ModelConfig.bidirectional_images)."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.clock = clock
        self.kv_window = kv_window
        self.state_slots = state_slots
        self.encoder_cache = encoder_cache
        self.max_num_encoder_tokens = max_num_encoder_tokens or max_num_batched_tokens
        self._step_images: set[bytes] = set()  # the images this step's chunks encode
        self._encoder_budget = 0
        self.whole_images = whole_images
        self.waiting: list[Request] = []  # both in queue order (_queue_key)
        self.running: list[Request] = []
        self._arrivals = itertools.count()
        self.requests: dict[str, Request] = {}  # every unfinished request by id

    # ---- queue -------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise RequestError(f"request id {request.request_id!r} is already in use")
        if request.num_tokens == 0:
            raise RequestError("the prompt is empty")
        bm = self.block_manager
        if bm.blocks_needed(request.num_tokens) > bm.num_blocks:
            raise RequestError(
                f"the prompt ({request.num_tokens} tokens) does not fit in the KV cache "
                f"({bm.num_blocks} blocks of {bm.block_size} tokens)")
        request.status = RequestStatus.WAITING
        request.arrival_order = next(self._arrivals)
        self.requests[request.request_id] = request
        _enqueue(self.waiting, request)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """End a request (running or waiting): free its blocks, set status and finish_time."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        else:
            return  # already finished
        self._free(request)
        self.requests.pop(request.request_id, None)
        request.status = status
        request.finish_time = self.clock()

    def release_request(self, request: Request) -> None:
        """Take an unfinished request out of this scheduler, its blocks freed, to be computed again from its
        tokens by another engine's (a cascade's move to its large model: hearth/engine/cascade.py)."""
        (self.running if request.status is RequestStatus.RUNNING else self.waiting).remove(request)
        self.requests.pop(request.request_id, None)
        self._let_go(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Abort a request wherever it is; None if no unfinished request has that id."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    # ---- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._step_images.clear()
        self._encoder_budget = self.max_num_encoder_tokens
        budget, guessing = self._schedule_running(out, self.max_num_batched_tokens)
        budget = self._admit_waiting(out, budget)
        self._schedule_guesses(out, budget, guessing)
        out.num_batched_tokens = sum(n for _, n in out.scheduled)
        out.kv_cache_usage = self.block_manager.usage
        out.num_running, out.num_waiting = len(self.running), len(self.waiting)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, list[int]]:
        """1. Running requests, in admission order, without their guesses (3.): the budget left, and
        where in out.scheduled the requests with guesses are."""
        bm = self.block_manager
        guessing: list[int] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            self._free_behind_window(request)
            num_new = request.num_tokens + request.num_pending_tokens - request.num_computed_tokens
            if num_new != 1:  # guesses follow only the last real token
                request.spec_token_ids.clear()
            start = request.num_computed_tokens
            num_new = self._fit_encoder(request, start, self._whole_images(
                request, start, self._fit(self._to_checkpoint(request, start, num_new), budget, out)))
            if num_new <= 0:  # does not fit the budget unchunked (or nothing to compute)
                i += 1
                continue
            slots = num_new + self._scratch(request, request.num_computed_tokens + num_new)
            if bm.blocks_needed(request.num_computed_tokens + slots) > bm.num_blocks:
                if request.num_pending_tokens:  # ends once its drawn token is appended, as without them
                    i += 1
                    continue
                self.finish_request(request, RequestStatus.FINISHED_LENGTH)
                out.finished.append(request)
                continue
            fits = bm.allocate_slots(request, slots)
            while not fits:
                victim = self.running[-1]  # the lowest priority, latest among equals
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
                fits = bm.allocate_slots(request, slots)
            else:
                if request.spec_token_ids:
                    guessing.append(len(out.scheduled))
                out.scheduled.append((request, num_new))
                budget -= num_new
                i += 1
                continue
            break  # the request preempted itself: it was the last running one
        return budget, guessing

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """2. Waiting requests, in queue order; returns the budget left."""
        bm = self.block_manager
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            if bm.blocks_needed(request.num_tokens + request.num_scratch_slots) > bm.num_blocks:  # grew past the cache
                self.finish_request(request, RequestStatus.FINISHED_LENGTH)
                out.finished.append(request)
                continue
            computed, num_hit = bm.get_computed_blocks(request)
            num_new = self._fit_encoder(request, num_hit, self._whole_images(
                request, num_hit, self._fit(self._to_checkpoint(request, num_hit, request.num_tokens - num_hit), budget, out)))
            if num_new <= 0 or (self.state_slots is not None and not self.state_slots.num_free):
                break
            queries, hits = bm.prefix_cache_queries, bm.prefix_cache_hits
            if not bm.allocate_slots(request, num_new + self._scratch(request, num_hit + num_new), computed):
                break
            out.prefix_cache_queries += bm.prefix_cache_queries - queries
            out.prefix_cache_hits += bm.prefix_cache_hits - hits
            if self.state_slots is not None:
                self.state_slots.allocate(request)  # (one is free: checked above)
                if bm.checkpoints is not None:
                    bm.restore_state(request)
            self._free_behind_window(request)  # prefix-cache hits older than the window
            self.waiting.pop(0)
            _enqueue(self.running, request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.clock()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            out.scheduled.append((request, num_new))
            budget -= num_new
        return budget

    def _schedule_guesses(self, out: SchedulerOutput, budget: int, guessing: list[int]) -> None:
        """3. Guesses, from what is left of the budget and within what the whole cache holds."""
        bm = self.block_manager
        for index in guessing:
            request, num_new = out.scheduled[index]
            room = bm.num_blocks * bm.block_size - request.num_tokens
            # a hybrid's guesses end at its next checkpoint boundary: its states there are the slot's after the step
            # only where no guess passes it (the rejected ones' are taken back out, those after it stay)
            boundary = self._to_checkpoint(request, request.num_computed_tokens, num_new + room) - num_new
            del request.spec_token_ids[max(min(budget, room, boundary), 0):]
            if request.spec_token_ids and bm.allocate_slots(request, num_new + len(request.spec_token_ids)):
                out.scheduled[index] = (request, num_new + len(request.spec_token_ids))
                budget -= len(request.spec_token_ids)
            else:
                request.spec_token_ids.clear()

    def update_after_step(self, output: SchedulerOutput) -> None:
        """After the forward pass: advance num_computed_tokens and cache the full blocks.

        Call it before finishing any request of the step, so the blocks the step wrote
        reach the prefix cache. Requests ended since schedule() are skipped. Guesses are not
        counted here: accept_spec_tokens does once they are verified.
        """
        for request, num_new in output.scheduled:
            if request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += num_new - len(request.spec_token_ids)
            self.block_manager.cache_blocks(request, request.num_computed_tokens)
            if self._next_checkpoint(request, request.num_computed_tokens - 1) == request.num_computed_tokens:
                self.block_manager.save_state(request)
            if request.num_scratch_slots:
                self.block_manager.free_excess(request, request.num_computed_tokens)

    def accept_spec_tokens(self, request: Request, num_accepted: int) -> None:
        """After the step's tokens are appended: the first num_accepted guesses were right (they
        are in all_token_ids now and their K/V stay); the rest's slots are given back."""
        num_guesses = len(request.spec_token_ids)
        request.spec_token_ids.clear()
        if request.status is not RequestStatus.RUNNING or not num_guesses:
            return
        if not 0 <= num_accepted <= num_guesses:
            raise ValueError(f"{num_accepted} of {num_guesses} guesses accepted")
        request.num_computed_tokens += num_accepted
        self.block_manager.cache_blocks(request, request.num_computed_tokens)
        self.block_manager.free_excess(request, request.num_computed_tokens)
        if num_accepted and self._next_checkpoint(request, request.num_computed_tokens - 1) == request.num_computed_tokens:
            self.block_manager.save_state(request)  # (its states there: the kept guesses', LLMEngine._roll_back_states)

    # ---- helpers -------------------------------------------------------------------

    @staticmethod
    def _scratch(request: Request, end: int) -> int:
        """The request's scratch slots (Request.num_scratch_slots) when it samples in the step, i.e. its
        tokens computed up to `end` reach its last."""
        return request.num_scratch_slots if end == request.num_tokens else 0

    def _fit(self, num_new: int, budget: int, out: SchedulerOutput) -> int:
        """Tokens to schedule for a request with num_new left, given the remaining budget."""
        if self.enable_chunked_prefill:
            if 0 < self.long_prefill_token_threshold < num_new:
                num_new = self.long_prefill_token_threshold
            return min(num_new, budget)
        if num_new <= budget or not out.scheduled:
            return num_new
        return 0

    def _next_checkpoint(self, request: Request, computed: int) -> int | None:
        """With state checkpoints: the request's first checkpoint boundary after `computed` tokens
        (state_slots.py: its prompt's last full block, its junction, every interval); else None."""
        checkpoints = self.block_manager.checkpoints
        if checkpoints is None:
            return None
        bs = self.block_manager.block_size
        every = checkpoints.interval_blocks * bs
        prompt_end = (request.num_prompt_tokens - 1) // bs * bs
        return min([b for b in (prompt_end, request.checkpoint_junction) if b > computed]
                   + [(computed // every + 1) * every])

    def _to_checkpoint(self, request: Request, computed: int, num_new: int) -> int:
        """num_new, cut so that a step from `computed` tokens ends at the request's next checkpoint boundary."""
        boundary = self._next_checkpoint(request, computed)
        return num_new if boundary is None else min(num_new, boundary - computed)

    def _fit_encoder(self, request: Request, start: int, num_new: int) -> int:
        """The chunk start..start+num_new-1 cut before the first image it reaches whose encoding does not
        fit what is left of the step's encoder budget (unless nothing else is encoded this step); the
        images it keeps are counted against the budget."""
        for image in request.images:
            if image.start >= start + num_new or image.end <= start:
                continue
            if image.content_hash in self._step_images or image.content_hash in self.encoder_cache:
                continue
            if image.num_embeds > self._encoder_budget and self._step_images:  # (unchunked: it waits whole)
                return max(image.start, start) - start if self.enable_chunked_prefill else 0
            self._step_images.add(image.content_hash)
            self._encoder_budget -= image.num_embeds
        return num_new

    def _whole_images(self, request: Request, start: int, num_new: int) -> int:
        """With whole_images: the chunk start..start+num_new-1 cut before an image (a run of its tokens that
        attend both ways: ImageSpan.blocks) it would end inside, or run on to that run's end where it starts at
        or inside it."""
        end = start + num_new
        for image in request.images if self.whole_images else ():
            for low, high in image.blocks() if image.start < end < image.end else ():
                if low < end < high:
                    return high - start if low <= start else low - start
        return num_new

    def _free_behind_window(self, request: Request) -> None:
        """With a window on every layer: free the request's blocks that its next query (at
        num_computed_tokens) and every later one cannot see."""
        if self.kv_window is not None:
            self.block_manager.free_outside_window(request, request.num_computed_tokens - self.kv_window + 1)

    def _free(self, request: Request) -> None:
        """Give back the request's KV blocks and its state slot."""
        self.block_manager.free(request)
        if self.state_slots is not None:
            self.state_slots.free(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._let_go(request)
        request.num_preemptions += 1
        _enqueue(self.waiting, request)

    def _let_go(self, request: Request) -> None:
        """Free the request's blocks; it is to be computed again from its tokens (prompt and output)."""
        self._free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids.clear()


def _queue_key(request: Request) -> tuple[int, int]:
    return request.priority, request.arrival_order


def _enqueue(queue: list[Request], request: Request) -> None:
    """Insert `request` at its place in a queue kept in _queue_key order (after its equals)."""
    bisect.insort(queue, request, key=_queue_key)
