"""A second model beside the target, with its own paged KV cache: the draft of speculative decoding.

`SecondModel` keeps, per target request, a `ModelSequence`: the blocks of the second model's
cache and the tokens whose K/V they hold. Before each pass it catches a request up with the
target's tokens (only what differs since its last pass: after a verification, the guesses that
were rejected are rolled back and their blocks given back), and it lets go of a request's blocks
as soon as the request is no longer running (finished, aborted or preempted: a preempted request
is caught up again from its tokens when it runs again). Its BlockManager has no prefix caching.

`DraftProposer` runs it k times per step, batched over the requests that guess, all k passes in
one call of the runner (`ModelRunner.propose`): the first pass catches each request up and draws
its first guess, each further pass feeds the guess drawn before it (on the device: the host reads
the guesses once, after the last pass) and draws the next, every draw from the request's own
sampling parameters applied to the draft's logits; the distributions q of the guesses are kept
for the target's verification (sampler.verify_guesses). Greedy chains on the CPU's one-call
path run all k passes in one kernel call (cpu_decode.py's greedy_passes). With token trees
(tree_width > 1) each pass runs every branch of a request as a row of its own (`DraftProposer.guess`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hearth.engine.kv_cache import BlockManager
from hearth.engine.request import Request, RequestStatus
from hearth.engine.runner import BatchEntry, DraftPass, ModelRunner
from hearth.engine.speculative import branch_width
from hearth.engine.token_tree import tree_of

# What the draft's cache records for a tree region's slot: no token, so a catch-up never keeps it.
TREE_NODE = -1


@dataclass(eq=False)
class ModelSequence:
    """A request in the second model's cache: what BlockManager reads (block_table,
    num_computed_tokens) and the tokens those K/V belong to."""

    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # len == num_computed_tokens
    num_confirmed: int = 0  # the leading token_ids that were the request's own tokens when fed (not guesses)


class SecondModel:
    """The second model's runner and KV bookkeeping, request by request."""

    def __init__(self, runner: ModelRunner, block_size: int):
        self.runner = runner
        self.block_manager = BlockManager(runner.num_blocks, block_size, enable_prefix_caching=False)
        self.sequences: dict[Request, ModelSequence] = {}

    def release_stopped(self) -> None:
        """Free the blocks of every request that no longer runs."""
        for request in [r for r in self.sequences if r.status is not RequestStatus.RUNNING]:
            self.block_manager.free(self.sequences.pop(request))

    def catch_up(self, request: Request, num_extra: int) -> BatchEntry | None:
        """The entry feeding `request`'s tokens the cache lacks, with room for num_extra tokens fed
        after them; K/V of tokens that differ from the request's (rejected guesses) are dropped first.
        None when the cache has no room for it (the request goes without this step)."""
        seq = self.sequences.setdefault(request, ModelSequence())
        tokens = request.all_token_ids
        limit = min(seq.num_computed_tokens, len(tokens) - 1)  # the last token is always fed: its logits
        common = min(seq.num_confirmed, limit)  # past those, guesses were fed: compare them
        while common < limit and seq.token_ids[common] == tokens[common]:
            common += 1
        seq.num_computed_tokens = common
        del seq.token_ids[common:]
        self.block_manager.free_excess(seq, common)
        if not self.block_manager.allocate_slots(seq, len(tokens) - common + num_extra):
            return None
        seq.num_confirmed = len(tokens)
        return BatchEntry(tokens[common:], common, seq.block_table)

    def fed(self, request: Request, token_ids: list[int]) -> None:
        """The pass wrote these tokens' K/V (after those already there)."""
        seq = self.sequences[request]
        seq.token_ids += token_ids
        seq.num_computed_tokens += len(token_ids)


def rows_of(q: torch.Tensor | None, count: int) -> list[torch.Tensor | None]:
    """The rows of a pass's distributions [count, V]; None each where the pass gave none (all greedy)."""
    return [None] * count if q is None else list(q)


def one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    """A point mass on `token`, shaped and placed as the distribution `like` [V]."""
    return torch.zeros_like(like).index_fill_(0, torch.tensor([token], device=like.device), 1.0)


class DraftProposer:
    """Guesses from a draft model: k tokens per request per step, and their distributions."""

    def __init__(self, draft: SecondModel, tree_width: int = 1):
        self.draft = draft
        self.tree_width = tree_width
        self.guess_probs: dict[Request, torch.Tensor] = {}  # [k, V] per request with guesses

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
        requests = [request for request, _ in first]
        if not requests:
            return
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
        (choices, q), *later = self.draft.runner.propose(passes)
        # per request, per branch: its guesses and their distributions (None: point masses, a greedy pass's)
        branches, probs = {}, {}
        for (request, entry), tokens, dist in zip(first, choices, rows_of(q, len(first))):
            self.draft.fed(request, entry.token_ids)
            tokens = tokens[: widths[request]]
            branches[request] = [[token] for token in tokens]
            probs[request] = [[dist]] + [[None if dist is None else one_hot(token, dist)] for token in tokens[1:]]
        for rows, (choices, q) in zip(later_rows, later):
            for (request, b), tokens, dist in zip(rows, choices, rows_of(q, len(rows))):  # each fed its branch's last guess
                self.draft.fed(request, branches[request][b][-1:] if widths[request] == 1 else [TREE_NODE])
                branches[request][b].append(tokens[0])
                probs[request][b].append(dist)
        for request in requests:
            token_ids, parents = tree_of(branches[request])  # (the first guesses differ: nothing merges)
            request.set_guesses(token_ids, parents if widths[request] > 1 else None)
            dists = [dist for branch in probs[request] for dist in branch]
            if any(dist is None for dist in dists):  # a greedy request's: every guess a point mass
                self.guess_probs.pop(request, None)
            else:
                self.guess_probs[request] = torch.stack(dists)

    def _branch_entry(self, request: Request, branch: int, depth: int, width: int) -> BatchEntry:
        """The pass feeding a branch's guess number `depth` (its token: drawn by the pass before,
        DraftPass.feeds), after the request's tokens (a chain), or in the tree region at slot
        width x (depth - 1) + branch, seeing its branch's earlier guesses."""
        start, table = request.num_tokens, self.draft.sequences[request].block_table
        if width == 1:
            return BatchEntry([0], start + depth - 1, table)
        mask = sum(1 << (branch + width * i) for i in range(depth))
        return BatchEntry([0], start + width * (depth - 1) + branch, table, (start, [mask]))

    def probs_of(self, request: Request) -> torch.Tensor | None:
        return self.guess_probs.get(request) if request.spec_token_ids else None

    def release_stopped(self) -> None:
        self.draft.release_stopped()
        for request in [r for r in self.guess_probs if not r.spec_token_ids or r.status is not RequestStatus.RUNNING]:
            del self.guess_probs[request]
