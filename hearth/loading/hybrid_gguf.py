"""llama.cpp's GGUF layout of the hybrids with Gated DeltaNet or Mamba2 layers: Qwen3.5 (qwen35), Qwen3-Next
(qwen3next), Granite 4.0-H (granitehybrid) and Nemotron-H (nemotron_h; with experts nemotron_h_moe), as
llama.cpp's converter writes them (0.3.36: conversion/qwen.py, granite.py, nemotron.py, mamba.py) and its
graphs read them (src/models/qwen35.cpp, qwen3next.cpp, granite-hybrid.cpp, nemotron-h.cpp): the metadata of
their ModelConfig, read and written, and the tensor values llama.cpp stores otherwise than the checkpoint
(the names: hearth/loading/names.py):

- A as -exp(A_log) (ssm_a; Mamba2's as [heads, 1], and D), Mamba2's gated norm as [groups, inner / groups],
  the convolutions as [channels, taps];
- qwen35 / qwen3next: every RMSNorm but the delta rule's stored as (1 + w);
- qwen35: the value heads tiled (value head j reads key head j % key heads) instead of grouped by key head;
  hearth runs them in that order (ModelConfig.linear_value_heads_tiled), and `hearth convert` reorders a
  checkpoint's rows and columns into it;
- qwen3next: in_proj_b and in_proj_a fused per key head (ssm_ba: a key head's value heads' b, then their a);
- granitehybrid: gate and up (its input_linear) as two matrices; Q and K of both Mamba2 families in llama's
  interleaved row order (names.PERMUTED_QK_ARCHITECTURES).

What llama.cpp's layout cannot hold is refused by name when converting: key and value heads of two sizes
in a Gated DeltaNet, Qwen3-Next's dense MLP layers,
Nemotron-H with both MLP and expert blocks, biases on Mamba2's projections, a clamped Granite dt. llama.cpp's
nemotron_h does not clamp dt from time_step_min (its files have no key for it): hearth runs such a file as
llama.cpp does.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from gguf import GGUFWriter

from hearth.config import ATTENTION, GATED_DELTA_NET, MAMBA2, MLP, QWEN_DELTA_NET, ModelConfig
from hearth.errors import ModelLoadError
from hearth.loading.names import mtp_as_block, mtp_of_block
from hearth.quant import QuantTensor

Weight = torch.Tensor | QuantTensor

# llama.cpp's architecture -> hearth's
GGUF_HYBRIDS = {"qwen35": "qwen3_5", "qwen3next": "qwen3_next", "granitehybrid": "granitemoehybrid",
                "nemotron_h": "nemotron_h", "nemotron_h_moe": "nemotron_h"}
MAMBA2_FAMILIES = ("granitemoehybrid", "nemotron_h")


def gguf_architecture(config: ModelConfig) -> str:
    """llama.cpp's general.architecture for a hybrid hearth architecture."""
    if config.architecture == "nemotron_h":
        return "nemotron_h_moe" if config.num_experts else "nemotron_h"
    return next(gguf for gguf, ours in GGUF_HYBRIDS.items() if ours == config.architecture)


# ---------------------------------------------------------------- reading

def hybrid_fields_from_metadata(md: dict[str, Any], arch: str, get: Callable[..., Any]) -> dict[str, Any]:
    """The ModelConfig fields of a GGUF hybrid (arch: llama.cpp's name) over the common ones. Trailing
    multi-token-prediction blocks (nextn_predict_layers) are not layers of the model: qwen35's and qwen3next's
    are its MTP layers (mtp_layers; names.mtp_of_block), the others' are not read."""
    mtp_layers = int(md.get(f"{arch}.nextn_predict_layers") or 0)
    layers = int(get("block_count")) - mtp_layers
    if arch in ("qwen35", "qwen3next"):  # (their MTP blocks: the draft of --speculative-method mtp)
        return _delta_net_fields(md, arch, get, layers) | dict(mtp_layers=mtp_layers)
    return _mamba2_fields(md, arch, get, layers)


def per_layer(value: Any, layers: int, name: str) -> list[int]:
    """A per-layer count (a number for every layer, or one list entry per layer; trailing MTP blocks cut)."""
    counts = [int(n) for n in value] if isinstance(value, (list, tuple)) else [int(value)] * layers
    if len(counts) < layers:
        raise ModelLoadError(f"{name} = {counts!r}: expected one entry per each of the {layers} layers")
    return counts[:layers]


