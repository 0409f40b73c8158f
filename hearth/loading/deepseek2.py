"""llama.cpp's deepseek2 GGUF layout of deepseek_v2 (multi-head latent attention), read and written.

llama.cpp runs the latent attention as multi-query attention with one KV head: its converter writes
head_count_kv 1, key_length kv_lora_rank + qk_rope_head_dim and value_length kv_lora_rank (the
cached latent), and the per-head sizes as key_length_mla (qk_nope_head_dim + qk_rope_head_dim) and
value_length_mla (v_head_dim). kv_b_proj [heads x (nope + v), rank] is split per head into
attn_k_b [heads, rank, nope] (W_UK transposed) and attn_v_b [heads, v, rank] (W_UV). Files of older
converters keep kv_b_proj whole as attn_kv_b and the per-head sizes in key_length / value_length,
without the _mla keys: both are read. DeepSeek rotates adjacent pairs, as llama.cpp's "normal" RoPE
does, so no rows are permuted. YaRN's temperature is rope.scaling.yarn_log_multiplier = 0.1 x mscale_all_dim
(llama.cpp's deepseek2 divides it back), with mscale taken equal to it.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch
from gguf import GGUFWriter, RopeScalingType

from hearth.config import ModelConfig
from hearth.errors import ModelLoadError
from hearth.quant import QuantTensor

Weight = torch.Tensor | QuantTensor

# the per-head halves of kv_b_proj: hearth's name for each while a file is read
SPLIT_KV_B = {"attn_k_b.weight": "self_attn.k_b_proj.weight", "attn_v_b.weight": "self_attn.v_b_proj.weight"}
_KV_B = re.compile(r"(model\.layers\.\d+\.self_attn)\.kv_b_proj\.weight")
# llama.cpp's expert_gating_func: 1 softmax (DeepSeek-V2's; the default), 2 sigmoid (V3's, which hearth lacks)
_SOFTMAX = 1


def config_fields(md: dict[str, Any], get: Callable[[str], Any], where: str) -> dict[str, Any]:
    """ModelConfig's fields of a deepseek2 file beyond the common ones (they replace those)."""
    heads, rope = int(get("attention.head_count")), int(get("rope.dimension_count"))
    mla = md.get("deepseek2.attention.key_length_mla") is not None
    key = int(get("attention.key_length_mla" if mla else "attention.key_length"))
    value = int(get("attention.value_length_mla" if mla else "attention.value_length"))
    gating = int(md.get("deepseek2.expert_gating_func") or _SOFTMAX)
    groups = int(md.get("deepseek2.expert_group_count") or 0)
    if gating != _SOFTMAX or groups > 1:
        raise ModelLoadError(f"{where}: deepseek2.expert_gating_func = {gating}, expert_group_count = {groups}: hearth "
                             "implements DeepSeek-V2's experts (softmax, no groups), not V3's sigmoid routing")
    for key_name in ("rope.scaling.yarn_attn_factor", "rope.scaling.yarn_ext_factor", "attention.temperature_scale"):
        if md.get(f"deepseek2.{key_name}") is not None:
            raise ModelLoadError(f"{where}: deepseek2.{key_name} is not implemented by hearth")
    if key <= rope:
        raise ModelLoadError(f"{where}: key length {key} leaves no unrotated part beside {rope} rotated dimensions")
    experts = int(get("expert_count"))
    per_expert = int(get("expert_feed_forward_length"))
    return dict(
        num_kv_heads=heads, head_dim=rope, kv_lora_rank=int(get("attention.kv_lora_rank")),
        q_lora_rank=int(md.get("deepseek2.attention.q_lora_rank") or 0), qk_nope_head_dim=key - rope,
        v_head_dim=value, num_experts=experts, num_experts_per_tok=int(get("expert_used_count")),
        moe_intermediate_size=per_expert, norm_topk_prob=bool(md.get("deepseek2.expert_weights_norm", False)),
        shared_expert_intermediate_size=int(md.get("deepseek2.expert_shared_count") or 0) * per_expert,
        shared_expert_gated=False, routed_scaling_factor=float(md.get("deepseek2.expert_weights_scale") or 1.0),
    )


