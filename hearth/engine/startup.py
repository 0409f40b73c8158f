"""What an engine starts from: its backend, the target model (in this process or split over
several), the context it serves, the blocks of its KV cache and CALM's exit layers."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

from hearth.backend import Backend, choose_backend
from hearth.kv_format import check_kv_cache_dtype, kv_bytes_per_element
from hearth.config import ModelConfig
from hearth.engine_config import EngineConfig
from hearth.default_model import resolve_model
from hearth.errors import HearthError
from hearth.engine.kv_disk_tier import DiskTier
from hearth.engine.kv_tiers import KVTiers, RamTier
from hearth.engine.memory import (BudgetSplit, kv_cache_blocks, kv_cache_budget, model_bytes, split_budget,
                                  state_bytes_per_slot)
from hearth.loading.loader import LoadedModel, load_model
from hearth.model.calm import CalmExits, default_exit_layers
from hearth.model.transformer import Attention

logger = logging.getLogger("hearth")


def engine_backend(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> Backend:
    """The backend the engine's models run on, refused where it lacks what the config asks of it."""
    # A model split over processes runs eagerly: gloo's collectives cannot be captured in a CUDA
    # graph, NCCL's capture is untried (no two GPUs to try it on), and pipeline stages never replay one.
    split = config.parallel.split
    # (LoRA: a step's adapters are chosen per step, which a captured graph would not see)
    backend = choose_backend(device, dtype, config.backend, config.enforce_eager or split or config.lora.enable_lora)
    if split and backend.name == "gpu" and device.type == "cuda" and not config.enforce_eager:
        logger.warning("gpu backend: no CUDA graphs for a model split over processes (every step runs eagerly)")
    return backend


def load_target(model: str | Path | None, config: EngineConfig, backend: Backend, dtype: torch.dtype,
                device: torch.device, progress: bool) -> tuple[LoadedModel, object | None, object | None]:
    """The target model (its tokenizer's chat template config.chat_template's where given), and with a
    model split over processes the workers (ranks 1..N-1, processes of their own) and this process's
    shard; else None and None."""
    workers, shard = None, None
    if config.parallel.split:
        from hearth.engine.workers import start_split

        model = resolve_model(model)
        workers, shard = start_split(model, config.parallel.tensor_parallel_size,
                                     config.parallel.pipeline_parallel_size, dtype, config.scheduler.max_model_len,
                                     backend.name, device)
    try:
        loaded = load_model(model, dtype, device, max_positions=config.scheduler.max_model_len,
                            progress=progress, backend=backend, shard=shard, sparsity=config.sparsity,
                            mmproj=config.mmproj, image_max_tokens=config.image_max_tokens,
                            image_min_tokens=config.image_min_tokens)
        if config.speculative.token_trees and not backend.takes_token_trees(loaded.config):
            raise ValueError(f"speculative_tree_width > 1 and lookahead_mode full (token-tree verification) are not "
                             f"implemented for {loaded.config.architecture} on the {backend.name} backend (its "
                             "latent attention kernels take no tree masks): use the cpu or reference backend, or "
                             "speculative_tree_width 1 and lookahead_mode chain")
        if config.chat_template is not None:  # (Jinja is imported where a template is set or rendered only)
            from hearth.chat_template import load_chat_template

            loaded.tokenizer.chat_template = load_chat_template(config.chat_template)
    except BaseException:
        if workers is not None:
            workers.kill()
        raise
    return loaded, workers, shard


def context_length(config: EngineConfig, model_config: ModelConfig) -> int:
    """The longest sequence the engine serves: max_model_len, at most the model's context."""
    context, wanted = model_config.max_position_embeddings, config.scheduler.max_model_len
    if wanted is not None and wanted > context:
        raise ValueError(f"max_model_len {wanted} exceeds the model's context length {context}")
    return wanted or context


def kv_cache_size(config: EngineConfig, model_config: ModelConfig, backend: Backend, device: torch.device,
                  dtype: torch.dtype, max_model_len: int, model_path: Path) -> tuple[int, int, BudgetSplit]:
    """The KV cache's blocks (kv_cache_memory's, else the default budget, hearth/engine/memory.py), its
    bytes per token (with --speculative-method mtp the MTP layer's beside the target's: its cache has the
    target's blocks, in the compute dtype, hearth/engine/mtp_draft.py), and how the budget was shared
    (split_budget: a hybrid model's state slots, each with a state checkpoint's bytes beside it when prefix
    caching is on and a snapshot's per guess with speculation; none for other models)."""
    cache, max_num_seqs = config.cache, config.scheduler.max_num_seqs
    check_kv_cache_dtype(cache.kv_cache_dtype, model_config, backend)
    bytes_per_token = model_config.kv_bytes_per_token(kv_bytes_per_element(cache.kv_cache_dtype, dtype.itemsize))
    if config.speculative.method == "mtp" and model_config.mtp_layers:  # (none: refused by name in mtp_draft.py)
        bytes_per_token += model_config.mtp_layer_config().kv_bytes_per_token(dtype.itemsize)
    state_bytes = state_bytes_per_slot(model_config.state_bytes_per_sequence(dtype.itemsize),
                                       cache.enable_prefix_caching, state_snapshots_per_slot(config))
    budget = cache.kv_cache_memory or kv_cache_budget(device, bytes_per_token, cache.block_size, max_model_len,
                                                      max_num_seqs, model_bytes(model_path), state_bytes)
    split = split_budget(budget, bytes_per_token, cache.block_size, max_model_len, state_bytes, max_num_seqs)
    return kv_cache_blocks(split.kv_bytes, bytes_per_token, cache.block_size), bytes_per_token, split


