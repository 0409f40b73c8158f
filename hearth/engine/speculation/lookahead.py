"""Lookahead decoding's guesses (Fu et al., 2024), in one chain or as published. Host lists only, no tensors.

Both keep, per request, a pool of N-grams: the text's, the prompt's from the start (the reference
implementation's POOL_FROM_PROMPT) and what was kept, and the model's own Jacobi trajectories.

As published (lookahead_mode full, lookahead_window.py): every step is one token tree, a 2-D
Jacobi window of W x (N - 1) rows beside up to G pool n-grams that follow the last token.

In one chain (lookahead_mode chain: the verification path that prompt lookup uses, no tree mask):
a request keeps a 1-D Jacobi window, its current guesses for the next positions. Every
verification step is also a Jacobi iteration: the row after a wrong guess gives the model's token
for the next position under that guess, which becomes the window's new guess there. Each row's
trajectory joins the pool: the tokens the N - 2 steps before had one, two... positions before
the row, its own token and its draw, each one the model's next token after the one before it
(the window's guesses are). A step's guesses are the pool's most frequent continuation of the
request's last two tokens (text n-grams are also kept under the two tokens before their
continuation: one token, say a space or a bracket, is followed by too many things to guess well
from), else of its last token, chained while the pool goes on, then the window's tokens for the
positions after them.
"""

from __future__ import annotations

import random
import weakref
from dataclasses import dataclass, field

from hearth.engine.request import Request
from hearth.engine.speculation.lookahead_window import JacobiWindow, lookahead_tree
from hearth.engine.speculation.ngram import branch_width
from hearth.engine.speculation.token_tree import accepted_path

# The most continuations the pool keeps for one first token (the most recent).
LOOKAHEAD_POOL_PER_TOKEN = 8


@dataclass
class LookaheadState:
    """One request's lookahead: its Jacobi window and n-gram pool."""

    n: int  # the n-grams' length
    window: list[int] = field(default_factory=list)  # guesses for positions window_start, window_start + 1, ...
    window_start: int = 0
    # the token(s) before -> the N - 1 tokens that followed -> times seen (the latest last): keyed by
    # one token (the Jacobi trajectories, the text) and by two (the text: what the prompt or the
    # output said after these two tokens, a sharper guess where the one token is common)
    pool: dict[tuple[int, ...], dict[tuple[int, ...], int]] = field(default_factory=dict)
    guesses: list[int] = field(default_factory=list)  # the last step's, as proposed
    history: list[dict[int, int]] = field(default_factory=list)  # the last N - 2 steps' rows: position -> token
    # as published: the 2-D window, the last step's tree (guesses: its tokens) and its columns' top nodes
    jacobi: JacobiWindow | None = None
    parents: list[int] = field(default_factory=list)
    tops: list[int | None] = field(default_factory=list)
    rng: random.Random = field(default_factory=lambda: random.Random(0))  # tokens that enter the window

    def add_ngram(self, ngram: list[int], context: int = 1) -> None:
        continuations = self.pool.setdefault(tuple(ngram[:context]), {})
        seen = continuations.pop(tuple(ngram[context:]), 0)
        continuations[tuple(ngram[context:])] = seen + 1
        if len(continuations) > LOOKAHEAD_POOL_PER_TOKEN:
            del continuations[next(iter(continuations))]

    def add_text(self, tokens: list[int], end: int) -> None:
        """The text's n-gram ending at `end` (exclusive), under its first token and under the two
        tokens before its continuation."""
        n = self.n
        if end >= n:
            self.add_ngram(tokens[end - n : end])
        if end >= n + 1:
            self.add_ngram(tokens[end - n - 1 : end], context=2)

    def best_continuation(self, tokens: list[int]) -> tuple[int, ...]:
        """The continuation seen most often (of those the latest) after the text's last two tokens,
        else after its last token; () for none."""
        return next(iter(self.continuations(tokens, 1)), ())

    def continuations(self, tokens: list[int], count: int) -> list[tuple[int, ...]]:
        """Up to `count` different continuations: those of the text's last two tokens, then of its
        last token, each the most often seen first (of those the latest)."""
        found: list[tuple[int, ...]] = []
        for context in (2, 1):
            seen = self.pool.get(tuple(tokens[-context:])) if len(tokens) >= context else None
            for continuation, _ in sorted(reversed((seen or {}).items()), key=lambda item: -item[1]):
                if len(found) < count and continuation not in found:
                    found.append(continuation)
        return found