def rope_scaling(md: dict[str, Any], get: Callable[[str], Any]) -> dict[str, Any]:
    """A deepseek2 file's YaRN as transformers' deepseek_v2 config has it."""
    log_mul = md.get("deepseek2.rope.scaling.yarn_log_multiplier")
    if log_mul is None:
        raise ModelLoadError("deepseek2 YaRN without rope.scaling.yarn_log_multiplier is not implemented by hearth")
    mscale = float(log_mul) / 0.1  # (llama.cpp's converter writes 0.1 x mscale_all_dim)
    return {"rope_type": "yarn", "factor": float(get("rope.scaling.factor")),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
            "beta_fast": float(md.get("deepseek2.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(md.get("deepseek2.rope.scaling.yarn_beta_slow", 1.0)),
            "mscale": mscale, "mscale_all_dim": mscale}


def join_kv_b(weights: dict[str, Weight], config: ModelConfig, where: str) -> None:
    """kv_b_proj [heads x (nope + v), rank] back out of each layer's attn_k_b and attn_v_b, in place."""
    heads, rank, nope, v = config.num_heads, config.kv_lora_rank, config.qk_nope_head_dim, config.v_head_dim
    for layer in range(config.num_layers):
        k_name, v_name = (f"model.layers.{layer}.{SPLIT_KV_B[part]}" for part in SPLIT_KV_B)
        if k_name not in weights and v_name not in weights:
            continue
        if k_name not in weights or v_name not in weights:
            raise ModelLoadError(f"{where}: layer {layer} has one of attn_k_b and attn_v_b without the other")
        k_b, v_b = _dense(weights.pop(k_name)), _dense(weights.pop(v_name))
        if k_b.numel() != heads * rank * nope or v_b.numel() != heads * v * rank:
            raise ModelLoadError(f"{where}: layer {layer}'s attn_k_b / attn_v_b have {k_b.numel()} / {v_b.numel()} "
                                 f"values, expected {heads} heads of [{rank}, {nope}] / [{v}, {rank}]")
        w_uk = k_b.reshape(heads, rank, nope).transpose(1, 2)  # [heads, nope, rank]
        weights[f"model.layers.{layer}.self_attn.kv_b_proj.weight"] = torch.cat([w_uk, v_b.reshape(heads, v, rank)], dim=1).reshape(-1, rank)


def _dense(weight: Weight) -> torch.Tensor:
    return weight.dequantize(torch.float32) if isinstance(weight, QuantTensor) else weight.float()


def split_kv_b(config: ModelConfig, hf_name: str,
               tensor: torch.Tensor) -> list[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]] | None:
    """(name, shape, values) of attn_k_b [heads, rank, nope] and attn_v_b [heads, v, rank] out of a
    layer's kv_b_proj, as llama.cpp's converter writes them (computed when written); None for any
    other tensor."""
    m = _KV_B.fullmatch(hf_name)
    if m is None:
        return None
    heads, rank, nope, v = config.num_heads, config.kv_lora_rank, config.qk_nope_head_dim, config.v_head_dim
    layer = m.group(1).split(".")[2]

    def half(which: int) -> torch.Tensor:
        k_b, v_b = tensor.float().view(heads, nope + v, rank).split([nope, v], dim=1)
        return k_b.transpose(1, 2).contiguous() if which == 0 else v_b.contiguous()

    return [(f"blk.{layer}.attn_k_b.weight", (heads, rank, nope), lambda: half(0)),
            (f"blk.{layer}.attn_v_b.weight", (heads, v, rank), lambda: half(1))]


def add_metadata(writer: GGUFWriter, config: ModelConfig) -> None:
    """deepseek2's keys, as llama.cpp's converter writes them (head_count_kv and the rest: the caller)."""
    writer.add_leading_dense_block_count(len(config.dense_mlp_layers))
    if config.dense_mlp_layers != tuple(range(len(config.dense_mlp_layers))):
        raise ModelLoadError(f"dense MLP layers {list(config.dense_mlp_layers)}: llama.cpp's deepseek2 has them "
                             "first only (leading_dense_block_count)")
    if config.expert_groups:
        raise ModelLoadError("topk_method group_limited_greedy: llama.cpp's deepseek2 has no expert groups of "
                             "DeepSeek-V2's kind (its groups are V3's), so no GGUF key says it")
    if config.q_lora_rank:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(config.kv_lora_rank)
    writer.add_key_length(config.kv_lora_rank + config.head_dim)
    writer.add_value_length(config.kv_lora_rank)
    writer.add_key_length_mla(config.qk_nope_head_dim + config.head_dim)
    writer.add_value_length_mla(config.v_head_dim)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_shared_count(config.shared_expert_intermediate_size // config.moe_intermediate_size)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    if config.norm_topk_prob:
        writer.add_expert_weights_norm(True)


def add_rope_scaling(writer: GGUFWriter, scaling: dict[str, Any]) -> None:
    """YaRN as llama.cpp's converter writes it for deepseek2, where llama.cpp computes what transformers
    does: mscale equal to mscale_all_dim (DeepSeek-V2's and V3's configs), or both absent."""
    mscale, mscale_all_dim = float(scaling.get("mscale") or 1.0), scaling.get("mscale_all_dim")
    if mscale_all_dim is None or mscale != float(mscale_all_dim) or scaling.get("truncate", True) is False:
        raise ModelLoadError(f"rope_scaling {scaling}: llama.cpp's deepseek2 takes YaRN's mscale equal to "
                             "mscale_all_dim (and the ramp truncated)")
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(scaling["factor"]))
    writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    for key, add in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                     ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
        if scaling.get(key) is not None:
            add(float(scaling[key]))
    writer.add_rope_scaling_yarn_log_mul(0.1 * float(mscale_all_dim))
