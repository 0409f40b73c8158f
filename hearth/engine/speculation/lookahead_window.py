"""Lookahead decoding as published (Fu et al., 2024): a step's rows as one token tree. Host lists only.

The step after a request's last token carries two branches in one token tree (token_tree.py), so
that the decode kernels' ancestor masks are the paper's attention mask:

- the lookahead branch, a 2-D Jacobi window of W positions x N - 1 levels (the last N - 1
  iterations). Level l's token in column i stands l + i + 1 positions past the last token: level 0
  is one chain from the last token, and level l's token in column i follows level l - 1's in the
  same column. Column i's top row so sees level 0 up to column i, then the column's tokens above
  it (its trajectory), and its draw is the model's token for the position after it: the Jacobi
  iteration. After the step the levels move down one (the oldest leaves), the top level takes
  those draws, and each column's N - 1 tokens with its draw are an n-gram for the pool. Every
  token keeps its position when the step kept one token; when it kept more, the window moves on
  as many positions (its first columns leave, tokens from the text fill the end), as the text did.
- the verification branch: up to G pool n-grams that follow the last token, N - 1 guesses each.

The target verifies every row (a path through the window is a guess like any other) and keeps the
longest accepted path; the other rows' K/V are given back, as for any rejected guess.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hearth.engine.speculation.token_tree import tree_paths


@dataclass
class JacobiWindow:
    """One request's 2-D window: levels[l][i], level l's token in column i (module docstring)."""

    levels: list[list[int]]  # N - 1 levels of W tokens, the oldest first

    @classmethod
    def from_text(cls, tokens: list[int], width: int, ngram: int, rng: random.Random) -> JacobiWindow:
        """A window of tokens drawn from the text (the reference implementations' start)."""
        return cls([[rng.choice(tokens) for _ in range(width)] for _ in range(ngram - 1)])

    def columns(self) -> list[list[int]]:
        """Each column's branch from the last token: level 0 up to the column, then the column above it."""
        return [self.levels[0][: i + 1] + [level[i] for level in self.levels[1:]] for i in range(len(self.levels[0]))]

    def advance(self, tops: list[int | None], moved: int, fill: list[int]) -> list[list[int]]:
        """The Jacobi iteration after a step that drew tops[i] at column i's top row (None: the row
        was not verified) and moved the text on by `moved` tokens; fill: tokens for the columns
        that enter (at least W). Returns the columns' trajectories: the pool's new n-grams."""
        width = len(self.levels[0])
        trajectories = [[level[i] for level in self.levels] + [top] for i, top in enumerate(tops) if top is not None]
        top_level = [fill[i] if top is None else top for i, top in enumerate(tops)]
        skip = min(moved - 1, width)
        self.levels = [level[skip:] + fill[width - skip : width] for level in [*self.levels[1:], top_level]]
        return trajectories


def lookahead_tree(window: JacobiWindow, candidates: list[list[int]],
                   rows: int) -> tuple[list[int], list[int], list[int | None]]:
    """A step's guesses: the tree (tokens, parents) of the pool's candidate n-grams (first: trimming
    keeps them) and the window's columns, cut to `rows` guesses; and the node of each column's top
    row (None: cut)."""
    tokens, parents, paths = tree_paths(candidates + window.columns())
    tops = [path[-1] if path[-1] < rows else None for path in paths[len(candidates):]]
    return tokens[:rows], parents[:rows], tops
