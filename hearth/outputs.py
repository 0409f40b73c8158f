"""What generation returns, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

# One position's logprobs: {token_id: logprob} holding the chosen token and the top-N alternatives.
PositionLogprobs = dict[int, float]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass(frozen=True)
class CascadeRecord:
    """A request's way through a cascade (hearth/engine/cascade.py): whether, and after which of its tokens,
    it moved from the small model to the large one."""

    deferred_at: int | None = None  # output tokens the small model drew (the last one under the threshold); None: stayed
    confidence: float | None = None  # that last token's probability under the small model

    @property
    def deferred(self) -> bool:
        return self.deferred_at is not None

    def summary(self, num_tokens: int) -> dict:
        """The record as the API shows it, for an output of num_tokens tokens."""
        small = num_tokens if self.deferred_at is None else self.deferred_at
        return {"deferred": self.deferred, "deferred_at_token": self.deferred_at, "confidence": self.confidence,
                "small_model_tokens": small, "large_model_tokens": num_tokens - small}


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)
    cascade: CascadeRecord | None = None  # a cascade's request (hearth/engine/cascade.py): where it moved
