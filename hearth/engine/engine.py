"""LLMEngine: one iteration serves every running request (schedule, run the model, sample, update).

The server and the offline LLM drive it through add_request / step / abort_request.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hearth.backend import choose_backend
from hearth.config import EngineConfig
from hearth.engine.kv_cache import BlockManager
from hearth.engine.memory import choose_device, choose_dtype, default_kv_cache_memory
from hearth.engine.request import Request, RequestStatus
from hearth.engine.runner import BatchEntry, ModelRunner
from hearth.engine.sampler import Sampler, SamplingBatch, prompt_logprobs
from hearth.engine.scheduler import Scheduler, SchedulerOutput
from hearth.engine.structured_output import GrammarCompiler, advance
from hearth.engine.stopping import check_token_stop, find_stop_string, stream_safe_length
from hearth.errors import RequestError
from hearth.default_model import resolve_model
from hearth.loading.loader import load_model
from hearth.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from hearth.sampling_params import SamplingParams

logger = logging.getLogger("hearth")


class StepFailed(Exception):
    """A step raised; `request_ids` (aborted, their KV blocks free) were in it, `error` is why."""

    def __init__(self, request_ids: list[str], error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.request_ids, self.error = request_ids, error


@dataclass
class SequenceState:
    """What the engine keeps beside the scheduler's Request: text, logprobs, stop state."""

    request: Request
    index: int  # which of its group's samples
    detokenizer: object
    generator: torch.Generator | None
    text: str = ""
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] | None = None
    stop_reason: int | str | None = None
    matcher: object | None = None  # the llguidance.LLMatcher of a structured-output request


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


