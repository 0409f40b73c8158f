"""Speculative decoding's host side: where guesses come from and how many to make. No tensors.

Prompt lookup (n-gram) speculation guesses that the text goes on as it did the last time its
most recent words appeared: the continuation of the longest recent match of the request's
last n tokens (prompt_lookup_max >= n >= prompt_lookup_min) in its own prompt and output (a
match that ends less than k tokens before the end continues periodically: "a b a b" -> "a b").
The guesses are verified by the target model in the step that follows (runner + sampler), as
extra tokens of their request. Draft-model guesses (hearth/engine/draft.py) take the same path;
the proposers share one call, `guess`, and a point mass is the draft distribution of an n-gram
guess (sampler.verify_guesses).

Lookahead decoding (Fu et al., 2024) guesses from the model's own parallel guesses, in one
chain of rows (the verification path that prompt lookup uses; no tree mask): a request keeps a
Jacobi window, its current guesses for the next positions, and a pool of N-grams. Every
verification step is also a Jacobi iteration: the row after a wrong guess gives the model's token
for the next position under that guess, which becomes the window's new guess there. Each row's
trajectory joins the pool: the tokens the N - 2 steps before had one, two... positions before
the row, its own token and its draw, each one the model's next token after the one before it
(the window's guesses are); so does the text, the prompt's from the start (the reference
implementation's POOL_FROM_PROMPT) and what was kept. A step's guesses are the pool's most
frequent continuation of the request's last two tokens (text n-grams are also kept under the
two tokens before their continuation: one token, say a space or a bracket, is followed by too
many things to guess well from), else of its last token, chained while the pool goes on, then
the window's tokens for the positions after them. What the paper does beside that: its window
keeps N - 1 iterations side by side, iterated every step through a mask of its own, and it
verifies several pool n-grams at once.

How many guesses (`num_guesses`): the i-th guess pays off only when the i - 1 before it were
accepted, so it is worth about rate ** i tokens, where rate is the request's measured
acceptance rate: k guesses keep 1 + rate + ... + rate ** k tokens of the request. Each costs one
more row of the step: a share ROW_COST of a one-row step while decoding is bound by reading the
weights, and for B running requests the B - 1 rows beside it make the step dearer, so that a
guessed row weighs c = B ROW_COST / (1 + ROW_COST (B - 1)) of each request's one-token share of
the step. The count kept is the one of most tokens per cost, (1 + rate + ... + rate ** k) /
(1 + c k) (Leviathan et al.'s choice of the draft length), up to num_speculative_tokens; none
from disable_by_batch_size running requests on.

That cost is a model; `SpeedGate` holds the measurement: decode steps' output tokens per second
per request, with guesses and without. While steps with guesses are measured slower (a backend
whose multi-token steps leave its decode fast path, a machine whose cores are taken), no guesses
are made, except a few steps in every PROBE_EVERY that keep measuring them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np

from hearth.engine.request import Request
from hearth.engine.token_tree import tree_of

# The cost of one more row in a decode step, as a share of a one-row step: 0.28 for SmolLM2 and
# 0.36 for the built-in pair (a row of the target and a pass of its draft) on the CPU at batch 1
# (docs/benchmarks.md, "where its time goes").
ROW_COST = 0.3
# A request's acceptance rate before its first verification: hopeful (guessing starts at several
# guesses, where a first step of one guess would be measured slower than plain decoding and keep
# SpeedGate from trying more), and weighing as little as two guesses against the evidence.
PRIOR_RATE, PRIOR_WEIGHT = 0.9, 2.0
# How fast the acceptance estimate and the measured speeds forget: the weight of the past at each update.
RATE_MEMORY = 0.8
# The option (guesses or none) that measured slower is tried PROBE_STEPS steps in a row, to keep
# measuring it (SpeedGate): PROBE_EVERY steps after the last probe, twice as long after each probe
# that left the preference as it was, up to PROBE_EVERY_MAX steps (a probe is paid at the slower
# option's speed: at a fixed 4 steps in 16, a quarter of prompt lookup's steps at batch 1 ran without guesses).
PROBE_EVERY = 16
PROBE_EVERY_MAX = 128
PROBE_STEPS = 4
# Lookahead: the n-grams' length N (the paper's 5 and 4 do alike; shorter ones match more often),
# and the most continuations the pool keeps for one first token (the most recent).
LOOKAHEAD_NGRAM = 4
LOOKAHEAD_POOL_PER_TOKEN = 8


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, tree_width: int = 1):
        """tree_width: the most branches of a request's guesses (token_tree.py), each the
        continuation of another earlier match; 1: a chain."""
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min} and {prompt_lookup_max}")
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self.tree_width = tree_width

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest (then the latest) earlier match of the last
        n tokens; [] when no n >= prompt_lookup_min matches."""
        branches = self.branches(token_ids, k, 1)
        return branches[0] if branches else []

    def branches(self, token_ids: list[int], k: int, width: int) -> list[list[int]]:
        """Up to `width` different continuations (k tokens each) of earlier matches of the last n
        tokens, the longest matches first, then the latest; [] when no n >= prompt_lookup_min matches."""
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
        branches = []
        for i in np.lexsort((ends, match_len))[::-1]:  # longest, then latest
            if match_len[i] < self.min_n or len(branches) == width:
                break
            end = int(ends[i])
            guesses = tokens[end + 1 : end + 1 + k].tolist()
            period = last - end  # a match close to the end: the text repeats with this period
            while len(guesses) < k:
                guesses.append(guesses[len(guesses) - period])
            if guesses not in branches:
                branches.append(guesses)
        return branches


    def guess(self, wanted: dict[Request, int], generators: dict, verified_rows: dict[Request, list[int]]) -> None:
        """Set request.spec_token_ids of each request to up to k guesses (the proposers' common call:
        generators, the draft's; verified_rows, each request's token at each row of the step just
        verified, lookahead's)."""
        for request, k in wanted.items():
            branches = self.branches(request.all_token_ids, k, branch_width(request, self.tree_width))
            tokens, parents = tree_of(branches)
            request.set_guesses(tokens, parents if len(branches) > 1 else None)

    def probs_of(self, request: Request) -> None:
        """The guesses' distributions: point masses (None)."""
        return None

    def release_stopped(self) -> None:
        """Nothing held per request."""


