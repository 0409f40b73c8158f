"""Draft-model guesses: the passes a step's guessing takes, planned on the host. No tensors.

`DraftProposer` runs the draft (hearth/engine/draft_runner.py, beside the target's runner) k
times per step, batched over the requests that guess, all k passes in one call of the draft
runner: the first pass catches each request up and draws its first guess, each further pass
feeds the guess drawn before it and draws the next. With token trees (tree_width > 1) each pass
runs every branch of a request as a row of its own. The distributions of the guesses stay with
the draft runner until the target's runner verifies them.
"""

from __future__ import annotations

import torch

from hearth.engine.draft_runner import DraftPass, DraftRunner, GuessSource
from hearth.engine.request import Request
from hearth.engine.step_records import BatchEntry
from hearth.engine.speculation.ngram import branch_width
from hearth.engine.speculation.token_tree import tree_of

# What the draft's cache records for a tree region's slot: no token, so a catch-up never keeps it.
TREE_NODE = -1

Row = tuple[Request, int]  # a pass's row: (request, branch)


class DraftProposer:
    """Guesses from a draft model: k tokens per request per step."""

    def __init__(self, draft: DraftRunner, tree_width: int = 1):
        self.draft = draft
        self.tree_width = tree_width

    def guess(self, wanted: dict[Request, int], generators: dict[Request, torch.Generator | None],
              verified_rows: dict[Request, list[int]]) -> None:
        """Set request.spec_token_ids of each request to its k guesses (none when the draft's cache
        has no room for it); `generators`: each request's spec generator (seeded requests);
        verified_rows: lookahead's, not the draft's.

        With tree_width W > 1 a request's guesses are a token tree of W branches: the draft's
        first guess drawn as a chain's, and beside it its W - 1 best other tokens (point masses: a
        fixed choice, which the sibling rule verifies, sampler.verify_guesses), each followed by
        k - 1 guesses drawn as a chain's. The branches run side by side in the draft's cache, after
        the request's tokens, each seeing only its own (a tree region of W x (k - 1) slots, which
        the next catch-up drops)."""
        first, widths = [], {}
        for request, k in wanted.items():
            widths[request] = branch_width(request, self.tree_width)
            entry = self.draft.catch_up(request, widths[request] * (k - 1))
            if entry is not None:
                first.append((request, entry))
        if not first:
            return
        passes, later_rows = self._passes(first, wanted, widths, generators)
        choices, *later = self.draft.propose(passes)
        # per request, per branch: its guesses and where each one's distribution is (GuessSource)
        branches: dict[Request, list[list[int]]] = {}
        sources: dict[Request, list[list[GuessSource]]] = {}
        for i, ((request, entry), tokens) in enumerate(zip(first, choices)):
            self.draft.fed(request, entry.token_ids)
            tokens = tokens[: widths[request]]
            branches[request] = [[token] for token in tokens]
            sources[request] = [[(0, i, None)]] + [[(0, i, token)] for token in tokens[1:]]
        for depth, (rows, choices) in enumerate(zip(later_rows, later), 1):
            for i, ((request, b), tokens) in enumerate(zip(rows, choices)):  # each fed its branch's last guess
                self.draft.fed(request, branches[request][b][-1:] if widths[request] == 1 else [TREE_NODE])
                branches[request][b].append(tokens[0])
                sources[request][b].append((depth, i, None))
        for request, _ in first:
            token_ids, parents = tree_of(branches[request])  # (the first guesses differ: nothing merges)
            request.set_guesses(token_ids, parents if widths[request] > 1 else None)
            self.draft.keep_distributions(request, [source for branch in sources[request] for source in branch])

    def _passes(self, first: list[tuple[Request, BatchEntry]], wanted: dict[Request, int], widths: dict[Request, int],
                generators: dict[Request, torch.Generator | None]) -> tuple[list[DraftPass], list[list[Row]]]:
        """The step's draft passes (the first catching each request up), and each later pass's rows."""
        requests = [request for request, _ in first]
        width = max(widths[r] for r in requests)
        passes = [DraftPass([entry for _, entry in first], requests, [generators[r] for r in requests], width=width)]
        # the first pass's branches, and where their tokens are among its choices
        feeds = {(r, b): i * width + b for i, r in enumerate(requests) for b in range(widths[r])}
        rows = list(feeds)
        later_rows = []  # per later pass: its rows (request, branch)
        for depth in range(1, max(wanted[r] for r in requests)):
            rows = [(r, b) for r, b in rows if depth < wanted[r]]
            passes.append(DraftPass([self._branch_entry(r, b, depth, widths[r]) for r, b in rows], [r for r, _ in rows],
                                    [generators[r] for r, _ in rows], [feeds[row] for row in rows]))
            later_rows.append(rows)
            feeds = {row: i for i, row in enumerate(rows)}
        return passes, later_rows

    def _branch_entry(self, request: Request, branch: int, depth: int, width: int) -> BatchEntry:
        """The pass feeding a branch's guess number `depth` (its token: drawn by the pass before,
        DraftPass.feeds), after the request's tokens (a chain), or in the tree region at slot
        width x (depth - 1) + branch, seeing its branch's earlier guesses."""
        start, table = request.num_tokens + self.draft.position_offset, self.draft.block_table(request)
        if width == 1:
            return BatchEntry([0], start + depth - 1, table)
        mask = sum(1 << (branch + width * i) for i in range(depth))
        return BatchEntry([0], start + width * (depth - 1) + branch, table, (start, [mask]))