class LLMEngine:
    def __init__(self, model: str | Path | None, config: EngineConfig | None = None, progress: bool = True):
        self.config = config = config or EngineConfig()
        self.device = choose_device(config.device)
        self.dtype = choose_dtype(config.dtype, self.device)
        backend = choose_backend(self.device, self.dtype, config.backend, config.enforce_eager)
        self.workers, shard = None, None
        if config.tensor_parallel_size > 1:  # ranks 1..N-1 load their slices in processes of their own
            from hearth.distributed.tensor_parallel import TensorShard, start_workers

            if self.device.type != "cpu":
                raise ValueError("tensor parallelism runs on CPUs (gloo) in this version")
            model = resolve_model(model)
            self.workers = start_workers(model, config.tensor_parallel_size, self.dtype, config.max_model_len,
                                         backend.name)
            shard = TensorShard(0, config.tensor_parallel_size)
        try:
            loaded = load_model(model, self.dtype, self.device, max_positions=config.max_model_len,
                                progress=progress, backend=backend, shard=shard)
        except BaseException:
            if self.workers is not None:
                self.workers.kill()
            raise
        self.model, self.tokenizer, self.model_config = loaded.model, loaded.tokenizer, loaded.config
        self.model_path = loaded.path
        context = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > context:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context length {context}")
        self.max_model_len = config.max_model_len or context
        bytes_per_token = self.model_config.kv_bytes_per_token(self.dtype.itemsize)
        # what the run can use: max_num_seqs contexts, each in whole blocks and with room for the
        # token sampled after a full-length prompt (admission asks for prompt + 1 slots)
        blocks_per_seq = -(-(self.max_model_len + 1) // config.block_size)
        budget = config.kv_cache_memory or default_kv_cache_memory(
            self.device, bytes_per_token * config.block_size * blocks_per_seq * config.max_num_seqs
        )
        self.num_blocks = max(1, budget // (bytes_per_token * config.block_size))
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        self.runner = ModelRunner(self.model, self.num_blocks, config.block_size, self.device, self.dtype)
        self.kv_cache_bytes = self.num_blocks * config.block_size * bytes_per_token
        if progress:
            print(
                f"hearth: {self.model_config.architecture} model on {self.device} ({str(self.dtype)[6:]}); "
                f"KV cache {self.kv_cache_bytes / 2**20:.1f} MiB holds {self.kv_cache_tokens:,} tokens "
                f"({self.num_blocks:,} blocks of {config.block_size})",
                file=sys.stderr,
            )
        self.sampler = Sampler()
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self.groups: dict[str, RequestGroup] = {}
        self.sequences: dict[str, SequenceState] = {}  # by the scheduler's request id
        self._groups_sharing_prompt: list[RequestGroup] = []
        self.last_step = StepStats()
        self._ids = itertools.count()
        torch.manual_seed(config.seed)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is collected)."""
        if self.workers is not None:
            self.workers.stop()

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_blocks * self.config.block_size

    # ---- requests in -------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request; raises RequestError (a ValueError) when it cannot be served."""
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.groups:
            raise RequestError(f"request id {request_id!r} is already in use")
        prompt_text, prompt_ids = self._encode(prompt)
        self._check_fits(prompt_ids)
        try:
            params.validate_for_vocab(self.model_config.vocab_size)
        except ValueError as e:
            raise RequestError(str(e)) from None
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammars.compile(params.structured_outputs)
        now = time.monotonic() if arrival_time is None else arrival_time
        group = RequestGroup(request_id, prompt_text, prompt_ids, params, now)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        for index in range(params.best_of or params.n):
            seq_id = request_id if (params.best_of or params.n) == 1 else f"{request_id}#{index}"
            request = Request(seq_id, list(prompt_ids), params, arrival_time=now)
            # prompt logprobs need every prompt position computed: no prefix-cache skipping
            request.skip_prefix_cache = params.prompt_logprobs is not None
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed + index)
            state = SequenceState(
                request, index, self.tokenizer.incremental_decoder(params.skip_special_tokens, prompt_ids), generator,
                logprobs=[] if params.logprobs is not None else None,
                matcher=None if grammar is None else self.grammars.matcher(grammar),
            )
            group.sequences.append(state)
            self.sequences[seq_id] = state
            if index == 0:
                self.scheduler.add_request(request)
            else:
                # the other samples wait until the first has computed the prompt, then reuse its blocks
                group.waiting_for_prompt.append(request)
        self.groups[request_id] = group
        self._groups_sharing_prompt.extend([group] if group.waiting_for_prompt else [])
        return request_id

    def _encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            ids, text = list(prompt), None
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise RequestError(f"prompt token ids out of range [0, {self.model_config.vocab_size}): {bad[:5]}")
        if not ids:
            raise RequestError("the prompt is empty")
        return text, ids

    def _check_fits(self, prompt_ids: list[int]) -> None:
        if len(prompt_ids) > self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens, more than the model's context window "
                f"of {self.max_model_len} tokens"
            )
        if self.block_manager.blocks_needed(len(prompt_ids) + 1) > self.num_blocks:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens, more than the KV cache holds "
                f"({self.kv_cache_tokens} tokens); give the engine a larger kv_cache_memory"
            )

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False when it is unknown or done."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        for state in group.sequences:
            self.scheduler.abort_request(state.request.request_id)
            self.sequences.pop(state.request.request_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # ---- one iteration ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the (cumulative) output of every group that progressed.

        If it raises (a kernel error, out of memory), the requests it planned are aborted (their
        KV blocks freed) and StepFailed names them: the engine serves the others on."""
        plan = self.scheduler.schedule()
        try:
            return self._run_plan(plan)
        except Exception as e:
            failed = sorted({self._group_id(r.request_id) for r, _ in plan.scheduled}
                            | {self._group_id(r.request_id) for r in plan.finished})
            for group_id in failed:
                self.abort_request(group_id)
            raise StepFailed(failed, e) from e

    def _run_plan(self, plan: SchedulerOutput) -> list[RequestOutput]:
        stats = StepStats(
            batch_size=len(plan.scheduled),
            num_tokens=plan.num_batched_tokens,
            num_preempted=len(plan.preempted),
        )
        progressed: dict[str, RequestGroup] = {}  # by group id; outputs are built once, in _emit
        for request in plan.finished:  # ended by the scheduler: its sequence outgrew the whole cache
            stats.finished_reasons.append("length")
            self._collect(request, progressed)
        if not plan.scheduled:
            self.last_step = stats
            return self._emit(progressed)
        now = time.monotonic()
        entries, sampling_rows, sampled_states = [], [], []
        scoring = []  # (state, first row, number of rows) of requests that want prompt logprobs
        row = 0
        for request, num_new in plan.scheduled:
            start = request.num_computed_tokens
            entries.append(BatchEntry(request.all_token_ids[start : start + num_new], start, request.block_table))
            state = self.sequences[request.request_id]
            if state.index == 0 and request.num_output_tokens == 0 and request.sampling_params.prompt_logprobs is not None:
                scoring.append((state, row, start, num_new))
            if start + num_new == request.num_tokens:
                sampling_rows.append(row + num_new - 1)
                sampled_states.append(state)
            row += num_new
        # the grammar masks of this step's constrained rows are filled while the model runs
        constrained = [i for i, state in enumerate(sampled_states) if state.matcher is not None]
        masks = self.grammars.start_masks([sampled_states[i].matcher for i in constrained]) if constrained else None
        hidden, _ = self.runner.execute(entries)
        for state, first_row, start, num_new in scoring:
            self._score_prompt(state, hidden[first_row : first_row + num_new], start)
        self.scheduler.update_after_step(plan)
        self._release_prompt_sharers()

        if sampled_states:
            logits = self.model.compute_logits(hidden[torch.tensor(sampling_rows, device=hidden.device)])
            requests = [s.request for s in sampled_states]
            batch = SamplingBatch.build(
                [r.sampling_params for r in requests],
                [r.prompt_token_ids for r in requests],
                [r.output_token_ids for r in requests],
                [s.generator for s in sampled_states],
                self.model_config.vocab_size,
                self.device,
                eos_token_ids=self.tokenizer.eos_token_ids,
                grammar_masks=None if masks is None else (constrained, masks.result()),
            )
            result = self.sampler(logits, batch)
            # one copy to the host (one synchronisation): token ids are exact in float64
            chosen = torch.stack([result.sampled_token_ids.double(), result.logprobs.double()])
            top = None
            if result.top_logprobs is not None:
                chosen = torch.cat([chosen, result.top_logprobs[0].double().T, result.top_logprobs[1].double().T])
            chosen = chosen.cpu()
            token_ids, chosen_logprobs = chosen[0].long().tolist(), chosen[1].tolist()
            if result.top_logprobs is not None:
                k = result.top_logprobs[0].shape[1]
                top = (chosen[2 : 2 + k].T.long().tolist(), chosen[2 + k :].T.tolist())
            for i, state in enumerate(sampled_states):
                alternatives = None if top is None else (top[0][i], top[1][i])
                reason = self._append_token(state, token_ids[i], chosen_logprobs[i], alternatives, now)
                stats.num_generated += state.request.sampling_params.max_tokens != 0
                if reason:
                    stats.finished_reasons.append(reason)
        for request, _ in plan.scheduled:
            self._collect(request, progressed)
        stats.kv_usage = self.block_manager.usage
        stats.prefix_cache_queries = plan.prefix_cache_queries
        stats.prefix_cache_hits = plan.prefix_cache_hits
        self.last_step = stats
        return self._emit(progressed)

    def _collect(self, request: Request, progressed: dict[str, RequestGroup]) -> None:
        if request.request_id in self.sequences:
            group = self.groups[self._group_id(request.request_id)]
            progressed[group.request_id] = group

    def _emit(self, progressed: dict[str, RequestGroup]) -> list[RequestOutput]:
        """Each progressed group's output (once, however many of its samples ran this step)."""
        outputs = [self._group_output(group) for group in progressed.values()]
        for output in outputs:
            if output.finished:
                self._release_group(output.request_id)
        return outputs

    def _release_prompt_sharers(self) -> None:
        """Queue the samples whose group's first sample has its prompt in the cache now."""
        still_waiting = []
        for group in self._groups_sharing_prompt:
            first = group.sequences[0].request
            if self.groups.get(group.request_id) is not group:
                continue  # aborted
            if first.num_computed_tokens >= len(group.prompt_token_ids) or first.is_finished:
                for request in group.waiting_for_prompt:
                    self.scheduler.add_request(request)
                group.waiting_for_prompt.clear()
            else:
                still_waiting.append(group)
        self._groups_sharing_prompt = still_waiting

    def _group_id(self, seq_id: str) -> str:
        return seq_id if seq_id in self.groups else seq_id.rsplit("#", 1)[0]

    def _score_prompt(self, state: SequenceState, hidden: torch.Tensor, start: int) -> None:
        """Logprobs of prompt tokens start+1 .. start+len(hidden) given everything before them."""
        request = state.request
        group = self.groups[self._group_id(request.request_id)]
        prompt = request.prompt_token_ids
        count = min(len(hidden), len(prompt) - 1 - start)
        if count <= 0:
            return
        logits = self.model.compute_logits(hidden[:count])
        targets = torch.tensor(prompt[start + 1 : start + 1 + count], device=logits.device)
        k = request.sampling_params.prompt_logprobs
        chosen, top_ids, top_lps = prompt_logprobs(logits, targets, k)
        for j, token in enumerate(targets.tolist()):
            entry = {token: chosen[j].item()}
            entry.update(zip(top_ids[j].tolist(), top_lps[j].tolist()))
            group.prompt_logprobs.append(entry)

    def _append_token(self, state, token_id, logprob, alternatives, now) -> str | None:
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

    def _release_group(self, group_id: str) -> None:
        group = self.groups.pop(group_id)
        for state in group.sequences:
            self.sequences.pop(state.request.request_id, None)
