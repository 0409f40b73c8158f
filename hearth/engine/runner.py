"""ModelRunner: owns the KV cache tensors and the whole tensor side of a step.

The only engine module that builds tensors. `execute` takes the step's scheduled requests
(how many new tokens each, its guesses, its generator and grammar matcher) and returns plain
host results: per request that reached the end of its tokens, the tokens it keeps (verified
guesses, then one sampled token) with their logprobs, and the prompt logprobs asked for.
On the way: the batch laid out as one `StepInputs` (host arrays), which the backend (chosen once
per engine, hearth/backend) turns into its tensors and attention metadata to run the model;
logits of the rows that are sampled or scored; one SamplingBatch; the Sampler; and exactly one
copy to the host. `forward` is the bare model pass, for callers that want hidden states
(perplexity, kernels' benchmarks, tests).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hearth.backend import StepInputs
from hearth.backend.kv_quant import Q8_BLOCK, Fp8Cache, KVCache, Q8Cache
from hearth.engine.request import Request
from hearth.engine.sampler import (Guesses, Sampler, SamplerOutput, SamplingBatch, draw, final_distribution,
                                   prompt_logprobs, skip_draws)
from hearth.engine.structured_output import GrammarCompiler
from hearth.model.transformer import Transformer
from hearth.sampling_params import SamplingType

Alternatives = tuple[list[int], list[float]]  # top-k (token ids, logprobs), best first
KVCaches = list[tuple[KVCache, ...]]  # per layer (K, V), each [slots, kv_heads, head_dim]; or (latent,)


@dataclass
class BatchEntry:
    token_ids: list[int]  # the new tokens of this sequence this step
    num_computed_tokens: int  # tokens already in the cache before them
    block_table: list[int]


@dataclass
class ScheduledSequence:
    """One request's share of a step, as the engine hands it to the runner (no tensors)."""

    request: Request
    num_new_tokens: int  # from num_computed_tokens on; its guesses (spec_token_ids) are the last ones
    generator: torch.Generator | None = None  # a seeded request's own
    matcher: object | None = None  # the llguidance.LLMatcher of a structured-output request
    score_prompt: bool = False  # return the logprobs of the prompt tokens this step computes
    # the distribution each guess was drawn from [k, V] (a draft model's); None: point masses (prompt lookup)
    guess_probs: torch.Tensor | None = None
    spec_generator: torch.Generator | None = None  # a seeded request's randomness for verifying guesses
    amateur_logits: torch.Tensor | None = None  # [V] contrastive decoding: the amateur's at the sampled position


@dataclass
class SampledTokens:
    """What one request keeps from a step: its verified guesses that were right, then one draw."""

    token_ids: list[int]
    logprobs: list[float]  # of each token under the raw distribution
    top_logprobs: list[Alternatives] | None  # per token, when the request asked for logprobs
    num_guesses: int  # guesses verified this step; len(token_ids) - 1 of them were accepted
    # the draw of every verified row (the last token's, then each guess's): past the first
    # rejected guess, what the model gave after a wrong one (lookahead's Jacobi iteration)
    row_token_ids: list[int]


