"""Asynchronous scheduling: the engine runs one step ahead of what the host has read.

A synchronous step is schedule -> execute -> process: the host waits for the model pass, then
the kernels wait for the host's output processing and the next schedule. With async_scheduling
(EngineConfig), each LLMEngine.step, with step N in flight, does:

    schedule N+1    a request that drew in N counts its draw as a pending token to compute
    stage N+1       its batch laid out on the host (ModelRunner.stage)
    launch N+1      its pending tokens fed from N's draws where they are (ModelRunner.launch): on a
                    CPU on a worker thread once N's pass is done (torch's and hearth's kernels release
                    the GIL), on a GPU queued behind N, nothing read back first
    collect N       N's tokens on the host (the copy ModelRunner.launch started)
    process N       append, detokenize, stop checks, logprobs, stream: while N+1 computes
    update N+1      the scheduler counts N+1's tokens as computed; its draws become pending

so the host learns step N's tokens one step late, and returns N's outputs. A request that N ends
(EOS, a stop token or string) has had one more token computed in N+1: the output processor drops
that draw (its request is finished), and its blocks were freed when N ended it. max_tokens and the
context's end are known ahead: such a request's last draw is not pending, so it costs no extra token.

What the user sees does not change: a step runs ahead only where nothing in it needs the host to
know a token before the next step is laid out (`needs_host`); otherwise the step in flight is
finished first and the step runs synchronously (LLMEngine._run_plan). That covers structured output
(the grammar mask follows the token), thinking budgets (their forcing does), penalties, min_tokens
and watermarks (they read the output), contrastive decoding, prompt scoring without output.
Speculative decoding runs every step synchronously (the engine builds no OneStepAhead with it):
guesses made from tokens the host does not know yet are wrong ones (vLLM's n-gram acceptance fell
from 70% to 1.2% under its asynchronous scheduling, vllm-project/vllm#37150).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from hearth.engine.output_processor import SequenceState, StepStats
from hearth.engine.request import Request, RequestStatus
from hearth.engine.step_records import LaunchedStep, StagedStep
from hearth.engine.scheduler import SchedulerOutput
from hearth.outputs import RequestOutput

if TYPE_CHECKING:
    from hearth.engine.engine import LLMEngine


def needs_host(state: SequenceState) -> bool:
    """Whether the sequence's next step needs its last token on the host before it is laid out."""
    p = state.request.sampling_params
    return (state.matcher is not None or state.thinking is not None or p.max_tokens == 0 or p.min_tokens > 0
            or p.reads_earlier_tokens)


@dataclass
class InFlight:
    """The step launched and not yet read: its plan, host side, pass (a Future) and numbers."""

    plan: SchedulerOutput
    staged: StagedStep
    launched: Future[LaunchedStep]
    stats: StepStats


class OneStepAhead:
    """LLMEngine.step with the next step launched before this one's outputs are processed."""

    def __init__(self, engine: LLMEngine, worker_thread: bool):
        """worker_thread: run the passes on a thread of their own (a CPU: nothing else is asynchronous)."""
        self.engine = engine
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="hearth-pass") if worker_thread else None
        self.in_flight: InFlight | None = None

    def step(self) -> list[RequestOutput]:
        """Schedule and launch the next step, then process the one in flight; their outputs."""
        engine = self.engine
        plan = engine.scheduler.schedule()
        in_flight = self.in_flight
        try:
            if plan.scheduled and not any(needs_host(engine.output_processor.sequences[r.request_id])
                                          for r, _ in plan.scheduled):
                return self._run_ahead(plan)
            outputs = self.finish()
            processed = engine.last_step if in_flight is not None else None
            outputs = _latest(outputs + engine._run_plan(plan))
            if processed is not None:  # the step's numbers: the one in flight's and this one's
                engine.last_step = processed.then(engine.last_step)
            return outputs
        except Exception as e:
            requests = [r for r, _ in plan.scheduled] + plan.finished
            requests += [] if in_flight is None else [r for r, _ in in_flight.plan.scheduled]
            self.in_flight = None
            raise engine._failed(requests, e) from e

    def finish(self) -> list[RequestOutput]:
        """Process the step in flight, if any (the engine is synchronous again after it); its outputs."""
        in_flight, self.in_flight = self.in_flight, None
        return [] if in_flight is None else self._process(in_flight, in_flight.launched.result())

    def wait(self) -> None:
        """Wait until the step in flight no longer computes (before the KV cache is read or written
        from outside a step, or the model's adapters change); its outputs stay to be processed."""
        if self.in_flight is not None:
            self.in_flight.launched.result()

    def _run_ahead(self, plan: SchedulerOutput) -> list[RequestOutput]:
        engine, runner = self.engine, self.engine.runner
        before, self.in_flight = self.in_flight, None
        stats = engine._plan_stats(plan)
        staged = runner.stage(engine._scheduled_sequences(plan), None if before is None else before.staged.draw_rows)
        launched_before = None if before is None else before.launched.result()  # (a CPU: its pass is done)
        engine.move_cache_contents()
        draws = None if launched_before is None or launched_before.out is None else launched_before.out.sampled_token_ids
        self.in_flight = InFlight(plan, staged, self._start(lambda: runner.launch(staged, draws)), stats)
        if before is None:  # nothing read this step: its numbers are none (not the step before's)
            engine.last_step = StepStats()
        outputs = [] if before is None else self._process(before, launched_before)
        engine.scheduler.update_after_step(plan)
        engine.output_processor.release_prompt_sharers()
        for request in staged.draw_rows:
            request.num_pending_tokens = int(self._goes_on(request))
        return outputs

    def _process(self, in_flight: InFlight, launched: LaunchedStep) -> list[RequestOutput]:
        result = self.engine.runner.collect(launched)
        for request in launched.draw_rows:
            request.num_pending_tokens = 0  # appended now (or dropped: its request ended before)
        return self.engine._process(in_flight.plan, result, in_flight.stats)

    def _start(self, launch: Callable[[], LaunchedStep]) -> Future[LaunchedStep]:
        if self.pool is not None:
            return self.pool.submit(launch)
        done: Future[LaunchedStep] = Future()
        done.set_result(launch())
        return done

    def _goes_on(self, request: Request) -> bool:
        """Whether the request may go on after the token it draws in flight (max_tokens and the context's
        end are known ahead; a stop token or string is not)."""
        max_tokens = request.sampling_params.max_tokens
        return (request.status is RequestStatus.RUNNING
                and (max_tokens is None or request.num_output_tokens + 1 < max_tokens)
                and request.num_tokens + 1 < self.engine.max_model_len)


def one_step_ahead(engine: LLMEngine) -> OneStepAhead | None:
    """The engine's OneStepAhead where its async_scheduling is on (None, auto: where it pays, a GPU or
    a CPU with a core the passes leave to the host); never with speculation (its guesses need the
    tokens) or a model split over processes. A CPU runs the passes on a thread of their own."""
    on_cpu = engine.device.type == "cpu"
    on = engine.config.scheduler.async_scheduling
    if on is None:
        on = not on_cpu or torch.get_num_threads() < (os.cpu_count() or 1)
    return OneStepAhead(engine, worker_thread=on_cpu) if on and not engine.speculator.active and engine.workers is None \
        else None


def _latest(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output per request (outputs are cumulative: the last one), in order of first appearance."""
    by_id: dict[str, RequestOutput] = {}
    for output in outputs:
        by_id[output.request_id] = output
    return list(by_id.values())
