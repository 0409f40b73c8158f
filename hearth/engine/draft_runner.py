"""The draft model's runner, beside the target's: its passes and the distributions of its guesses.

`DraftRunner.propose` runs a step's draft passes in one call (speculation/draft.py plans them):
the first pass catches each request up and draws its first guess, each further pass feeds the
guess drawn before it (on the device: the host reads the guesses once, after the last pass) and
draws the next, every draw from the request's own sampling parameters applied to the draft's
logits. Greedy chains on the CPU backend run all k passes in one kernel call
(`CpuBackend.greedy_passes`, cpu_decode.py). The distributions q of a request's guesses
(`keep_distributions`) stay here until the target's runner verifies them (sampler.verify_guesses)
in the next step; a greedy request's are point masses and are not kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hearth.backend import StepInputs
from hearth.backend.cpu import CpuBackend
from hearth.engine_config import EngineConfig
from hearth.engine.request import Request, RequestStatus
from hearth.backend.transfer import to_host
from hearth.engine.runner import ModelRunner
from hearth.engine.step_records import BatchEntry, ScheduledSequence
from hearth.engine.sampler import SamplingBatch, apply_penalties_and_bias, draw, exponential_noise, final_distribution
from hearth.engine.second_model import SecondModel, load_second_runner
from hearth.tokenizer import Tokenizer


@dataclass
class DraftPass:
    """One pass of a draft model's proposals (DraftRunner.propose), a row per entry. The first
    pass's entries carry their tokens (catching each request up); a later pass's rows each feed a
    token an earlier pass drew, not read by the host yet: feeds[i], its index in the pass before's
    choices [rows, width] flattened (the entries' token_ids are placeholders)."""

    entries: list[BatchEntry]
    requests: list[Request]  # per row: whose sampling parameters and output it draws with
    generators: list[torch.Generator | None]  # per row: a seeded request's spec generator
    feeds: list[int] | None = None
    width: int = 1  # choices per row: the draw, then the next best tokens (a token tree's first guesses)


# Where a guess's distribution comes from: (pass, row) of the last propose, and a token when the
# guess is the point mass at it (a token tree's other first guesses), else None.
GuessSource = tuple[int, int, int | None]


class DraftRunner(SecondModel):
    """The draft model: its runner and KV bookkeeping (SecondModel), its passes, its guesses' distributions."""

    # where the row feeding a request's guess d sits: position num_tokens + d - 1 + position_offset (a draft
    # model feeds each token at its own position; the MTP layer one before, mtp_draft.py)
    position_offset = 0
    # whether it reads the target's final hidden states of every row (target_hidden): the MTP layer does, so a
    # step of its requests runs the target's eager pass, which hands them on (the decode graphs do not)
    reads_target_hidden = False

    def __init__(self, runner: ModelRunner, own_cache: bool = True):
        super().__init__(runner, own_cache)
        self.backend = runner.backend
        self.guess_probs: dict[Request, torch.Tensor] = {}  # [k, V] per request with guesses
        self._pass_probs: list[torch.Tensor | None] = []  # the last propose's, per pass [rows, V]

    def propose(self, passes: list[DraftPass]) -> list[list[list[int]]]:
        """The passes in one call: each row's next token drawn from its request's final distribution
        (its sampling parameters applied to the draft's logits, its output followed by the guesses
        its branch drew in the passes before; a seeded request's noise from its spec generator), a
        later pass's rows fed tokens the passes before drew, on the device; one copy to the host at
        the end. Returns per pass, per row its choices (DraftPass.width: the draw, then the next
        best tokens by the penalised logits); the passes' distributions are kept for
        keep_distributions (none where every row is greedy: a greedy row's is the point mass at its
        draw). Where every row takes the argmax of its logits as they come and each draws one choice
        (a chain), the CPU backend runs all the passes in one call."""
        first = passes[0]
        batch = self._sampling_batch(first)
        every = self.runner.prepare([entry for p in passes for entry in p.entries])  # all passes' entries, end to end
        step = every.sequences(0, len(first.entries))
        later = every.sequences(len(first.entries), every.num_seqs) if len(passes) > 1 else None
        if batch.argmax_only and all(p.width == 1 for p in passes):  # a greedy chain: one backend call
            chosen = self._one_call(passes, step, later)
            if chosen is not None:
                self._pass_probs = [None] * len(passes)
                return chosen
        drawn = self._run_passes(passes, batch, step, later)
        self._pass_probs = [probs for _, probs in drawn]
        return [choices.tolist() for choices in to_host([choices for choices, _ in drawn])]

    def _sampling_batch(self, p: DraftPass, pending: torch.Tensor | None = None) -> SamplingBatch:
        return SamplingBatch.build([r.sampling_params for r in p.requests], [r.prompt_token_ids for r in p.requests],
                                   [r.output_token_ids for r in p.requests], p.generators,
                                   self.runner.model.config.vocab_size, self.runner.device,
                                   eos_token_ids=self.runner.eos_token_ids, pending=pending)

    def _one_call(self, passes: list[DraftPass], step: StepInputs, later: StepInputs | None
                  ) -> list[list[list[int]]] | None:
        """A greedy chain's passes in one kernel call of the CPU backend, where its decode path takes
        the model; None otherwise (then the passes run one by one)."""
        if not isinstance(self.backend, CpuBackend):
            return None
        runner = self.runner
        chosen = self.backend.greedy_passes(runner.model, step, later, [p.feeds for p in passes[1:]], runner.kv_caches)
        if chosen is None:
            return None
        chosen, ends = chosen.tolist(), np.cumsum([len(p.entries) for p in passes]).tolist()
        return [[[token] for token in chosen[end - len(p.entries) : end]] for p, end in zip(passes, ends)]

    def _run_passes(self, passes: list[DraftPass], batch: SamplingBatch, step: StepInputs, later: StepInputs | None
                    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The passes one by one: per pass, its choices [rows, width] and distributions [rows, V]
        (None: every row greedy), on the device."""
        drawn: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        # [rows, depth] the guesses each row's branch drew before it, kept where the first pass's
        # sampling reads the output (later rows are of the same requests: none of theirs does otherwise)
        pending = (torch.empty(len(passes[0].entries), 0, dtype=torch.int64, device=self.runner.device)
                   if batch.reads_output else None)
        first_row = 0  # of the pass in `later`
        for p in passes:
            if p.feeds is not None:
                step = later.sequences(first_row, first_row + len(p.entries))
                first_row += len(p.entries)
                choices = drawn[-1][0]
                feeds = torch.tensor(p.feeds, device=self.runner.device)
                step.input_ids = choices.reshape(-1)[feeds]
                if pending is not None:
                    pending = torch.cat([pending[feeds // choices.shape[1]], step.input_ids[:, None]], dim=1)
            if p.feeds is not None and (pending is not None or p.requests != passes[len(drawn) - 1].requests):
                batch = self._sampling_batch(p, pending)
            drawn.append(self._draw(p, self._pass_logits(step, p.feeds), batch))
        return drawn

    def _pass_logits(self, step: StepInputs, feeds: list[int] | None) -> torch.Tensor:
        """A pass of the draft: the logits [rows, V] of each sequence's last row (feeds: DraftPass.feeds)."""
        return self.runner.last_logits_of_step(step)

    def target_hidden(self, sequences: list[ScheduledSequence], hidden: torch.Tensor) -> None:
        """The target's final hidden states of a step's rows [T, hidden] (its sequences' new tokens end to end),
        for a draft that reads them (mtp_draft.py); a draft model does not."""

    def _draw(self, p: DraftPass, logits: torch.Tensor, batch: SamplingBatch
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pass's choices [rows, width] and distributions [rows, V] (None: every row greedy) from its logits."""
        penalised = apply_penalties_and_bias(logits, batch, self.backend.apply_token_bitmask)
        if batch.all_greedy:
            probs, choices = None, penalised.argmax(dim=-1)
        else:
            probs, greedy_ids = final_distribution(penalised, batch)
            choices = draw(probs, greedy_ids, batch, exponential_noise(probs, p.generators))
        choices = choices[:, None]
        if p.width > 1:  # the next best tokens other than the draw (one of the top width + 1 may be it)
            best = penalised.topk(p.width + 1, dim=-1).indices
            others_first = (best == choices).to(torch.int32).sort(dim=1, stable=True).indices
            choices = torch.cat([choices, best.gather(1, others_first[:, : p.width - 1])], dim=1)
        return choices, probs

    def keep_distributions(self, request: Request, sources: list[GuessSource]) -> None:
        """Keep the distributions of a request's guesses (in its guesses' order) for their
        verification: each its pass row's, or the point mass at its token. Where a pass gave none
        (every row greedy), the guesses are a greedy request's: point masses, nothing kept."""
        if any(self._pass_probs[p] is None for p, _, _ in sources):
            self.guess_probs.pop(request, None)
            return
        rows = [self._pass_probs[p][row] for p, row, _ in sources]
        self.guess_probs[request] = torch.stack([
            q if token is None else torch.zeros_like(q).index_fill_(0, torch.tensor([token], device=q.device), 1.0)
            for q, (_, _, token) in zip(rows, sources)])

    def probs_of(self, request: Request) -> torch.Tensor | None:
        """The distributions [k, V] of the request's guesses; None: point masses (a greedy request's)."""
        return self.guess_probs.get(request) if request.spec_token_ids else None

    def release_stopped(self) -> None:
        super().release_stopped()
        for request in [r for r in self.guess_probs if not r.spec_token_ids or r.status is not RequestStatus.RUNNING]:
            del self.guess_probs[request]


def load_second_models(config: EngineConfig, target: ModelRunner, dtype: torch.dtype, tokenizer: Tokenizer,
                       max_model_len: int, progress: bool) -> tuple[DraftRunner | None, SecondModel | None]:
    """The models beside the target's runner: the speculative draft and contrastive decoding's amateur (None: none)."""
    def load(path: str, what: str) -> ModelRunner:
        return load_second_runner(path, what, target, dtype, tokenizer, max_model_len, progress)

    draft = amateur = None
    if config.speculative.model is not None:
        draft = DraftRunner(load(config.speculative.model, "speculative_model"))
    if config.contrastive_model is not None:
        amateur = SecondModel(load(config.contrastive_model, "contrastive_model"))
    return draft, amateur
