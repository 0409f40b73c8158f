"""Speculative decoding's host side: where guesses come from and how many to make. No tensors.

Prompt lookup (n-gram) speculation guesses that the text goes on as it did the last time its
most recent words appeared: the continuation of the longest recent match of the request's
last n tokens (prompt_lookup_max >= n >= prompt_lookup_min) in its own prompt and output (a
match that ends less than k tokens before the end continues periodically: "a b a b" -> "a b").
The guesses are verified by the target model in the step that follows (runner + sampler), as
extra tokens of their request. Draft-model guesses (hearth/engine/draft.py) take the same path;
the proposers share one call, `guess`, and a point mass is the draft distribution of an n-gram
guess (sampler.verify_guesses).

How many guesses (`num_guesses`): the i-th guess pays off only when the i - 1 before it were
accepted, so it is worth about rate ** i tokens, where rate is the request's measured
acceptance rate. It costs one more token of the step, which is nearly free when decoding is
bound by reading the weights (few running requests) and a full token's work when the batch
already fills the machine. The cost is taken as running requests / disable_by_batch_size; a
guess is made while rate ** i exceeds it, so a busy engine makes none.

That cost is a model; `SpeedGate` holds the measurement: decode steps' output tokens per second
per request, with guesses and without. While steps with guesses are measured slower (a backend
whose multi-token steps leave its decode fast path, a machine whose cores are taken), no guesses
are made, except one step in PROBE_EVERY that keeps measuring them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hearth.engine.request import Request

# How fast the acceptance estimate and the measured speeds forget: the weight of the past at each update.
RATE_MEMORY = 0.8
# One step in this many tries the option (guesses or none) that measured slower, to keep measuring it.
PROBE_EVERY = 16


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min} and {prompt_lookup_max}")
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest (then the latest) earlier match of the last
        n tokens; [] when no n >= prompt_lookup_min matches."""
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids)
        last = len(tokens) - 1
        ends = np.flatnonzero(tokens[:last] == tokens[last])  # candidate match ends, before the suffix itself
        if len(ends) == 0:
            return []
        match_len = np.ones(len(ends), dtype=np.int64)
        alive = np.ones(len(ends), dtype=bool)
        for d in range(1, self.max_n):
            alive &= ends >= d
            alive[alive] = tokens[ends[alive] - d] == tokens[last - d]
            match_len += alive
        best = match_len.max()
        if best < self.min_n:
            return []
        end = int(ends[np.flatnonzero(match_len == best)[-1]])
        guesses = tokens[end + 1 : end + 1 + k].tolist()
        period = last - end  # a match close to the end: the text repeats with this period
        while len(guesses) < k:
            guesses.append(guesses[len(guesses) - period])
        return guesses


    def guess(self, wanted: dict[Request, int], generators: dict) -> None:
        """Set request.spec_token_ids of each request to up to k guesses (the proposers' common call)."""
        for request, k in wanted.items():
            request.spec_token_ids = self.propose(request.all_token_ids, k)

    def probs_of(self, request: Request) -> None:
        """The guesses' distributions: point masses (None)."""
        return None

    def release_stopped(self) -> None:
        """Nothing held per request."""


class SpeedGate:
    """Whether the next step may carry guesses: only while steps with them are not measured slower."""

    def __init__(self) -> None:
        self.speed: dict[bool, float | None] = {True: None, False: None}  # with guesses? -> tokens/s/request
        self._steps = 0

    def record(self, with_guesses: bool, num_tokens: int, num_requests: int, seconds: float) -> None:
        """A step made only of decodes (and verifications): its output tokens and duration."""
        if seconds <= 0 or num_requests <= 0:
            return
        speed = num_tokens / seconds / num_requests
        old = self.speed[with_guesses]
        self.speed[with_guesses] = speed if old is None else RATE_MEMORY * old + (1 - RATE_MEMORY) * speed

    def allow(self) -> bool:
        self._steps += 1
        with_guesses, without = self.speed[True], self.speed[False]
        preferred = with_guesses is None or without is None or with_guesses >= without
        if without is None and with_guesses is not None:
            preferred = False  # measure plain steps once
        return preferred != (self._steps % PROBE_EVERY == 0)


@dataclass
class AcceptanceRate:
    """A sequence's recent share of accepted guesses: each accepted guess counts as a success, the
    first rejected one as a failure (guesses after it were never judged)."""

    accepted: float = 0.0
    rejected: float = 0.0

    def update(self, num_guesses: int, num_accepted: int) -> None:
        if num_guesses:
            self.accepted = RATE_MEMORY * self.accepted + num_accepted
            self.rejected = RATE_MEMORY * self.rejected + (num_accepted < num_guesses)

    @property
    def rate(self) -> float:
        return (self.accepted + 1) / (self.accepted + self.rejected + 2)  # 1/2 before any evidence


def num_guesses(rate: float, num_running: int, max_guesses: int, disable_by_batch_size: int) -> int:
    """Guesses worth making for one request (module docstring): 0 .. max_guesses."""
    cost = num_running / disable_by_batch_size
    k = 0
    while k < max_guesses and rate ** (k + 1) > cost:
        k += 1
    return k


@dataclass
class SpecDecodeCounts:
    """Counts with vLLM's names: verifications (a request with guesses in a step), guesses,
    accepted guesses, and accepted guesses by position ([i]: guess number i + 1)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_guesses: int, num_accepted: int) -> None:
        if num_guesses:
            self.num_drafts += 1
            self.num_draft_tokens += num_guesses
            self.num_accepted_tokens += num_accepted
            self._add_positions([1] * num_accepted)

    def add(self, other: SpecDecodeCounts) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self._add_positions(other.accepted_per_position)

    def _add_positions(self, counts: list[int]) -> None:
        self.accepted_per_position += [0] * (len(counts) - len(self.accepted_per_position))
        for i, count in enumerate(counts):
            self.accepted_per_position[i] += count

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def copy(self) -> SpecDecodeCounts:
        return SpecDecodeCounts(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                list(self.accepted_per_position))

    def since(self, earlier: SpecDecodeCounts) -> SpecDecodeCounts:
        """The counts added after `earlier` (a copy taken before)."""
        positions = [n - (earlier.accepted_per_position[i] if i < len(earlier.accepted_per_position) else 0)
                     for i, n in enumerate(self.accepted_per_position)]
        return SpecDecodeCounts(self.num_drafts - earlier.num_drafts, self.num_draft_tokens - earlier.num_draft_tokens,
                                self.num_accepted_tokens - earlier.num_accepted_tokens, positions)

    def summary(self) -> str:
        rate = self.acceptance_rate
        return (f"{self.num_drafts} drafts, {self.num_draft_tokens} guessed tokens, {self.num_accepted_tokens} accepted"
                f" ({'-' if rate is None else f'{rate:.0%}'}); accepted by position {self.accepted_per_position}")