class LookaheadProposer:
    """Lookahead decoding's guesses (module docstring): as published, or in one chain."""

    def __init__(self, ngram: int = 4, window: int = 0, guesses: int = 0) -> None:
        """ngram: the n-grams' length N; window: W > 0 for the published step (a token tree of the
        2-D window's W x (N - 1) rows and up to `guesses` pool n-grams), 0 for one chain."""
        self.n, self.width, self.num_candidates = ngram, window, guesses
        self.states: weakref.WeakKeyDictionary[Request, LookaheadState] = weakref.WeakKeyDictionary()

    def guess(self, wanted: dict[Request, int], generators: dict, verified_rows: dict[Request, list[int]]) -> None:
        """Learn from every request's verified rows; set the guesses of those in `wanted` (a
        structured-output request's in one chain: its grammar masks follow one)."""
        for request, rows in verified_rows.items():
            k = wanted.get(request, 0)
            if self.width and branch_width(request, 2) > 1:
                request.set_guesses(*self.propose_tree(request, k, rows))
            else:
                request.set_guesses(self.propose(request, k, rows))

    def _state(self, request: Request) -> LookaheadState:
        state = self.states.get(request)
        if state is None:  # the pool starts with the prompt's n-grams (the reference implementation's
            state = self.states[request] = LookaheadState(self.n)  # POOL_FROM_PROMPT): text it may repeat
            prompt = request.prompt_token_ids
            for end in range(self.n, len(prompt) + 1):
                state.add_text(prompt, end)
        return state

    def propose_tree(self, request: Request, k: int, row_token_ids: list[int]) -> tuple[list[int], list[int]]:
        """As published: up to k guesses in a token tree (tokens, parents), the pool's candidate
        n-grams and the 2-D window's rows, after learning from the step just verified."""
        state = self._state(request)
        tokens = request.all_token_ids
        if state.jacobi is None:
            state.jacobi = JacobiWindow.from_text(tokens, self.width, self.n, state.rng)
        else:
            self._learn_tree(state, tokens, row_token_ids)
        state.guesses, state.parents, state.tops = [], [], []
        if k > 0:
            candidates = [list(c) for c in state.continuations(tokens, self.num_candidates)]
            state.guesses, state.parents, state.tops = lookahead_tree(state.jacobi, candidates, k)
        return state.guesses, state.parents

    def _learn_tree(self, state: LookaheadState, tokens: list[int], row_token_ids: list[int]) -> None:
        """The step that gave row_token_ids (a draw per row: the last token's, then each guess's)
        verified the first of state.guesses; tokens: the request's, those it kept appended."""
        verified = len(row_token_ids) - 1
        parents = state.parents[:verified]
        accepted = [state.guesses[i] == row_token_ids[parent + 1] for i, parent in enumerate(parents)]
        kept = len(accepted_path(parents, accepted)) + 1
        for i in range(kept):  # the text kept
            state.add_text(tokens, len(tokens) - kept + 1 + i)
        tops = [None if node is None or node >= verified else row_token_ids[node + 1] for node in state.tops]
        fill = [state.rng.choice(tokens) for _ in range(self.width)]
        for ngram in state.jacobi.advance(tops or [None] * self.width, kept, fill):
            state.add_ngram(ngram)

    def propose(self, request: Request, k: int, row_token_ids: list[int]) -> list[int]:
        """In one chain: up to k guesses to follow `request`'s tokens, after learning from the step
        just verified: row_token_ids, the model's token at each of its rows (the last token, then each guess)."""
        state = self._state(request)
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
        n = state.n
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
