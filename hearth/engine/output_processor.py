"""Output processing: what a step's sampled tokens do to their requests.

Per request that the runner sampled: append its tokens one by one (a step may bring several:
verified guesses, then one draw), detokenize incrementally, check stops (tokens, stop strings,
grammar completion, lengths), keep logprobs; then the scheduler learns how many guesses were
right, and each group that progressed (n / best_of samples of one prompt) yields one
RequestOutput. No tensors here: the runner's results are plain host values.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from hearth.engine.request import ImageSpan, Request, RequestStatus
from hearth.engine.step_records import Alternatives, SampledTokens, StepResult
from hearth.engine.scheduler import Scheduler, SchedulerOutput
from hearth.engine.stopping import check_token_stop, find_stop_string, stream_safe_length
from hearth.engine.structured_output import advance
from hearth.engine.thinking import ThinkingBudget
from hearth.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from hearth.sampling_params import SamplingParams
from hearth.tokenizer import Tokenizer


@dataclass
class SequenceState:
    """What the engine keeps beside the scheduler's Request: text, logprobs, stop state."""

    request: Request
    index: int  # which of its group's samples
    detokenizer: object
    generator: torch.Generator | None
    spec_generator: torch.Generator | None = None  # a seeded request's draws for guessing and verifying
    text: str = ""
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] | None = None
    stop_reason: int | str | None = None
    matcher: object | None = None  # the llguidance.LLMatcher of a structured-output request
    thinking: ThinkingBudget | None = None  # a request with a thinking budget: its count (hearth/engine/thinking.py)


@dataclass
class RequestGroup:
    """One add_request: its prompt and the n (or best_of) sequences sampled from it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    sequences: list[SequenceState] = field(default_factory=list)
    waiting_for_prompt: list[Request] = field(default_factory=list)  # samples not yet handed to the scheduler
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    images: list[ImageSpan] = field(default_factory=list)  # the prompt's images (every sample's the same)

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.sequences)


@dataclass
class StepStats:
    """Per-step numbers for metrics and benchmarks."""

    batch_size: int = 0
    num_tokens: int = 0
    num_generated: int = 0
    kv_usage: float = 0.0
    num_preempted: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    finished_reasons: list[str] = field(default_factory=list)

    def then(self, later: StepStats) -> StepStats:
        """This step's numbers and a later one's as one step's (asynchronous scheduling processes the
        step in flight and runs another in one LLMEngine.step): counts summed, the state the later's."""
        return StepStats(later.batch_size, self.num_tokens + later.num_tokens,
                         self.num_generated + later.num_generated, later.kv_usage,
                         self.num_preempted + later.num_preempted,
                         self.prefix_cache_queries + later.prefix_cache_queries,
                         self.prefix_cache_hits + later.prefix_cache_hits,
                         self.finished_reasons + later.finished_reasons)


