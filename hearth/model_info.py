"""What `hearth inspect` reports: architecture, parameters, weight types and bytes, KV cache cost."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from pathlib import Path

from hearth.kv_format import kv_bytes_per_element, kv_cache_dtype_name
from hearth.engine_config import EngineConfig
from hearth.default_model import resolve_model
from hearth.engine.memory import (choose_device, choose_dtype, kv_cache_blocks, kv_cache_budget, model_bytes,
                                  split_budget, state_bytes_per_slot)
from hearth.errors import HearthError
from hearth.loading.loader import read_model
from hearth.quant import QuantTensor


def weight_type(weight) -> str:
    if isinstance(weight, QuantTensor):
        return weight.qtype.name
    return str(weight.dtype).removeprefix("torch.")


def model_info(path: str | Path | None, kv_budget_bytes: int | None = None, kv_element_size: int | None = None,
               kv_cache_dtype: str = "auto", max_num_seqs: int | None = None, max_model_len: int | None = None) -> dict:
    """kv_cache_dtype: auto (K/V in the compute dtype the engine picks here, or of kv_element_size bytes),
    float16, q8_0 or fp8 / fp8_e4m3 (hearth/kv_format.py). kv_budget_bytes: None for the default
    budget of an engine with EngineConfig's defaults (`hearth serve`'s), as the engine computes it;
    max_num_seqs and max_model_len (None: the engine's defaults) as the engine's options, which a
    hybrid model's budget is shared by (hearth/engine/memory.py, split_budget)."""
    path = resolve_model(path)
    config, weights, tokenizer = read_model(path, progress=False)
    params = 0
    types: Counter[str] = Counter()
    type_bytes: Counter[str] = Counter()
    for weight in weights.values():
        count = weight.shape[0] * (weight.shape[1] if len(weight.shape) > 1 else 1)
        params += count
        kind = weight_type(weight)
        types[kind] += count
        type_bytes[kind] += weight.nbytes if isinstance(weight, QuantTensor) else weight.numel() * weight.element_size()
    if "lm_head.weight" not in weights:
        tied = "tied"
    else:
        tied = "untied"
    kv_name, kv_element = _kv_dtype(kv_cache_dtype, kv_element_size)
    kv_per_token = config.kv_bytes_per_token(kv_element)
    info = {
        "path": str(path),
        "architecture": config.architecture,
        "parameters": params,
        "embeddings": tied,
        "weight_types": {k: {"parameters": types[k], "bytes": type_bytes[k]} for k in sorted(types)},
        "weight_bytes": sum(type_bytes.values()),
        "context_length": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "kv_cache_dtype": kv_name,
        "kv_bytes_per_element": kv_element,
        "kv_window": config.kv_window,
        "kv_cache_bytes_per_token": kv_per_token,
        "config": {k: v for k, v in asdict(config).items() if k != "extra"},
        "tokenizer": {"bos_token_id": tokenizer.bos_token_id, "eos_token_ids": tokenizer.eos_token_ids,
                      "has_chat_template": tokenizer.chat_template is not None},
    }
    if config.num_experts:
        info["experts"] = _experts(config, params)
    if config.kv_lora_rank:
        info["latent_attention"] = _latent_attention(config)
    if not config.uniform_kv_cache:  # gemma4's: full layers of other K/V shapes, layers reading an earlier one's
        info["kv_layers"] = _kv_layers(config)
    if config.vision is not None:  # the image side of an image-text model (its weights are counted above)
        info["vision"] = config.vision.describe()
    compute_element = kv_element_size or choose_dtype("auto", choose_device("auto")).itemsize
    if config.mtp_layers:  # --speculative-method mtp's layers: K/V in the compute dtype, in its budget beside the target's
        info["mtp_layers"] = {"count": config.mtp_layers,
                              "kv_cache_bytes_per_token": config.mtp_layer_config().kv_bytes_per_token(compute_element)}
    state_bytes = 0
    if config.is_hybrid:  # the state cache's share: convolution windows in the compute dtype, delta rules in float32
        state_bytes = config.state_bytes_per_sequence(compute_element)
        info["state_layers"] = {"layer_types": list(config.layer_types), "state_bytes_per_sequence": state_bytes}
    info.update(_kv_budget(path, kv_per_token, kv_budget_bytes, state_bytes, max_num_seqs,
                           _context_length(config, max_model_len)))
    return info


def _kv_dtype(kv_cache_dtype: str, kv_element_size: int | None) -> tuple[str, float]:
    """The cache's dtype name and bytes per K or V value: with auto and no element size given, the
    compute dtype an engine with default options picks on this machine (engine/memory.py's choice)."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype_name(kv_cache_dtype), kv_bytes_per_element(kv_cache_dtype, 2)
    if kv_element_size is not None:
        return {1: "8-bit", 2: "16-bit", 4: "float32"}[kv_element_size], kv_element_size
    dtype = choose_dtype("auto", choose_device("auto"))
    return str(dtype).removeprefix("torch."), dtype.itemsize


def _context_length(config, max_model_len: int | None) -> int:
    """The longest request the budget is sized for: max_model_len, at most the model's context."""
    if max_model_len is not None and not 2 <= max_model_len <= config.max_position_embeddings:
        raise HearthError(f"max_model_len {max_model_len}: the model's context is {config.max_position_embeddings} tokens")
    return max_model_len or config.max_position_embeddings


def _kv_budget(path: Path, kv_per_token: int, budget: int | None, state_bytes: int, max_num_seqs: int | None,
               max_model_len: int) -> dict:
    """The tokens a budget given holds; with none, the budget an engine with default options computes
    (`hearth serve`'s), in whole blocks as the engine's start-up line gives it. A hybrid model's budget
    keeps the states of some sequences (kv_budget_sequences: how many run at once, and kv_budget_why: why
    that many, split_budget), with prefix caching (on by default) as many state checkpoints
    (hearth/engine/state_slots.py), and K/V in the rest."""
    defaults = EngineConfig()
    block_size = defaults.cache.block_size
    slot_bytes = state_bytes_per_slot(state_bytes, defaults.cache.enable_prefix_caching)
    default = budget is None
    if default:
        budget = kv_cache_budget(choose_device("auto"), kv_per_token, block_size, max_model_len, max_num_seqs,
                                 model_bytes(path), slot_bytes)
    split = split_budget(budget, kv_per_token, block_size, max_model_len, slot_bytes, max_num_seqs)
    tokens = kv_cache_blocks(split.kv_bytes, kv_per_token, block_size) * block_size if default else \
        split.kv_bytes // kv_per_token
    info = {"kv_budget_bytes": tokens * kv_per_token if default else budget, "kv_budget_default": default,
            "kv_budget_tokens": tokens, "kv_budget_max_model_len": max_model_len}
    if state_bytes:
        slots = split.state_slots
        info |= {"kv_budget_bytes": tokens * kv_per_token + slots * slot_bytes, "kv_budget_sequences": slots,
                 "kv_budget_why": split.why, "kv_budget_state_checkpoints": slots * (slot_bytes // state_bytes - 1),
                 "kv_budget_state_checkpoint_bytes": slots * (slot_bytes - state_bytes)}
    return info


def _experts(config, params: int) -> dict:
    """A mixture of experts' shape, and the parameters a token uses (the unchosen experts' left out)."""
    moe_layers = sum(config.is_moe_layer(layer) for layer in range(config.num_layers))
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size  # gate, up, down
    unused = moe_layers * (config.num_experts - config.num_experts_per_tok) * per_expert
    return {"count": config.num_experts, "used_per_token": config.num_experts_per_tok,
            "intermediate_size": config.moe_intermediate_size,
            "shared_intermediate_size": config.shared_expert_intermediate_size,
            "normalised": config.norm_topk_prob, "active_parameters": params - unused}


def _kv_layers(config) -> dict:
    """The shapes of the layers' caches (the layers of each) and the layers that keep none, reading another's."""
    shapes: dict[tuple[int, int], list[int]] = {}
    for layer in range(config.num_layers):
        if config.keeps_kv_cache(layer):
            shapes.setdefault((config.kv_heads_of(layer), config.head_dim_of(layer)), []).append(layer)
    return {"shapes": [{"layers": layers, "kv_heads": heads, "head_dim": dim} for (heads, dim), layers in shapes.items()],
            "shared": {layer: config.kv_source(layer) for layer in range(config.num_layers)
                       if config.kv_source(layer) != layer}}


def _latent_attention(config) -> dict:
    """Multi-head latent attention's sizes, and the values a token takes in a layer's cache (the latent
    and the shared rotated key part) against the per-head K and V it stands for."""
    nope, rope, v = config.qk_nope_head_dim, config.head_dim, config.v_head_dim
    return {"kv_lora_rank": config.kv_lora_rank, "qk_rope_head_dim": rope, "qk_nope_head_dim": nope, "v_head_dim": v,
            "values_per_token_per_layer": config.kv_lora_rank + rope,
            "per_head_kv_values_per_token_per_layer": config.num_heads * (nope + rope + v)}
