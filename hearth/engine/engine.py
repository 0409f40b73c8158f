"""LLMEngine: one iteration serves every running request: schedule, execute (the runner), process outputs.

The server and the offline LLM drive it through add_request / step / abort_request.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from pathlib import Path

import torch

from hearth.backend import choose_backend
from hearth.config import EngineConfig
from hearth.engine.kv_cache import BlockManager
from hearth.engine.memory import choose_device, choose_dtype, default_kv_cache_memory
from hearth.engine.output_processor import OutputProcessor, RequestGroup, SequenceState, StepStats
from hearth.engine.request import Request, RequestStatus
from hearth.engine.runner import ModelRunner, ScheduledSequence, StepResult
from hearth.engine.scheduler import Scheduler, SchedulerOutput
from hearth.engine.speculative import SpecDecodeCounts, SpeedGate, make_proposer, num_guesses
from hearth.engine.structured_output import GrammarCompiler
from hearth.errors import RequestError
from hearth.default_model import resolve_model
from hearth.loading.loader import load_model
from hearth.outputs import RequestOutput
from hearth.sampling_params import SamplingParams

logger = logging.getLogger("hearth")


class StepFailed(Exception):
    """A step raised; `request_ids` (aborted, their KV blocks free) were in it, `error` is why."""

    def __init__(self, request_ids: list[str], error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.request_ids, self.error = request_ids, error


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
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self.runner = ModelRunner(self.model, self.num_blocks, config.block_size, self.device, self.dtype,
                                  eos_token_ids=self.tokenizer.eos_token_ids, grammars=self.grammars)
        self.kv_cache_bytes = self.num_blocks * config.block_size * bytes_per_token
        if progress:
            print(
                f"hearth: {self.model_config.architecture} model on {self.device} ({str(self.dtype)[6:]}); "
                f"KV cache {self.kv_cache_bytes / 2**20:.1f} MiB holds {self.kv_cache_tokens:,} tokens "
                f"({self.num_blocks:,} blocks of {config.block_size})",
                file=sys.stderr,
            )
        self.output_processor = OutputProcessor(self.scheduler, self.tokenizer, self.max_model_len)
        self.proposer = make_proposer(config.speculative_method, config.prompt_lookup_min, config.prompt_lookup_max)
        self.spec_decode_totals = SpecDecodeCounts()  # since the engine started
        self.speed_gate = SpeedGate()
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
        if request_id in self.output_processor.groups:
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
            if index == 0:
                self.scheduler.add_request(request)
            else:
                # the other samples wait until the first has computed the prompt, then reuse its blocks
                group.waiting_for_prompt.append(request)
        self.output_processor.add_group(group)
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
        group = self.output_processor.remove_group(request_id)
        if group is None:
            return False
        for state in group.sequences:
            self.scheduler.abort_request(state.request.request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.groups)

    # ---- one iteration ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the (cumulative) output of every group that progressed.

        If it raises (a kernel error, out of memory), the requests it planned are aborted (their
        KV blocks freed) and StepFailed names them: the engine serves the others on."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        try:
            return self._run_plan(plan, start)
        except Exception as e:
            group_id = self.output_processor.group_id
            failed = sorted({group_id(r.request_id) for r, _ in plan.scheduled}
                            | {group_id(r.request_id) for r in plan.finished})
            for request_id in failed:
                self.abort_request(request_id)
            raise StepFailed(failed, e) from e

    def _run_plan(self, plan: SchedulerOutput, start: float) -> list[RequestOutput]:
        stats = StepStats(batch_size=len(plan.scheduled), num_tokens=plan.num_batched_tokens,
                          num_preempted=len(plan.preempted))
        stats.finished_reasons += ["length"] * len(plan.finished)  # outgrew the whole cache
        result = self.runner.execute([self._scheduled_sequence(r, n) for r, n in plan.scheduled])
        self.scheduler.update_after_step(plan)
        self._release_prompt_sharers()
        outputs = self.output_processor.process(plan, result, stats)
        if self.proposer is not None:
            if plan.scheduled and len(result.sampled) == len(plan.scheduled):  # decodes only: comparable steps
                self.speed_gate.record(stats.spec_decode.num_drafts > 0, stats.num_generated, len(plan.scheduled),
                                       time.perf_counter() - start)
            self._propose(result)
        self.spec_decode_totals.add(stats.spec_decode)
        stats.kv_usage = self.block_manager.usage
        stats.prefix_cache_queries = plan.prefix_cache_queries
        stats.prefix_cache_hits = plan.prefix_cache_hits
        self.last_step = stats
        return outputs

    def _scheduled_sequence(self, request: Request, num_new_tokens: int) -> ScheduledSequence:
        state = self.output_processor.sequences[request.request_id]
        score_prompt = (state.index == 0 and request.num_output_tokens == 0
                        and request.sampling_params.prompt_logprobs is not None)
        return ScheduledSequence(request, num_new_tokens, state.generator, state.matcher, score_prompt)

    def _propose(self, result: StepResult) -> None:
        """Guess the next tokens of every request that sampled this step and goes on."""
        config, num_running = self.config, self.scheduler.num_running
        if config.speculative_adaptive and not self.speed_gate.allow():
            return
        for request, sampled in result.sampled.items():
            params = request.sampling_params
            if request.status is not RequestStatus.RUNNING or not params.speculative:
                continue
            state = self.output_processor.sequences[request.request_id]
            k = config.num_speculative_tokens
            if config.speculative_adaptive:
                k = num_guesses(state.acceptance.rate, num_running, k, config.speculative_disable_by_batch_size)
            # never past max_tokens (the last guess is followed by one more token) or the context
            if params.max_tokens is not None:
                k = min(k, params.max_tokens - request.num_output_tokens - 1)
            k = min(k, self.max_model_len - request.num_tokens)
            request.spec_token_ids = self.proposer.propose(request, k, sampled.row_token_ids)

    def _release_prompt_sharers(self) -> None:
        """Queue the samples whose group's first sample has its prompt in the cache now."""
        still_waiting = []
        for group in self._groups_sharing_prompt:
            first = group.sequences[0].request
            if self.output_processor.groups.get(group.request_id) is not group:
                continue  # aborted
            if first.num_computed_tokens >= len(group.prompt_token_ids) or first.is_finished:
                for request in group.waiting_for_prompt:
                    self.scheduler.add_request(request)
                group.waiting_for_prompt.clear()
            else:
                still_waiting.append(group)
        self._groups_sharing_prompt = still_waiting
