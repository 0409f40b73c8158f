"""LLMEngine: one iteration serves every running request.

A step reads: speculator.plan (this step's guesses) -> schedule -> execute (the runner) ->
process outputs -> speculator.update. The server and the offline LLM drive it through
add_request / step / abort_request.
"""

from __future__ import annotations

import functools
import itertools
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hearth.engine_config import DEFAULT_MAX_NUM_SEQS, EngineConfig
from hearth.engine import kv_transfer
from hearth.engine.chain_passes import can_chain, multi_step_on
from hearth.engine.draft_runner import load_second_models
from hearth.engine.images import Media, PromptWithImages, expand_prompt
from hearth.engine.kv_cache import BlockManager
from hearth.engine.kv_tiers import TierCounts
from hearth.engine.lora import LoadedAdapter, LoraAdapters
from hearth.engine.memory import choose_device, choose_dtype
from hearth.engine.output_processor import OutputProcessor, RequestGroup, SequenceState, StepStats
from hearth.engine.overlap import one_step_ahead
from hearth.engine.request import Request, RequestStatus
from hearth.engine.runner import ModelRunner
from hearth.engine.step_records import ScheduledSequence, StepResult
from hearth.engine.sampler import make_generator
from hearth.engine.scheduler import Scheduler, SchedulerOutput
from hearth.engine.speculation.early_exit import EarlyExitDraft
from hearth.engine.mtp_draft import MtpDraft
from hearth.engine.speculation.speculator import build_speculator, spec_seed
from hearth.engine.speculation.stats import SpecDecodeCounts
from hearth.engine.startup import (calm_exits, check_hybrid, context_length, engine_backend, kv_cache_size, kv_tiers,
                                   load_target, state_snapshots_per_slot)
from hearth.engine.state_slots import StateCheckpoints, StateSlots
from hearth.engine.structured_output import GrammarCompiler
from hearth.engine.thinking import ThinkingBudget, ThinkingMarkers
from hearth.errors import NO_IMAGES, RequestError
from hearth.lora_request import LoRARequest
from hearth.model.lora import LoraBank
from hearth.outputs import RequestOutput
from hearth.reasoning import FORMATS
from hearth.sampling_params import SamplingParams


