"""The thinking budget: after N tokens inside a reply's thinking section, the engine closes it.

A request with a budget (SamplingParams.thinking_token_budget, else the engine's reasoning_budget)
on an engine with a reasoning format (hearth/reasoning.py) gets a `ThinkingBudget`. It follows the
reply token by token: the section opens with the format's start marker (written by the model, or
already by the prompt's template), every token after it counts, and when N have been written with
the section still open, `forced` holds the tokens of the format's `close` marker: the runner lets
the sampler draw nothing else at those positions (llama.cpp's --reasoning-budget, vLLM's
thinking_token_budget). The answer follows, sampled as usual. No tensors here.
"""

from __future__ import annotations

from dataclasses import dataclass

from hearth.reasoning import ReasoningFormat
from hearth.tokenizer import Tokenizer


@dataclass(frozen=True)
class ThinkingMarkers:
    """A reasoning format's markers as token ids of the engine's tokenizer."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    close: tuple[int, ...]

    @classmethod
    def of(cls, fmt: ReasoningFormat, tokenizer: Tokenizer) -> ThinkingMarkers:
        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        return cls(ids(fmt.start), ids(fmt.end), ids(fmt.close))


def _ends_with(ids: list[int], marker: tuple[int, ...], end: int | None = None) -> bool:
    end = len(ids) if end is None else end
    return end >= len(marker) and tuple(ids[end - len(marker):end]) == marker


def _opened(prompt_ids: list[int], markers: ThinkingMarkers) -> bool:
    """The prompt leaves a section open: its last start marker has no end marker after it."""
    n = len(markers.start)
    for at in range(len(prompt_ids), n - 1, -1):
        if _ends_with(prompt_ids, markers.end, at):
            return False
        if _ends_with(prompt_ids, markers.start, at):
            return True
    return False


class ThinkingBudget:
    """One sequence's count of thinking tokens and the closing tokens it is owed."""

    def __init__(self, markers: ThinkingMarkers, budget: int, prompt_ids: list[int]) -> None:
        self.markers, self.budget = markers, budget
        self.thinking = False
        self.count = 0  # tokens written inside the open section
        self.forced: list[int] = []  # the tokens the next positions must be (the close marker's rest)
        if _opened(prompt_ids, markers):
            self._open()

    def _open(self) -> None:
        self.thinking, self.count = True, 0
        if self.budget == 0:
            self.forced = list(self.markers.close)

    def append(self, token_id: int, output_ids: list[int]) -> bool:
        """Take the token just appended (output_ids ends with it); True when it used up the budget,
        so that the tokens after it must be the close marker's (a step that sampled more, verified
        guesses, keeps none of them)."""
        if self.forced:
            self.forced.pop(0)
            self.thinking = bool(self.forced)
            return False
        if not self.thinking:
            if _ends_with(output_ids, self.markers.start):
                self._open()
                return bool(self.forced)
            return False
        if _ends_with(output_ids, self.markers.end):
            self.thinking = False
            return False
        self.count += 1
        if self.count >= self.budget:
            self.forced = list(self.markers.close)
            return True
        return False