def state_snapshots_per_slot(config: EngineConfig) -> int:
    """A hybrid model's state snapshots per running sequence: one per guess it may verify in a step."""
    return config.speculative.num_speculative_tokens if config.speculative.method is not None else 0


def check_hybrid(config: EngineConfig, model_config: ModelConfig) -> bool:
    """Refuse what a hybrid model (layers with a state per sequence: lfm2, qwen3_5) cannot run yet
    rather than compute it wrongly; returns whether the model is one. (Its prefix caching keeps state
    checkpoints beside the KV blocks: state_slots.py.)"""
    if not model_config.is_hybrid:
        return False
    kind = f"a hybrid model ({model_config.architecture}: layers that keep a state per sequence)"
    spec = config.speculative
    # Guesses in one chain are verified with a state snapshot after each (state_ops.py), and a rejected one's
    # states are put back. A token tree's branches would each need states of their own through the tree (the
    # state layers run a sequence's rows in order, not along a tree's branches); early exit's draft runs the
    # target's own first layers, whose states its guesses would advance.
    refused = [(spec.method == "early-exit", "speculative_method early-exit"),
               (spec.method is not None and (spec.tree_width > 1 or spec.lookahead_full),
                "token trees of guesses (speculative_tree_width above 1, lookahead_mode full)"),
               (config.contrastive_model is not None, "contrastive_model")]
    for asked, what in refused:
        if asked:
            raise HearthError(f"{what} is not implemented for {kind}")
    return True


def kv_tiers(config: EngineConfig, model_config: ModelConfig, model_path: Path, kv_cache_dtype: str,
             num_layers: int, block_bytes: int, split: bool, q8_0: bool = False) -> KVTiers | None:
    """The tiers under the prefix cache (kv_cache_ram, kv_cache_dir), or None: none asked for, or off
    (with a log line) where prefix caching is off or the cache is not all in this process. block_bytes:
    one block's payload (q8_0: compressed, ModelRunner.block_bytes). Their identity hashes what a block's
    bytes depend on: the model (path, size, config), KV dtype, block size, layers, payload and format."""
    cache = config.cache
    if cache.kv_cache_dir is None and not cache.kv_cache_ram:
        return None
    why = ("prefix caching is off" if not cache.enable_prefix_caching else
           f"a hybrid model ({model_config.architecture}) keeps states the tiers do not hold"
           if model_config.is_hybrid else "the model is split over processes" if split else
           "LoRA adapters are on (a block's K/V depends on the adapter, which the tiers do not name)"
           if config.lora.enable_lora else None)
    if why is not None:
        logger.info("the KV cache tiers (kv_cache_ram, kv_cache_dir) are off: %s", why)
        return None
    identity = json.dumps([str(Path(model_path).resolve()), model_bytes(model_path), repr(model_config),
                           kv_cache_dtype, cache.block_size, num_layers, block_bytes] + (["q8_0"] if q8_0 else []))
    identity = hashlib.sha256(identity.encode()).digest()
    ram = RamTier(cache.kv_cache_ram) if cache.kv_cache_ram else None
    if cache.kv_cache_dir is None:
        return KVTiers(identity, ram, None, q8_0)
    try:
        return KVTiers(identity, ram, DiskTier(cache.kv_cache_dir, cache.kv_cache_dir_size, identity, block_bytes), q8_0)
    except OSError as e:
        raise HearthError(f"kv_cache_dir {cache.kv_cache_dir}: not a folder hearth can use ({e})") from None


def calm_exits(config: EngineConfig, runner, model) -> CalmExits | None:
    """CALM's early exits (hearth/model/calm.py) after config.calm_exit_layers (default: half and three
    quarters of the model's layers) where the engine can run them, else None; ValueError where they
    are asked for and it cannot."""
    if (not runner.own_pass or config.lora.enable_lora or model.config.is_hybrid
            or not all(type(getattr(layer, "self_attn", None)) is Attention for layer in model.layers)):
        if config.calm_exit_layers is not None:
            raise ValueError("calm_exit_layers: CALM early exit is not implemented with tensor or pipeline "
                             "parallelism, LoRA adapters, hybrid models or latent attention")
        return None
    layers = config.calm_exit_layers or default_exit_layers(len(model.layers))
    return CalmExits(model, list(layers), runner.kv_caches) if layers else None
