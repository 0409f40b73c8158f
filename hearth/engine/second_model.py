"""A second model beside the target, with its own paged KV cache: a speculative draft, or
contrastive decoding's amateur.

`SecondModel` keeps, per target request, a `ModelSequence`: the blocks of the second model's
cache and the tokens whose K/V they hold. Before each pass it catches a request up with the
target's tokens (only what differs since its last pass: after a verification, the guesses that
were rejected are rolled back and their blocks given back), and it lets go of a request's blocks
as soon as the request is no longer running (finished, aborted or preempted: a preempted request
is caught up again from its tokens when it runs again). Its BlockManager has no prefix caching.

The amateur is a logits source of the target's runner (`last_logits`: its logits at each
contrastive request's last token, for the sampler's contrastive scores); the draft's passes and
the distributions of its guesses are draft_runner.py's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from hearth.engine.kv_cache import BlockManager
from hearth.engine.request import Request, RequestStatus
from hearth.errors import HearthError
from hearth.engine.runner import ModelRunner
from hearth.engine.step_records import BatchEntry
from hearth.loading.loader import load_model
from hearth.tokenizer import Tokenizer


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

    def __init__(self, runner: ModelRunner, own_cache: bool = True):
        """own_cache False: the runner's KV cache is the target's (early exit's draft), whose blocks the
        target's requests hold; a subclass then says which (catch_up, fed, block_table)."""
        self.runner = runner
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False) \
            if own_cache else None
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

    def block_table(self, request: Request) -> list[int]:
        """The blocks of the request's K/V in this model's cache."""
        return self.sequences[request].block_table

    def fed(self, request: Request, token_ids: list[int]) -> None:
        """The pass wrote these tokens' K/V (after those already there)."""
        seq = self.sequences[request]
        seq.token_ids += token_ids
        seq.num_computed_tokens += len(token_ids)

    def last_logits(self, requests: list[Request]) -> torch.Tensor:
        """Contrastive decoding's amateur: its logits [len(requests), V] at each request's last token
        (caught up with the request's tokens through its own KV cache)."""
        entries = [self.catch_up(r, 0) for r in requests]
        if None in entries:
            raise RuntimeError("the contrastive model's KV cache is full (its requests share no prefix blocks): "
                               "run fewer requests with contrastive_weight at once")
        logits = self.runner.last_logits(entries)
        for request, entry in zip(requests, entries):
            self.fed(request, entry.token_ids)
        return logits


def load_second_runner(path: str, what: str, target: ModelRunner, dtype: torch.dtype, tokenizer: Tokenizer,
                       max_model_len: int, progress: bool) -> ModelRunner:
    """Load a model to run beside the target (`what`: its option's name): same vocabulary, context at
    least max_model_len, its own KV cache of as many blocks as the target's."""
    loaded = load_model(path, dtype, target.device, max_positions=max_model_len, progress=progress,
                        backend=target.backend)
    config, vocab_size = loaded.config, target.model.config.vocab_size
    if config.vocab_size != vocab_size or loaded.tokenizer.token_bytes() != tokenizer.token_bytes():
        raise ValueError(f"{what} {path} does not share the target's vocabulary ({config.vocab_size:,} tokens "
                         f"against {vocab_size:,}, or different token texts)")
    if config.is_hybrid:
        raise HearthError(f"{what} {path} is a hybrid model ({config.architecture}, layers with a state per "
                          "sequence): hearth runs such models only as the target, not beside one")
    if config.max_position_embeddings < max_model_len:
        raise ValueError(f"{what} {path} has a context of {config.max_position_embeddings:,} tokens, less than "
                         f"max_model_len {max_model_len:,}: give a smaller max_model_len")
    runner = ModelRunner(loaded.model, target.num_blocks, target.block_size, target.device, dtype,
                         eos_token_ids=tokenizer.eos_token_ids)
    if progress:
        size = target.num_blocks * target.block_size * config.kv_bytes_per_token(dtype.itemsize)
        print(f"hearth: {what} {config.architecture} model, its KV cache {size / 2**20:.1f} MiB", file=sys.stderr)
    return runner