class StepFailed(Exception):
    """A step raised; `request_ids` (aborted, their KV blocks free) were in it, `error` is why."""

    def __init__(self, request_ids: list[str], error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.request_ids, self.error = request_ids, error


class LLMEngine:
    cascade_totals = None  # a cascade's counts (hearth/engine/cascade.py's CascadeEngine has them); one engine: none

    def __init__(self, model: str | Path | None, config: EngineConfig | None = None, progress: bool = True):
        self.config = config = config or EngineConfig()
        self.device = choose_device(config.device)
        self.dtype = choose_dtype(config.dtype, self.device)
        backend = engine_backend(config, self.device, self.dtype)
        loaded, self.workers, shard = load_target(model, config, backend, self.dtype, self.device, progress)
        self.model, self.tokenizer, self.model_config = loaded.model, loaded.tokenizer, loaded.config
        self.model_path = loaded.path
        self.image_processor, self.video_processor = loaded.image_processor, loaded.video_processor  # None: none
        self.reasoning = None if config.reasoning.parser is None else FORMATS[config.reasoning.parser]
        self.thinking_markers = None if self.reasoning is None else ThinkingMarkers.of(self.reasoning, self.tokenizer)
        self.max_model_len = context_length(config, self.model_config)
        hybrid = check_hybrid(config, self.model_config)
        self.num_blocks, bytes_per_token, self.budget_split = kv_cache_size(
            config, self.model_config, self.model.backend, self.device, self.dtype, self.max_model_len, self.model_path)
        self.num_state_checkpoints, self.num_state_snapshots = self._state_rows(config, hybrid)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self.runner = ModelRunner(self.model, self.num_blocks, config.cache.block_size, self.device, self.dtype,
                                  eos_token_ids=self.tokenizer.eos_token_ids, grammars=self.grammars,
                                  kv_cache_dtype=config.cache.kv_cache_dtype,
                                  model_pass=None if shard is None else shard.model_pass(backend),
                                  num_state_slots=self.num_state_slots + self.num_state_checkpoints,
                                  num_state_snapshots=self.num_state_snapshots)
        self.runner.calm = calm_exits(config, self.runner, self.model)
        self.kv_tiers = self._start_tiers(config, shard is not None)
        self.kv_disk_tier = None if self.kv_tiers is None else self.kv_tiers.disk
        checkpoints = StateCheckpoints(self.num_state_slots, self.num_state_checkpoints) \
            if self.num_state_checkpoints else None
        self.block_manager = BlockManager(self.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                          self.kv_tiers, checkpoints)
        scheduling = config.scheduler
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=self.max_num_seqs,
                                   max_num_batched_tokens=scheduling.max_num_batched_tokens,
                                   enable_chunked_prefill=scheduling.enable_chunked_prefill,
                                   kv_window=self.model_config.kv_window,
                                   state_slots=StateSlots(self.num_state_slots) if hybrid else None,
                                   encoder_cache=self.runner.encoder_cache or (),
                                   whole_images=self.model_config.bidirectional_images)
        self.lora = self._start_lora(config)
        self.kv_cache_bytes = self.num_blocks * config.cache.block_size * bytes_per_token
        state_bytes = self.model_config.state_bytes_per_sequence(self.dtype.itemsize)
        self.state_cache_bytes, self.state_checkpoint_bytes = (n * state_bytes for n in (self.num_state_slots,
                                                                                         self.num_state_checkpoints))
        if progress:
            self._announce()
        self.output_processor = OutputProcessor(self.scheduler, self.tokenizer, self.max_model_len)
        self.runner.draft, self.runner.amateur = load_second_models(config, self.runner, self.dtype, self.tokenizer,
                                                                    self.max_model_len, progress)
        if config.speculative.method == "early-exit":  # the model's own first layers draft
            self.runner.draft = EarlyExitDraft(self.runner, config.speculative.exit_layer, self.block_manager)
        elif config.speculative.method == "mtp":  # the model's own multi-token-prediction layer drafts
            self.runner.draft = MtpDraft(self.runner, self.block_manager)
        self.runner.chains_guesses = multi_step_on(self.runner, config.speculative.method)
        self.speculator = build_speculator(config.speculative, self.runner.draft, self.max_model_len,
                                           self.output_processor.sequences, functools.partial(can_chain, self.runner))
        self.overlap = one_step_ahead(self)  # asynchronous scheduling (None: off)
        self.last_step = StepStats()
        self._ids = itertools.count()
        torch.manual_seed(config.seed)

    @property
    def num_state_slots(self) -> int:
        """A hybrid model's running sequences' states (memory.split_budget; 0: a model without states)."""
        return self.budget_split.state_slots

    @property
    def max_num_seqs(self) -> int:
        """Sequences run at once: as given, else a hybrid's state slots (split_budget), else the default."""
        return self.config.scheduler.max_num_seqs or self.num_state_slots or DEFAULT_MAX_NUM_SEQS

    def _state_rows(self, config: EngineConfig, hybrid: bool) -> tuple[int, int]:
        """A hybrid's state rows past its running slots: with prefix caching, its checkpoints (as many as
        its slots); with speculation, the states after each verified guess (state_ops.py)."""
        if not hybrid:
            return 0, 0
        checkpoints = self.num_state_slots if config.cache.enable_prefix_caching else 0
        return checkpoints, self.num_state_slots * state_snapshots_per_slot(config)

    def _announce(self) -> None:
        """The start-up line: the model, where it runs, and what its caches hold."""
        states = "" if not self.model_config.is_hybrid else (f"; states of {self.num_state_slots:,} sequences "
                                                             f"{self.state_cache_bytes / 2**20:.1f} MiB")
        if self.num_state_checkpoints:
            states += f" and as many prefix-cache state checkpoints {self.state_checkpoint_bytes / 2**20:.1f} MiB"
        if self.budget_split.why:  # why a hybrid's budget holds that many sequences (memory.split_budget)
            states += f" ({self.budget_split.why})"
        tier = "" if self.kv_tiers is None or self.kv_tiers.ram is None else \
            f"; RAM tier up to {self.config.cache.kv_cache_ram / 2**20:.0f} MiB"
        if self.kv_disk_tier is not None:
            tier += f"; disk tier {self.config.cache.kv_cache_dir} holds {self.kv_disk_tier.total_bytes / 2**20:.1f} MiB"
        print(f"hearth: {self.model_config.architecture} model on {self.device} ({str(self.dtype)[6:]}); "
              f"KV cache {self.kv_cache_bytes / 2**20:.1f} MiB ({self.kv_cache_dtype}) holds {self.kv_cache_tokens:,} "
              f"tokens ({self.num_blocks:,} blocks of {self.config.cache.block_size}){states}{tier}", file=sys.stderr)

    def _start_tiers(self, config: EngineConfig, split: bool):
        """The RAM and disk tiers under the prefix cache (startup.kv_tiers), q8_0 where asked and the
        cache holds 16- or 32-bit values."""
        runner = self.runner
        q8_0 = config.cache.kv_cache_tier_dtype == "q8_0" and runner.tier_block_bytes(True) != runner.tier_block_bytes()
        return kv_tiers(config, self.model_config, self.model_path, self.kv_cache_dtype, len(runner.kv_caches),
                        runner.tier_block_bytes(q8_0), split, q8_0)

    def _start_lora(self, config: EngineConfig) -> LoraAdapters | None:
        """With enable_lora: the model's projections wrapped for adapters, and lora_modules loaded."""
        if not config.lora.enable_lora:
            return None
        dtype = None if config.lora.lora_dtype == "auto" else getattr(torch, config.lora.lora_dtype)
        adapters = LoraAdapters(LoraBank(self.model, config.lora.max_loras, config.lora.max_lora_rank, dtype))
        self.runner.lora = (adapters.bank, adapters.slots)
        for name, path in config.lora.named_paths():
            adapters.add(LoRARequest(name, 0, path))
        return adapters

    def close(self) -> None:
        """Save the blocks the prefix cache still holds to a disk tier, if any (the next start finds them, as after
        a server's shutdown), end its writer thread with its queue written, and stop the workers of a split model
        (also done when the engine is collected). Idle the engine first: no request runs after."""
        if self.kv_tiers is not None:
            if self.kv_tiers.disk is not None:
                self.wait_for_pass()
                self.save_cache_to_tiers()
            self.kv_tiers.close()
        if self.workers is not None:
            self.workers.stop()

    @property
    def kv_cache_dtype(self) -> str:
        """What K and V are stored as: the compute dtype's name, float16, q8_0 or fp8_e4m3."""
        return str(self.dtype).removeprefix("torch.") if self.config.cache.kv_cache_dtype == "auto" else self.config.cache.kv_cache_dtype

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_blocks * self.config.cache.block_size

    @property
    def kv_disk_totals(self) -> TierCounts:
        """The disk tier's counts since the engine started (zeros without one)."""
        return TierCounts() if self.kv_disk_tier is None else self.kv_disk_tier.totals()

    @property
    def kv_ram_totals(self) -> TierCounts:
        """The RAM tier's counts since the engine started (zeros without one)."""
        ram = None if self.kv_tiers is None else self.kv_tiers.ram
        return TierCounts() if ram is None else ram.counts.copy()

    @property
    def spec_decode_totals(self) -> SpecDecodeCounts:
        """Speculative decoding's counts since the engine started."""
        return self.speculator.totals

    # ---- requests in -------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int] | PromptWithImages,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        multi_modal_data: dict[str, list] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Queue a request (with lora_request: through that LoRA adapter, loaded first where it is not);
        raises RequestError (a ValueError) when it cannot be served. A lower `priority` is served first
        (vLLM's semantics): admitted before, and preempted after, requests of a higher value
        (hearth/engine/scheduler.py). multi_modal_data: vLLM's {"image": [PIL images]}, each named in
        the text prompt by the model's marker <image> (hearth/engine/images.py), made with mm_processor_kwargs'
        settings (vLLM's), and Qwen3-VL's and Qwen3.5's {"video": [videos]}; refused by a model without a vision
        encoder."""
        params = params or SamplingParams()
        if lora_request is not None and self.lora is None:
            raise RequestError(f"LoRA adapter {lora_request.lora_name!r}: this engine was started without "
                               "enable_lora (--enable-lora, or --lora NAME=PATH)")
        lora_id = 0 if lora_request is None else self.lora.lora_id(lora_request)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.output_processor.groups:
            raise RequestError(f"request id {request_id!r} is already in use")
        expanded = prompt if isinstance(prompt, PromptWithImages) else \
            self.prompt_with_images(prompt, multi_modal_data, mm_processor_kwargs)
        prompt_text, prompt_ids = self._encode(prompt) if expanded is None else (expanded.text, expanded.token_ids)
        self._check_fits(prompt_ids)
        self._check_params(params)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise RequestError(f"priority must be an integer, got {priority!r}")
        grammar = None if params.structured_outputs is None else self.grammars.compile(params.structured_outputs)
        now = time.monotonic() if arrival_time is None else arrival_time
        group = RequestGroup(request_id, prompt_text, prompt_ids, params, now)
        group.images = [] if expanded is None else expanded.images
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        for index in range(params.best_of or params.n):
            group.sequences.append(state := self._new_sequence(group, index, grammar, priority, lora_id))
            if index == 0:
                self.scheduler.add_request(state.request)
            else:
                # the other samples wait until the first has computed the prompt, then reuse its blocks
                group.waiting_for_prompt.append(state.request)
        self.output_processor.add_group(group)
        return request_id

    def prompt_with_images(self, prompt: str | list[int], multi_modal_data: dict | None,
                           mm_processor_kwargs: dict[str, Any] | None = None) -> PromptWithImages | None:
        """The prompt with its images' placeholders and spans (None: no images); RequestError as
        add_request's. Reads no engine state: safe beside a step on another thread."""
        if multi_modal_data is not None and not self.accepts_images:
            images = multi_modal_data.get("image") if isinstance(multi_modal_data, dict) else None
            raise RequestError(f"{NO_IMAGES}: {self.model_path.name} has no vision encoder "
                               f"(multi_modal_data with {len(images) if isinstance(images, list) else 'no'} images)")
        vision = self.model_config.vision
        videos = None if self.video_processor is None else Media("video", self.video_processor, vision.video_token_id,
                                                                  self.video_processor.video_token)
        return expand_prompt(prompt, multi_modal_data, self.image_processor, self.tokenizer,
                             None if vision is None else vision.image_token_id, videos, mm_processor_kwargs)

    def _new_sequence(self, group: RequestGroup, index: int, grammar, priority: int, lora_id: int) -> SequenceState:
        """Sample number `index` of the group: its request, generators (seeded), detokenizer, matcher."""
        params = group.params
        seq_id = group.request_id if (params.best_of or params.n) == 1 else f"{group.request_id}#{index}"
        request = Request(seq_id, list(group.prompt_token_ids), params, arrival_time=group.arrival_time,
                          priority=priority, lora_id=lora_id, images=group.images)
        # prompt logprobs need every prompt position computed, and contrastive search every position's
        # hidden state: no prefix-cache skipping; its candidates take scratch slots after the tokens
        request.skip_prefix_cache = params.prompt_logprobs is not None or params.contrastive_search
        request.num_scratch_slots = params.top_k if params.contrastive_search else 0
        generator = spec_generator = None
        if params.seed is not None:
            generator = make_generator(params.seed + index, self.device)
            if self.speculator.active:  # draws of guessing and verifying: a stream of their own
                spec_generator = make_generator(spec_seed(params.seed + index), self.device)
        decoder = self.tokenizer.incremental_decoder(params.skip_special_tokens, group.prompt_token_ids)
        budget = self.config.reasoning.budget if params.thinking_token_budget is None else params.thinking_token_budget
        thinking = None if budget < 0 else ThinkingBudget(self.thinking_markers, budget, group.prompt_token_ids)
        return SequenceState(request, index, decoder, generator, spec_generator=spec_generator,
                             logprobs=[] if params.logprobs is not None else None,
                             matcher=None if grammar is None else self.grammars.matcher(grammar), thinking=thinking)

    @property
    def accepts_images(self) -> bool:
        """Whether requests may bring images (multi_modal_data)."""
        return self.model_config.accepts_images

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

    def _check_params(self, params: SamplingParams) -> None:
        try:
            params.validate_for_vocab(self.model_config.vocab_size)
        except ValueError as e:
            raise RequestError(str(e)) from None
        if params.thinking_token_budget is not None and params.thinking_token_budget >= 0 and self.reasoning is None:
            raise RequestError("thinking_token_budget needs an engine started with a reasoning_parser "
                               "(--reasoning-parser NAME): it knows no thinking markers")
        if params.contrastive_weight > 0 and self.runner.amateur is None:
            raise RequestError("contrastive_weight needs an engine started with a contrastive_model "
                               "(--contrastive-model PATH)")
        if params.calm_threshold is not None and self.runner.calm is None:
            raise RequestError("calm_threshold (CALM early exit) is not implemented for this engine: not with tensor or "
                               "pipeline parallelism, LoRA adapters, hybrid models, latent attention or 1-layer models")
        if params.contrastive_search and not self.model.backend.takes_token_trees(self.model_config):
            raise RequestError(f"contrastive search (penalty_alpha) is not implemented for "
                               f"{self.model_config.architecture} on the {self.model.backend.name} backend (its "
                               f"candidates attend through a tree mask): use the cpu or reference backend")
        if params.contrastive_search and self.model_config.is_hybrid:  # (the candidates would advance the states)
            raise RequestError(f"contrastive search (penalty_alpha) is not implemented for a hybrid model "
                               f"({self.model_config.architecture}: layers that keep a state per sequence)")

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False when it is unknown or done."""
        group = self.output_processor.remove_group(request_id)
        if group is None:
            return False
        for state in group.sequences:
            self.scheduler.abort_request(state.request.request_id)
        self.runner.release_stopped()
        return True

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) --------------------

    def add_lora(self, lora_request: LoRARequest) -> LoadedAdapter:
        """Load an adapter (ModelLoadError for a bad one, RequestError without enable_lora or a free slot)."""
        if self.lora is None:
            raise RequestError("this engine was started without enable_lora (--enable-lora)")
        self.wait_for_pass()
        return self.lora.add(lora_request)

    def remove_lora(self, lora_name: str) -> None:
        """Unload an adapter; RequestError for an unknown one or one that unfinished requests run with."""
        if self.lora is None:
            raise RequestError("this engine was started without enable_lora (--enable-lora)")
        loaded = self.lora.by_name.get(lora_name)
        using = 0 if loaded is None else sum(s.request.lora_id == loaded.lora_id
                                             for s in self.output_processor.sequences.values())
        self.wait_for_pass()
        self.lora.remove(lora_name, using)

    def list_loras(self) -> list[LoadedAdapter]:
        return [] if self.lora is None else list(self.lora.by_name.values())

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.groups)

    def sleep(self) -> int:
        """A level-1 sleep (vLLM's): forget the prefix cache and give the KV cache's memory back, and on a GPU
        move the weights to host RAM (ModelRunner.sleep). The next request finds an empty cache, and its
        tiers, where there are any, the blocks it held: saved to them first. The bytes released; RequestError
        while requests run. A step, an embedding or a KV transfer wakes the engine first (wake_up)."""
        self.wait_for_pass()
        refused = RequestError("the model cannot sleep while requests are running")
        if self.has_unfinished_requests():
            raise refused
        self.save_cache_to_tiers()
        if not self.block_manager.reset_prefix_cache():
            raise refused
        return self.runner.sleep()

    def wake_up(self) -> None:
        """Back from sleep (the weights on the device again, the KV cache's memory back); awake: nothing."""
        self.runner.wake_up()

    def wait_for_pass(self) -> None:
        """Wait until no model pass runs (with async_scheduling one may, between steps): before the
        KV cache or the model's adapters are touched from outside a step."""
        if self.overlap is not None:
            self.overlap.wait()

    # ---- KV handed between engines (hearth/fleet/disaggregated.py) ------------------

    export_kv = kv_transfer.export_kv
    import_kv = kv_transfer.import_kv

    # ---- a request moved between engines (a cascade: hearth/engine/cascade.py) -------------

    def take_request(self, request_id: str) -> RequestGroup:
        """Take an unfinished request out whole: its KV blocks freed here, its tokens, text, stop state and
        generators kept, for another engine (of the same vocabulary) to go on with in adopt_request."""
        self.wait_for_pass()
        group = self.output_processor.remove_group(request_id)
        for state in group.sequences:
            if not state.request.is_finished and state.request not in group.waiting_for_prompt:
                self.scheduler.release_request(state.request)
            self.speculator.forget(state.request)
        self.runner.release_stopped()
        return group

    def adopt_request(self, group: RequestGroup) -> None:
        """Go on with a request another engine's take_request gave: its tokens so far (prompt and output)
        are computed here first, as a preempted request's are; RequestError where it does not fit."""
        if group.request_id in self.output_processor.groups:
            raise RequestError(f"request id {group.request_id!r} is already in use")
        running = [s.request for s in group.sequences
                   if not s.request.is_finished and s.request not in group.waiting_for_prompt]
        for request in running:
            self._check_fits(request.all_token_ids)
        for request in running:
            self.scheduler.add_request(request)
        self.output_processor.add_group(group)

    # ---- one iteration ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the (cumulative) output of every group that progressed (with
        async_scheduling: the outputs of the step before, this one launched: hearth/engine/overlap.py).

        If it raises (a kernel error, out of memory), the requests it planned are aborted (their
        KV blocks freed) and StepFailed names them: the engine serves the others on."""
        if self.runner.asleep:  # a request reached a sleeping engine: it wakes
            self.wake_up()
        if self.overlap is not None:
            return self.overlap.step()
        try:
            self.speculator.plan(self.scheduler.num_running)  # this step's guesses
        except Exception as e:
            raise self._failed(self.scheduler.running, e) from e
        plan = self.scheduler.schedule()
        try:
            return self._run_plan(plan)
        except Exception as e:
            raise self._failed([r for r, _ in plan.scheduled] + plan.finished, e) from e

    def _run_plan(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """A scheduled step, synchronously: execute, then process its results."""
        stats = self._plan_stats(plan)
        self.move_cache_contents()
        result = self.runner.execute(self._scheduled_sequences(plan))
        self.scheduler.update_after_step(plan)
        self.output_processor.release_prompt_sharers()
        return self._process(plan, result, stats)

    @staticmethod
    def _plan_stats(plan: SchedulerOutput) -> StepStats:
        stats = StepStats(batch_size=len(plan.scheduled), num_tokens=plan.num_batched_tokens,
                          num_preempted=len(plan.preempted))
        stats.finished_reasons += ["length"] * len(plan.finished)  # outgrew the whole cache
        return stats

    def _process(self, plan: SchedulerOutput, result: StepResult, stats: StepStats) -> list[RequestOutput]:
        """A step's results to its requests (its tokens computed and counted by the scheduler)."""
        verified = {r: r.num_computed_tokens for r, t in result.sampled.items() if t.state_snapshot >= 0}
        outputs = self.output_processor.process(plan, result, stats)
        self._roll_back_states(result, verified)
        self.speculator.update(plan, result, stats)
        self.runner.release_stopped()
        stats.kv_usage = self.block_manager.usage
        stats.prefix_cache_queries = plan.prefix_cache_queries
        stats.prefix_cache_hits = plan.prefix_cache_hits
        self.last_step = stats
        return outputs

    def _roll_back_states(self, result: StepResult, verified: dict[Request, int]) -> None:
        """A hybrid model's requests that verified guesses (`verified`: their computed tokens before the
        guesses counted): where a guess was not kept (rejected, or past a token that ended the step's
        tokens), the states at the last kept one, from the verification's snapshots, for the next pass."""
        moves = []
        for request, before in verified.items():
            kept, tokens = request.num_computed_tokens - before, result.sampled[request]
            if request.status is RequestStatus.RUNNING and kept < tokens.num_guesses:
                moves.append((tokens.state_snapshot + kept, request.state_slot))
        self.runner.copy_states(moves)

    def save_cache_to_tiers(self) -> int:
        """Copy every block the prefix cache still holds to the tiers (those they lack), so that a disk tier has
        them after a restart (a server's shutdown, a sleep; evicted blocks went there already), and wait until
        its files are written (its writer thread ended); how many were copied."""
        if self.kv_tiers is None:
            return 0
        copied = self._copy_to_tiers(self.block_manager.cached_blocks(), wait=True)
        self.kv_tiers.close()
        return copied

    def _copy_to_tiers(self, blocks: list[tuple[bytes, int]], wait: bool = False) -> int:
        """Write each (content hash, block id)'s K/V to the tiers that lack it; how many blocks were written.
        wait: for room in the disk tier's queue, where a step would drop its oldest blocks (KVTiers.write)."""
        tiers = self.kv_tiers
        blocks = [(content_hash, block) for content_hash, block in blocks if not tiers.held_by_all(content_hash)]
        if blocks:
            for (content_hash, _), payload in zip(blocks, self.runner.block_bytes([b for _, b in blocks], tiers.q8_0)):
                tiers.write(content_hash, payload, wait)
        return len(blocks)

    def move_cache_contents(self) -> None:
        """Before a forward pass (anything that writes over the one or reads the other): copy the blocks
        the KV cache evicted to the tiers (those they do not hold already), then write the blocks found
        there into theirs (kv_cache.py);
        a hybrid's state checkpoints to take and to restore (state_slots.py), in order."""
        if self.block_manager.checkpoints is not None:
            self.runner.copy_states(self.block_manager.checkpoints.take_moves())
        tiers = self.kv_tiers
        if tiers is None:
            return
        evicted, loads = self.block_manager.take_tier_moves()
        self._copy_to_tiers(evicted)
        if loads:
            self.runner.write_block_bytes(loads, tiers.q8_0)

    def _failed(self, requests: list[Request], error: Exception) -> StepFailed:
        """Abort the groups of the requests a failed step held; the StepFailed that names them."""
        group_id = self.output_processor.group_id
        failed = sorted({group_id(r.request_id) for r in requests})
        for request_id in failed:
            self.abort_request(request_id)
        return StepFailed(failed, error)

    def _scheduled_sequences(self, plan: SchedulerOutput) -> list[ScheduledSequence]:
        return [self._scheduled_sequence(r, n) for r, n in plan.scheduled]

    def _scheduled_sequence(self, request: Request, num_new_tokens: int) -> ScheduledSequence:
        state = self.output_processor.sequences[request.request_id]
        score_prompt = (state.index == 0 and request.num_output_tokens == 0
                        and request.sampling_params.prompt_logprobs is not None)
        return ScheduledSequence(request, num_new_tokens, state.generator, state.matcher, score_prompt,
                                 state.spec_generator, [] if state.thinking is None else state.thinking.forced)
