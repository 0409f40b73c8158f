"""The engine's one handle on speculative decoding: `Speculator`. No tensors.

The engine calls it in two places of a step:

    speculator.plan(num_running)            guesses for this step (request.spec_token_ids), before
                                            the schedule: from the proposer, as many per request as
                                            the guess count allows, none while the speed gate says
                                            guessing is slower
    plan = scheduler.schedule(); result = runner.execute(...); output_processor.process(...)
    speculator.update(plan, result, stats)  the step's result: acceptance per request, the counts
                                            (SpecDecodeCounts), the speed gate's measurement

Built once from the engine's SpeculativeConfig (`build_speculator`); with no method it makes no
guesses. The guesses are verified by the target in the step that carries them (runner +
sampler), as extra tokens of their request.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from hearth.engine_config import SpeculativeConfig
from hearth.engine.draft_runner import DraftRunner
from hearth.engine.output_processor import SequenceState, StepStats
from hearth.engine.request import Request, RequestStatus
from hearth.engine.step_records import SampledTokens, StepResult
from hearth.engine.scheduler import SchedulerOutput
from hearth.engine.speculation.draft import DraftProposer
from hearth.engine.speculation.guess_count import AcceptanceRate, num_guesses
from hearth.engine.speculation.lookahead import LookaheadProposer
from hearth.engine.speculation.multi_step import MultiStepProposer
from hearth.engine.speculation.ngram import NgramProposer
from hearth.engine.speculation.speed_gate import SpeedGate
from hearth.engine.speculation.stats import SpecDecodeCounts

# Added to a seeded request's seed for the generator of its speculative draws (guesses, verification coins).
SPEC_SEED = 0x5BEC_0000_0000


def spec_seed(seed: int) -> int:
    """The seed of a seeded sequence's speculative draws (its own stream: plain decoding's stays as it is)."""
    return (seed + SPEC_SEED) % 2**64


class Proposer(Protocol):
    def guess(self, wanted: dict[Request, int], generators: dict[Request, torch.Generator | None],
              verified_rows: dict[Request, list[int]]) -> None:
        """Set the guesses (request.set_guesses) of each request in `wanted`, up to its count;
        generators: each one's spec generator (a draft's draws); verified_rows: each request of
        the step before's draw at every row it verified (lookahead learns from them)."""


class Speculator:
    """Proposer, guess count, speed gate and acceptance statistics behind plan / update."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None, max_model_len: int,
                 sequences: Mapping[str, SequenceState]):
        """sequences: the engine's sequences by request id (their spec generators)."""
        self.config, self.proposer, self.max_model_len, self.sequences = config, proposer, max_model_len, sequences
        self.totals = SpecDecodeCounts()  # since the engine started
        self.speed_gate = SpeedGate()
        self.acceptance: weakref.WeakKeyDictionary[Request, AcceptanceRate] = weakref.WeakKeyDictionary()
        self._last: dict[Request, SampledTokens] | None = None  # the step before's sampled requests
        self._step_start = 0.0

    @property
    def active(self) -> bool:
        """Whether it makes guesses (a method is set)."""
        return self.proposer is not None

    def plan(self, num_running: int) -> None:
        """Guess the next tokens of every request that sampled in the step before and goes on."""
        self._step_start = time.perf_counter()  # guessing belongs to the step it is for: its cost
        sampled, self._last = self._last, None
        if sampled is None or (self.config.adaptive and not self.speed_gate.allow()):
            return
        wanted, generators, verified_rows = {}, {}, {}
        for request, tokens in sampled.items():
            params = request.sampling_params
            if (request.status is not RequestStatus.RUNNING or not params.speculative or params.contrastive_weight
                    or params.contrastive_search or params.calm_threshold is not None):
                continue  # opted out, contrastive or CALM (its scores or exits come one position at a time)
            verified_rows[request] = tokens.row_token_ids
            k = self._count(request, num_running)
            if k > 0:
                wanted[request], generators[request] = k, self.sequences[request.request_id].spec_generator
        self.proposer.guess(wanted, generators, verified_rows)

    def forget(self, request: Request) -> None:
        """The request left this engine (LLMEngine.take_request): no guesses for it in the next step."""
        if self._last is not None:
            self._last.pop(request, None)

    def _count(self, request: Request, num_running: int) -> int:
        """How many guesses the request makes: the guess count's (adaptive), never past max_tokens
        (the last guess is followed by one more token) or the context."""
        config, params = self.config, request.sampling_params
        k = config.num_speculative_tokens
        if config.adaptive:
            acceptance = self.acceptance.setdefault(request, AcceptanceRate())
            k = num_guesses(acceptance, num_running, k, config.disable_by_batch_size)
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - request.num_output_tokens - 1)
        return min(k, self.max_model_len - request.num_tokens)

    def update(self, plan: SchedulerOutput, result: StepResult, stats: StepStats) -> None:
        """Take a step's result (after the output processor): acceptance, counts, the step's speed."""
        if not self.active:
            return
        counts = SpecDecodeCounts()
        for request, tokens in result.sampled.items():
            num_accepted = len(tokens.token_ids) - 1
            counts.record(tokens.num_guesses, num_accepted)
            self.acceptance.setdefault(request, AcceptanceRate()).update(tokens.depth, num_accepted)  # a tree: its deepest branch
        self.totals.add(counts)
        if plan.scheduled and len(result.sampled) == len(plan.scheduled):  # decodes only: comparable steps
            self.speed_gate.record(counts.num_drafts > 0, stats.num_generated, len(plan.scheduled),
                                   time.perf_counter() - self._step_start)
        self._last = result.sampled


def build_speculator(config: SpeculativeConfig, draft: DraftRunner | None, max_model_len: int,
                     sequences: Mapping[str, SequenceState], chains: Callable[[Request], bool]) -> Speculator:
    """The engine's speculator for its config (draft: the draft runner, with method draft, early-exit or mtp;
    chains: whether the target runner's chained passes decode a request, multi-step's)."""
    proposer: Proposer | None = None
    if config.method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, config.tree_width)
    elif config.method == "lookahead":
        proposer = LookaheadProposer(config.lookahead_ngram, config.lookahead_window if config.lookahead_full else 0,
                                     config.lookahead_guesses)
    elif config.method in ("draft", "early-exit", "mtp"):
        proposer = DraftProposer(draft, config.tree_width)
    elif config.method == "multi-step":
        proposer = MultiStepProposer(chains)
    return Speculator(config, proposer, max_model_len, sequences)
