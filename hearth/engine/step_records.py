"""The records a step hands between the engine, the runner and the output processing: what a request
gets to compute (ScheduledSequence), what it keeps (SampledTokens, StepResult), and a step between its
laying out and its reading (StagedStep, LaunchedStep: asynchronous scheduling holds them across a
step, engine/overlap.py). No tensors are built here; the runner fills them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hearth.backend import StepInputs
from hearth.backend.transfer import HostCopy
from hearth.engine.request import Request
from hearth.engine.sampler import SamplerOutput

if TYPE_CHECKING:  # (the runner lays the entries out)
    from hearth.engine.runner import BatchEntry

Alternatives = tuple[list[int], list[float]]  # top-k (token ids, logprobs), best first


@dataclass
class ScheduledSequence:
    """One request's share of a step, as the engine hands it to the runner (no tensors)."""

    request: Request
    num_new_tokens: int  # from num_computed_tokens on; its guesses (spec_token_ids) are the last ones
    generator: torch.Generator | None = None  # a seeded request's own
    matcher: object | None = None  # the llguidance.LLMatcher of a structured-output request
    score_prompt: bool = False  # return the logprobs of the prompt tokens this step computes
    spec_generator: torch.Generator | None = None  # a seeded request's randomness for verifying guesses
    # the tokens its next positions must be, whatever the model says (a thinking budget's close marker):
    # the row at depth d of its guesses draws forced[d]
    forced: list[int] = field(default_factory=list)


@dataclass
class SampledTokens:
    """What one request keeps from a step: its verified guesses that were right, then one draw."""

    token_ids: list[int]
    logprobs: list[float]  # of each token under the raw distribution
    top_logprobs: list[Alternatives] | None  # per token, when the request asked for logprobs
    num_guesses: int  # guesses verified this step; len(token_ids) - 1 of them were accepted
    depth: int  # their longest path (a chain's: num_guesses; a token tree's: fewer)
    # the draw of every verified row (the last token's, then each guess's): past the first
    # rejected guess, what the model gave after a wrong one (lookahead's Jacobi iteration)
    row_token_ids: list[int]


@dataclass
class StepResult:
    sampled: dict[Request, SampledTokens]  # the requests that reached the end of their tokens
    prompt_logprobs: dict[Request, list[dict[int, float]]]  # per scored prompt token: {id: logprob}


@dataclass
class StagedStep:
    """A step's host side (ModelRunner.stage): read from its requests on the engine's thread."""

    sequences: list[ScheduledSequence]
    entries: list[BatchEntry]
    sampled: list[ScheduledSequence]  # those that reach the end of their tokens
    sample_rows: list[int]  # their rows (each guess's and the one after)
    scored: list[tuple[Request, int, int, int]]  # prompt scoring: (request, first row, start, count)
    inputs: StepInputs
    # per pending token, its row here and its row among the step before's draws (int64 on the host)
    feeds: tuple[torch.Tensor, torch.Tensor] | None
    draw_rows: dict[Request, int]  # each sampling request's draw: its row of the sampler's sampled_token_ids

    def calm_rows(self) -> dict[int, float]:
        """The rows that may leave the model early (CALM, hearth/model/calm.py) and their thresholds:
        each decode's one row whose request has a calm_threshold; none where the step puts image
        embeddings in (CALM's pass takes none)."""
        if self.inputs.embeds is not None:
            return {}
        return {self.sample_rows[self.draw_rows[s.request]]: s.request.sampling_params.calm_threshold
                for s in self.sampled if s.request.sampling_params.calm_threshold is not None and s.num_new_tokens == 1}


@dataclass
class LaunchedStep:
    """A step whose model pass and draws are started (ModelRunner.launch); `collect` reads them."""

    sampled: list[ScheduledSequence]
    out: SamplerOutput | None
    rewinds: dict[Request, torch.Tensor]  # seeded generators' states before the step's draws
    scoring: list[tuple[Request, list[int]]]
    host: HostCopy
    draw_rows: dict[Request, int]
