"""CascadeEngine: a request starts on a small model and moves to a large one where the small model is unsure.

`LLM(cascade=("small.gguf", "large.gguf"), defer_threshold=T)`, `hearth serve|generate --cascade SMALL,LARGE
--defer-threshold T` (docs/cascade.md). The small model's confidence in a token is the probability it gave the
token it drew (under its own softmax, the number logprobs report: for greedy decoding the max softmax
probability). After a token drawn with a probability under T the request stops on the small model (what a
speculative step drew after that token is dropped) and moves, between two steps, to the large model: its
tokens so far, prompt and output, are computed there as a preempted request's are (one prefill), and the
large model draws every later token. The request moves whole (LLMEngine.take_request / adopt_request): its
output text, detokenizer, stop-string and grammar state, seeded generators and counts go on where they were,
so a stream goes on across the move as if one model had drawn everything, and max_tokens, min_tokens, stop
strings and penalties count the whole output. A request with n > 1 samples moves as a group, after any of
its samples drew such a token. A token that ends the request (EOS, a stop, max_tokens) ends it there.

Two LLMEngines under one request interface, stepped one after the other on the caller's thread: the server's
AsyncEngine and LLM drive it as they drive one LLMEngine. Why here, not in the fleet (which runs engines
side by side, each a server of its own): a move hands one request's state from one engine to the other
between two steps, which needs both on one thread, and the offline LLM and `hearth generate` use it too.
Everything else (the tokenizer, context length, stats of the KV cache and the scheduler, embeddings) is the
small engine's: a cascade is served under the small model's facts, its own counts aside (cascade_totals).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

from hearth.engine.engine import LLMEngine, StepFailed
from hearth.engine.output_processor import StepStats
from hearth.engine_config import CascadeConfig, EngineConfig
from hearth.errors import HearthError, RequestError
from hearth.lora_request import LoRARequest
from hearth.outputs import CascadeRecord, RequestOutput
from hearth.sampling_params import SamplingParams

logger = logging.getLogger("hearth")


@dataclasses.dataclass
class CascadeCounts:
    """Finished requests of a cascade: how many, how many moved to the large model, and the output tokens
    each model drew."""

    num_requests: int = 0
    num_deferred: int = 0
    num_small_tokens: int = 0
    num_large_tokens: int = 0

    def copy(self) -> CascadeCounts:
        return dataclasses.replace(self)


class CascadeEngine:
    accepts_images = False  # the large model may not read them: the server refuses images with a 400

    def __init__(self, small: LLMEngine, large: LLMEngine, defer_threshold: float,
                 config: EngineConfig | None = None) -> None:
        """Two built engines of one vocabulary; config: the cascade's own (the engines' have no cascade)."""
        if small.tokenizer.token_bytes() != large.tokenizer.token_bytes():
            raise HearthError(f"a cascade's two models need one vocabulary: {small.model_path.name} has "
                              f"{small.model_config.vocab_size} tokens, {large.model_path.name} "
                              f"{large.model_config.vocab_size}, not the same ones")
        if large.max_model_len < small.max_model_len:
            raise HearthError(f"the large model's context ({large.max_model_len} tokens) is shorter than the small "
                              f"one's ({small.max_model_len}): give --max-model-len")
        if not 0 <= defer_threshold <= 1:
            raise HearthError(f"defer_threshold is a probability, in [0, 1]; got {defer_threshold}")
        self.small, self.large = small, large
        self.defer_threshold = defer_threshold
        self.config = config or small.config
        # log(0) = -inf: no token is under it
        small.output_processor.floor_logprob = math.log(defer_threshold) if defer_threshold > 0 else -math.inf
        self.cascade_totals = CascadeCounts()
        self.records: dict[str, CascadeRecord] = {}  # the unfinished requests' (by request id)
        self.last_step = StepStats()
        self.failed: StepFailed | None = None  # the large model's failed step, raised by the next step()

    @classmethod
    def build(cls, model: str | Path | None, config: EngineConfig, progress: bool = True) -> CascadeEngine:
        """The cascade of config.cascade (models SMALL, LARGE), each engine with the rest of config."""
        if model is not None:
            raise HearthError(f"give the models either as MODEL ({model}) or as a cascade (SMALL,LARGE), not both")
        small_path, large_path = config.cascade.models
        own = dataclasses.replace(config, cascade=CascadeConfig())
        # the small model runs synchronously: a request leaves it between two steps, none in flight
        synchronous = dataclasses.replace(own, scheduler=dataclasses.replace(config.scheduler, async_scheduling=False))
        small = LLMEngine(small_path, synchronous, progress)
        try:
            return cls(small, LLMEngine(large_path, own, progress), config.cascade.defer_threshold, config)
        except BaseException:
            small.close()
            raise

    def __getattr__(self, name: str):
        """The small engine's facts and services (tokenizer, context length, KV cache stats, embeddings)."""
        return getattr(self.small, name)

    # ---- requests

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, lora_request: LoRARequest | None = None,
                    multi_modal_data: dict[str, list] | None = None,
                    mm_processor_kwargs: dict[str, Any] | None = None) -> str:
        """LLMEngine.add_request, on the small model; no images (the large model may not read them)."""
        if multi_modal_data is not None or mm_processor_kwargs is not None:
            raise RequestError("a cascade takes text prompts only: no images (multi_modal_data, mm_processor_kwargs)")
        if request_id is not None and request_id in self.records:
            raise RequestError(f"request id {request_id!r} is already in use")
        request_id = self.small.add_request(request_id, prompt, params, arrival_time, priority, lora_request)
        self.records[request_id] = CascadeRecord()
        return request_id

    def abort_request(self, request_id: str) -> bool:
        self.records.pop(request_id, None)
        return self.small.abort_request(request_id) or self.large.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return (self.failed is not None or self.small.has_unfinished_requests()
                or self.large.has_unfinished_requests())

    def step(self) -> list[RequestOutput]:
        """A step of the small model (then the moves its unsure tokens call for) and one of the large model.
        StepFailed as LLMEngine.step raises it; the large model's comes a step late, after the small
        model's outputs of its step (a finished one among them must reach its caller)."""
        if self.failed is not None:
            failed, self.failed = self.failed, None
            raise failed
        outputs: list[RequestOutput] = []
        stats = []
        if self.small.has_unfinished_requests():
            outputs += self.small.step()
            stats.append(self.small.last_step)
            self._move_unsure()
        if self.large.has_unfinished_requests():
            try:
                outputs += self.large.step()
            except StepFailed as e:  # its requests are aborted already
                self.failed = e
                for request_id in e.request_ids:
                    self.records.pop(request_id, None)
            stats.append(self.large.last_step)
        self.last_step = stats[0].then(stats[1]) if len(stats) == 2 else stats[0] if stats else StepStats()
        for output in outputs:
            self._record(output)
        return outputs

    def _move_unsure(self) -> None:
        """Move each request whose last token the small model drew under the threshold to the large model."""
        below, self.small.output_processor.below_floor = self.small.output_processor.below_floor, {}
        for request_id, probability in below.items():
            group = self.small.take_request(request_id)
            try:
                self.large.adopt_request(group)
            except RequestError as e:  # (its context does not fit the large model's KV cache): it stays
                logger.warning("request %s stays on the small model of its cascade: %s", request_id, e)
                self.small.adopt_request(group)
                continue
            drawn = max(len(s.request.output_token_ids) for s in group.sequences)
            self.records[request_id] = CascadeRecord(drawn, probability)

    def _record(self, output: RequestOutput) -> None:
        """The request's record on its output; counted and logged once it finished."""
        record = self.records.get(output.request_id, CascadeRecord())
        output.cascade = record
        if not output.finished:
            return
        self.records.pop(output.request_id, None)
        num_tokens = max((len(c.token_ids) for c in output.outputs), default=0)
        summary = record.summary(num_tokens)
        counts = self.cascade_totals
        counts.num_requests += 1
        counts.num_deferred += record.deferred
        counts.num_small_tokens += summary["small_model_tokens"]
        counts.num_large_tokens += summary["large_model_tokens"]
        if record.deferred:
            logger.info("cascade request %s: moved to the large model after %d tokens (p=%.3f < %g); %d tokens in "
                        "all", output.request_id, record.deferred_at, record.confidence, self.defer_threshold,
                        num_tokens)
        else:
            logger.info("cascade request %s: %d tokens, all on the small model", output.request_id, num_tokens)

    # ---- both engines

    def sleep(self) -> int:
        return self.small.sleep() + self.large.sleep()

    def wake_up(self) -> None:
        self.small.wake_up()
        self.large.wake_up()

    def close(self) -> None:
        self.small.close()
        self.large.close()