def _delta_net_fields(md: dict[str, Any], arch: str, get: Callable[..., Any], layers: int) -> dict[str, Any]:
    recurrent = md.get(f"{arch}.attention.recurrent_layers")
    if recurrent is None:  # llama.cpp's default: an attention layer every full_attention_interval
        interval = int(md.get(f"{arch}.full_attention_interval") or 4)
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    recurrent = per_layer(recurrent, layers, f"{arch}.attention.recurrent_layers")
    head_dim, value_heads = int(get("attention.key_length")), int(get("ssm.time_step_rank"))
    return dict(
        num_layers=layers, layer_types=tuple(GATED_DELTA_NET if r else ATTENTION for r in recurrent),
        conv_kernel_size=int(get("ssm.conv_kernel")), linear_num_key_heads=int(get("ssm.group_count")),
        linear_num_value_heads=value_heads, linear_key_head_dim=int(get("ssm.state_size")),
        linear_value_head_dim=int(get("ssm.inner_size")) // value_heads,
        linear_value_heads_tiled=arch == "qwen35", attention_output_gate=True, qk_norm="head",
        partial_rotary_factor=int(get("rope.dimension_count")) / head_dim,
    )


def _mamba2_fields(md: dict[str, Any], arch: str, get: Callable[..., Any], layers: int) -> dict[str, Any]:
    """A layer is attention where it has KV heads; else nemotron_h's is an MLP (or experts) where it has a
    width, and Mamba2 otherwise (llama.cpp's is_recr)."""
    nemotron = arch != "granitehybrid"
    kv = per_layer(get("attention.head_count_kv"), layers, f"{arch}.attention.head_count_kv")
    ff = per_layer(get("feed_forward_length"), layers, f"{arch}.feed_forward_length")
    kinds = tuple(ATTENTION if kv[i] else MLP if nemotron and ff[i] else MAMBA2 for i in range(layers))
    attention = {n for n in kv if n}
    if len(attention) != 1:
        raise ModelLoadError(f"{arch}.attention.head_count_kv = {kv!r}: expected the same count for every "
                             "attention layer, and one attention layer at least")
    heads, inner = int(get("ssm.time_step_rank")), int(get("ssm.inner_size"))
    attention_layers = tuple(i for i, kind in enumerate(kinds) if kind == ATTENTION)
    rope = not nemotron and bool(md.get(f"{arch}.rope.scaling.finetuned", True))  # (granite's switch for RoPE)
    fields = dict(
        num_layers=layers, num_kv_heads=attention.pop(), layer_types=kinds, conv_kernel_size=int(get("ssm.conv_kernel")),
        mamba_num_heads=heads, mamba_head_dim=inner // heads, ssm_state_size=int(get("ssm.state_size")),
        mamba_groups=int(get("ssm.group_count")), time_step_limit=(0.0, math.inf),
        no_rope_layers=() if rope else attention_layers, single_mixer_blocks=nemotron, gated_mlp=not nemotron,
    )
    if nemotron:
        experts = dict(router_sigmoid=True, shared_expert_gated=False,
                       routed_scaling_factor=float(md.get(f"{arch}.expert_weights_scale") or 1.0))
        return fields | dict(hidden_act="relu2", intermediate_size=max(ff)) | (experts if "moe" in arch else {})
    scale = md.get(f"{arch}.attention.scale")
    return fields | dict(
        shared_expert_gated=False, embedding_scale=float(md.get(f"{arch}.embedding_scale") or 1.0),
        residual_multiplier=float(md.get(f"{arch}.residual_scale") or 1.0),
        logits_divisor=float(md.get(f"{arch}.logit_scale") or 1.0),
        query_pre_attn_scalar=float(scale) ** -2 if scale else None,
    )


def hybrid_weights_from_gguf(config: ModelConfig, weights: dict[str, Weight]) -> None:
    """The weights (by hearth's names) of a GGUF hybrid as hearth's modules take them, in place; the
    Mamba2 biases the file has, in the config; the MTP blocks' tensors under the checkpoint's mtp.* names."""
    for name in list(weights) if config.mtp_layers else ():
        weights[mtp_of_block(name, config.num_layers)] = weights.pop(name)
    for name in list(weights):
        w = weights[name]
        if name.endswith("conv1d.weight") and w.dim() == 2:  # [channels, taps] as a Conv1d's [channels, 1, taps]
            weights[name] = w.unsqueeze(1)
        elif name.endswith(".A_log"):
            weights[name] = torch.log(-_dense(w).reshape(-1))  # llama.cpp's A = -exp(A_log)
        elif name.endswith((".mamba.D", ".mamba.norm.weight")):
            weights[name] = _dense(w).reshape(-1)
        elif name.endswith(".in_proj_ba.weight"):
            del weights[name]
            prefix = name.removesuffix("ba.weight")
            b_rows, a_rows = _ba_rows(config)
            weights[prefix + "b.weight"], weights[prefix + "a.weight"] = _rows(w, b_rows), _rows(w, a_rows)
    if config.architecture in MAMBA2_FAMILIES:
        config.conv_bias = any(name.endswith("mamba.conv1d.bias") for name in weights)
        config.mamba_proj_bias = any(name.endswith("mamba.in_proj.bias") for name in weights)