@dataclass
class LookaheadState:
    """One request's lookahead: its Jacobi window and n-gram pool."""

    window: list[int] = field(default_factory=list)  # guesses for positions window_start, window_start + 1, ...
    window_start: int = 0
    # the token(s) before -> the N - 1 tokens that followed -> times seen (the latest last): keyed by
    # one token (the Jacobi trajectories, the text) and by two (the text: what the prompt or the
    # output said after these two tokens, a sharper guess where the one token is common)
    pool: dict[tuple[int, ...], dict[tuple[int, ...], int]] = field(default_factory=dict)
    guesses: list[int] = field(default_factory=list)  # the last step's, as proposed
    history: list[dict[int, int]] = field(default_factory=list)  # the last N - 2 steps' rows: position -> token

    def add_ngram(self, ngram: list[int], context: int = 1) -> None:
        continuations = self.pool.setdefault(tuple(ngram[:context]), {})
        seen = continuations.pop(tuple(ngram[context:]), 0)
        continuations[tuple(ngram[context:])] = seen + 1
        if len(continuations) > LOOKAHEAD_POOL_PER_TOKEN:
            del continuations[next(iter(continuations))]

    def add_text(self, tokens: list[int], end: int) -> None:
        """The text's n-gram ending at `end` (exclusive), under its first token and under the two
        tokens before its continuation."""
        n = LOOKAHEAD_NGRAM
        if end >= n:
            self.add_ngram(tokens[end - n : end])
        if end >= n + 1:
            self.add_ngram(tokens[end - n - 1 : end], context=2)

    def best_continuation(self, tokens: list[int]) -> tuple[int, ...]:
        """The continuation seen most often (of those the latest) after the text's last two tokens,
        else after its last token; () for none."""
        for context in (2, 1):
            continuations = self.pool.get(tuple(tokens[-context:])) if len(tokens) >= context else None
            if continuations:
                return max(reversed(continuations.items()), key=lambda item: item[1])[0]
        return ()


