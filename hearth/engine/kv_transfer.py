"""KV handed between engines (hearth/fleet/disaggregated.py): LLMEngine.export_kv and import_kv.

A prefill engine exports the K/V of a prompt's cached full blocks; a decode engine enters them
into its prefix cache, so that a request with that prompt finds them computed. A hybrid model's
blocks travel with the state checkpoint at the end of the last of them (state_slots.py): the
export stops at the last cached block that has one, and the import enters that checkpoint beside
the blocks, so that the decode engine starts after them as after any prefix-cache hit. Functions of
the engine (bound as its methods); the tensors are the runner's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hearth.errors import RequestError

if TYPE_CHECKING:
    from hearth.engine.engine import LLMEngine


def export_kv(engine: LLMEngine, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """The K/V of the cached full blocks that start `token_ids` (short of its last token), "kv":
    [attention layers, 2, tokens, kv_heads, head_dim], tokens a multiple of the block size (maybe 0);
    for a hybrid model up to the last block with a state checkpoint, and that checkpoint's states
    (runner.state_tensors' names, each [*shape]; none without blocks)."""
    _check_kv_local(engine)
    engine.wait_for_pass()
    engine.wake_up()
    blocks, checkpoints = engine.block_manager.lookup(token_ids), engine.block_manager.checkpoints
    if engine.model_config.is_hybrid:
        engine.move_cache_contents()  # the checkpoints the last step took, copied in
        blocks = blocks[:checkpoints.prefix_end([engine.block_manager.blocks[b].content_id for b in blocks])]
    tensors = {"kv": engine.runner.read_kv(blocks)}
    if engine.model_config.is_hybrid and blocks:
        slot = checkpoints.slot(engine.block_manager.blocks[blocks[-1]].content_id)
        tensors |= {name: state[slot].cpu() for name, state in engine.runner.state_tensors().items()}
    return tensors


def import_kv(engine: LLMEngine, token_ids: list[int], tensors: dict[str, torch.Tensor]) -> int:
    """Enter the blocks of `tensors` (export_kv's, computed elsewhere for `token_ids`) into the
    engine's prefix cache, so that a request with that prompt finds them computed; returns the
    tokens entered (blocks already cached here, or with no room left, are not)."""
    _check_kv_local(engine)
    runner, block_size, kv = engine.runner, engine.config.cache.block_size, tensors.get("kv")
    caches = runner.attention_caches()
    if (kv is None or kv.dim() != 5 or kv.shape[:2] != (len(caches), 2) or kv.shape[2] % block_size
            or kv.shape[3:] != caches[0][0].shape[1:]):
        raise RequestError(f"KV of shape {None if kv is None else tuple(kv.shape)} does not fit this engine's cache "
                           f"({len(caches)} attention layers, blocks of {block_size}, {tuple(caches[0][0].shape[1:])})")
    states = _checked_states(engine, tensors) if kv.shape[2] else {}
    engine.wait_for_pass()
    engine.wake_up()
    covered = token_ids[: kv.shape[2] + 1]  # the blocks kv holds, and one more token
    entered = engine.block_manager.import_prefix(covered)
    engine.move_cache_contents()  # the blocks it evicted, before their K/V are written over; steps' state copies
    if entered:
        runner.write_kv_blocks(entered, kv)
    chain = engine.block_manager.lookup(covered)
    if states and len(chain) * block_size == kv.shape[2]:  # every block is cached here: its checkpoint beside it
        slot = engine.block_manager.checkpoints.enter(engine.block_manager.blocks[chain[-1]].content_id)
        for name, state in runner.state_tensors().items():
            state[slot] = states[name].to(state)
    return len(entered) * block_size


def _checked_states(engine: LLMEngine, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A hybrid model's checkpoint states among `tensors`, each of its state tensor's shape; {} for others."""
    expected = {name: state.shape[1:] for name, state in engine.runner.state_tensors().items()}
    given = {name: t for name, t in tensors.items() if name != "kv"}
    if set(given) != set(expected) or any(t.shape != expected[name] for name, t in given.items()):
        raise RequestError(f"the states beside the KV ({sorted(given)}) do not fit this engine's state layers "
                           f"({sorted(expected)}, shapes {[tuple(s) for s in expected.values()]})")
    return given


def _check_kv_local(engine: LLMEngine) -> None:
    if engine.workers is not None:
        raise RequestError("KV transfer between engines is not implemented for a model split over processes")
    if engine.config.cache.kv_cache_dtype != "auto" or engine.model_config.kv_lora_rank:
        raise RequestError("KV transfer between engines is not implemented for a KV cache in another dtype than the "
                           "compute dtype (float16, q8_0, fp8) or a latent one")
    if not engine.model_config.uniform_kv_cache:
        raise RequestError(f"KV transfer between engines is not implemented for a model whose layers' K/V differ in "
                           f"shape or are shared between layers ({engine.model_config.architecture})")
    if engine.model_config.is_hybrid and engine.block_manager.checkpoints is None:
        raise RequestError(f"KV transfer between engines needs prefix caching on a hybrid model "
                           f"({engine.model_config.architecture}): its states travel as a prefix's state checkpoint")
