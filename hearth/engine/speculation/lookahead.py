"""Lookahead decoding's guesses. Host lists only, no tensors.

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
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from hearth.engine.request import Request

# Lookahead: the n-grams' length N (the paper's 5 and 4 do alike; shorter ones match more often),
# and the most continuations the pool keeps for one first token (the most recent).
LOOKAHEAD_NGRAM = 4
LOOKAHEAD_POOL_PER_TOKEN = 8


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
