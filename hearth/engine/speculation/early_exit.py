"""Early exit as self-speculation (LayerSkip, Elhoushi et al. 2024): the model's own first N layers,
its final norm and LM head are the draft. No tensors here.

The draft is an ordinary draft model to the rest of speculation (draft.py plans its passes, the
draft runner runs them, the target verifies every guess by speculative sampling's rule, so outputs
keep the full model's distribution, and greedy ones its tokens), with one difference: it has no KV
cache of its own. Its layers are the target's first N, so the K/V the target has for a request's
tokens in those layers are exactly what the draft would compute: the draft reads them from the
target's cache, and a request needs no catch-up (the draft's first pass feeds only its last token,
whose K/V the verification has not written yet). The draft writes its passes' K/V (the last token,
then each guess it feeds) into the target's own slots for those positions, in the first N layers,
in blocks of the request's table it allocates in the target's BlockManager before the schedule
(the verification's slots; the scheduler finds them there, and gives back those of rejected
guesses, or keeps them for the next step's guesses when it dropped this step's). The verification
computes every layer for every row again, the first N included, and overwrites those K/V: on the
cpu backend with the very same numbers (a row's arithmetic does not depend on its step), so
starting the verification's guessed rows at layer N from the draft's hidden states would be exact
there; hearth does not (the model pass would need rows that start at different layers).
"""

from __future__ import annotations

from hearth.engine.draft_runner import DraftRunner
from hearth.engine.kv_cache import BlockManager
from hearth.engine.request import Request
from hearth.engine.runner import ModelRunner
from hearth.engine.step_records import BatchEntry


class EarlyExitDraft(DraftRunner):
    """The target's first exit_layer layers, final norm and LM head, on the target's KV cache."""

    def __init__(self, target: ModelRunner, exit_layer: int, target_blocks: BlockManager):
        num_layers = len(target.model.layers)
        if not 1 <= exit_layer < num_layers:
            raise ValueError(f"exit_layer must be in [1, {num_layers - 1}] for this model of {num_layers} layers, "
                             f"got {exit_layer}")
        runner = ModelRunner(target.model.first_layers(exit_layer), target.num_blocks, target.block_size,
                             target.device, target.model.dtype, eos_token_ids=target.eos_token_ids,
                             kv_caches=target.kv_caches[:exit_layer])
        super().__init__(runner, own_cache=False)
        self.target_blocks = target_blocks

    def catch_up(self, request: Request, num_extra: int) -> BatchEntry | None:
        """The entry feeding the request's last token (the target's cache holds the K/V of the
        tokens before), with the target's slots for it and num_extra tokens after it allocated
        (None when the cache has no free blocks for them: no guesses this step)."""
        if request.num_computed_tokens != request.num_tokens - 1:
            return None
        if not self.target_blocks.allocate_slots(request, 1 + num_extra):
            return None
        return BatchEntry(request.all_token_ids[-1:], request.num_computed_tokens, request.block_table)

    def block_table(self, request: Request) -> list[int]:
        return request.block_table

    def fed(self, request: Request, token_ids: list[int]) -> None:
        """Nothing to record: the K/V went into the target's slots, which the verification overwrites."""
