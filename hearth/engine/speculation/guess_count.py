"""How many guesses a request makes in a step, from its measured acceptance and the batch. No tensors.

`num_guesses`: the i-th guess pays off only when the i - 1 before it were
accepted, so it is worth about rate ** i tokens, where rate is the request's measured
acceptance rate: k guesses keep 1 + rate + ... + rate ** k tokens of the request. Each costs one
more row of the step: a share ROW_COST of a one-row step while decoding is bound by reading the
weights, and for B running requests the B - 1 rows beside it make the step dearer, so that a
guessed row weighs c = B ROW_COST / (1 + ROW_COST (B - 1)) of each request's one-token share of
the step. The count kept is the one of most tokens per cost, (1 + rate + ... + rate ** k) /
(1 + c k) (Leviathan et al.'s choice of the draft length), up to num_speculative_tokens; none
from disable_by_batch_size running requests on.
"""

from __future__ import annotations

from dataclasses import dataclass

# The cost of one more row in a decode step, as a share of a one-row step: 0.28 for SmolLM2 and
# 0.36 for the built-in pair (a row of the target and a pass of its draft) on the CPU at batch 1
# (docs/benchmarks.md, "where its time goes").
ROW_COST = 0.3
# A request's acceptance rate before its first verification: hopeful (guessing starts at several
# guesses, where a first step of one guess would be measured slower than plain decoding and keep
# SpeedGate from trying more), and weighing as little as two guesses against the evidence.
PRIOR_RATE, PRIOR_WEIGHT = 0.9, 2.0
# How fast the acceptance estimate and the measured speeds forget: the weight of the past at each update.
RATE_MEMORY = 0.8


@dataclass
class AcceptanceRate:
    """A sequence's recent share of accepted guesses: each accepted guess counts as a success, the
    first rejected one as a failure (guesses after it were never judged). Before the evidence, the
    prior: PRIOR_WEIGHT guesses of which a share PRIOR_RATE were accepted."""

    accepted: float = 0.0
    rejected: float = 0.0

    def update(self, num_guesses: int, num_accepted: int) -> None:
        if num_guesses:
            self.accepted = RATE_MEMORY * self.accepted + num_accepted
            self.rejected = RATE_MEMORY * self.rejected + (num_accepted < num_guesses)

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR_RATE * PRIOR_WEIGHT) / (self.accepted + self.rejected + PRIOR_WEIGHT)


def num_guesses(acceptance: AcceptanceRate, num_running: int, max_guesses: int, disable_by_batch_size: int) -> int:
    """Guesses worth making for one request (module docstring): 0 .. max_guesses; at least one
    while its acceptance has not been measured (a count of none would never measure it)."""
    if num_running >= disable_by_batch_size:
        return 0
    rate = acceptance.rate
    cost = num_running * ROW_COST / (1 + ROW_COST * (num_running - 1))
    best, best_value, expected = 0, 1.0, 1.0
    for k in range(1, max_guesses + 1):
        expected += rate ** k
        if expected / (1 + cost * k) > best_value:
            best, best_value = k, expected / (1 + cost * k)
    unmeasured = acceptance.accepted + acceptance.rejected == 0
    return max(best, 1) if unmeasured else best
