"""Acceptance statistics of speculative decoding, as vLLM counts them. No tensors."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeCounts:
    """Counts with vLLM's names: verifications (a request with guesses in a step), guesses,
    accepted guesses, and accepted guesses by position ([i]: guess number i + 1)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_guesses: int, num_accepted: int) -> None:
        if num_guesses:
            self.num_drafts += 1
            self.num_draft_tokens += num_guesses
            self.num_accepted_tokens += num_accepted
            self._add_positions([1] * num_accepted)

    def add(self, other: SpecDecodeCounts) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self._add_positions(other.accepted_per_position)

    def _add_positions(self, counts: list[int]) -> None:
        self.accepted_per_position += [0] * (len(counts) - len(self.accepted_per_position))
        for i, count in enumerate(counts):
            self.accepted_per_position[i] += count

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def copy(self) -> SpecDecodeCounts:
        return SpecDecodeCounts(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                list(self.accepted_per_position))

    def since(self, earlier: SpecDecodeCounts) -> SpecDecodeCounts:
        """The counts added after `earlier` (a copy taken before)."""
        positions = [n - (earlier.accepted_per_position[i] if i < len(earlier.accepted_per_position) else 0)
                     for i, n in enumerate(self.accepted_per_position)]
        return SpecDecodeCounts(self.num_drafts - earlier.num_drafts, self.num_draft_tokens - earlier.num_draft_tokens,
                                self.num_accepted_tokens - earlier.num_accepted_tokens, positions)

    def summary(self) -> str:
        rate = self.acceptance_rate
        return (f"{self.num_drafts} drafts, {self.num_draft_tokens} guessed tokens, {self.num_accepted_tokens} accepted"
                f" ({'-' if rate is None else f'{rate:.0%}'}); accepted by position {self.accepted_per_position}")
