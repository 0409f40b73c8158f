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
from hearth.kv_format import check_kv_cache_dtype, kv_bytes_per_element
from hearth.config import EngineConfig
from hearth.engine.draft import DraftProposer, SecondModel
from hearth.engine.kv_cache import BlockManager
from hearth.engine.memory import choose_device, choose_dtype, kv_cache_blocks, kv_cache_budget, model_bytes
from hearth.engine.output_processor import OutputProcessor, RequestGroup, SequenceState, StepStats
from hearth.engine.request import Request, RequestStatus
from hearth.engine.runner import ModelRunner, ScheduledSequence, StepResult
from hearth.engine.scheduler import Scheduler, SchedulerOutput
from hearth.engine.speculative import (LookaheadProposer, NgramProposer, SpecDecodeCounts, SpeedGate,
                                      num_guesses)
from hearth.engine.structured_output import GrammarCompiler
from hearth.errors import RequestError
from hearth.default_model import resolve_model
from hearth.loading.loader import load_model
from hearth.outputs import RequestOutput
from hearth.sampling_params import SamplingParams

logger = logging.getLogger("hearth")

# Added to a seeded request's seed for the generator of its speculative draws (guesses, verification coins).
SPEC_SEED = 0x5BEC_0000_0000


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
        # A model split over processes runs eagerly: gloo's collectives cannot be captured in a CUDA
        # graph, NCCL's capture is untried (no two GPUs to try it on), and pipeline stages never replay one.
        split = config.parallel.split
        backend = choose_backend(self.device, self.dtype, config.backend, config.enforce_eager or split)
        if split and backend.name == "gpu" and self.device.type == "cuda" and not config.enforce_eager:
            logger.warning("gpu backend: no CUDA graphs for a model split over processes (every step runs eagerly)")
        if config.speculative.tree_width > 1 and not backend.token_trees:
            raise ValueError(f"speculative_tree_width > 1 (token-tree verification) is not implemented on the "
                             f"{backend.name} backend (its attention kernels take no tree masks): use the cpu or "
                             f"reference backend, or speculative_tree_width 1")
        self.workers, shard = None, None
        if config.parallel.split:
            from hearth.engine.workers import start_split  # ranks 1..N-1: processes of their own

            model = resolve_model(model)
            self.workers, shard = start_split(model, config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size,
                                              self.dtype, config.scheduler.max_model_len, backend.name, self.device)
        try:
            loaded = load_model(model, self.dtype, self.device, max_positions=config.scheduler.max_model_len,
                                progress=progress, backend=backend, shard=shard)
        except BaseException:
            if self.workers is not None:
                self.workers.kill()
            raise
        self.model, self.tokenizer, self.model_config = loaded.model, loaded.tokenizer, loaded.config
        self.model_path = loaded.path
        context = self.model_config.max_position_embeddings
        if config.scheduler.max_model_len is not None and config.scheduler.max_model_len > context:
            raise ValueError(f"max_model_len {config.scheduler.max_model_len} exceeds the model's context length {context}")
        self.max_model_len = config.scheduler.max_model_len or context
        check_kv_cache_dtype(config.cache.kv_cache_dtype, self.model_config, self.model.backend)
        bytes_per_token = self.model_config.kv_bytes_per_token(kv_bytes_per_element(config.cache.kv_cache_dtype, self.dtype.itemsize))
        budget = config.cache.kv_cache_memory or kv_cache_budget(
            self.device, bytes_per_token, config.cache.block_size, self.max_model_len, config.scheduler.max_num_seqs,
            model_bytes(self.model_path))
        self.num_blocks = kv_cache_blocks(budget, bytes_per_token, config.cache.block_size)
        self.block_manager = BlockManager(self.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            enable_chunked_prefill=config.scheduler.enable_chunked_prefill,
            kv_window=self.model_config.kv_window,
        )
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self.runner = ModelRunner(self.model, self.num_blocks, config.cache.block_size, self.device, self.dtype,
                                  eos_token_ids=self.tokenizer.eos_token_ids, grammars=self.grammars,
                                  kv_cache_dtype=config.cache.kv_cache_dtype,
                                  model_pass=None if shard is None else shard.model_pass(backend))
        self.kv_cache_bytes = self.num_blocks * config.cache.block_size * bytes_per_token
        if progress:
            print(
                f"hearth: {self.model_config.architecture} model on {self.device} ({str(self.dtype)[6:]}); "
                f"KV cache {self.kv_cache_bytes / 2**20:.1f} MiB ({self.kv_cache_dtype}) holds {self.kv_cache_tokens:,} tokens "
                f"({self.num_blocks:,} blocks of {config.cache.block_size})",
                file=sys.stderr,
            )
        self.output_processor = OutputProcessor(self.scheduler, self.tokenizer, self.max_model_len)
        self.proposer = None
        self.spec_decode_totals = SpecDecodeCounts()  # since the engine started
        self.speed_gate = SpeedGate()
        if config.speculative.method == "ngram":
            self.proposer = NgramProposer(config.speculative.prompt_lookup_min, config.speculative.prompt_lookup_max,
                                          config.speculative.tree_width)
        elif config.speculative.method == "lookahead":
            self.proposer = LookaheadProposer()
        elif config.speculative.method == "draft":
            self.proposer = DraftProposer(self._second_model(config.speculative.model, "speculative_model", progress),
                                          config.speculative.tree_width)
        self.amateur = None  # contrastive decoding's second model
        if config.contrastive_model is not None:
            self.amateur = self._second_model(config.contrastive_model, "contrastive_model", progress)
        self._guessing_seconds = 0.0  # how long the last guessing took (the draft's passes)
        self._groups_sharing_prompt: list[RequestGroup] = []
        self.last_step = StepStats()
        self._ids = itertools.count()
        torch.manual_seed(config.seed)

    def _second_model(self, path: str, what: str, progress: bool) -> SecondModel:
        """Load a model to run beside the target (a draft): same vocabulary, context at least max_model_len,
        its own KV cache of as many blocks as the target's."""
        loaded = load_model(path, self.dtype, self.device, max_positions=self.max_model_len, progress=progress,
                            backend=self.model.backend)
        config = loaded.config
        if (config.vocab_size != self.model_config.vocab_size
                or loaded.tokenizer.token_bytes() != self.tokenizer.token_bytes()):
            raise ValueError(f"{what} {path} does not share the target's vocabulary ({config.vocab_size:,} tokens "
                             f"against {self.model_config.vocab_size:,}, or different token texts)")
        if config.max_position_embeddings < self.max_model_len:
            raise ValueError(f"{what} {path} has a context of {config.max_position_embeddings:,} tokens, less than "
                             f"max_model_len {self.max_model_len:,}: give a smaller max_model_len")
        runner = ModelRunner(loaded.model, self.num_blocks, self.config.cache.block_size, self.device, self.dtype,
                             eos_token_ids=self.tokenizer.eos_token_ids)
        if progress:
            size = self.num_blocks * self.config.cache.block_size * config.kv_bytes_per_token(self.dtype.itemsize)
            print(f"hearth: {what} {config.architecture} model, its KV cache {size / 2**20:.1f} MiB", file=sys.stderr)
        return SecondModel(runner, self.config.cache.block_size)

    def close(self) -> None:
        """Stop the workers of a split model, if any (also done when the engine is collected)."""
        if self.workers is not None:
            self.workers.stop()

    @property
    def kv_cache_dtype(self) -> str:
        """What K and V are stored as: the compute dtype's name, float16, q8_0 or fp8_e4m3."""
        return str(self.dtype).removeprefix("torch.") if self.config.cache.kv_cache_dtype == "auto" else self.config.cache.kv_cache_dtype

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_blocks * self.config.cache.block_size

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
        if params.contrastive_weight > 0 and self.amateur is None:
            raise RequestError("contrastive_weight needs an engine started with a contrastive_model "
                               "(--contrastive-model PATH)")
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
            generator = spec_generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed + index)
                if self.proposer is not None:  # draws of guessing and verifying: a stream of their own
                    spec_seed = (params.seed + index + SPEC_SEED) % 2**64
                    spec_generator = torch.Generator(device=self.device).manual_seed(spec_seed)
            state = SequenceState(
                request, index, self.tokenizer.incremental_decoder(params.skip_special_tokens, prompt_ids), generator,
                spec_generator=spec_generator,
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
        elif isinstance(prompt, (list, tuple)):
            ids, text = list(prompt), None
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise RequestError(f"prompt token ids must be integers in [0, {self.model_config.vocab_size}); got "
                                   f"{bad[:5]}")
        else:
            raise RequestError(f"a prompt is a string or a list of token ids, not {type(prompt).__name__}")
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
        self._release_stopped()
        return True

    def _release_stopped(self) -> None:
        """The second models (draft, amateur) let go of the requests that no longer run."""
        for second in (self.proposer, self.amateur):
            if second is not None:
                second.release_stopped()

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.groups)

    # ---- KV handed between engines (hearth/fleet/disaggregated.py) ------------------

    def export_kv(self, token_ids: list[int]) -> torch.Tensor:
        """The K/V of the cached full blocks that start `token_ids` (short of its last token):
        [layers, 2, tokens, kv_heads, head_dim], tokens a multiple of the block size (maybe 0)."""
        self._check_kv_local()
        return self.runner.read_kv(self.block_manager.lookup(token_ids))

    def import_kv(self, token_ids: list[int], kv: torch.Tensor) -> int:
        """Enter the blocks of `kv` (export_kv's, computed elsewhere for `token_ids`) into this
        engine's prefix cache, so that a request with that prompt finds them computed; returns the
        tokens entered (blocks already cached here, or with no room left, are not)."""
        self._check_kv_local()
        block_size, k_cache = self.config.cache.block_size, self.runner.kv_caches[0][0]
        if (kv.dim() != 5 or kv.shape[:2] != (len(self.runner.kv_caches), 2) or kv.shape[2] % block_size
                or kv.shape[3:] != k_cache.shape[1:]):
            raise RequestError(f"KV of shape {tuple(kv.shape)} does not fit this engine's cache "
                               f"({len(self.runner.kv_caches)} layers, blocks of {block_size}, {tuple(k_cache.shape[1:])})")
        covered = token_ids[: kv.shape[2] + 1]  # the blocks kv holds, and one more token
        entered = self.block_manager.import_prefix(covered)
        if entered:
            rows = torch.cat([torch.arange(i * block_size, (i + 1) * block_size) for i, _ in entered])
            self.runner.write_kv([block_id for _, block_id in entered], kv[:, :, rows])
        return len(entered) * block_size

    def _check_kv_local(self) -> None:
        if self.workers is not None:
            raise RequestError("KV transfer between engines is not implemented for a model split over processes")
        if self.config.cache.kv_cache_dtype != "auto" or self.model_config.kv_lora_rank:
            raise RequestError("KV transfer between engines is not implemented for a KV cache in another dtype than the "
                               "compute dtype (float16, q8_0, fp8) or a latent one")

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
        amateur_logits = self._amateur_logits(plan) if self.amateur is not None else {}
        result = self.runner.execute([self._scheduled_sequence(r, n, amateur_logits.get(r))
                                      for r, n in plan.scheduled])
        self.scheduler.update_after_step(plan)
        self._release_prompt_sharers()
        outputs = self.output_processor.process(plan, result, stats)
        if self.proposer is not None:
            if plan.scheduled and len(result.sampled) == len(plan.scheduled):  # decodes only: comparable steps
                # the guessing after the previous step (a draft model's passes) belongs to this step's cost
                self.speed_gate.record(stats.spec_decode.num_drafts > 0, stats.num_generated, len(plan.scheduled),
                                       time.perf_counter() - start + self._guessing_seconds)
            guessing_start = time.perf_counter()
            self._propose(result)
            self._guessing_seconds = time.perf_counter() - guessing_start
        self._release_stopped()
        self.spec_decode_totals.add(stats.spec_decode)
        stats.kv_usage = self.block_manager.usage
        stats.prefix_cache_queries = plan.prefix_cache_queries
        stats.prefix_cache_hits = plan.prefix_cache_hits
        self.last_step = stats
        return outputs

    def _amateur_logits(self, plan: SchedulerOutput) -> dict[Request, torch.Tensor]:
        """Contrastive decoding: the amateur's logits [V] for each contrastive request that samples
        this step (the amateur caught up with its tokens through its own KV cache)."""
        requests = [r for r, n in plan.scheduled
                    if r.sampling_params.contrastive_weight > 0 and r.num_computed_tokens + n == r.num_tokens]
        if not requests:
            return {}
        entries = [self.amateur.catch_up(r, 0) for r in requests]
        if None in entries:
            raise RuntimeError("the contrastive model's KV cache is full (its requests share no prefix blocks): "
                               "run fewer requests with contrastive_weight at once")
        logits = self.amateur.runner.last_logits(entries)
        for request, entry in zip(requests, entries):
            self.amateur.fed(request, entry.token_ids)
        return dict(zip(requests, logits))

    def _scheduled_sequence(self, request: Request, num_new_tokens: int,
                            amateur_logits: torch.Tensor | None = None) -> ScheduledSequence:
        state = self.output_processor.sequences[request.request_id]
        score_prompt = (state.index == 0 and request.num_output_tokens == 0
                        and request.sampling_params.prompt_logprobs is not None)
        guess_probs = self.proposer.probs_of(request) if self.proposer is not None else None
        return ScheduledSequence(request, num_new_tokens, state.generator, state.matcher, score_prompt,
                                 guess_probs, state.spec_generator, amateur_logits)

    def _propose(self, result: StepResult) -> None:
        """Guess the next tokens of every request that sampled this step and goes on."""
        config, num_running = self.config, self.scheduler.num_running
        if config.speculative.adaptive and not self.speed_gate.allow():
            return
        wanted, generators, verified_rows = {}, {}, {}
        for request, sampled in result.sampled.items():
            params = request.sampling_params
            if request.status is not RequestStatus.RUNNING or not params.speculative or params.contrastive_weight:
                continue  # opted out, or contrastive (its scores come from one position at a time)
            state = self.output_processor.sequences[request.request_id]
            k = config.speculative.num_speculative_tokens
            if config.speculative.adaptive:
                k = num_guesses(state.acceptance, num_running, k, config.speculative.disable_by_batch_size)
            # never past max_tokens (the last guess is followed by one more token) or the context
            if params.max_tokens is not None:
                k = min(k, params.max_tokens - request.num_output_tokens - 1)
            k = min(k, self.max_model_len - request.num_tokens)
            verified_rows[request] = sampled.row_token_ids
            if k > 0:
                wanted[request], generators[request] = k, state.spec_generator
        self.proposer.guess(wanted, generators, verified_rows)

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
