"""ModelRunner: owns the KV cache tensors and the whole tensor side of a step.

The engine's tensors are built here and in the sampler (the models beside the target, a speculative draft and a
contrastive amateur, run runners of their own: draft_runner.py, second_model.py). `execute` takes the step's scheduled
requests (how many new tokens each, its guesses, its generator and grammar matcher) and returns plain host results:
per request that reached the end of its tokens, the tokens it keeps (verified guesses, then one sampled token) with
their logprobs, and the prompt logprobs asked for. On the way: the batch laid out as one `StepInputs` (host arrays),
which the backend (chosen once per engine, hearth/backend) turns into its tensors and attention metadata to run the
model; logits of the rows that are sampled or scored (and, for contrastive requests, the amateur's); one
SamplingBatch, with the draft's distributions of the guesses it verifies; the Sampler; and exactly one copy to the
host. Guesses that form a token tree (speculation/token_tree.py) go in as rows with ancestor masks and their depths'
positions; after the draws, the kept path's K/V are moved into the slots after the context. `forward` is the bare
model pass, for callers that want hidden states (perplexity, kernels' benchmarks, tests).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from hearth.backend import StepInputs
from hearth.backend.transfer import HostCopy, to_device
from hearth.kv_format import (KVCaches, Payload, allocate_kv_caches, block_payload_bytes, block_payloads, move_rows,
                              stored_tensors, with_state_caches, write_block_payloads)
from hearth.engine import contrastive_search
from hearth.engine.chain_passes import chained_draws
from hearth.engine.images import ENCODER_CACHE_ROWS, EncoderCache, image_blocks, mrope_positions, step_embeddings
from hearth.engine.request import Request, RequestStatus
from hearth.engine.step_records import (BatchEntry, LaunchedStep, SampledTokens, ScheduledSequence, StagedStep,
                                        StepResult, rows_of_sequences)
from hearth.engine.sampler import (GrammarBitmask, Guesses, Sampler, SamplerOutput, SamplingBatch,
                                   apply_penalties_and_bias, prompt_logprobs, skip_draws)
from hearth.engine.step_sampling import decode_sampling, drawn_in_step
from hearth.engine.structured_output import GrammarCompiler
from hearth.engine.speculation.token_tree import accepted_path, ancestor_masks, chain, depth, tree_rows
from hearth.model.lora import LoraBank
from hearth.model.transformer import Transformer
from hearth.sampling_params import SamplingType

if TYPE_CHECKING:  # (they run ModelRunners of their own)
    from hearth.engine.draft_runner import DraftRunner
    from hearth.engine.second_model import SecondModel
    from hearth.model.calm import CalmExits


class ModelRunner:
    def __init__(
        self,
        model: Transformer, num_blocks: int, block_size: int, device: torch.device,
        kv_dtype: torch.dtype,  # the compute dtype: the cache's with kv_cache_dtype "auto"
        eos_token_ids: Sequence[int] = (),
        grammars: GrammarCompiler | None = None,
        kv_cache_dtype: str = "auto",  # or float16, q8_0, fp8_e4m3 (hearth/kv_format.py)
        model_pass: Callable[[Transformer, StepInputs, KVCaches], torch.Tensor] | None = None,
        num_state_slots: int = 0,
        kv_caches: KVCaches | None = None,
        num_state_snapshots: int = 0,
    ):
        """model_pass: runs the model on a step -> hidden states [T, hidden] (default: the backend's
        forward; a pipeline-parallel model's passes through its stages). num_state_slots: a hybrid
        model's state cache, the sequences it holds at once and its prefix checkpoints (each BatchEntry
        names its slot; copy_states copies between them)); num_state_snapshots: rows after those for the
        states after each verified guess (speculation on a hybrid model: a step's guesses at most).
        kv_caches: caches it shares (early exit's draft: the target's first layers'); None: its own,
        allocated here."""
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars
        self.backend = model.backend
        self.sampler = Sampler(self.backend)
        self.model_pass = model_pass or self.backend.forward
        self.own_pass = model_pass is None  # the backend runs the whole model (no shards' passes)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        config = model.config
        if kv_caches is not None:
            self.kv_caches = kv_caches
        else:
            self.kv_caches = allocate_kv_caches(config, len(model.layers), num_blocks * block_size, kv_cache_dtype,
                                                kv_dtype, device)
            if config.is_hybrid:
                self.kv_caches = with_state_caches(config, self.kv_caches, num_state_slots + num_state_snapshots,
                                                   kv_dtype, device)
        self.owns_kv_cache = kv_caches is None
        self.state_snapshots = (num_state_slots, num_state_snapshots)  # (the first snapshot row, how many)
        self.asleep, self._freed_kv = False, []  # (sleep() to wake_up(): the KV storages freed off a CPU)
        # the models beside it: the draft, whose guesses' distributions the verification reads, and
        # contrastive decoding's amateur, a source of logits for the sampler (second_model.py)
        self.draft: DraftRunner | None = None
        self.amateur: SecondModel | None = None
        self.calm: CalmExits | None = None  # CALM's early exits (hearth/model/calm.py), where the engine runs them
        self.chains_guesses = False  # multi-step decoding: guesses are placeholders its passes fill (chain_passes.py)
        # contrastive search's requests: the final hidden states of their computed tokens [t, hidden]
        self.hidden_states: weakref.WeakKeyDictionary[Request, torch.Tensor] = weakref.WeakKeyDictionary()
        # with LoRA adapters (hearth/engine/lora.py): the model's LoraBank and each load's slot by Request.lora_id
        self.lora: tuple[LoraBank, dict[int, int]] | None = None
        # an image-text model's image embeddings by content (images.py), a few prompts' worth
        self.encoder_cache = EncoderCache(ENCODER_CACHE_ROWS) if model.vision is not None else None

    def release_stopped(self) -> None:
        """The models beside it let go of the requests that no longer run; so do the hidden states kept."""
        for second in (self.draft, self.amateur):
            if second is not None:
                second.release_stopped()
        for request in [r for r in self.hidden_states if r.status is not RequestStatus.RUNNING]:
            del self.hidden_states[request]

    def prepare(self, entries: list[BatchEntry]) -> StepInputs:
        """The step's batch as host arrays: every entry's new tokens end to end. Its counts in Python lists and its
        rows in few numpy operations: at batch 1 each costs ~5 us, its code cold from the weights' stream."""
        size = self.block_size
        query_start, ends, lens = [0], [], []
        for e in entries:
            lens.append(len(e.token_ids))
            ends.append(e.num_computed_tokens + lens[-1])
            query_start.append(query_start[-1] + lens[-1])
        used_blocks = [-(-end // size) for end in ends]
        block_tables = np.zeros((len(entries), max(used_blocks, default=0)), dtype=np.int32)
        for i, (entry, used) in enumerate(zip(entries, used_blocks)):
            block_tables[i, :used] = entry.block_table[:used]
        np.maximum(block_tables, 0, out=block_tables)  # blocks freed behind a sliding window: no kernel reads them
        query_start_loc, ends = np.array(query_start, dtype=np.int32), np.array(ends, dtype=np.int64)
        starts = np.array([e.num_computed_tokens for e in entries], dtype=np.int64)
        seq_of_row = np.repeat(np.arange(len(entries)), lens)
        positions = np.arange(query_start[-1]) + (starts - query_start_loc[:-1])[seq_of_row]
        slot_mapping = block_tables[seq_of_row, positions // size] * np.int64(size) + positions % size
        tree_start, tree_masks = None, None
        if any(e.tree is not None for e in entries):  # a tree row's position is its depth's
            tree_start, tree_masks = tree_rows([e.tree for e in entries], starts, query_start_loc, positions)
        if self.model.config.mrope_section is not None:  # [3, T]: each row's time, height and width positions
            positions = np.concatenate([mrope_positions(positions[query_start_loc[i]:query_start_loc[i + 1]], e.images)
                                        for i, e in enumerate(entries)], axis=1)
        state_slots = None
        if self.model.config.is_hybrid:
            if any(e.state_slot is None for e in entries):
                raise ValueError(f"a {self.model.config.architecture} model keeps a state per sequence: every "
                                 "sequence of a step needs a state slot")
            state_slots = np.array([e.state_slot for e in entries], dtype=np.int64)
        snapshots = None if all(e.state_snapshot is None for e in entries) else np.array(
            [-1 if e.state_snapshot is None else e.state_snapshot for e in entries], dtype=np.int64)
        both_ways = self.model.config.bidirectional_images
        return StepInputs(
            input_ids=np.fromiter((t for e in entries for t in e.token_ids), dtype=np.int64, count=len(slot_mapping)),
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=ends.astype(np.int32),
            block_tables=block_tables,
            block_size=self.block_size,
            tree_start=tree_start,
            tree_masks=tree_masks,
            state_slots=state_slots,
            state_snapshots=snapshots,
            embeds=image_rows(entries, query_start_loc),
            image_blocks=image_blocks([e.images for e in entries], starts, ends) if both_ways else None,
            image_blocks_sliding_only=self.model.config.bidirectional_images_sliding_only,
        )

    def forward(self, entries: list[BatchEntry], step: StepInputs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The model pass alone: hidden states of every new token [T, hidden] and each entry's last row [B]
        (step: the entries already prepared)."""
        step = self.prepare(entries) if step is None else step
        hidden = self._pass(step, entries)
        return hidden, torch.from_numpy(step.last_rows).to(hidden.device)

    def _pass(self, step: StepInputs, entries: list[BatchEntry]) -> torch.Tensor:
        """The model pass of the entries' prepared step: hidden states [T, hidden]."""
        if self.lora is not None:  # each row's adapter
            self.lora[0].activate(np.repeat([e.lora_slot for e in entries], step.query_lens))
        return self.model_pass(self.model, step, self.kv_caches)

    def last_logits(self, entries: list[BatchEntry]) -> torch.Tensor:
        """The model pass and the logits of each entry's last token [B, V]."""
        return self.last_logits_of_step(self.prepare(entries))

    def last_logits_of_step(self, step: StepInputs) -> torch.Tensor:
        """The model pass of a prepared step and the logits of each sequence's last token [B, V]."""
        hidden = self.model_pass(self.model, step, self.kv_caches)
        if not step.decode_only:  # (a decode's one row is its last)
            hidden = hidden[torch.from_numpy(step.last_rows).to(hidden.device)]
        return self.model.compute_logits(hidden)

    def pooled(self, batches: Iterable[list[BatchEntry]], pooling: str) -> torch.Tensor:
        """Embeddings (embedding.py): each entry's final hidden states [T, hidden] pooled, its last
        token's ("last") or their mean ("mean"), L2-normalised; [entries, hidden] float32 on the CPU."""
        vectors = []
        for entries in batches:
            hidden, _ = self.forward(entries)
            for rows in hidden.split([len(e.token_ids) for e in entries]):
                vector = rows[-1] if pooling == "last" else rows.mean(0, dtype=torch.float32)
                vectors.append(torch.nn.functional.normalize(vector.float(), dim=0))
        return torch.stack(vectors).cpu()

    def copy_states(self, moves: list[tuple[int, int]]) -> None:
        """A hybrid model's state checkpoints taken and restored (state_slots.py), and its states at the last
        kept guess put back from their snapshots: every state layer's states copied from slot to slot,
        move by move in order (a later one may read an earlier one's)."""
        for state in self.state_tensors().values() if moves else ():
            for source, target in moves:
                state[target] = state[source]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """A hybrid model's state tensors, [state and checkpoint slots, *shape] each, by name:
        state.{layer}.{its index in the layer} (ModelConfig.state_shapes)."""
        config = self.model.config
        return {f"state.{layer}.{i}": t for layer, states in enumerate(self.kv_caches) if config.state_shapes(layer)
                for i, t in enumerate(states)}

    def attention_caches(self) -> KVCaches:
        """The (K, V) caches of the attention layers that keep their own (not a hybrid model's state and MLP
        layers, nor layers that read another's K/V)."""
        config = self.model.config
        return [cache for layer, cache in enumerate(self.kv_caches) if config.keeps_kv_cache(layer)]

    def read_kv(self, block_ids: list[int]) -> torch.Tensor:
        """The K/V of the blocks, in order, on the host: [attention layers, 2, blocks x block_size, kv_heads,
        head_dim]."""
        slots = self._slots(block_ids)
        return torch.stack([torch.stack((k[slots], v[slots])) for k, v in self.attention_caches()]).cpu()

    def write_kv(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Write kv (read_kv's layout, for these blocks) into the blocks."""
        slots = self._slots(block_ids)
        for (k, v), layer in zip(self.attention_caches(), kv.to(self.device)):
            k[slots], v[slots] = layer[0].to(k.dtype), layer[1].to(v.dtype)

    def write_kv_blocks(self, entered: list[tuple[int, int]], kv: torch.Tensor) -> None:
        """Write blocks of kv (read_kv's layout, from its first block on) into the cache: per
        (index of the block in kv, block id)."""
        block_size = self.block_size
        rows = torch.cat([torch.arange(i * block_size, (i + 1) * block_size) for i, _ in entered])
        self.write_kv([block_id for _, block_id in entered], kv[:, :, rows])

    def block_bytes(self, block_ids: list[int], q8_0: bool = False) -> list[Payload]:
        """Each block's K/V as bytes (the KV tiers' payload, kv_format.block_payloads)."""
        return block_payloads(self._cache_tensors(), self._slots(block_ids), len(block_ids), q8_0)

    def write_block_bytes(self, payloads: dict[int, Payload], q8_0: bool = False) -> None:
        """Write block_bytes' payloads back, per block id (q8_0: as block_bytes(q8_0=True) packed them)."""
        write_block_payloads(self._cache_tensors(), self._slots(list(payloads)), list(payloads.values()),
                             self.block_size, q8_0)

    def tier_block_bytes(self, q8_0: bool = False) -> int:
        """The bytes of one block's K/V in block_bytes' payload."""
        return block_payload_bytes(self._cache_tensors(), self.block_size, q8_0)

    def _cache_tensors(self) -> list[tuple[torch.Tensor, bool]]:
        return stored_tensors(self.kv_caches, self.block_size)

    def sleep(self) -> int:
        """A level-1 sleep (vLLM's), with the models beside it: the KV cache's memory given back (its contents
        forgotten: the engine forgot the prefix cache first) and on a GPU the weights moved to host RAM
        (Backend.release_memory). Nothing may run until wake_up. Returns the bytes released."""
        if self.asleep:
            return 0
        beside = sum(s.runner.sleep() for s in (self.draft, self.amateur) if s is not None)
        kv = [t for t, _ in self._cache_tensors()] if self.owns_kv_cache else []
        (released, self._freed_kv), self.asleep = self.backend.release_memory(self.model, kv), True
        return beside + released

    def wake_up(self) -> None:
        """Back from sleep: the weights on the device again, the KV cache's memory back (read as zeros)."""
        if self.asleep:
            self.backend.restore_memory(self.model, self._freed_kv)
            self._freed_kv, self.asleep = [], False
            for second in (s for s in (self.draft, self.amateur) if s is not None):
                second.runner.wake_up()

    def _slots(self, block_ids: list[int]) -> torch.Tensor:  # [blocks x block_size] every slot of the blocks
        blocks = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return (blocks[:, None] * self.block_size + torch.arange(self.block_size, device=self.device)).reshape(-1)

    def execute(self, sequences: list[ScheduledSequence]) -> StepResult:
        """Run one engine step: forward, logits, sampling and verification, prompt scoring."""
        if not sequences:
            return StepResult({}, {})
        return self.collect(self.launch(self.stage(sequences)))

    def stage(self, sequences: list[ScheduledSequence], drawn_before: dict[Request, int] | None = None
              ) -> StagedStep:
        """A step's host side, read from its requests now: the batch laid out, its StepInputs. A request
        whose last token is still pending (Request.num_pending_tokens) is fed its draw in the step
        before, at its row drawn_before[request] of that step's draws (StagedStep.draw_rows)."""
        entries, sampled, sample_rows, scored, fed = self._lay_out(sequences)
        feeds = None
        if fed:
            if drawn_before is None or any(r not in drawn_before for _, r in fed):
                raise RuntimeError("a pending token is fed from the step before's draws, which do not hold it")
            feeds = (torch.tensor([row for row, _ in fed]), torch.tensor([drawn_before[r] for _, r in fed]))
        draw_rows, row = {}, 0
        for seq in sampled:
            draw_rows[seq.request] = row
            row += len(seq.request.spec_token_ids) + 1
        return StagedStep(sequences, entries, sampled, sample_rows, scored, self.prepare(entries), feeds, draw_rows)

    def launch(self, staged: StagedStep, draws_before: torch.Tensor | None = None) -> LaunchedStep:
        """The step's tensor work: the model pass, logits, the draws, and their copy to the host started;
        draws_before: the step before's sampled token ids, which feed its pending tokens. Reads no
        request field that the engine's output processing writes (asynchronous scheduling runs it
        beside that, on a worker thread: engine/overlap.py)."""
        sampled, step = staged.sampled, staged.inputs
        exits = {} if self.calm is None else staged.calm_rows()
        if staged.feeds is not None:  # tokens drawn by the step before, never read by the host
            rows, sources = staged.feeds
            step.input_ids = to_device(torch.from_numpy(step.input_ids), self.device)
            step.input_ids[to_device(rows, self.device)] = draws_before[to_device(sources, draws_before.device)]
        drawn = None if exits else (self.chains_guesses and chained_draws(self, staged)) or self._draws_in_step(staged)
        if drawn is not None:
            copies = [drawn.sampled_token_ids, drawn.logprobs] + ([] if drawn.accepted is None else [drawn.accepted])
            return LaunchedStep(sampled, drawn, {}, [], HostCopy(copies), staged.draw_rows)
        amateur_logits = self._amateur_logits(sampled)
        # seeded requests with guesses: where their generators stood, to keep only kept tokens' draws
        rewinds = {s.request: s.generator.get_state() for s in sampled if s.request.spec_token_ids
                   and s.request.sampling_params.sampling_type == SamplingType.RANDOM_SEED}
        hidden, exited = self.calm.run(step, exits) if exits else (self._pass(step, staged.entries), None)
        self._keep_hidden_states(staged.sequences, hidden)

        device_results: list[torch.Tensor] = []  # everything the host reads, copied once at the end
        out = None
        if sampled:
            logits = self.model.compute_logits(hidden[to_device(torch.tensor(staged.sample_rows), hidden.device)]) \
                if exited is None else self.calm.logits(hidden, staged.sample_rows, exited)
            constrained = [seq for seq in sampled if seq.matcher is not None]
            # The grammar masks are filled on another thread from here until the sampler applies them,
            # after drawing its noise: on a CPU the model's threads fill every core until now, and a mask
            # thread beside them only slows them, while the noise draw is serial. (On a GPU the device
            # is still computing when this host code runs.)
            masks = None if not constrained else self.grammars.start_masks(
                [s.matcher for s in constrained], [s.request.spec_token_ids for s in constrained],
                new_bitmask=GrammarBitmask)
            batch, guesses = self._sampling_batch(sampled, masks, amateur_logits)
            out = self.sampler(logits, batch, guesses)
            self._contrastive_search(sampled, logits, out)
            device_results += [out.sampled_token_ids, out.logprobs]
            device_results += [] if out.accepted is None else [out.accepted]
            device_results += [] if out.top_logprobs is None else list(out.top_logprobs)
        scoring = []
        for request, first_row, start, count in staged.scored:
            count = min(count, request.num_prompt_tokens - 1 - start)
            if count > 0:  # the rows predicting prompt tokens start+1 .. start+count
                targets = request.prompt_token_ids[start + 1 : start + 1 + count]
                logits = self.model.compute_logits(hidden[first_row : first_row + count])
                scoring.append((request, targets))
                device_results += prompt_logprobs(logits, torch.tensor(targets, device=logits.device),
                                                  request.sampling_params.prompt_logprobs)
        return LaunchedStep(sampled, out, rewinds, scoring, HostCopy(device_results), staged.draw_rows)

    def collect(self, launched: LaunchedStep) -> StepResult:
        """The launched step's results on the host (waiting for its copy): the kept tokens, the prompt logprobs."""
        host = iter(launched.host.wait())
        result = StepResult({}, {})
        if launched.out is not None:
            result.sampled = self._kept_tokens(launched.sampled, launched.out, host, launched.rewinds)
        for request, targets in launched.scoring:
            chosen, top_ids, top_lps = next(host).tolist(), next(host).tolist(), next(host).tolist()
            entries = [{t: lp} for t, lp in zip(targets, chosen)]
            for entry, ids, lps in zip(entries, top_ids, top_lps):
                entry.update(zip(ids, lps))
            result.prompt_logprobs[request] = entries
        return result

    def _draws_in_step(self, staged: StagedStep) -> SamplerOutput | None:
        """A step of plain decodes, each drawing its next token as step_sampling.py's head can: the backend runs the model,
        the LM head and the draws in one go (the gpu backend: one CUDA graph replay; its outputs hold until that graph's
        next replay, after the next step's inputs took them). None: not such a step (one whose requests' guesses the MTP
        layer makes from its hidden states is not), or the backend has no such path (then the step takes the eager way)."""
        sampled, step = staged.sampled, staged.inputs
        reads_hidden = self.draft is not None and self.draft.reads_target_hidden
        if (len(sampled) != len(staged.sequences) or not step.decode_only or not self.own_pass
                or self.lora is not None or any(
                    s.request.spec_token_ids or s.matcher is not None or s.generator is not None or s.forced
                    or (reads_hidden and s.request.sampling_params.speculative)
                    or not drawn_in_step(s.request.sampling_params, len(s.request.output_token_ids))
                    for s in sampled)):
            return None
        sampling = decode_sampling([s.request.sampling_params for s in sampled], self.model.config.vocab_size,
                                   self.backend)
        out = self.backend.decode_and_sample(self.model, step, self.kv_caches, sampling)
        return None if out is None else SamplerOutput(*out, top_logprobs=None)

    def _lay_out(self, sequences: list[ScheduledSequence]):
        """The step's BatchEntry list, the sequences that sample and their rows (each guess's and
        the one after), the prompt-scoring (request, first row, start, count) of each, and the
        (row, request) of each pending token (a placeholder 0 in its entry)."""
        entries, sampled, sample_rows, scored, fed = [], [], [], [], []
        row, snapshot = 0, self.state_snapshots[0]  # (the next free snapshot row)
        for seq in sequences:
            request, start, count = seq.request, seq.request.num_computed_tokens, seq.num_new_tokens
            tokens = request.all_token_ids[start : start + count]
            if request.num_pending_tokens and len(tokens) < count:  # its last draw, still on the device
                fed.append((row + len(tokens), request))
                tokens.append(0)
            tokens += request.spec_token_ids[: count - len(tokens)]
            tree = request.spec_tree if request.spec_token_ids else None  # (guesses follow only a decode's one token)
            keeps = bool(request.spec_token_ids) and request.state_slot >= 0  # its states after each guess
            entries.append(BatchEntry(tokens, start, request.block_table,
                                      None if tree is None else (start, ancestor_masks(tree)),
                                      request.state_slot if request.state_slot >= 0 else None,
                                      snapshot if keeps else None,
                                      self.lora[1].get(request.lora_id, -1) if self.lora else -1,
                                      None if not request.images else step_embeddings(
                                          request, start, count, self.model.config.vision.image_token_id,
                                          self.encoder_cache, self.model.vision.encode),
                                      request.images))
            snapshot += len(request.spec_token_ids) if keeps else 0
            if seq.score_prompt:
                scored.append((request, row, start, count))
            if start + count == request.num_tokens + request.num_pending_tokens + len(request.spec_token_ids):
                num_rows = len(request.spec_token_ids) + 1
                sample_rows.extend(range(row + count - num_rows, row + count))
                sampled.append(seq)
            row += count
        if snapshot > sum(self.state_snapshots):
            raise RuntimeError(f"the step's guesses need {snapshot - self.state_snapshots[0]} state snapshots, "
                               f"the runner keeps {self.state_snapshots[1]}")
        return entries, sampled, sample_rows, scored, fed

    def _kept_tokens(self, sampled: list[ScheduledSequence], out: SamplerOutput, host,
                     rewinds: dict[Request, torch.Tensor]) -> dict[Request, SampledTokens]:
        """Per sampling sequence, from the host copies of `out`: its guesses up to the first rejected
        one, then that row's own draw. A seeded generator is wound back to the kept draws."""
        token_ids, logprobs = next(host).tolist(), next(host).tolist()
        accepted = next(host).tolist() if out.accepted is not None else None
        top = (next(host).tolist(), next(host).tolist()) if out.top_logprobs is not None else None
        kept_tokens, row, guess, snapshot = {}, 0, 0, self.state_snapshots[0]
        moves: list[tuple[list[int], int, list[int]]] = []  # (block table, first guess's position, kept guesses)
        for seq in sampled:
            request = seq.request
            num_guesses = len(request.spec_token_ids)
            parents = request.spec_tree or chain(num_guesses)
            path = accepted_path(parents, accepted[guess : guess + num_guesses] if num_guesses else [])
            keeps = num_guesses and request.state_slot >= 0  # (_lay_out's snapshot rows, in the same order)
            snapshot += num_guesses if keeps else 0
            kept, levels = len(path) + 1, depth(parents)
            if request in rewinds and kept <= levels:
                seq.generator.set_state(rewinds[request])
                skip_draws(seq.generator, kept, self.model.config.vocab_size)
            if path != list(range(len(path))):  # a branch other than the first guesses: its K/V move
                moves.append((request.block_table, request.num_computed_tokens + 1, path))
            rows = [row] + [row + 1 + i for i in path]
            kept_tokens[request] = SampledTokens(
                [token_ids[r] for r in rows], [logprobs[r] for r in rows],
                None if top is None else [(top[0][r], top[1][r]) for r in rows], num_guesses, levels,
                token_ids[row : row + num_guesses + 1], snapshot - num_guesses if keeps else -1)
            row += num_guesses + 1
            guess += num_guesses
        self._move_kept_guesses(moves)
        return kept_tokens

    def _move_kept_guesses(self, moves: list[tuple[list[int], int, list[int]]]) -> None:
        """The K/V of each token tree's kept guesses (their indices, in order) into the slots right
        after the context, where the next steps read them (sources are never behind targets)."""
        if not moves:
            return
        def slot(table: list[int], position: int) -> int:
            return table[position // self.block_size] * self.block_size + position % self.block_size

        sources, targets = [], []
        for table, first, path in moves:
            for d, node in enumerate(path):
                if node != d:
                    sources.append(slot(table, first + node))
                    targets.append(slot(table, first + d))
        sources, targets = (torch.tensor(x, device=self.device) for x in (sources, targets))
        for layer in self.kv_caches:
            for cache in layer:
                move_rows(cache, sources, targets)

    def _keep_hidden_states(self, sequences: list[ScheduledSequence], hidden: torch.Tensor) -> None:
        """Contrastive search: append the hidden states of the tokens each of its requests computed this step to
        those of its tokens before (a recomputed request starts again at 0); a draft that reads them gets them."""
        if self.draft is not None:  # (the MTP layer)
            self.draft.target_hidden(sequences, hidden)
        for request, rows in rows_of_sequences(sequences, hidden):
            if not request.sampling_params.contrastive_search:
                continue
            start, kept = request.num_computed_tokens, self.hidden_states.get(request)
            if start and (kept is None or len(kept) < start):
                raise RuntimeError(f"contrastive search lacks the hidden states of request {request.request_id}'s "
                                   f"first {start} tokens (computed elsewhere)")
            self.hidden_states[request] = torch.cat([kept[:start], rows]) if start else rows.clone()

    def _contrastive_search(self, sampled: list[ScheduledSequence], logits: torch.Tensor, out: SamplerOutput) -> None:
        """Contrastive search's requests take, in `out`, their candidate of most contrastive score
        (contrastive_search.py) instead of the argmax: their top_k candidates run as one extra pass,
        each request's k as sibling rows of a token tree after its tokens (in its scratch slots, which
        later steps overwrite), and their final hidden states meet the request's kept ones."""
        rows, requests, row = [], [], 0
        for seq in sampled:
            if seq.request.sampling_params.contrastive_search:  # (such a request makes no guesses)
                rows.append(row)
                requests.append(seq.request)
            row += len(seq.request.spec_token_ids) + 1
        if not requests:
            return
        raw = logits[torch.tensor(rows, device=logits.device)].float()
        batch = SamplingBatch.build([r.sampling_params for r in requests], [r.prompt_token_ids for r in requests],
                                    [r.output_token_ids for r in requests], [None] * len(requests),
                                    self.model.config.vocab_size, self.device, eos_token_ids=self.eos_token_ids)
        penalised = apply_penalties_and_bias(raw, batch, self.backend.apply_token_bitmask)
        tops = [contrastive_search.candidates(row, r.sampling_params.top_k) for row, r in zip(penalised, requests)]
        step = self.prepare([BatchEntry([0] * len(ids), r.num_tokens, r.block_table,
                                        (r.num_tokens, [1 << i for i in range(len(ids))]))
                             for r, (_, ids) in zip(requests, tops)])
        step.input_ids = torch.cat([ids for _, ids in tops])
        hidden = self.model_pass(self.model, step, self.kv_caches).split([len(ids) for _, ids in tops])
        chosen = torch.stack([
            ids[contrastive_search.choose(self.hidden_states[r], h, probs, r.sampling_params.penalty_alpha)]
            for r, (probs, ids), h in zip(requests, tops, hidden)])
        at = torch.tensor(rows, device=out.sampled_token_ids.device)
        out.sampled_token_ids[at] = chosen.to(out.sampled_token_ids.device)
        out.logprobs[at] = raw.log_softmax(dim=-1).gather(1, chosen[:, None]).squeeze(1).to(out.logprobs.device)

    def _amateur_logits(self, sampled: list[ScheduledSequence]) -> dict[Request, torch.Tensor]:
        """Contrastive decoding: the amateur's logits [V] for each contrastive request that samples
        this step (such a request makes no guesses: its sampled row is its last token's)."""
        requests = [s.request for s in sampled if s.request.sampling_params.contrastive_weight > 0]
        if not requests or self.amateur is None:
            return {}
        return dict(zip(requests, self.amateur.last_logits(requests)))

    def _sampling_batch(self, sampled: list[ScheduledSequence], masks, amateur_logits: dict[Request, torch.Tensor]
                        ) -> tuple[SamplingBatch, Guesses | None]:
        """One row per verified position: a request with k guesses has k + 1 rows, the first seeing
        its output, row 1 + i its output followed by guess i and the guesses before it on its
        branch (a chain: the first i + 1 guesses); guess i is verified at its parent's row. Rows at
        one depth of a token tree draw with one noise (that of plain decoding's token there).
        Returns the batch and the rows' guesses (None: no row has one)."""
        params, prompts, outputs, generators, constrained_rows, contrastive_rows, forced = [], [], [], [], [], [], ([], [])
        guess_rows, guess_ids, guess_probs, guess_generators, siblings, noise_rows = [], [], [], [], [], []
        V = self.model.config.vocab_size
        for seq in sampled:
            request, spec = seq.request, seq.request.spec_token_ids
            parents = request.spec_tree or chain(len(spec))
            first = len(params)
            if seq.matcher is not None:
                constrained_rows.extend(range(first, first + len(spec) + 1))
            if request in amateur_logits:  # such a request makes no guesses: one row
                contrastive_rows.append(first)
            if spec:
                guess_rows.extend(first + 1 + parent for parent in parents)
                siblings.extend(parent in parents[:i] for i, parent in enumerate(parents))
                guess_ids.extend(spec)
                guess_generators.extend([seq.spec_generator] * len(spec))
                guess_probs.append((spec, None if self.draft is None else self.draft.probs_of(request)))
            branches, depth_rows = [[]], {0: first}  # per row: the guesses on its branch; each depth's first row
            for parent, token in zip(parents, spec):
                branches.append(branches[parent + 1] + [token])
            for branch in branches:
                noise_rows.append(depth_rows.setdefault(len(branch), len(params)))
                if len(branch) < len(seq.forced):
                    forced[0].append(len(params))
                    forced[1].append(seq.forced[len(branch)])
                params.append(request.sampling_params)
                prompts.append(request.prompt_token_ids)
                outputs.append(request.output_token_ids + branch if branch else request.output_token_ids)
                generators.append(seq.generator)
        batch = SamplingBatch.build(
            params, prompts, outputs, generators, V, self.device,
            eos_token_ids=self.eos_token_ids,
            grammar_masks=None if masks is None else (constrained_rows, masks),
            amateur_logits=None if not contrastive_rows else (
                contrastive_rows, torch.stack([amateur_logits[s.request] for s in sampled if s.request in amateur_logits])),
            noise_rows=noise_rows if noise_rows != list(range(len(noise_rows))) else None,
            forced=forced if forced[0] else None,
        )
        if not guess_rows:
            return batch, None
        probs = None  # greedy rows verify by comparison (sampler.greedy_acceptance)
        if not batch.all_greedy:
            probs = torch.cat([q[: len(spec)] if q is not None else  # None: a point mass on each guess
                               torch.nn.functional.one_hot(torch.tensor(spec, device=self.device), V).float()
                               for spec, q in guess_probs]).to(self.device)
        return batch, Guesses(torch.tensor(guess_rows, device=self.device), torch.tensor(guess_ids, device=self.device),
                              probs, guess_generators, siblings if any(siblings) else None)


def image_rows(entries: list[BatchEntry], query_start_loc: np.ndarray) -> tuple[np.ndarray, torch.Tensor] | None:
    """The step's rows that take image embeddings (in the flattened batch) and their values."""
    given = [(i, e.embeds) for i, e in enumerate(entries) if e.embeds is not None]
    if not given:
        return None
    return (np.concatenate([rows + query_start_loc[i] for i, (rows, _) in given]),
            torch.cat([v for _, (_, values) in given for v in values]))
