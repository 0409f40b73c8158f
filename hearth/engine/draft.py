"""A second model beside the target, with its own paged KV cache: the draft of speculative decoding.

`SecondModel` keeps, per target request, a `ModelSequence`: the blocks of the second model's
cache and the tokens whose K/V they hold. Before each pass it catches a request up with the
target's tokens (only what differs since its last pass: after a verification, the guesses that
were rejected are rolled back and their blocks given back), and it lets go of a request's blocks
as soon as the request is no longer running (finished, aborted or preempted: a preempted request
is caught up again from its tokens when it runs again). Its BlockManager has no prefix caching.

`DraftProposer` runs it k times per step, batched over the requests that guess: the first pass
catches each request up and draws its first guess, each further pass feeds the previous guess
and draws the next, every draw from the request's own sampling parameters applied to the draft's
logits; the distributions q of the guesses are kept for the target's verification
(sampler.verify_guesses).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hearth.engine.kv_cache import BlockManager
from hearth.engine.request import Request, RequestStatus
from hearth.engine.runner import BatchEntry, ModelRunner


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


class DraftProposer:
    """Guesses from a draft model: k tokens per request per step, and their distributions."""

    def __init__(self, draft: SecondModel):
        self.draft = draft
        self.guess_probs: dict[Request, torch.Tensor] = {}  # [k, V] per request with guesses

    def guess(self, wanted: dict[Request, int], generators: dict[Request, torch.Generator | None],
              verified_rows: dict[Request, list[int]]) -> None:
        """Set request.spec_token_ids of each request to its k guesses (none when the draft's cache
        has no room for it); `generators`: each request's spec generator (seeded requests);
        verified_rows: lookahead's, not the draft's."""
        entries, rows = [], []
        for request, k in wanted.items():
            entry = self.draft.catch_up(request, k - 1)
            if entry is not None:
                entries.append(entry)
                rows.append((request, k))
        guesses = {request: [] for request, _ in rows}
        probs = {request: [] for request, _ in rows}
        while rows:
            requests = [request for request, _ in rows]
            outputs = [request.output_token_ids + guesses[request] for request in requests]
            tokens, q = self.draft.runner.draw_next(entries, requests, outputs, [generators[r] for r in requests])
            for i, ((request, _), entry) in enumerate(zip(rows, entries)):
                self.draft.fed(request, entry.token_ids)
                guesses[request].append(tokens[i])
                probs[request].append(q[i])
            rows_next, entries = [], []
            for (request, k), token in zip(rows, tokens):
                if len(guesses[request]) < k:
                    rows_next.append((request, k))
                    entries.append(BatchEntry([token], request.num_tokens + len(guesses[request]) - 1,
                                              self.draft.sequences[request].block_table))
            rows = rows_next
        for request, token_ids in guesses.items():
            request.spec_token_ids = token_ids
            self.guess_probs[request] = torch.stack(probs[request])

    def probs_of(self, request: Request) -> torch.Tensor | None:
        return self.guess_probs.get(request) if request.spec_token_ids else None

    def release_stopped(self) -> None:
        self.draft.release_stopped()
        for request in [r for r in self.guess_probs if not r.spec_token_ids or r.status is not RequestStatus.RUNNING]:
            del self.guess_probs[request]
