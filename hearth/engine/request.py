"""One request's bookkeeping: its tokens, how many of them are in the KV cache, its blocks.

No tensors here. The scheduler and the block manager read and write these fields; the
engine appends sampled tokens and sets the timing fields it owns (first_token_time).

Engine-specific state (detokenizer, stop-string state...) does not live here. The engine
may subclass `Request` (`@dataclass(slots=True, eq=False) class EngineRequest(Request)`)
or keep a side dict keyed by `request_id`: the scheduler never copies or rebuilds a
request, so the object it hands back in `SchedulerOutput` is the one the engine added.

Requests compare and hash by identity (`eq=False`): two requests with equal fields are
still two requests, and a request can be a dict key.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # blocks taken back; waits to be recomputed from its tokens
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token or a stop string
    FINISHED_LENGTH = enum.auto()  # max_tokens, or no room left for the sequence
    FINISHED_ABORTED = enum.auto()  # the client went away or cancelled

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI / vLLM finish_reason string, None while not finished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False)
class ImageSpan:
    """One image of a prompt (hearth/engine/images.py): its placeholder tokens lie in positions
    [start, end) (with the tile markers between them), and its num_embeds embeddings take the places
    of those placeholders, in order."""

    start: int
    end: int
    content_hash: bytes  # 16 bytes of the image's pixels and size: the encoder cache's and prefix cache's key
    pixel_values: Any  # the processor's numpy array (its layout the family's): what the encoder reads
    num_embeds: int
    # M-RoPE (ModelConfig.mrope_section): the image's tokens as a grid of rows x columns, each at its row's
    # and column's positions, the text after it one past the grid's longer side; None: one position a token
    grid: tuple[int, int] | None = None
    # the runs of its placeholders, each [first, end) (an image's tiles or crops, the text between them apart):
    # with ModelConfig.bidirectional_images each run's tokens attend to each other both ways and no chunk ends
    # inside one; empty: [start, end) is one run
    runs: tuple[tuple[int, int], ...] = ()
    token_id: int | None = None  # its placeholder token: None, the model's image token; a video's frame group's, its own

    def blocks(self) -> tuple[tuple[int, int], ...]:
        """The runs of its placeholders (`runs`), [start, end) where it has none."""
        return self.runs or ((self.start, self.end),)

    @property
    def key(self) -> tuple[int, int]:
        """The content hash as two int64s, for the prefix cache's block keys (kv_cache.py)."""
        return (int.from_bytes(self.content_hash[:8], "little", signed=True),
                int.from_bytes(self.content_hash[8:16], "little", signed=True))


@dataclass(slots=True, eq=False, weakref_slot=True)  # weak references: per-request state kept beside it
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any = None  # opaque to the scheduler; the engine reads max_tokens etc.
    arrival_time: float = field(default_factory=time.monotonic)
    # vLLM's priority: a lower value is served first (admission, and preempted last); 0 by default
    priority: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose K/V are in the cache. Positions [0, num_computed_tokens) are readable
    # by attention; the next step computes [num_computed_tokens, +num_new_tokens).
    num_computed_tokens: int = 0
    # Tokens of the prompt found in the prefix cache at first scheduling (-1 before).
    num_cached_tokens: int = -1
    # KV block ids, in order: token position p lives in block_table[p // block_size].
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # A hybrid model's: the request's slot in the state cache while it runs (-1: none; state_slots.py).
    state_slot: int = -1
    # With state checkpoints (a hybrid's prefix caching): where its cached K/V ended at admission, past the
    # checkpoint it started from (0: not past it); a checkpoint is taken there (state_slots.py).
    checkpoint_junction: int = 0
    # Compute every prompt position even if cached (prompt logprobs need their logits);
    # the request's own blocks still enter the prefix cache for others.
    skip_prefix_cache: bool = False
    # Slots after its tokens that a step in which it samples may write and that are given back after
    # the step (contrastive search's candidates, one row each: runner.py).
    num_scratch_slots: int = 0
    # The LoRA adapter it runs with: the engine's number for that adapter's load (0: none). Its prefix
    # cache is its own (the chain of its blocks starts at -lora_id, hearth/engine/kv_cache.py).
    lora_id: int = 0
    # The prompt's images, in order (none for a text prompt): their embeddings enter in place of their
    # placeholder tokens, and their content hashes are part of the prefix cache's keys of their blocks.
    images: list[ImageSpan] = field(default_factory=list)
    # Drawn tokens not appended yet: with asynchronous scheduling (overlap.py) the step after the one
    # that drew them runs before the host reads them, its input the draw still on the device (0 or 1).
    num_pending_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    output_token_ids: list[int] = field(default_factory=list, init=False)
    # Guessed next tokens (speculative decoding) to verify in the next step, after the last
    # real token; not part of all_token_ids until verified. The scheduler may trim them.
    spec_token_ids: list[int] = field(default_factory=list, init=False)
    # When the guesses form a token tree (several branches verified at once): each guess's parent,
    # -1 for the last real token, else an earlier guess's index. Read for the first
    # len(spec_token_ids) only: the scheduler trims guesses from the end, and parents come before
    # their children. Empty: a chain.
    spec_parents: list[int] = field(default_factory=list, init=False)
    # the order the scheduler received it in (its tie-break between equal priorities); set by add_request
    arrival_order: int = field(default=0, init=False)
    # prompt + output in one list, appended to, so all_token_ids is O(1)
    _all_token_ids: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self._all_token_ids = list(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens. Read-only by convention: use append_output_token."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    @property
    def spec_tree(self) -> list[int] | None:
        """Each guess's parent (spec_parents) when the guesses form a tree; None for a chain."""
        return self.spec_parents[: len(self.spec_token_ids)] if self.spec_parents else None

    def set_guesses(self, token_ids: list[int], parents: list[int] | None = None) -> None:
        """The guesses to verify next: a chain, or a tree given each one's parent."""
        self.spec_token_ids = list(token_ids)
        self.spec_parents = list(parents or [])

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
