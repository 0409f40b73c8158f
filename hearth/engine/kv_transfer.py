"""KV handed between engines (hearth/fleet/disaggregated.py): LLMEngine.export_kv and import_kv.

A prefill engine exports the K/V of a prompt's cached full blocks; a decode engine enters them
into its prefix cache, so that a request with that prompt finds them computed. Functions of the
engine (bound as its methods); the tensors are the runner's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hearth.errors import RequestError

if TYPE_CHECKING:
    from hearth.engine.engine import LLMEngine


def export_kv(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """The K/V of the cached full blocks that start `token_ids` (short of its last token):
    [layers, 2, tokens, kv_heads, head_dim], tokens a multiple of the block size (maybe 0)."""
    _check_kv_local(engine)
    engine.wait_for_pass()
    return engine.runner.read_kv(engine.block_manager.lookup(token_ids))


def import_kv(engine: LLMEngine, token_ids: list[int], kv: torch.Tensor) -> int:
    """Enter the blocks of `kv` (export_kv's, computed elsewhere for `token_ids`) into the
    engine's prefix cache, so that a request with that prompt finds them computed; returns the
    tokens entered (blocks already cached here, or with no room left, are not)."""
    _check_kv_local(engine)
    runner, block_size = engine.runner, engine.config.cache.block_size
    k_cache = runner.kv_caches[0][0]
    if (kv.dim() != 5 or kv.shape[:2] != (len(runner.kv_caches), 2) or kv.shape[2] % block_size
            or kv.shape[3:] != k_cache.shape[1:]):
        raise RequestError(f"KV of shape {tuple(kv.shape)} does not fit this engine's cache "
                           f"({len(runner.kv_caches)} layers, blocks of {block_size}, {tuple(k_cache.shape[1:])})")
    engine.wait_for_pass()
    covered = token_ids[: kv.shape[2] + 1]  # the blocks kv holds, and one more token
    entered = engine.block_manager.import_prefix(covered)
    engine.move_tier_blocks()  # the blocks it evicted, before their K/V are written over
    if entered:
        runner.write_kv_blocks(entered, kv)
    return len(entered) * block_size


def _check_kv_local(engine: LLMEngine) -> None:
    if engine.workers is not None:
        raise RequestError("KV transfer between engines is not implemented for a model split over processes")
    if engine.config.cache.kv_cache_dtype != "auto" or engine.model_config.kv_lora_rank:
        raise RequestError("KV transfer between engines is not implemented for a KV cache in another dtype than the "
                           "compute dtype (float16, q8_0, fp8) or a latent one")
    if engine.model_config.is_hybrid:
        raise RequestError(f"KV transfer between engines is not implemented for hybrid models "
                           f"({engine.model_config.architecture}: its layers' states would have to travel too)")