class LookaheadProposer:
    """Lookahead decoding's guesses (module docstring): a pool n-gram, then the Jacobi window."""

    def __init__(self) -> None:
        self.states: weakref.WeakKeyDictionary[Request, LookaheadState] = weakref.WeakKeyDictionary()

    def guess(self, wanted: dict[Request, int], generators: dict, verified_rows: dict[Request, list[int]]) -> None:
        """Learn from every request's verified rows; set the guesses of those in `wanted`."""
        for request, rows in verified_rows.items():
            request.set_guesses(self.propose(request, wanted.get(request, 0), rows))

    def probs_of(self, request: Request) -> None:
        """The guesses' distributions: point masses (None)."""
        return None

    def release_stopped(self) -> None:
        """Nothing held but by the requests themselves (a weak dictionary)."""

    def propose(self, request: Request, k: int, row_token_ids: list[int]) -> list[int]:
        """Up to k guesses to follow `request`'s tokens, after learning from the step just verified:
        row_token_ids, the model's token at each of its rows (the last token, then each guess)."""
        state = self.states.get(request)
        if state is None:  # the pool starts with the prompt's n-grams (the reference implementation's
            state = self.states[request] = LookaheadState()  # POOL_FROM_PROMPT): text it may repeat
            prompt = request.prompt_token_ids
            for end in range(LOOKAHEAD_NGRAM, len(prompt) + 1):
                state.add_text(prompt, end)
        tokens = request.all_token_ids
        self._learn(state, tokens, row_token_ids)
        if k <= 0:
            state.guesses = []
            return []
        last = len(tokens) - 1  # position of the last token; guesses go to last + 1, ...
        guesses: list[int] = []
        while len(guesses) < k and (more := state.best_continuation(tokens[-2:] + guesses)):  # pool n-grams, chained
            guesses += more[: k - len(guesses)]
        first = last + 1 + len(guesses) - state.window_start  # the window's entry for the next position
        guesses += state.window[max(first, 0) : max(first, 0) + k - len(guesses)]
        while len(guesses) < k:  # a window not grown yet: the text read on as if it repeated
            guesses.append(tokens[len(tokens) - k + len(guesses)] if len(tokens) >= k else tokens[-1])
        state.guesses = list(guesses)  # the scheduler trims and clears the request's own list
        return guesses

    @staticmethod
    def _learn(state: LookaheadState, tokens: list[int], row_token_ids: list[int]) -> None:
        """The step that gave row_token_ids verified state.guesses[: rows - 1] after the token at
        position c; tokens (the request's, the step's kept ones appended) end at c + kept."""
        guesses = state.guesses[: len(row_token_ids) - 1]
        kept = 1
        while kept <= len(guesses) and guesses[kept - 1] == row_token_ids[kept - 1]:
            kept += 1
        c = len(tokens) - kept - 1
        n = LOOKAHEAD_NGRAM
        inputs = {c + i: t for i, t in enumerate([tokens[c], *guesses])}  # this step's rows by position
        for i, given in enumerate(row_token_ids):
            # a trajectory: the token each earlier step had one position before, each one the
            # model's next token after the one before it (the window's guesses are)
            ngram = [inputs[c + i], given]
            for back, past in enumerate(reversed(state.history), 1):
                if len(ngram) == n or c + i - back not in past:
                    break
                ngram.insert(0, past[c + i - back])
            if len(ngram) == n:
                state.add_ngram(ngram)
        for i in range(kept):  # and the text itself, up to the first wrong guess
            state.add_text(tokens, c + i + 2)
        state.history = [*state.history, inputs][-(n - 2):]
        # the Jacobi iteration: after the first wrong guess, each row's token is the new guess
        # for the position after it; the old window stays where the rows did not reach
        old = {state.window_start + i: t for i, t in enumerate(state.window)}
        old.update({c + 1 + i: t for i, t in enumerate(row_token_ids) if i >= kept})
        start = len(tokens)
        window = []
        while start + len(window) in old:
            window.append(old[start + len(window)])
        state.window, state.window_start = window, start


def branch_width(request: Request, tree_width: int) -> int:
    """How many branches a request's guesses may have: a structured-output request's grammar masks
    follow one chain of guesses."""
    return 1 if request.sampling_params.structured_outputs is not None else tree_width


