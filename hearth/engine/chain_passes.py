"""The target's own chained passes: multi-step decoding's tensor side (speculation/multi_step.py plans it).

A step of multi-step decoding carries, per greedy request, k placeholder guesses after its one new
token: the scheduler gave them their slots, as it gives any guesses. Here they never reach the
sampler: the cpu backend runs k + 1 greedy passes in one kernel call (`CpuBackend.greedy_passes`,
cpu_decode.py), the first over each request's new token, each later one over a row per request fed
the token the pass before chose, its K/V written to the next slot. The passes' choices go back as
the verification of the placeholders would: every guess kept (each is the model's own argmax after
the tokens before it, exactly what plain decoding would have drawn there), then one more token.
The output processing keeps them up to a stop, as a speculative step's, and gives back the slots
after it. Where the kernel cannot run the step (a prompt in it, a request that needs the sampler),
None: the runner verifies the placeholders as guesses (the tokens are the same; the guesses' rows
are spent).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from hearth.backend.cpu import CpuBackend
from hearth.engine.request import Request
from hearth.engine.sampler import SamplerOutput
from hearth.engine.step_records import BatchEntry, StagedStep
from hearth.engine.step_sampling import drawn_in_step
from hearth.errors import HearthError
from hearth.sampling_params import SamplingType

if TYPE_CHECKING:
    from hearth.engine.runner import ModelRunner


def multi_step_on(runner: ModelRunner, method: str | None) -> bool:
    """Whether the runner's steps chain their guesses' passes (speculative_method multi-step); refused by name
    where the cpu backend's greedy kernel cannot run the model."""
    if method != "multi-step":
        return False
    if not (isinstance(runner.backend, CpuBackend) and runner.own_pass and runner.lora is None
            and runner.backend.greedy_path(runner.model) is not None):
        raise HearthError(f"speculative_method multi-step runs on the cpu backend's greedy kernel, which does not run "
                          f"this {runner.model.config.architecture} model on the {runner.backend.name} backend "
                          f"(layers with states, a norm with an offset, divided logits, LoRA adapters or layers "
                          f"split between processes are not on it)")
    return True


def can_chain(runner: ModelRunner, request: Request) -> bool:
    """Whether the runner's chained passes can decode the request: a greedy one that needs nothing of the
    sampler, on an engine whose runner chains (multi_step_on)."""
    params = request.sampling_params
    return (runner.chains_guesses and params.sampling_type == SamplingType.GREEDY
            and params.structured_outputs is None and params.thinking_token_budget is None
            and drawn_in_step(params, request.num_output_tokens))


def chained_draws(runner: ModelRunner, staged: StagedStep) -> SamplerOutput | None:
    """The step's draws by chained passes, in the rows' order of the step (each request's own row, then
    its guesses'), every guess accepted; None where they cannot run it (module docstring)."""
    sampled = staged.sampled
    if (len(sampled) != len(staged.sequences) or staged.feeds is not None or staged.scored
            or any(not s.request.spec_token_ids or s.num_new_tokens != 1 + len(s.request.spec_token_ids)
                   or s.matcher is not None or s.generator is not None or s.forced
                   or s.request.spec_tree is not None or not can_chain(runner, s.request) for s in sampled)):
        return None
    passes = _passes(staged.entries)
    every = runner.prepare([entry for rows in passes for entry, _ in rows])
    first = every.sequences(0, len(passes[0]))
    later = every.sequences(len(passes[0]), every.num_seqs) if len(passes) > 1 else None
    feeds = []  # per later pass, per row: the row of its request in the pass before
    for before, rows in zip(passes, passes[1:]):
        row_of = {i: row for row, (_, i) in enumerate(before)}
        feeds.append([row_of[i] for _, i in rows])
    logprobs = torch.empty(every.num_seqs)
    choices = runner.backend.greedy_passes(runner.model, first, later, feeds, runner.kv_caches, logprobs)
    if choices is None:
        return None
    order = torch.from_numpy(_step_rows(passes, staged.entries))  # the step's rows, each its index in the choices
    num_guesses = sum(len(e.token_ids) - 1 for e in staged.entries)
    return SamplerOutput(choices[order], logprobs[order], None,
                         accepted=torch.ones(num_guesses, dtype=torch.bool))


def _passes(entries: list[BatchEntry]) -> list[list[tuple[BatchEntry, int]]]:
    """Per pass, its rows: (a one-token entry, the index of its request's entry). Pass 0 is each request's
    new token; pass p the requests with p guesses or more, at the position of their guess p (its token a
    placeholder: the kernel feeds the choice before it)."""
    depth = max(len(e.token_ids) for e in entries)
    return [[(BatchEntry(e.token_ids[:1] if p == 0 else [0], e.num_computed_tokens + p, e.block_table), i)
             for i, e in enumerate(entries) if len(e.token_ids) > p] for p in range(depth)]


def _step_rows(passes: list[list[tuple[BatchEntry, int]]], entries: list[BatchEntry]) -> np.ndarray:
    """Where each row of the step (entries' tokens end to end) sits in the passes' choices (pass-major)."""
    at, start = {}, 0
    for p, rows in enumerate(passes):
        for j, (_, i) in enumerate(rows):
            at[i, p] = start + j
        start += len(rows)
    return np.array([at[i, p] for i, e in enumerate(entries) for p in range(len(e.token_ids))], dtype=np.int64)