def _dense(w: Weight) -> torch.Tensor:
    return w.dequantize(torch.float32) if isinstance(w, QuantTensor) else w.float()


def _rows(w: Weight, rows: torch.Tensor) -> Weight:
    return w.rows(rows) if isinstance(w, QuantTensor) else w[rows]


def _ba_rows(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of qwen3next's ssm_ba that are in_proj_b's and in_proj_a's: per key head, its value heads' b, then a."""
    per_key = config.linear_num_value_heads // config.linear_num_key_heads
    starts = torch.arange(config.linear_num_key_heads).unsqueeze(1) * 2 * per_key
    b_rows = (starts + torch.arange(per_key)).reshape(-1)
    return b_rows, b_rows + per_key


# ---------------------------------------------------------------- writing

def check_convertible(config: ModelConfig) -> None:
    """What llama.cpp's layout of the family cannot hold, refused by name."""
    arch = config.architecture
    if arch == "qwen3_next" and config.num_experts and config.dense_mlp_layers:
        raise ModelLoadError(f"qwen3_next with dense MLP layers {list(config.dense_mlp_layers)} (mlp_only_layers, "
                             "decoder_sparse_step): llama.cpp's qwen3next has experts in every layer")
    if arch == "nemotron_h" and config.num_experts and any(
            config.layer_type(i) == MLP and not config.is_moe_layer(i) for i in range(config.num_layers)):
        raise ModelLoadError("nemotron_h with both MLP and expert blocks: llama.cpp's nemotron_h_moe runs every MLP "
                             "block as experts")
    if arch in QWEN_DELTA_NET and config.linear_key_head_dim != config.linear_value_head_dim:
        raise ModelLoadError(f"linear_key_head_dim {config.linear_key_head_dim} and linear_value_head_dim "
                             f"{config.linear_value_head_dim}: llama.cpp's {gguf_architecture(config)} has one size "
                             "for both (ssm.state_size)")
    if arch in MAMBA2_FAMILIES and config.mamba_proj_bias:
        raise ModelLoadError(f"{arch} with biases on Mamba2's in_proj and out_proj: llama.cpp's {arch} has none")
    if arch == "granitemoehybrid" and config.time_step_limit != (0.0, math.inf):
        raise ModelLoadError(f"time_step_limit = {list(config.time_step_limit)}: llama.cpp's granitehybrid does not "
                             "clamp dt")


def layer_counts(config: ModelConfig) -> tuple[int | list[int], int | list[int]]:
    """feed_forward_length and attention.head_count_kv: per layer for the Mamba2 families (0 in a layer without
    attention; nemotron_h's widths only in its MLP blocks), else one number."""
    kinds = [config.layer_type(i) for i in range(config.num_layers)]
    if config.architecture not in MAMBA2_FAMILIES:
        return config.intermediate_size, config.num_kv_heads
    kv = [config.num_kv_heads * (kind == ATTENTION) for kind in kinds]
    if config.architecture != "nemotron_h":
        return config.intermediate_size, kv
    width = config.moe_intermediate_size if config.num_experts else config.intermediate_size
    return [width * (kind == MLP) for kind in kinds], kv


def add_hybrid_metadata(writer: GGUFWriter, config: ModelConfig) -> None:
    """The family's keys beyond the common ones (convert.py's): the state layers' sizes and llama.cpp's
    per-family switches."""
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_ssm_conv_kernel(config.conv_kernel_size)
    if config.architecture in QWEN_DELTA_NET:
        writer.add_ssm_state_size(config.linear_key_head_dim)
        writer.add_ssm_group_count(config.linear_num_key_heads)
        writer.add_ssm_time_step_rank(config.linear_num_value_heads)
        writer.add_ssm_inner_size(config.linear_num_value_heads * config.linear_value_head_dim)
        recurrent = [config.layer_type(i) == GATED_DELTA_NET for i in range(config.num_layers)] + \
            [False] * config.mtp_layers  # (the MTP blocks: attention)
        # (the installed gguf-py has no add_recurrent_layers yet: llama.cpp's key, written by its name)
        writer.add_array(f"{writer.arch}.attention.recurrent_layers", recurrent)
        interval = next((i + 1 for i, r in enumerate(recurrent) if not r), config.num_layers)
        writer.add_full_attention_interval(interval)
        if config.architecture == "qwen3_5":
            writer.add_rope_dimension_sections(_qwen35_sections(config))
        if config.mtp_layers:
            writer.add_nextn_predict_layers(config.mtp_layers)
        return
    writer.add_ssm_state_size(config.ssm_state_size)
    writer.add_ssm_group_count(config.mamba_groups)
    writer.add_ssm_time_step_rank(config.mamba_num_heads)
    writer.add_ssm_inner_size(config.mamba_num_heads * config.mamba_head_dim)
    writer.add_rope_scaling_finetuned(any(i not in config.no_rope_layers for i in range(config.num_layers)
                                          if config.layer_type(i) == ATTENTION))
    if config.architecture == "granitemoehybrid":
        writer.add_attention_scale((config.query_pre_attn_scalar or config.head_dim) ** -0.5)
        writer.add_embedding_scale(config.embedding_scale)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_divisor)
        return
    writer.add_layer_norm_eps(config.rms_norm_eps)  # (llama.cpp's nemotron_h requires it)
    if config.num_experts:
        writer.add_expert_shared_count(1)
        writer.add_expert_weights_scale(config.routed_scaling_factor)
        writer.add_expert_group_count(1)
        writer.add_expert_group_used_count(1)


