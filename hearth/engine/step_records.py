"""The records a step hands between the engine, the runner and the output processing: what a request
gets to compute (ScheduledSequence), what it keeps (SampledTokens, StepResult), and a step between its
laying out and its reading (StagedStep, LaunchedStep: asynchronous scheduling holds them across a
step, engine/overlap.py); one sequence's rows of a pass as the runner lays them out (BatchEntry). No
tensors are built here; the runner fills them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hearth.backend import StepInputs
from hearth.backend.transfer import HostCopy
from hearth.engine.request import ImageSpan, Request
from hearth.engine.sampler import SamplerOutput
from hearth.model.calm import CalmCheck

Alternatives = tuple[list[int], list[float]]  # top-k (token ids, logprobs), best first


@dataclass
class BatchEntry:
    token_ids: list[int]  # the new tokens of this sequence this step
    num_computed_tokens: int  # tokens already in the cache before them
    block_table: list[int]
    # a token tree (hearth/engine/speculation/token_tree.py): where its region begins, and per new token a mask
    # of the region's positions it sees (bit j: tree_start + j); None: causal
    tree: tuple[int, list[int]] | None = None
    state_slot: int | None = None  # a hybrid model's: the sequence's slot in the state cache
    # a hybrid model's sequence verifying guesses: the first of the state slots that keep its states after each
    # row but the last (hearth/backend/state_ops.py), so that rejected guesses can be taken back out
    state_snapshot: int | None = None
    lora_slot: int = -1  # the LoRA adapter's slot in the model's LoraBank (-1: none)
    # rows (from the entry's first) that take image embeddings, and the values (images.step_embeddings)
    embeds: tuple[np.ndarray, list[torch.Tensor]] | None = None
    images: Sequence[ImageSpan] = ()  # the request's images (an M-RoPE model's positions: images.mrope_positions)


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


def rows_of_sequences(sequences: list[ScheduledSequence], rows: torch.Tensor
                      ) -> Iterator[tuple[Request, torch.Tensor]]:
    """Each sequence's request and its share of a step's rows [T, ...] (its new tokens', end to end in order)."""
    start = 0
    for seq in sequences:
        yield seq.request, rows[start : start + seq.num_new_tokens]
        start += seq.num_new_tokens


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
    # a hybrid model's verification: the first of the state snapshot rows, the states after its last token and
    # each guess but the last (hearth/backend/state_ops.py), from which the engine puts back the states at the
    # last guess kept (LLMEngine._roll_back_states); -1: none
    state_snapshot: int = -1


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

    def calm_rows(self) -> dict[int, CalmCheck]:
        """The rows that may leave the model early (CALM, hearth/model/calm.py) and their rules:
        each decode's one row whose request has a calm_threshold; none where the step puts image
        embeddings in (CALM's pass takes none)."""
        if self.inputs.embeds is not None:
            return {}
        return {self.sample_rows[self.draw_rows[s.request]]: CalmCheck(
                    params.calm_threshold, params.calm_measure, params.calm_saturation_bound)
                for s in self.sampled if (params := s.request.sampling_params).calm_threshold is not None
                and s.num_new_tokens == 1}


@dataclass
class LaunchedStep:
    """A step whose model pass and draws are started (ModelRunner.launch); `collect` reads them."""

    sampled: list[ScheduledSequence]
    out: SamplerOutput | None
    rewinds: dict[Request, torch.Tensor]  # seeded generators' states before the step's draws
    scoring: list[tuple[Request, list[int]]]
    host: HostCopy
    draw_rows: dict[Request, int]
