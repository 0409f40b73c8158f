"""Prompt lookup (n-gram) guesses. Host lists only, no tensors.

Prompt lookup speculation guesses that the text goes on as it did the last time its
most recent words appeared: the continuation of the longest recent match of the request's
last n tokens (prompt_lookup_max >= n >= prompt_lookup_min) in its own prompt and output (a
match that ends less than k tokens before the end continues periodically: "a b a b" -> "a b").
With a tree width W > 1 the continuations of up to W different earlier matches are the
branches of a token tree (token_tree.py). A point mass is the draft distribution of an n-gram
guess (sampler.verify_guesses).
"""

from __future__ import annotations

import numpy as np

from hearth.engine.request import Request
from hearth.engine.speculation.token_tree import tree_of


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


def branch_width(request: Request, tree_width: int) -> int:
    """How many branches a request's guesses may have: a structured-output request's grammar masks
    follow one chain of guesses."""
    return 1 if request.sampling_params.structured_outputs is not None else tree_width