@dataclass
class StepResult:
    sampled: dict[Request, SampledTokens]  # the requests that reached the end of their tokens
    prompt_logprobs: dict[Request, list[dict[int, float]]]  # per scored prompt token: {id: logprob}


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kv_dtype: torch.dtype,  # the compute dtype: the cache's with kv_cache_dtype "auto"
        eos_token_ids: Sequence[int] = (),
        grammars: GrammarCompiler | None = None,
        kv_cache_dtype: str = "auto",  # or q8_0, fp8_e4m3 (hearth/backend/kv_quant.py)
        model_pass: Callable[[Transformer, StepInputs, KVCaches], torch.Tensor] | None = None,
    ):
        """model_pass: runs the model on a step -> hidden states [T, hidden] (default: the backend's
        forward; a pipeline-parallel model's passes through its stages)."""
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars
        self.backend = model.backend
        self.sampler = Sampler(self.backend.apply_token_bitmask)
        self.model_pass = model_pass or self.backend.forward
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.kv_caches = allocate_kv_caches(model.config, len(model.layers), num_blocks * block_size, kv_cache_dtype,
                                            kv_dtype, device)

    def prepare(self, entries: list[BatchEntry]) -> StepInputs:
        """The step's batch as host arrays: every entry's new tokens end to end."""
        query_lens = np.array([len(e.token_ids) for e in entries], dtype=np.int32)
        starts = np.array([e.num_computed_tokens for e in entries], dtype=np.int64)
        ends = starts + query_lens
        query_start_loc = np.zeros(len(entries) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        # position of every row: its sequence's start + its index among the sequence's new rows
        seq_of_row = np.repeat(np.arange(len(entries)), query_lens)
        positions = starts[seq_of_row] + np.arange(len(seq_of_row)) - query_start_loc[seq_of_row]
        used_blocks = -(-ends // self.block_size)
        block_tables = np.zeros((len(entries), int(used_blocks.max())), dtype=np.int32)
        for i, (entry, used) in enumerate(zip(entries, used_blocks)):
            block_tables[i, :used] = entry.block_table[:used]
        # blocks freed behind a sliding window (NO_BLOCK, < 0) read as block 0: no kernel reads them
        np.maximum(block_tables, 0, out=block_tables)
        slot_mapping = (block_tables[seq_of_row, positions // self.block_size].astype(np.int64) * self.block_size
                        + positions % self.block_size)
        return StepInputs(
            input_ids=np.fromiter((t for e in entries for t in e.token_ids), dtype=np.int64, count=len(positions)),
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=ends.astype(np.int32),
            block_tables=block_tables,
            block_size=self.block_size,
        )

    def forward(self, entries: list[BatchEntry]) -> tuple[torch.Tensor, torch.Tensor]:
        """The model pass alone: hidden states of every new token [T, hidden] and each entry's last row [B]."""
        step = self.prepare(entries)
        hidden = self.model_pass(self.model, step, self.kv_caches)
        return hidden, torch.from_numpy(step.last_rows).to(hidden.device)

    def last_logits(self, entries: list[BatchEntry]) -> torch.Tensor:
        """The model pass and the logits of each entry's last token [B, V]."""
        hidden, last_rows = self.forward(entries)
        return self.model.compute_logits(hidden[last_rows])


    def read_kv(self, block_ids: list[int]) -> torch.Tensor:
        """The K/V of the blocks, in order, on the host: [layers, 2, blocks x block_size, kv_heads, head_dim]."""
        slots = self._slots(block_ids)
        return torch.stack([torch.stack((k[slots], v[slots])) for k, v in self.kv_caches]).cpu()

    def write_kv(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Write kv (read_kv's layout, for these blocks) into the blocks."""
        slots = self._slots(block_ids)
        for (k, v), layer in zip(self.kv_caches, kv.to(self.device)):
            k[slots], v[slots] = layer[0].to(k.dtype), layer[1].to(v.dtype)

    def _slots(self, block_ids: list[int]) -> torch.Tensor:  # [blocks x block_size] every slot of the blocks
        blocks = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return (blocks[:, None] * self.block_size + torch.arange(self.block_size, device=self.device)).reshape(-1)

    def execute(self, sequences: list[ScheduledSequence]) -> StepResult:
        """Run one engine step: forward, logits, sampling and verification, prompt scoring."""
        if not sequences:
            return StepResult({}, {})
        entries, sampled, sample_rows, scored = self._lay_out(sequences)
        constrained = [seq for seq in sampled if seq.matcher is not None]
        # the grammar masks are filled while the model runs
        masks = self.grammars.start_masks([s.matcher for s in constrained],
                                          [s.request.spec_token_ids for s in constrained]) if constrained else None
        # seeded requests with guesses: where their generators stood, to keep only kept tokens' draws
        rewinds = {s.request: s.generator.get_state() for s in sampled if s.request.spec_token_ids
                   and s.request.sampling_params.sampling_type == SamplingType.RANDOM_SEED}
        hidden, _ = self.forward(entries)

        device_results: list[torch.Tensor] = []  # everything the host reads, copied once at the end
        out = None
        if sampled:
            batch, guesses = self._sampling_batch(sampled, masks)
            out = self.sampler(self.model.compute_logits(hidden[torch.tensor(sample_rows, device=hidden.device)]),
                               batch, guesses)
            device_results += [out.sampled_token_ids, out.logprobs]
            device_results += [] if out.accepted is None else [out.accepted]
            device_results += [] if out.top_logprobs is None else list(out.top_logprobs)
        scoring = []
        for request, first_row, start, count in scored:
            count = min(count, request.num_prompt_tokens - 1 - start)
            if count > 0:  # the rows predicting prompt tokens start+1 .. start+count
                targets = request.prompt_token_ids[start + 1 : start + 1 + count]
                logits = self.model.compute_logits(hidden[first_row : first_row + count])
                scoring.append((request, targets))
                device_results += prompt_logprobs(logits, torch.tensor(targets, device=logits.device),
                                                  request.sampling_params.prompt_logprobs)
        host = iter(to_host(device_results))

        result = StepResult({}, {})
        if out is not None:
            result.sampled = self._kept_tokens(sampled, out, host, rewinds)
        for request, targets in scoring:
            chosen, top_ids, top_lps = next(host).tolist(), next(host).tolist(), next(host).tolist()
            entries = [{t: lp} for t, lp in zip(targets, chosen)]
            for entry, ids, lps in zip(entries, top_ids, top_lps):
                entry.update(zip(ids, lps))
            result.prompt_logprobs[request] = entries
        return result

    def _lay_out(self, sequences: list[ScheduledSequence]):
        """The step's BatchEntry list, the sequences that sample and their rows (each guess's and
        the one after), and the prompt-scoring (request, first row, start, count) of each."""
        entries, sampled, sample_rows, scored = [], [], [], []
        row = 0
        for seq in sequences:
            request, start, count = seq.request, seq.request.num_computed_tokens, seq.num_new_tokens
            tokens = request.all_token_ids[start : start + count]
            tokens += request.spec_token_ids[: count - len(tokens)]
            entries.append(BatchEntry(tokens, start, request.block_table))
            if seq.score_prompt:
                scored.append((request, row, start, count))
            if start + count == request.num_tokens + len(request.spec_token_ids):
                num_rows = len(request.spec_token_ids) + 1
                sample_rows.extend(range(row + count - num_rows, row + count))
                sampled.append(seq)
            row += count
        return entries, sampled, sample_rows, scored

    def _kept_tokens(self, sampled: list[ScheduledSequence], out: SamplerOutput, host,
                     rewinds: dict[Request, torch.Tensor]) -> dict[Request, SampledTokens]:
        """Per sampling sequence, from the host copies of `out`: its guesses up to the first rejected
        one, then that row's own draw. A seeded generator is wound back to the kept draws."""
        token_ids, logprobs = next(host).tolist(), next(host).tolist()
        accepted = next(host).tolist() if out.accepted is not None else None
        top = (next(host).tolist(), next(host).tolist()) if out.top_logprobs is not None else None
        kept_tokens, row = {}, 0
        for seq in sampled:
            num_guesses = len(seq.request.spec_token_ids)
            kept = 1
            while kept <= num_guesses and accepted[row + kept - 1]:
                kept += 1
            if seq.request in rewinds and kept <= num_guesses:
                seq.generator.set_state(rewinds[seq.request])
                skip_draws(seq.generator, kept, self.model.config.vocab_size)
            rows = range(row, row + kept)
            kept_tokens[seq.request] = SampledTokens(
                [token_ids[r] for r in rows], [logprobs[r] for r in rows],
                None if top is None else [(top[0][r], top[1][r]) for r in rows], num_guesses,
                token_ids[row : row + num_guesses + 1])
            row += num_guesses + 1
        return kept_tokens

    def _sampling_batch(self, sampled: list[ScheduledSequence], masks) -> tuple[SamplingBatch, Guesses | None]:
        """One row per verified position: a request with k guesses has k + 1 rows, row j seeing its
        output followed by the first j guesses. Returns the batch and the rows' guesses (None: no row has one)."""
        params, prompts, outputs, generators, constrained_rows, contrastive_rows = [], [], [], [], [], []
        guess_rows, guess_ids, guess_probs, guess_generators = [], [], [], []
        V = self.model.config.vocab_size
        for seq in sampled:
            request, spec = seq.request, seq.request.spec_token_ids
            if seq.matcher is not None:
                constrained_rows.extend(range(len(params), len(params) + len(spec) + 1))
            if seq.amateur_logits is not None:  # such a request makes no guesses: one row
                contrastive_rows.append(len(params))
            if spec:
                guess_rows.extend(range(len(params), len(params) + len(spec)))
                guess_ids.extend(spec)
                guess_generators.extend([seq.spec_generator] * len(spec))
                guess_probs.append(seq.guess_probs[: len(spec)] if seq.guess_probs is not None else
                                   torch.nn.functional.one_hot(torch.tensor(spec, device=self.device), V).float())
            for j in range(len(spec) + 1):
                params.append(request.sampling_params)
                prompts.append(request.prompt_token_ids)
                outputs.append(request.output_token_ids + spec[:j] if j else request.output_token_ids)
                generators.append(seq.generator)
        batch = SamplingBatch.build(
            params, prompts, outputs, generators, V, self.device,
            eos_token_ids=self.eos_token_ids,
            grammar_masks=None if masks is None else (constrained_rows, masks.result()),
            amateur_logits=None if not contrastive_rows else (
                contrastive_rows, torch.stack([s.amateur_logits for s in sampled if s.amateur_logits is not None])),
        )
        if not guess_rows:
            return batch, None
        return batch, Guesses(torch.tensor(guess_rows, device=self.device), torch.tensor(guess_ids, device=self.device),
                              torch.cat(guess_probs).to(self.device), guess_generators)

    def draw_next(self, entries: list[BatchEntry], requests: list[Request], outputs: list[list[int]],
                  generators: list[torch.Generator | None]) -> tuple[list[int], torch.Tensor]:
        """A draft model's pass: each entry's next token drawn from its request's final distribution
        (its sampling parameters applied; `outputs`: each request's output so far, guesses included;
        `generators`: a seeded request's spec generator). Returns the tokens and the distributions [B, V]."""
        batch = SamplingBatch.build([r.sampling_params for r in requests], [r.prompt_token_ids for r in requests],
                                    outputs, generators, self.model.config.vocab_size, self.device,
                                    eos_token_ids=self.eos_token_ids)
        probs, greedy_ids = final_distribution(self.last_logits(entries), batch, self.backend.apply_token_bitmask)
        return draw(probs, greedy_ids, batch, generators).tolist(), probs


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy the tensors to the host in one transfer (one synchronisation); each keeps its shape.
    They travel as float64, which holds token ids and float32 values exactly."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1).double() for t in tensors]).cpu()
    parts = flat.split([t.numel() for t in tensors])
    return [part.view(t.shape).to(t.dtype) for part, t in zip(parts, tensors)]


def allocate_kv_caches(config, num_layers: int, num_slots: int, kv_cache_dtype: str, dtype: torch.dtype,
                       device: torch.device) -> KVCaches:
    """Per layer (of num_layers: a pipeline stage holds its own), (K, V), each [num_slots, kv_heads,
    head_dim] in `dtype`, q8_0 codes and scales, or fp8 with its scale (1.0: no checkpoint hearth
    loads carries calibrated ones); with multi-head latent attention (one latent), [num_slots, 1,
    latent width] (ModelConfig.kv_cache_layout)."""
    tensors, heads, width = config.kv_cache_layout()
    shape = (tensors * num_layers, num_slots, heads, width)
    if kv_cache_dtype == "q8_0":  # (not with a latent: check_kv_cache_dtype)
        codes = zeroed(shape, torch.int8, device)
        scales = zeroed((*shape[:-1], width // Q8_BLOCK), torch.float16, device)
        caches = [Q8Cache(c, s) for c, s in zip(codes, scales)]
    elif kv_cache_dtype == "fp8_e4m3":
        caches = [Fp8Cache(values, 1.0) for values in zeroed(shape, torch.float8_e4m3fn, device)]
    else:
        caches = list(zeroed(shape, dtype, device))
    return [tuple(caches[tensors * i : tensors * (i + 1)]) for i in range(num_layers)]


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor whose pages are not touched up front. On a CPU: an anonymous memory map,
    which the OS fills with zeros page by page on first use, so a KV cache sized for a long context
    costs nothing until tokens are written (torch.zeros would write every page at start-up). On a
    GPU: torch.zeros (a device memset, milliseconds). Unused slots read as zeros either way, so a
    masked attention weight of 0 never meets a NaN left in memory."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = max(1, int(np.prod(shape)) * dtype.itemsize)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=int(np.prod(shape))).view(shape)
