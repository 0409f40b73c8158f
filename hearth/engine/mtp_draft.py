"""Multi-token prediction as the draft (`--speculative-method mtp`): Qwen3.5's and Qwen3-Next's MTP layer, as
their checkpoints ship it (hearth/model/mtp.py), guesses from the target's own final hidden states.

To the rest of speculation it is a draft model (`MtpDraft`, a `DraftRunner`: speculation/draft.py plans its
passes, the target verifies every guess by speculative sampling's rule, so outputs keep the target's
distribution and greedy ones its tokens; a hybrid's states are rolled back as for any draft). What differs:

- Its rows are shifted by one: the row at position p reads the token at p + 1 and the target's hidden state
  at p (after the final norm, what the LM head reads: vLLM's and llama.cpp's input) and guesses the token at
  p + 2. The target's runner hands it the hidden states of every row it computes (`target_hidden`), kept per
  request from the first position the MTP has not read; before a step's guesses (`catch_up`) the MTP reads
  them up to the request's last computed position, each with the token after it (the last: the token the
  target drew), which guesses the first token after that; each later pass feeds the guess before and the
  MTP's own hidden state at the row before (`_pass_logits`). A verification's rows past the kept tokens
  (rejected guesses) are dropped from the kept hidden states, and rows the MTP wrote while guessing are
  written again from the target's hidden states at the next catch-up, as vLLM does. So every step of a guessing
  request runs the target's eager pass, which hands the hidden states on (`reads_target_hidden`), never the gpu
  backend's decode graphs, which do not: a step without guesses would leave the MTP reading a rejected guess's row.
- Its K/V (one attention layer) live in a cache of its own, indexed by the target's block tables: slot for
  slot the target's, as vLLM keeps its draft layers' (the guesses' rows go in the target's slots after the
  request's tokens, allocated in its BlockManager before the schedule, as early exit does). So a prefix the
  target's prefix cache reuses comes with the MTP's K/V for it, written when the request that computed it
  caught the MTP up; a prefix cached before its MTP rows were written (its request ended first), or a block's
  last row, which read the token after the block, may differ from what this request would have written:
  guesses, never outputs. The cache is counted in the KV budget beside the target's (engine/startup.py).
"""

from __future__ import annotations

import weakref

import torch

from hearth.backend import StepInputs
from hearth.engine.draft_runner import DraftPass, DraftRunner
from hearth.engine.kv_cache import BlockManager
from hearth.engine.request import Request, RequestStatus
from hearth.engine.runner import ModelRunner
from hearth.engine.step_records import BatchEntry, ScheduledSequence, rows_of_sequences
from hearth.errors import HearthError


class MtpDraft(DraftRunner):
    """The target's multi-token-prediction layer, its embeddings and LM head as the draft."""

    position_offset = -1  # a row reads the token after its position
    reads_target_hidden = True

    def __init__(self, target: ModelRunner, target_blocks: BlockManager):
        model = target.model
        if model.mtp is None:
            raise HearthError(f"speculative_method mtp: this {model.config.architecture} model has no "
                              "multi-token-prediction layers (Qwen3.5's and Qwen3-Next's checkpoints ship them as "
                              "mtp.*, llama.cpp's GGUF files as nextn blocks after the last layer)")
        if model.config.mtp_layers > 1:
            raise HearthError(f"speculative_method mtp: {model.config.mtp_layers} multi-token-prediction layers "
                              "(mtp_num_hidden_layers): hearth runs one")
        runner = ModelRunner(model.mtp_view(), target.num_blocks, target.block_size, target.device, model.dtype,
                             eos_token_ids=target.eos_token_ids)
        super().__init__(runner, own_cache=False)
        self.target, self.target_blocks = model, target_blocks
        # per request: the first position whose target hidden state the MTP has not read, and the hidden
        # states [n, hidden] from there
        self.pending: weakref.WeakKeyDictionary[Request, tuple[int, torch.Tensor]] = weakref.WeakKeyDictionary()
        self._first_hidden: dict[Request, torch.Tensor] = {}  # a catch-up's hidden states, till the passes run
        self._hidden: torch.Tensor | None = None  # the pass's input; after it, its last rows' output

    def target_hidden(self, sequences: list[ScheduledSequence], hidden: torch.Tensor) -> None:
        """Keep the target's hidden states of each guessing request's computed rows (a row before those kept
        replaces them from there: a recomputation, or the rows after rejected guesses)."""
        for request, rows in rows_of_sequences(sequences, hidden):
            if not request.sampling_params.speculative:
                continue
            start, kept = request.num_computed_tokens, self.pending.get(request)
            if kept is not None and kept[0] <= start <= kept[0] + len(kept[1]):
                self.pending[request] = (kept[0], torch.cat([kept[1][: start - kept[0]], rows]))
            else:
                self.pending[request] = (start, rows.clone())

    def catch_up(self, request: Request, num_extra: int) -> BatchEntry | None:
        """The entry feeding the MTP the request's positions whose target hidden states it has not read, up to
        its last computed one, each with the token after it, with the target's slots for num_extra rows after
        them allocated. None (no guesses this step): the target's hidden state at its last computed position
        is not here (the request's last token was not drawn by this runner's step), or no free blocks."""
        kept, computed = self.pending.get(request), request.num_computed_tokens
        if kept is None or request.num_tokens != computed + 1 or not kept[0] < computed <= kept[0] + len(kept[1]):
            return None
        if num_extra and not self.target_blocks.allocate_slots(request, num_extra):
            return None
        start, hidden = self.pending.pop(request)
        self._first_hidden[request] = hidden[: computed - start]
        return BatchEntry(request.all_token_ids[start + 1 :], start, request.block_table)

    def block_table(self, request: Request) -> list[int]:
        return request.block_table

    def fed(self, request: Request, token_ids: list[int]) -> None:
        """Nothing to record: the next catch-up writes the rows from the target's hidden states again."""

    def propose(self, passes: list[DraftPass]) -> list[list[list[int]]]:
        self._hidden = torch.cat([self._first_hidden.pop(r) for r in passes[0].requests])
        return super().propose(passes)

    def _one_call(self, passes, step, later):
        return None  # (the cpu backend's one-call passes run a draft model's layers, not these)

    def _pass_logits(self, step: StepInputs, feeds: list[int] | None) -> torch.Tensor:
        """A pass of the MTP: the first reads the target's hidden states, a later one the MTP's own at the
        rows its tokens were drawn at (feeds). Keeps the output at each sequence's last row for the next."""
        hidden = self._hidden if feeds is None else self._hidden[torch.tensor(feeds, device=self._hidden.device)]
        input_ids, positions, meta = self.backend.inputs(self.runner.model, step)
        out = self.target.predict_next(input_ids, hidden, positions, self.runner.kv_caches, meta)
        self._hidden = out if step.decode_only else out[torch.from_numpy(step.last_rows).to(out.device)]
        return self.target.compute_logits(self._hidden)

    def release_stopped(self) -> None:
        super().release_stopped()
        for request in [r for r in self.pending if r.status is not RequestStatus.RUNNING]:
            del self.pending[request]
        self._first_hidden.clear()