def hybrid_weights_for_gguf(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's weights under the names llama.cpp's tensors take them from: granite's gate-and-up
    matrices as gate and up (views), qwen3_next's in_proj_b and in_proj_a fused per key head, the MTP layers'
    as the blocks after the last layer (names.mtp_as_block)."""
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        name = mtp_as_block(name, config.num_layers) if name.startswith("mtp.") else name
        if config.architecture == "granitemoehybrid" and name.endswith(".gate_up_proj.weight"):
            gate, up = w.chunk(2)
            out[name.replace("gate_up_proj", "gate_proj")], out[name.replace("gate_up_proj", "up_proj")] = gate, up
        elif config.architecture == "qwen3_next" and name.endswith(".in_proj_a.weight"):
            continue
        elif config.architecture == "qwen3_next" and name.endswith(".in_proj_b.weight"):
            a = weights[name.replace("in_proj_b", "in_proj_a")]
            b_rows, a_rows = _ba_rows(config)
            fused = torch.empty(2 * len(b_rows), w.shape[1], dtype=w.dtype)
            fused[b_rows], fused[a_rows] = w, a
            out[name.replace("in_proj_b", "in_proj_ba")] = fused
        else:
            out[name] = w
    return out


def hybrid_value_for_gguf(config: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    """A float32 tensor (by hearth's name) as llama.cpp's converter stores it (the Q/K rows: convert.py's)."""
    if name.endswith(".A_log"):
        t = -t.exp()
    if config.architecture in QWEN_DELTA_NET and name.endswith("norm.weight") and \
            not name.endswith("linear_attn.norm.weight"):
        t = t + 1.0
    if config.architecture == "qwen3_5" and ".linear_attn." in name:
        t = _tiled_value_heads(config, name, t)
    if config.architecture in MAMBA2_FAMILIES:
        if name.endswith((".A_log", ".mamba.D")):
            t = t.reshape(-1, 1)
        elif name.endswith(".mamba.norm.weight"):
            t = t.reshape(config.mamba_groups, -1)
    if name.endswith("conv1d.weight"):
        t = t.squeeze(1)
    return t


def _qwen35_sections(config: ModelConfig) -> list[int]:
    """qwen35.rope.dimension_sections, which llama.cpp requires: the image-text model's M-RoPE sections, else
    the split that gives frequency i llama.cpp's interleaved axis i % 3 (as the checkpoints' default, [11,
    11, 10] of 32): a text token's three positions are one, so its frequencies turn as plain RoPE's."""
    if config.mrope_section:
        return [*config.mrope_section, 0]
    frequencies = int(config.head_dim * config.partial_rotary_factor) // 2
    return [(frequencies + 2) // 3, (frequencies + 1) // 3, frequencies // 3, 0]


def _tiled_value_heads(config: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    """A Gated DeltaNet tensor with its value heads reordered from grouped by key head to tiled (llama.cpp's
    qwen35: _LinearAttentionVReorderBase): the value rows of in_proj_qkv and the convolution, the rows of
    in_proj_z, in_proj_b and in_proj_a, A_log and dt_bias, the columns of out_proj."""
    keys, per_key = config.linear_num_key_heads, config.linear_num_value_heads // config.linear_num_key_heads
    width = config.linear_value_head_dim
    if per_key == 1:
        return t
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        split = 2 * keys * config.linear_key_head_dim
        return torch.cat([t[:split], _tile(t[split:], 0, keys, per_key, width)])
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", ".A_log", ".dt_bias")):
        return _tile(t, 0, keys, per_key, 1)
    if name.endswith(("in_proj_z.weight", "out_proj.weight")):
        return _tile(t, 1 if "out_proj" in name else 0, keys, per_key, width)
    return t


def _tile(t: torch.Tensor, dim: int, keys: int, per_key: int, width: int) -> torch.Tensor:
    """[keys, per_key, width] along dim as [per_key, keys, width]."""
    return t.unflatten(dim, (keys, per_key, width)).transpose(dim, dim + 1).flatten(dim, dim + 2)