class SpeedGate:
    """Whether the next step may carry guesses: only while steps with them are not measured slower.

    The option measured slower is probed PROBE_STEPS steps in a row, PROBE_EVERY steps after the last
    probe, the interval doubling (up to PROBE_EVERY_MAX) while probes confirm the preference and
    back to PROBE_EVERY when one turns it. The first step after a switch is not measured: it pays
    for the switch (a draft model catching up with the tokens decoded without it, a lookahead
    window grown again), not for the option, and one such step counted against guessing would keep
    it off for good."""

    def __init__(self) -> None:
        # with guesses? -> recent (tokens per request, seconds), each a moving sum: a step that kept
        # 5 tokens and one that kept 1 weigh by their tokens and seconds, not as two speeds averaged
        self._recent: dict[bool, tuple[float, float] | None] = {True: None, False: None}
        self._last: bool | None = None  # the option of the step recorded last
        self._interval = PROBE_EVERY  # steps from the end of one probe to the start of the next
        self._to_probe = PROBE_EVERY  # steps left before the next probe
        self._probing: bool | None = None  # during a probe: the preference it started from
        self._probe_left = 0

    @property
    def speed(self) -> dict[bool, float | None]:
        """With guesses? -> recent output tokens per second per request (None: not measured)."""
        return {option: None if recent is None else recent[0] / recent[1] for option, recent in self._recent.items()}

    def record(self, with_guesses: bool, num_tokens: int, num_requests: int, seconds: float) -> None:
        """A step made only of decodes (and verifications): its output tokens and duration."""
        switched, self._last = with_guesses != self._last, with_guesses
        if switched or seconds <= 0 or num_requests <= 0:
            return
        tokens, old = num_tokens / num_requests, self._recent[with_guesses]
        self._recent[with_guesses] = (tokens, seconds) if old is None else (
            RATE_MEMORY * old[0] + tokens, RATE_MEMORY * old[1] + seconds)

    def allow(self) -> bool:
        with_guesses, without = self.speed[True], self.speed[False]
        preferred = with_guesses is None or without is None or with_guesses >= without
        if without is None and with_guesses is not None:
            preferred = False  # measure plain steps once
        if self._probing is None and self._to_probe > 0:
            self._to_probe -= 1
            return preferred
        if self._probing is None:  # a probe starts
            self._probing, self._probe_left = preferred, PROBE_STEPS
        if self._probe_left:
            self._probe_left -= 1
            return not self._probing
        # the probe is over: probe again later while it confirmed the preference, soon if it turned it
        self._interval = min(2 * self._interval, PROBE_EVERY_MAX) if preferred == self._probing else PROBE_EVERY
        self._to_probe, self._probing = self._interval, None
        return self.allow()


@dataclass
class AcceptanceRate:
    """A sequence's recent share of accepted guesses: each accepted guess counts as a success, the
    first rejected one as a failure (guesses after it were never judged). Before the evidence, the
    prior: PRIOR_WEIGHT guesses of which a share PRIOR_RATE were accepted."""

    accepted: float = 0.0
    rejected: float = 0.0

    def update(self, num_guesses: int, num_accepted: int) -> None:
        if num_guesses:
            self.accepted = RATE_MEMORY * self.accepted + num_accepted
            self.rejected = RATE_MEMORY * self.rejected + (num_accepted < num_guesses)

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR_RATE * PRIOR_WEIGHT) / (self.accepted + self.rejected + PRIOR_WEIGHT)


def num_guesses(acceptance: AcceptanceRate, num_running: int, max_guesses: int, disable_by_batch_size: int) -> int:
    """Guesses worth making for one request (module docstring): 0 .. max_guesses; at least one
    while its acceptance has not been measured (a count of none would never measure it)."""
    if num_running >= disable_by_batch_size:
        return 0
    rate = acceptance.rate
    cost = num_running * ROW_COST / (1 + ROW_COST * (num_running - 1))
    best, best_value, expected = 0, 1.0, 1.0
    for k in range(1, max_guesses + 1):
        expected += rate ** k
        if expected / (1 + cost * k) > best_value:
            best, best_value = k, expected / (1 + cost * k)
    unmeasured = acceptance.accepted + acceptance.rejected == 0
    return max(best, 1) if unmeasured else best


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
