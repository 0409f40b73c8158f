"""Embeddings: prompts run through the model once, no sampling, their final hidden states pooled.

    vectors = embed(engine, [[ids...], ...])     # on the engine's thread: [N, hidden] float32, unit length

Each batch borrows KV blocks from the engine's BlockManager for one forward pass and gives them
back at once (nothing enters the prefix cache): the KV cache is where attention keeps a
prompt's keys and values, and borrowing its blocks keeps every backend (CUDA graphs included)
on the cache it was built for. Pooling is the family's (hidden states after the final norm):
the last token's for the causal decoders fine-tuned as embedders (Llama, Mistral and Qwen
ones, e5-mistral, Qwen3-Embedding), the mean over tokens for Gemma (EmbeddingGemma); vectors
are L2-normalised, as OpenAI's are. This module batches and borrows; the runner runs the
batches and pools (ModelRunner.pooled).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing
from typing import TYPE_CHECKING

from hearth.engine.request import Request
from hearth.engine.step_records import BatchEntry
from hearth.errors import HearthError, RequestError

if TYPE_CHECKING:
    import torch

    from hearth.engine.engine import LLMEngine

MEAN_POOLED = ("gemma", "gemma2", "gemma3")  # EmbeddingGemma's family; every other decoder: the last token


class CacheFull(HearthError):
    """The running requests hold the KV blocks an embedding batch needs (retry later)."""


def pooling_of(architecture: str) -> str:
    return "mean" if architecture in MEAN_POOLED else "last"


def embed(engine: LLMEngine, prompts: list[list[int]]) -> torch.Tensor:
    """The prompts' pooled embeddings [N, hidden] on the CPU; batches of up to max_num_batched_tokens tokens."""
    for ids in prompts:
        if not ids:
            raise RequestError("an input to embed is empty")
        if len(ids) > engine.max_model_len:
            raise RequestError(f"an input has {len(ids)} tokens, more than the model's context window "
                               f"of {engine.max_model_len} tokens")
    budget = max(engine.config.scheduler.max_num_batched_tokens, max(map(len, prompts)))
    engine.wait_for_pass()  # (a step in flight may still write into blocks freed for these)
    engine.wake_up()
    # closing: a batch's blocks go back even when the runner stops in the middle of it
    with closing(_batches(engine, prompts, budget)) as batches:
        return engine.runner.pooled(batches, pooling_of(engine.model_config.architecture))


def _batches(engine: LLMEngine, prompts: list[list[int]], budget: int) -> Iterator[list[BatchEntry]]:
    """The prompts in batches of up to `budget` tokens, each batch's blocks borrowed while the runner
    runs it (given back when it asks for the next)."""
    batch = []
    for ids in prompts:
        if batch and sum(map(len, batch)) + len(ids) > budget:
            yield from _borrowed(engine, batch)
            batch = []
        batch.append(ids)
    yield from _borrowed(engine, batch)


def _borrowed(engine: LLMEngine, batch: list[list[int]]) -> Iterator[list[BatchEntry]]:
    blocks, states = engine.block_manager, engine.scheduler.state_slots  # (states: a hybrid model's)
    borrowed = [Request(f"embed-{i}", ids) for i, ids in enumerate(batch)]
    try:
        for request in borrowed:
            if not blocks.allocate_slots(request, len(request.prompt_token_ids)) or not (
                    states is None or states.allocate(request)):
                raise CacheFull("the KV cache is full with running requests; retry the embedding later")
        engine.move_cache_contents()  # the cached blocks it evicted go to the tiers before they are written over
        yield [BatchEntry(r.prompt_token_ids, 0, r.block_table, state_slot=None if states is None else r.state_slot)
               for r in borrowed]
    finally:
        for request in borrowed:
            blocks.free(request)
            if states is not None:
                states.free(request)