class OutputProcessor:
    """Owns the engine's groups and sequences; turns each step's results into RequestOutputs."""

    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, max_model_len: int):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.groups: dict[str, RequestGroup] = {}
        self.sequences: dict[str, SequenceState] = {}  # by the scheduler's request id
        self.groups_sharing_prompt: list[RequestGroup] = []  # groups with samples waiting for the first's prompt
        # a cascade's small model (hearth/engine/cascade.py): a sample stops taking tokens after one drawn with
        # a log-probability below the floor, and its group waits in below_floor (the token's probability) for
        # the cascade to move it to the large model
        self.floor_logprob = -math.inf
        self.below_floor: dict[str, float] = {}

    def add_group(self, group: RequestGroup) -> None:
        self.groups[group.request_id] = group
        for state in group.sequences:
            self.sequences[state.request.request_id] = state
        if group.waiting_for_prompt:
            self.groups_sharing_prompt.append(group)

    def release_prompt_sharers(self) -> None:
        """Queue the samples whose group's first sample has its prompt in the cache now."""
        still_waiting = []
        for group in self.groups_sharing_prompt:
            first = group.sequences[0].request
            if self.groups.get(group.request_id) is not group:
                continue  # aborted
            if first.num_computed_tokens >= len(group.prompt_token_ids) or first.is_finished:
                for request in group.waiting_for_prompt:
                    self.scheduler.add_request(request)
                group.waiting_for_prompt.clear()
            else:
                still_waiting.append(group)
        self.groups_sharing_prompt = still_waiting

    def remove_group(self, group_id: str) -> RequestGroup | None:
        group = self.groups.pop(group_id, None)
        for state in group.sequences if group else ():
            self.sequences.pop(state.request.request_id, None)
        return group

    def process(self, plan: SchedulerOutput, result: StepResult, stats: StepStats) -> list[RequestOutput]:
        """Apply one step's results; returns the (cumulative) output of every group that progressed."""
        now = time.monotonic()
        # a request that ended before its results came (asynchronous scheduling: a stop found in the
        # step before, an abort) keeps none of them: its extra draw is dropped
        for request, entries in result.prompt_logprobs.items():
            if not request.is_finished:
                self.groups[self.group_id(request.request_id)].prompt_logprobs.extend(entries)
        for request, tokens in result.sampled.items():
            if request.is_finished:
                continue
            num_appended = self._append_tokens(self.sequences[request.request_id], tokens, now, stats)
            self.scheduler.accept_spec_tokens(request, num_appended - 1)
        progressed: dict[str, RequestGroup] = {}  # by group id: each group's output is built once
        for request in [*plan.finished, *(r for r, _ in plan.scheduled)]:
            if request.request_id in self.sequences:
                group = self.groups[self.group_id(request.request_id)]
                progressed[group.request_id] = group
        outputs = [self._group_output(group) for group in progressed.values()]
        for output in outputs:
            if output.finished:
                self.remove_group(output.request_id)
        return outputs

    def group_id(self, seq_id: str) -> str:
        return seq_id if seq_id in self.groups else seq_id.rsplit("#", 1)[0]

    def _append_tokens(self, state: SequenceState, tokens: SampledTokens, now: float, stats: StepStats) -> int:
        """Append the step's tokens until one ends the request; returns how many were appended."""
        for i, token_id in enumerate(tokens.token_ids):
            alternatives = None if tokens.top_logprobs is None else tokens.top_logprobs[i]
            reason = self._append_token(state, token_id, tokens.logprobs[i], alternatives, now)
            stats.num_generated += state.request.sampling_params.max_tokens != 0
            if reason:
                stats.finished_reasons.append(reason)
                return i + 1
            if state.thinking is not None and state.thinking.append(token_id, state.request.output_token_ids):
                return i + 1  # the budget ran out: what this step sampled after it is not kept
            if tokens.logprobs[i] < self.floor_logprob:
                self.below_floor[self.group_id(state.request.request_id)] = math.exp(tokens.logprobs[i])
                return i + 1  # the large model goes on from this token: what this step sampled after it is not kept
        return len(tokens.token_ids)

    def _append_token(self, state: SequenceState, token_id: int, logprob: float,
                      alternatives: Alternatives | None, now: float) -> str | None:
        """Take a sampled token: stop checks, detokenize; returns the finish reason if it ended."""
        request, params = state.request, state.request.sampling_params
        if params.max_tokens == 0:  # prompt scoring only
            self.scheduler.finish_request(request, RequestStatus.FINISHED_LENGTH)
            return "length"
        request.append_output_token(token_id)
        if request.first_token_time is None:
            request.first_token_time = now
        state.cumulative_logprob += logprob
        if state.logprobs is not None:
            entry = {token_id: logprob}
            if alternatives is not None:
                k = params.logprobs if params.logprobs != -1 else len(alternatives[0])
                entry.update(zip(alternatives[0][:k], alternatives[1][:k]))
                entry[token_id] = logprob
            state.logprobs.append(entry)
        reason = check_token_stop(token_id, request.num_output_tokens, params, self.tokenizer.eos_token_ids)
        if reason == "stop":
            state.stop_reason = None if token_id in self.tokenizer.eos_token_ids else token_id
            state.text += state.detokenizer.flush()
        else:
            old_len = len(state.text)
            state.text += state.detokenizer.step(token_id)
            if params.stop:
                match = find_stop_string(state.text, old_len, params.stop, params.include_stop_str_in_output)
                if match is not None:
                    state.text, state.stop_reason = match
                    reason = "stop"
            if reason is None and state.matcher is not None and advance(state.matcher, token_id):
                reason = "stop"  # the grammar is complete
                state.text += state.detokenizer.flush()
            if reason is None and request.num_tokens >= self.max_model_len:
                reason = "length"
            if reason == "length":
                state.text += state.detokenizer.flush()
        if reason is not None:
            status = RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_LENGTH
            self.scheduler.finish_request(request, status)
        return reason

    def _group_output(self, group: RequestGroup) -> RequestOutput:
        params = group.params
        finished = group.finished
        chosen = group.sequences
        if finished and params.best_of and params.best_of > params.n:
            chosen = sorted(chosen, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        completions = []
        for index, state in enumerate(chosen):
            request = state.request
            text = state.text
            if not request.is_finished and params.stop and not params.include_stop_str_in_output:
                text = text[: stream_safe_length(text, params.stop, params.include_stop_str_in_output)]
            completions.append(CompletionOutput(
                index=index,
                text=text,
                token_ids=list(request.output_token_ids),
                cumulative_logprob=state.cumulative_logprob,
                logprobs=state.logprobs,
                finish_reason=request.status.finish_reason if request.is_finished else None,
                stop_reason=state.stop_reason,
            ))
        first = group.sequences[0].request
        metrics = RequestMetrics(
            arrival_time=group.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=min((s.request.first_token_time for s in group.sequences if s.request.first_token_time), default=None),
            finished_time=max((s.request.finish_time or 0 for s in group.sequences), default=None) if finished else None,
            num_preemptions=sum(s.request.num_preemptions for s in group.sequences),
        )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=group.prompt_logprobs,
            metrics=metrics,
            num_cached_tokens=max(first.num_cached_tokens, 0),
        )

