"""Choosing the next token of every request in a step, in one batched pass of tensor ops.

Per row, in the order HF's generate and vLLM apply them:

    raw logits [B, V]
      -> contrastive decoding    log p - weight * log p_amateur where p >= alpha * max p, -inf elsewhere
      -> grammar masks           tokens a row's grammar does not allow -> -inf (structured output)
      -> logit_bias              logit[t] += bias[t]
      -> min_tokens              EOS / stop_token_ids -> -inf while fewer than min_tokens were generated
      -> repetition_penalty      HF's: tokens seen in prompt+output, logit > 0 -> logit / p, else logit * p
      -> presence / frequency    OpenAI's: logit[t] -= frequency * count[t] + presence * (count[t] > 0),
                                 counts over the output tokens only (as vLLM)
      -> watermark               green tokens after the previous one get +delta (hearth/watermark.py)
      -> forced                  a row the engine decides (a thinking budget's close): one token left
      -> greedy rows: argmax here (temperature 0; the penalties and bias above still apply)
      -> temperature             logit / T
      -> top-k                   keep logits >= the k-th largest (ties kept, as HF)
      -> top-p                   keep the smallest top set with mass >= p (HF's ascending-cumsum rule)
      -> min-p                   keep p >= min_p * p_max
      -> draw                    argmax(softmax / Exp(1) noise), the noise of a seeded row from its
                                 own torch.Generator, so its tokens do not depend on the batch

Speculative decoding: a row may carry a guessed token, verified against the row's final
distribution by speculative sampling's rejection rule (verify_guesses).

Logprobs are those of the model's raw distribution (log_softmax of the raw logits), as
vLLM's default: the chosen token's, and the top K by the same distribution.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from hearth.backend.base import Backend
from hearth.backend.transfer import to_device
from hearth.sampling_params import SamplingParams, SamplingType
from hearth.watermark import green_mask

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32: log-prob of the sampled token under log_softmax(raw logits)
    # (ids [B, K], logprobs [B, K]) sorted descending, K = the largest `logprobs` asked in the batch;
    # None when no row asked for alternatives. A row that asked for k < K reads its first k columns.
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None
    accepted: torch.Tensor | None = None  # [G] bool: each guess was kept (None: no guesses)


class GrammarBitmask:
    """A step's grammar masks [R, ceil(V/32)] int32 (bit t of a row set: token t allowed), zeroed here
    and filled in place on the grammar thread through its address (structured_output.py)."""

    def __init__(self, num_rows: int, vocab_size: int) -> None:
        self.tensor = torch.zeros((num_rows, (vocab_size + 31) // 32), dtype=torch.int32)
        self.address, self.row_bytes = self.tensor.data_ptr(), self.tensor.shape[1] * 4

    def repeat_row(self, row: int, end: int) -> None:  # rows row + 1 .. end - 1 become copies of row
        self.tensor[row + 1 : end] = self.tensor[row]


def make_generator(seed: int, device: torch.device | str | None = None) -> torch.Generator:
    """The per-request generator the engine keeps for a seeded request (create once, pass every step)."""
    return torch.Generator(device=device or "cpu").manual_seed(seed)


@dataclass
class SamplingBatch:
    """The sampling state of one step's rows as tensors, built once per step.

    A field is None when no row of the batch needs that transform, so a batch of plain
    requests pays for none of them.
    """

    temperature: torch.Tensor  # [B] float32, 1.0 on greedy rows
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    any_greedy: bool
    top_k: torch.Tensor | None  # [B] int64, vocab_size where disabled
    top_p: torch.Tensor | None  # [B] float64, 1.0 where disabled
    min_p: torch.Tensor | None  # [B] float32, 0.0 where disabled
    repetition_penalty: torch.Tensor | None  # [B] float32, 1.0 where disabled
    presence_penalty: torch.Tensor | None  # [B] float32
    frequency_penalty: torch.Tensor | None  # [B] float32
    prompt_mask: torch.Tensor | None  # [B, V] bool: the token occurs in the row's prompt
    output_counts: torch.Tensor | None  # [B, V] float32: occurrences in the row's output so far
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows [N], token ids [N], values [N])
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows [M], token ids [M]) set to -inf (min_tokens)
    # (rows [R], bitmask [R, ceil(V/32)] int32): bit t of a row's mask set = token t allowed by its grammar;
    # the bitmask is still being filled on another thread (structured_output.py), awaited where applied
    allowed: tuple[torch.Tensor, Future[torch.Tensor]] | None
    # (rows [W], keys [W] int64, previous tokens [W] int64, gamma [W] float64, delta [W] float32)
    watermark: tuple[torch.Tensor, ...] | None
    # (rows [C], the amateur's logits [C, V], alpha [C] float32, weight [C] float32): contrastive decoding
    contrastive: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    generators: list[torch.Generator | None]  # per row; None: the global RNG (or a greedy row)
    max_num_logprobs: int  # K of SamplerOutput.top_logprobs (0: none asked)
    # per row, the row whose draw's noise it takes (rows at one depth of a token tree share it); None: its own
    noise_rows: list[int] | None = None
    forced: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows [F], token ids [F]): all else -inf

    @property
    def reads_output(self) -> bool:
        """Whether a row's output so far changes what it draws (penalties, min_tokens, watermarks)."""
        return self.output_counts is not None or self.banned is not None or self.watermark is not None

    @property
    def argmax_only(self) -> bool:
        """Every row draws the argmax of its logits as they come (greedy, nothing applied to them)."""
        return self.all_greedy and all(f is None for f in (self.contrastive, self.allowed, self.bias, self.banned,
                                                           self.prompt_mask, self.output_counts, self.watermark,
                                                           self.forced))

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Sequence[int] = (),
        grammar_masks: tuple[list[int], Future[torch.Tensor]] | None = None,
        amateur_logits: tuple[list[int], torch.Tensor] | None = None,
        noise_rows: list[int] | None = None,
        pending: torch.Tensor | None = None,
        forced: tuple[list[int], list[int]] | None = None,
    ) -> "SamplingBatch":
        """`eos_token_ids` are the model's EOS ids: masked (with each row's stop_token_ids)
        while a row has fewer than min_tokens outputs, unless the row ignores EOS.
        `pending` [B, d] int64 on `device`: tokens that follow each row's output_token_ids and that
        the host has not read (a draft model's guesses so far, draft_runner.DraftRunner.propose).
        `grammar_masks`: the constrained rows and their token bitmasks (structured_output.py's
        GrammarCompiler.start_masks, maybe still being filled).
        `amateur_logits`: the contrastive rows and the amateur model's logits at each [C, V]."""
        n = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(generators) == n):
            raise ValueError("params, prompt_token_ids, output_token_ids and generators differ in length")
        V = vocab_size
        greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
        for p, g in zip(params, generators):
            if p.sampling_type == SamplingType.RANDOM_SEED and g is None:
                raise ValueError(f"request with seed={p.seed} has no generator; create it once with make_generator")
        def vec(values, dtype):  # (from pinned memory: never waits for the device's queue)
            return to_device(torch.tensor(values, dtype=dtype), device)

        def per_row(values, disabled, dtype):
            return vec(values, dtype) if any(v != disabled for v in values) else None

        top_k = [V if (p.top_k <= 0 or g) else min(p.top_k, V) for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        ks = [V if p.logprobs == -1 else (p.logprobs or 0) for p in params]
        return cls(
            temperature=vec([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32),
            greedy=vec(greedy, torch.bool),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            top_k=per_row(top_k, V, torch.int64),
            top_p=per_row(top_p, 1.0, torch.float64),
            min_p=per_row(min_p, 0.0, torch.float32),
            **_penalties(params, prompt_token_ids, output_token_ids, V, vec, device, pending),
            bias=_logit_bias(params, V, vec),
            banned=_min_tokens_bans(params, output_token_ids, eos_token_ids, V, vec, pending),
            allowed=None if grammar_masks is None else (vec(grammar_masks[0], torch.int64), grammar_masks[1]),
            watermark=_watermarks(params, prompt_token_ids, output_token_ids, vec, pending),
            contrastive=_contrastive(params, amateur_logits, vec, device),
            generators=[None if g else gen for g, gen in zip(greedy, generators)],
            max_num_logprobs=min(max(ks, default=0), V),
            noise_rows=noise_rows,
            forced=None if forced is None else (vec(forced[0], torch.int64), vec(forced[1], torch.int64)),
        )


# values, dtype -> a tensor on the batch's device
Vec = Callable[[list, torch.dtype], torch.Tensor]


def _penalties(params: list[SamplingParams], prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
               V: int, vec: Vec, device, pending: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """SamplingBatch's penalty fields: the repetition penalties with the prompt mask [B, V], the
    presence and frequency penalties with the output counts [B, V] (pending tokens counted); None
    where no row needs them."""
    rep = [p.repetition_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    freq = [p.frequency_penalty for p in params]
    prompt_mask = None
    if any(r != 1.0 for r in rep):
        prompt_mask = _token_mask(prompt_token_ids, V, device)
    output_counts = None
    if prompt_mask is not None or any(pres) or any(freq):
        output_counts = _token_counts(output_token_ids, V, device)
        if pending is not None and pending.shape[1]:
            output_counts.scatter_add_(1, pending, torch.ones(pending.shape, device=device))
    counted = output_counts is not None
    return dict(repetition_penalty=vec(rep, torch.float32) if prompt_mask is not None else None,
                presence_penalty=vec(pres, torch.float32) if counted else None,
                frequency_penalty=vec(freq, torch.float32) if counted else None,
                prompt_mask=prompt_mask, output_counts=output_counts)


def _logit_bias(params: list[SamplingParams], V: int, vec: Vec) -> tuple[torch.Tensor, ...] | None:
    """(rows, token ids, values) of every row's logit_bias; None: none."""
    rows, cols, vals = [], [], []
    for i, p in enumerate(params):
        for t, b in (p.logit_bias or {}).items():
            if 0 <= t < V:  # validate_for_vocab rejects the rest before a request gets here
                rows.append(i), cols.append(t), vals.append(b)
    return (vec(rows, torch.int64), vec(cols, torch.int64), vec(vals, torch.float32)) if rows else None


def _min_tokens_bans(params: list[SamplingParams], output_token_ids: list[list[int]], eos_token_ids: Sequence[int],
                     V: int, vec: Vec, pending: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token ids) banned while a row has fewer than min_tokens outputs; None: none."""
    num_pending = 0 if pending is None else pending.shape[1]
    rows, cols = [], []
    for i, (p, out) in enumerate(zip(params, output_token_ids)):
        if len(out) + num_pending < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            for t in sorted(t for t in stops if 0 <= t < V):
                rows.append(i), cols.append(t)
    return (vec(rows, torch.int64), vec(cols, torch.int64)) if rows else None


def _watermarks(params: list[SamplingParams], prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
                vec: Vec, pending: torch.Tensor | None) -> tuple[torch.Tensor, ...] | None:
    """(rows, keys, previous tokens, gamma, delta) of the watermarked rows; None: none."""
    marked = [(i, p.watermark, (out or prompt)[-1])
              for i, (p, prompt, out) in enumerate(zip(params, prompt_token_ids, output_token_ids)) if p.watermark]
    if not marked:
        return None
    rows = vec([i for i, _, _ in marked], torch.int64)
    previous = pending[rows, -1] if pending is not None and pending.shape[1] else vec([t for *_, t in marked], torch.int64)
    return (rows, vec([w.key for _, w, _ in marked], torch.int64), previous,
            vec([w.gamma for _, w, _ in marked], torch.float64), vec([w.delta for _, w, _ in marked], torch.float32))


def _contrastive(params: list[SamplingParams], amateur_logits: tuple[list[int], torch.Tensor] | None, vec: Vec, device):
    """(rows, the amateur's logits, alpha, weight) of the contrastive rows; None: none."""
    if amateur_logits is None:
        return None
    rows = amateur_logits[0]
    return (vec(rows, torch.int64), amateur_logits[1].to(device),
            vec([params[i].contrastive_alpha for i in rows], torch.float32),
            vec([params[i].contrastive_weight for i in rows], torch.float32))


# (logits [B, V], rows [R], bitmask [R, ceil(V/32)] int32) -> logits with the tokens each row's mask refuses at -inf
TokenBitmaskOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _flat_ids(token_ids: list[list[int]], V: int, device) -> torch.Tensor:
    """Row-major flat indices row * V + token into a [B, V] table (ids outside the vocab dropped)."""
    rows = [i for i, ids in enumerate(token_ids) for _ in ids]
    ids = [t for ids in token_ids for t in ids]
    rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
    ids_t = torch.tensor(ids, dtype=torch.int64, device=device)
    keep = (ids_t >= 0) & (ids_t < V)
    return rows_t[keep] * V + ids_t[keep]


def _token_counts(token_ids: list[list[int]], V: int, device) -> torch.Tensor:
    """[B, V] float32: how often each token occurs in each row's list."""
    B = len(token_ids)
    return torch.bincount(_flat_ids(token_ids, V, device), minlength=B * V).view(B, V).to(torch.float32)


def _token_mask(token_ids: list[list[int]], V: int, device) -> torch.Tensor:
    """[B, V] bool: whether each token occurs in each row's list."""
    mask = torch.zeros(len(token_ids) * V, dtype=torch.bool, device=device)
    mask[_flat_ids(token_ids, V, device)] = True
    return mask.view(len(token_ids), V)


# ---- building blocks, each [B, V] -> [B, V] with per-row parameters --------------------------


def apply_contrastive(logits: torch.Tensor, rows: torch.Tensor, amateur: torch.Tensor, alpha: torch.Tensor,
                      weight: torch.Tensor) -> torch.Tensor:
    """Contrastive decoding (Li et al. 2023) on rows [C]: log p - weight * log p_amateur over the
    plausible tokens (p >= alpha * max p), -inf elsewhere; amateur [C, V] logits, alpha and weight [C]."""
    expert = logits[rows].log_softmax(dim=-1)
    plausible = expert >= expert.amax(dim=-1, keepdim=True) + alpha.log().unsqueeze(1)
    scores = expert - weight.unsqueeze(1) * amateur.float().log_softmax(dim=-1)
    return logits.index_copy(0, rows, scores.masked_fill(~plausible, _NEG_INF))


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return logits.index_put((rows, token_ids), values, accumulate=True)


def apply_token_bans(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    return logits.index_put((rows, token_ids), torch.tensor(_NEG_INF, device=logits.device))


def apply_watermark(logits: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, prev_ids: torch.Tensor,
                    gamma: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """+delta on the green tokens of each watermarked row (all [W])."""
    green = green_mask(keys, prev_ids, gamma, logits.shape[-1]).to(logits.dtype)
    return logits.index_add(0, rows, green * delta.unsqueeze(1))


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF's RepetitionPenaltyLogitsProcessor per row: seen [B, V] bool, penalty [B]."""
    p = penalty.unsqueeze(1)
    penalized = torch.where(logits < 0, logits * p, logits / p)
    return torch.where(seen, penalized, logits)


def apply_presence_frequency_penalties(
    logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """OpenAI's formula: mu[j] - c[j] * frequency - (c[j] > 0) * presence; counts [B, V], presence/frequency [B]."""
    return logits - counts * frequency.unsqueeze(1) - (counts > 0).to(logits.dtype) * presence.unsqueeze(1)


def apply_penalties_and_bias(logits: torch.Tensor, batch: SamplingBatch,
                             apply_token_bitmask: TokenBitmaskOp = Backend.apply_token_bitmask) -> torch.Tensor:
    """Contrastive scores, grammar masks (by the backend's op), logit_bias, min_tokens bans,
    repetition penalty, presence/frequency penalties, watermark: what greedy rows see too."""
    if batch.contrastive is not None:
        logits = apply_contrastive(logits, *batch.contrastive)
    if batch.allowed is not None:
        rows, bitmask = batch.allowed
        logits = apply_token_bitmask(logits, rows, bitmask.result().to(logits.device, non_blocking=True))
    if batch.bias is not None:
        logits = apply_logit_bias(logits, *batch.bias)
    if batch.banned is not None:
        logits = apply_token_bans(logits, *batch.banned)
    if batch.prompt_mask is not None:
        seen = batch.prompt_mask | (batch.output_counts > 0)
        logits = apply_repetition_penalty(logits, seen, batch.repetition_penalty)
    if batch.output_counts is not None:
        logits = apply_presence_frequency_penalties(
            logits, batch.output_counts, batch.presence_penalty, batch.frequency_penalty
        )
    if batch.watermark is not None:
        logits = apply_watermark(logits, *batch.watermark)
    if batch.forced is not None:  # last: the forced token stays finite whatever masked it before
        logits = logits.index_put(batch.forced[:1], logits.new_tensor(_NEG_INF))
        logits = logits.index_put(batch.forced, logits.new_tensor(0.0))
    return logits


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    return logits / temperature.unsqueeze(1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Top-k then top-p with one sort; filtered logits become -inf.

    top_k [B] int (>= vocab size: off): keep the logits >= the k-th largest (HF keeps ties).
    top_p [B] float64 (1.0: off): HF's rule on the ascending sort: drop a token when the
    cumulative probability up to and including it is <= 1 - p; the top token always stays.
    """
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    V = logits.shape[-1]
    if top_k is not None:
        k = top_k.clamp(1, V)
        kth = sorted_logits.gather(1, (V - k).unsqueeze(1))  # [B, 1] the k-th largest
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        # 1 - p in float64 then float32: the threshold HF compares against; -1 makes p = 1 a no-op
        threshold = torch.where(top_p >= 1.0, -1.0, 1.0 - top_p.double()).to(torch.float32)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= threshold.unsqueeze(1)
        remove[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(remove, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """HF's MinPLogitsWarper per row: drop tokens with p < min_p * p_max (the top token always stays)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_sampling_filters(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p: the transforms after the greedy argmax."""
    logits = apply_temperature(logits, batch.temperature)
    logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    if batch.min_p is not None:
        logits = apply_min_p(logits, batch.min_p)
    return logits


def exponential_noise(probs_like: torch.Tensor, generators: Sequence[torch.Generator | None],
                      noise_rows: list[int] | None = None) -> torch.Tensor:
    """The exponential race's noise for rows shaped as probs_like [B, V]: E ~ Exp(1) i.i.d.

    A row with a generator draws its V noises from that generator alone (always the same
    count, into a fresh tensor), so its draw depends on nothing else in the batch. The noise
    does not depend on the logits: the sampler draws it before it waits for grammar masks.
    noise_rows: per row, the row whose noise it takes (drawn once, by that row).
    """
    B, V = probs_like.shape
    if noise_rows is not None:
        generators = [g if source == i else None for i, (g, source) in enumerate(zip(generators, noise_rows))]
    noise = torch.empty_like(probs_like)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < B:
        if not seeded:
            noise.exponential_()
        else:
            unseeded = torch.tensor(sorted(set(range(B)) - set(seeded)), device=probs_like.device)
            noise[unseeded] = torch.empty(len(unseeded), V, dtype=probs_like.dtype,
                                          device=probs_like.device).exponential_()
    for i in seeded:
        g = generators[i]
        row = torch.empty(V, dtype=probs_like.dtype, device=g.device).exponential_(generator=g)
        noise[i] = row.to(probs_like.device)
    if noise_rows is not None:
        noise = noise[torch.tensor(noise_rows, device=probs_like.device)]
    return noise


def sample_from_probs(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One draw per row by the exponential race: argmax(probs / E), E: exponential_noise's (used up here)."""
    # a zero noise would turn a filtered token's 0 into 0/0
    return (probs / noise.clamp_min_(torch.finfo(probs.dtype).tiny)).argmax(dim=-1)


def skip_draws(generator: torch.Generator, num_rows: int, vocab_size: int) -> None:
    """Advance a generator past num_rows draws of sample_from_probs over float32 probabilities
    (a seeded request's rows whose tokens were not kept: its stream stays that of plain decoding)."""
    for _ in range(num_rows):
        torch.empty(vocab_size, dtype=torch.float32, device=generator.device).exponential_(generator=generator)


def _logprobs_of(logits: torch.Tensor, ids: torch.Tensor, k: int, lse: torch.Tensor | None = None):
    """Log-softmax of `logits` [N, V] at `ids` [N], and its top k (ids, logprobs) sorted descending;
    lse [N]: the rows' log-sum-exp where already computed."""
    lse = logits.logsumexp(dim=-1, keepdim=True) if lse is None else lse.unsqueeze(1)
    chosen = (logits.gather(1, ids.unsqueeze(1)) - lse).squeeze(1)
    k = min(k, logits.shape[-1])
    top_values, top_ids = logits.topk(k, dim=-1)
    return chosen, top_ids, top_values - lse


@dataclass
class Guesses:
    """The guessed tokens a step verifies: the row [G] of the batch that verifies each, the guess
    [G] int64, the distribution q it was drawn from [G, V] (a point mass for prompt lookup; None
    where every row of the batch is greedy: greedy verification reads no q, greedy_acceptance), per
    guess the generator of the verification's own randomness (None: the global RNG), and which
    guesses are siblings after the first of their row (a token tree's: point masses, each at its
    own token; None: none)."""

    rows: torch.Tensor
    token_ids: torch.Tensor
    probs: torch.Tensor | None
    generators: list[torch.Generator | None]
    siblings: list[bool] | None = None


def uniforms(count: int, generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """[len(generators), count] uniform draws in [0, 1), a seeded row's from its own generator."""
    out = torch.rand(len(generators), count, device=device)
    for i, g in enumerate(generators):
        if g is not None:
            out[i] = torch.rand(count, generator=g, device=g.device).to(device)
    return out


def verify_guesses(probs: torch.Tensor, sampled: torch.Tensor, guesses: Guesses) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling's rejection rule on the guess rows: accept guess g ~ q with probability
    min(1, p(g) / q(g)); on rejection the row's token comes from normalise(max(0, p - q)).

    probs [B, V]: the target's final distributions (one-hot on greedy rows); sampled [B]: each
    row's own draw x ~ p, the token plain decoding would take. Returns each row's token [B] and
    whether each guess was kept [G].

    A token tree's row may verify several guesses: its first as above, then its siblings, point
    masses at other tokens, by recursive rejection sampling (SpecInfer's multi-draft rule): with
    the first rejected, the target is r; accept g2 with probability r(g2), else go on with r
    without g2, renormalised, and so on; the row's token after all are rejected is a draw from what
    is left. That is the same as drawing the row's token T ~ r (what the rule below gives when it
    rejects the first guess) and keeping the sibling equal to T if there is one: so a sibling is
    kept iff it equals its row's token (never when the first was kept: T is then that guess).

    The rule is realised from x, so that a point-mass draft (q = one-hot g, prompt lookup) keeps
    exactly the tokens of plain decoding: x == g happens with probability p(g), and a coin adds
    the rest of min(1, p(g) / q(g)) (nothing for a point mass). A rejected row's x is distributed
    as p without g (s); it is kept with probability min(1, r(x) / s(x)), r = normalise(max(0, p - q)),
    and otherwise replaced by a draw from normalise(max(0, r - s)) (its inverse CDF at a uniform
    draw), the maximal coupling of s to r,
    so the replacement is distributed as r. For a point mass r == s: x is always kept."""
    tokens = sampled.clone()
    accepted = torch.zeros(len(guesses.rows), dtype=torch.bool, device=sampled.device)
    if len(guesses.rows) == 0:
        return tokens, accepted
    siblings = guesses.siblings or [False] * len(guesses.rows)
    first = torch.tensor([not s for s in siblings], device=sampled.device)
    rows, g = guesses.rows[first], guesses.token_ids[first]
    p, q, x = probs[rows], guesses.probs[first].to(probs.dtype), sampled[rows]
    p_g, q_g = p.gather(1, g.unsqueeze(1)).squeeze(1), q.gather(1, g.unsqueeze(1)).squeeze(1)
    accept_prob = (p_g / q_g.clamp_min(torch.finfo(q.dtype).tiny)).clamp(max=1.0)
    coin = ((accept_prob - p_g) / (1.0 - p_g).clamp_min(torch.finfo(p.dtype).eps)).clamp(0.0, 1.0)
    # [rows, 3]: the acceptance coin, the coupling coin, the replacement's draw
    u = uniforms(3, [gen for gen, sibling in zip(guesses.generators, siblings) if not sibling], probs.device)
    keep_guess = (x == g) | (u[:, 0] < coin)
    s = p.scatter(1, g.unsqueeze(1), 0.0)
    s = s / s.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
    r = (p - q).clamp_min(0.0)
    r_sum = r.sum(dim=-1, keepdim=True)
    r = torch.where(r_sum > 0, r / r_sum.clamp_min(torch.finfo(p.dtype).tiny), s)  # p == q: never rejected
    s_x, r_x = s.gather(1, x.unsqueeze(1)).squeeze(1), r.gather(1, x.unsqueeze(1)).squeeze(1)
    keep_x = u[:, 1] * s_x <= r_x
    cdf = (r - s).clamp_min(0.0).cumsum(dim=-1)  # the replacement by the inverse CDF: one uniform a row
    other = torch.searchsorted(cdf, (u[:, 2] * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1).clamp_(max=p.shape[-1] - 1)
    tokens[rows] = torch.where(keep_guess, g, torch.where(keep_x, x, other))
    accepted[first] = keep_guess
    accepted[~first] = tokens[guesses.rows[~first]] == guesses.token_ids[~first]
    return tokens, accepted


def greedy_acceptance(sampled: torch.Tensor, guesses: Guesses) -> torch.Tensor:
    """verify_guesses where every row is greedy: p is the point mass at the row's argmax x, so a
    guess g is kept with probability min(1, p(g) / q(g)) = [g == x] whatever q, and a rejected
    row's residual normalise(max(0, p - q)) is the point mass at x: every row's token is x (a
    tree's sibling likewise: kept iff it is x). Returns whether each guess was kept [G]; no
    vocabulary-wide work."""
    return sampled[guesses.rows] == guesses.token_ids


def final_distribution(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """From logits after penalties (apply_penalties_and_bias), after the filters: the distribution
    each row draws from [B, V] (one-hot at the argmax on greedy rows), and the greedy argmax [B]
    (None without greedy rows)."""
    greedy_ids = logits.argmax(dim=-1) if batch.any_greedy else None
    if batch.all_greedy:
        return torch.nn.functional.one_hot(greedy_ids, logits.shape[-1]).to(logits.dtype), greedy_ids
    probs = apply_sampling_filters(logits, batch).softmax(dim=-1)
    if batch.any_greedy:
        one_hot = torch.nn.functional.one_hot(greedy_ids, logits.shape[-1]).to(probs.dtype)
        probs = torch.where(batch.greedy.unsqueeze(1), one_hot, probs)
    return probs, greedy_ids


def draw(probs: torch.Tensor, greedy_ids: torch.Tensor | None, batch: SamplingBatch,
         noise: torch.Tensor | None) -> torch.Tensor:
    """Each row's token from final_distribution's output: the argmax on greedy rows, else a draw
    with `noise` (exponential_noise's; None when every row is greedy)."""
    if batch.all_greedy:
        return greedy_ids
    sampled = sample_from_probs(probs, noise)
    return torch.where(batch.greedy, greedy_ids, sampled) if batch.any_greedy else sampled


class Sampler:
    """logits [B, V] of one step -> the next token of each row, with logprobs."""

    def __init__(self, backend: Backend | None = None) -> None:
        self.backend = backend or Backend()  # the engine's: its ops over the logits (the reference's: torch)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, guesses: Guesses | None = None) -> SamplerOutput:
        """guesses (speculative decoding): rows carrying a guessed token, verified by the
        rejection rule (verify_guesses); a kept guess is that row's token."""
        raw = logits.float()
        accepted, lse = None, None
        if batch.all_greedy:
            if batch.argmax_only:  # the argmax and the logprobs' normaliser in one call
                sampled, lse = self.backend.argmax_and_logsumexp(raw)
            else:
                sampled = apply_penalties_and_bias(raw, batch, self.backend.apply_token_bitmask).argmax(dim=-1)
            if guesses is not None:
                accepted = greedy_acceptance(sampled, guesses)
        else:
            # the noise first: it takes a while (a serial op over [B, V]), and the grammar masks'
            # thread fills them meanwhile; apply_penalties_and_bias waits for them
            noise = exponential_noise(raw, batch.generators, batch.noise_rows)
            probs, greedy_ids = final_distribution(apply_penalties_and_bias(raw, batch, self.backend.apply_token_bitmask),
                                                   batch)
            sampled = draw(probs, greedy_ids, batch, noise)
            if guesses is not None:
                sampled, accepted = verify_guesses(probs, sampled, guesses)
        chosen, top_ids, top_lps = _logprobs_of(raw, sampled, batch.max_num_logprobs, lse)
        top = (top_ids, top_lps) if batch.max_num_logprobs > 0 else None
        return SamplerOutput(sampled_token_ids=sampled, logprobs=chosen, top_logprobs=top, accepted=accepted)


def prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scoring a prompt: logits [T, V] at positions 0..T-1 predict target_ids [T] (the prompt
    shifted by one). Returns (logprob of each target [T], top ids [T, k], top logprobs [T, k]),
    from log_softmax of the raw logits; k = -1 means the whole vocabulary, k = 0 empty columns."""
    logits = logits.float()
    k = logits.shape[-1] if k == -1 else k
    return _logprobs_of(logits, target_ids.to(torch.int64), k)
