"""Read a GGUF file: metadata -> ModelConfig, tensors memory-mapped (quantized ones kept as blocks)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from hearth.config import ATTENTION, GEMMA_ARCHITECTURES, SHORT_CONV, SUPPORTED_ARCHITECTURES, ModelConfig
from hearth.errors import ModelLoadError
from hearth.loading import deepseek2, gemma4_gguf
from hearth.loading.gguf_reader import GGUFFile, TensorInfo, read_gguf
from hearth.loading.hybrid_gguf import GGUF_HYBRIDS, hybrid_fields_from_metadata, hybrid_weights_from_gguf
from hearth.loading.names import (LFM2_FINAL_NORM, PERMUTED_QK_ARCHITECTURES, UNUSED_GGUF_TENSORS,
                                  gguf_expert_stack, gguf_to_hf, hf_expert_name, qk_row_order)
from hearth.quant import SUPPORTED_QTYPES, QuantTensor

Weight = torch.Tensor | QuantTensor

_DENSE = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}


def config_from_metadata(md: dict[str, Any], where: str) -> ModelConfig:
    try:
        return _config_from_metadata(md, where)
    except ModelLoadError as e:
        raise ModelLoadError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
    except (TypeError, ValueError, AttributeError, OverflowError, ZeroDivisionError) as e:
        raise ModelLoadError(f"{where}: malformed metadata: {e}") from None


# llama.cpp's general.architecture -> hearth's, where they differ (llama with experts is mixtral)
_ARCHITECTURES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "deepseek2": "deepseek_v2",
                  "qwen3vl": "qwen3", "qwen3vlmoe": "qwen3_moe", **GGUF_HYBRIDS}
# Qwen3-VL's text models: qwen3's and qwen3moe's with M-RoPE (rope.dimension_sections)
_MROPE = ("qwen3vl", "qwen3vlmoe")
# whether llama.cpp renormalises the chosen experts' weights, for files without expert_weights_norm
# (gpt-oss: a softmax over the chosen experts' logits, the same)
_NORM_TOPK_PROB = {"llama": True, "qwen2moe": False, "qwen3moe": True, "qwen3vlmoe": True, "olmoe": False,
                   "gpt-oss": True,
                   "qwen3next": True, "granitehybrid": True, "nemotron_h_moe": True, "deepseek2": False,
                   "gemma4": True}


def _hearth_architecture(arch: Any, where: str) -> str:
    """hearth's name for llama.cpp's general.architecture `arch`, or a refusal that says why."""
    hearth_arch = _ARCHITECTURES.get(arch, arch)
    if hearth_arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{where}: unsupported architecture {arch!r} (general.architecture); "
                             f"hearth supports {', '.join(SUPPORTED_ARCHITECTURES)}")
    return hearth_arch


def _config_from_metadata(md: dict[str, Any], where: str) -> ModelConfig:
    arch = md.get("general.architecture")
    hearth_arch = _hearth_architecture(arch, where)

    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{where}: missing metadata key {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads, family = _kv_heads_and_layers(md, arch, get("attention.head_count_kv", heads), get, where)
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = int(md.get(f"{arch}.vocab_size") or (len(tokens) if tokens else 0))
    gemma = arch in GEMMA_ARCHITECTURES
    scaling = md.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear") and not (scaling == "yarn" and arch in ("gpt-oss", "deepseek2")):
        # llama3's scaling comes as the rope_freqs tensor instead
        raise ModelLoadError(f"{where}: RoPE scaling {scaling!r} ({arch}.rope.scaling.type) is not implemented by "
                             "hearth (it has: linear, llama3's rope_freqs, and gpt-oss's and deepseek2's yarn)")
    window = md.get(f"{arch}.attention.sliding_window")
    experts = int(md.get(f"{arch}.expert_count") or 0)
    if experts and arch == "llama":
        hearth_arch = "mixtral"
    fields = dict(
        architecture=hearth_arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_widest(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(md.get(f"{arch}.attention.key_length") or hidden // heads),
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling_from_metadata(md, arch, scaling, get),
        sliding_window=int(window) if window else None,
        sliding_layers=_sliding_layers(md, arch, int(get("block_count"))) if window else None,
        hidden_act="gelu_pytorch_tanh" if gemma else "silu",
        qk_norm={"qwen3": "head", "qwen3moe": "head", "qwen3vl": "head", "qwen3vlmoe": "head", "gemma3": "head",
                 "olmoe": "all", "lfm2": "head"}.get(arch),
        mrope_section=mrope_section_of(md, arch, where) if arch in _MROPE else None,
        # llama.cpp's converter already stored gemma's norm weights as (w + 1)
        norm_weight_offset=0.0,
        embedding_scale=float(np.sqrt(hidden)) if gemma else 1.0,
        **(_experts_from_metadata(md, arch, get) if experts else {}),
        **(_gemma2_from_metadata(md, arch, hidden // heads) if arch in ("gemma2", "gemma3") else {}),
        no_rope_layers=smollm3_no_rope_layers(int(get("block_count"))) if arch == "smollm3" else (),
        # gpt-oss: what llama.cpp fixes for the architecture (its clamped SwiGLU's alpha and limit)
        **(dict(attention_sinks=True, router_bias=True, clamped_swiglu=(1.702, 7.0)) if arch == "gpt-oss" else {}),
    ) | family  # (a family's own fields last: they override the common rules)
    if arch == "deepseek2":  # its attention's sizes and experts replace what the generic keys give
        fields.update(deepseek2.config_fields(md, get, where))
    return ModelConfig(**fields)


def mrope_section_of(md: dict[str, Any], arch: str, where: str) -> tuple[int, int, int]:
    """The M-RoPE sections of {arch}.rope.dimension_sections (time, height, width, and a fourth llama.cpp's qwen3vl and
    qwen35 leave 0)."""
    sections = md.get(f"{arch}.rope.dimension_sections")
    if not isinstance(sections, list) or len(sections) != 4 or sections[3] != 0 \
            or not all(isinstance(n, int) and n >= 0 for n in sections):
        raise ModelLoadError(f"{where}: {arch}.rope.dimension_sections = {sections!r}: expected the time, height and "
                             "width sections of M-RoPE and a 0 (an image-text model's text model)")
    return tuple(sections[:3])


def _widest(width: Any) -> int:
    """feed_forward_length: one width, or one per layer (nemotron_h's: 0 in its blocks without an MLP)."""
    return max(int(w) for w in width) if isinstance(width, (list, tuple, np.ndarray)) else int(width)


def _kv_heads_and_layers(md: dict[str, Any], arch: str, kv_heads: Any, get, where: str) -> tuple[int, dict[str, Any]]:
    """The KV heads, and a family's own fields: a hybrid's layer kinds and state layers' sizes (lfm2's
    attention.head_count_kv is one count per layer, 0: a short convolution of shortconv.l_cache taps; the
    others': hybrid_gguf.py), gemma4's layers of two shapes (gemma4_gguf.py)."""
    if arch == "gemma4":
        family = gemma4_gguf.fields_from_metadata(md, get)
        return family.pop("num_kv_heads"), family
    if arch in GGUF_HYBRIDS:
        hybrid = hybrid_fields_from_metadata(md, arch, get)
        return hybrid.pop("num_kv_heads", int(kv_heads) if not isinstance(kv_heads, list) else 0), hybrid
    if arch != "lfm2":
        return int(kv_heads), {}
    layers = int(get("block_count"))
    counts = list(kv_heads) if isinstance(kv_heads, (list, tuple, np.ndarray)) else [kv_heads] * layers
    attention = {int(n) for n in counts if n}
    if len(counts) != layers or len(attention) != 1:
        raise ModelLoadError(f"{where}: lfm2.attention.head_count_kv = {counts!r}: expected one count per layer, "
                             "0 for a convolution and the same for every attention layer")
    return attention.pop(), {"layer_types": tuple(ATTENTION if n else SHORT_CONV for n in counts),
                             "conv_kernel_size": int(get("shortconv.l_cache"))}


def smollm3_no_rope_layers(layers: int) -> tuple[int, ...]:
    """llama.cpp's smollm3: a NoPE layer every 4 (its n_no_rope_layer_step; no key in the file says otherwise)."""
    return tuple(i for i in range(layers) if (i + 1) % 4 == 0)


# llama.cpp's sliding-window pattern of the families that alternate local and global layers
SWA_PATTERNS = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2}


def _sliding_layers(md: dict[str, Any], arch: str, layers: int) -> tuple[int, ...] | None:
    """The local layers as llama.cpp reads them: {arch}.attention.sliding_window_pattern, a flag per
    layer or a period n (layer i local unless i % n == n - 1), else the family's period; None: all."""
    pattern = md.get(f"{arch}.attention.sliding_window_pattern", SWA_PATTERNS.get(arch))
    if pattern is None:
        return None
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ModelLoadError(f"{arch}.attention.sliding_window_pattern: {len(pattern)} entries for {layers} layers")
        return tuple(i for i, local in enumerate(pattern) if local)
    period = int(pattern)
    return tuple(i for i in range(layers) if period == 0 or i % period < period - 1)


def _gemma2_from_metadata(md: dict[str, Any], arch: str, hidden_per_head: int) -> dict[str, Any]:
    """gemma2/3 as llama.cpp runs them: the local RoPE base 10000, and the query scale 1/sqrt(head_dim)
    except in the 27B models (62 layers for gemma3, 46 for gemma2: hidden / heads)."""
    layers = int(md[f"{arch}.block_count"])
    scale = md.get(f"{arch}.attention.scale")
    if scale is not None:
        query_scalar = float(scale) ** -2
    elif layers == {"gemma2": 46, "gemma3": 62}[arch]:
        query_scalar = float(hidden_per_head)
    else:
        query_scalar = None  # head_dim
    return dict(
        local_rope_theta=float(md.get(f"{arch}.rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
        query_pre_attn_scalar=query_scalar,
        **{cap: float(md[f"{arch}.{cap}"]) if md.get(f"{arch}.{cap}") is not None else None
           for cap in ("attn_logit_softcapping", "final_logit_softcapping")},
        sandwich_norms=True,
    )


def _experts_from_metadata(md: dict[str, Any], arch: str, get) -> dict[str, Any]:
    return dict(
        num_experts=int(get("expert_count")),
        num_experts_per_tok=int(get("expert_used_count")),
        moe_intermediate_size=int(md.get(f"{arch}.expert_feed_forward_length") or get("feed_forward_length")),
        norm_topk_prob=bool(md.get(f"{arch}.expert_weights_norm", _NORM_TOPK_PROB.get(arch, False))),
        shared_expert_intermediate_size=int(md.get(f"{arch}.expert_shared_feed_forward_length") or 0),
    )


def _mapped(array: np.ndarray) -> torch.Tensor:
    """A tensor over the read-only memory map, no copy (nothing ever writes to weights)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(np.asarray(array))


def _tensor(file: GGUFFile, t: TensorInfo, where: str) -> Weight:
    rows_cols = tuple(reversed(t.shape))  # ggml lists ne0 (columns) first
    if t.qtype in _DENSE:
        return _mapped(file.tensor_bytes(t)).view(_DENSE[t.qtype]).reshape(rows_cols)
    if t.qtype not in SUPPORTED_QTYPES:
        raise ModelLoadError(
            f"{where}: tensor {t.name} has unsupported type {t.qtype.name}; "
            f"supported: {', '.join(q.name for q in SUPPORTED_QTYPES)}"
        )
    if len(rows_cols) == 3 and (gguf_expert_stack(t.name) or t.name.endswith(tuple(deepseek2.SPLIT_KV_B))):
        # [experts, rows, cols] (deepseek2's [heads, rows, cols]): rows of all experts end to end
        rows_cols = (rows_cols[0] * rows_cols[1], rows_cols[2])
    if len(rows_cols) != 2:
        raise ModelLoadError(f"{where}: quantized tensor {t.name} is not 2-D (shape {rows_cols})")
    return QuantTensor(_mapped(file.tensor_bytes(t)).reshape(rows_cols[0], -1), t.qtype, rows_cols)


def _split_experts(stack: Weight, t: TensorInfo, config: ModelConfig, where: str) -> list[Weight]:
    """One weight (or bias) per expert out of llama.cpp's stack of them (views: nothing is copied)."""
    experts = t.shape[-1] if len(t.shape) == (2 if t.name.endswith(".bias") else 3) else 0
    if experts != config.num_experts:
        raise ModelLoadError(f"{where}: tensor {t.name} has shape {tuple(reversed(t.shape))}, expected "
                             f"{config.num_experts} experts stacked")
    rows = t.shape[1]
    if isinstance(stack, QuantTensor):
        return [QuantTensor(stack.data[e * rows:(e + 1) * rows], stack.qtype, (rows, stack.shape[1]))
                for e in range(experts)]
    return list(stack.unbind(0))


def _read(file: GGUFFile, t: TensorInfo, where: str) -> Weight:
    try:
        return _tensor(file, t, where)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{where}: tensor {t.name} cannot be read ({e})") from None


def _rope_scaling_from_metadata(md: dict[str, Any], arch: str, scaling: str, get) -> dict[str, Any] | None:
    """Linear scaling, or LongRoPE (llama.cpp's phi3 writes its attention factor, and the two factor
    lists as the rope_factors_long / rope_factors_short tensors that the model loads)."""
    if scaling == "linear":
        return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    if scaling == "yarn" and arch == "deepseek2":
        return deepseek2.rope_scaling(md, get)
    if scaling == "yarn":  # gpt-oss's, as its config.json has it (OpenAI's and transformers' ramp, not truncated)
        return {"rope_type": "yarn", "factor": float(get("rope.scaling.factor")), "beta_fast": 32.0, "beta_slow": 1.0,
                "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
                "truncate": False}
    if md.get(f"{arch}.rope.scaling.attn_factor") is not None:
        return {"rope_type": "longrope", "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
                "attention_factor": float(get("rope.scaling.attn_factor"))}
    return None


def load_gguf(path: str | Path, progress: bool = True) -> tuple[ModelConfig, dict[str, Weight], dict[str, Any]]:
    """Config, weights by HF name (memory-mapped) and raw metadata (for the tokenizer)."""
    from tqdm import tqdm

    where = str(path)
    file = read_gguf(path)
    md = file.metadata
    config = config_from_metadata(md, where)
    weights: dict[str, Weight] = {}
    for t in tqdm(file.tensors, desc="loading", unit="tensor", disable=not progress, leave=False):
        if _layer_of(t.name) >= config.num_layers + config.mtp_layers:
            continue  # a block after the last layer: a family's multi-token prediction hearth does not run
        stack = gguf_expert_stack(t.name)
        if stack is not None and config.num_experts:
            for e, weight in enumerate(_split_experts(_read(file, t, where), t, config, where)):
                weights[hf_expert_name(stack[0], e, *stack[1:])] = weight
            continue
        name = gguf_to_hf(t.name, config.sandwich_norms, config.architecture)
        if config.architecture == "lfm2" and t.name == LFM2_FINAL_NORM:
            name = "model.norm.weight"
        if name is None:
            if UNUSED_GGUF_TENSORS.fullmatch(t.name):
                continue
            raise ModelLoadError(f"{where}: tensor {t.name} is not part of the {config.architecture} model hearth "
                                 "implements (a feature of the file hearth would otherwise drop)")
        if config.architecture == "phi3" and name.endswith("mlp.up_proj.weight"):
            name = name.replace("up_proj", "gate_up_proj")  # llama.cpp's phi3 ffn_up: gate and up in one matrix
        weights[name] = _read(file, t, where)
        if name.endswith("conv.conv.weight") and weights[name].dim() == 2:
            weights[name] = weights[name].unsqueeze(1)  # [channels, taps] as a depthwise Conv1d's [channels, 1, taps]
        if name.endswith("shared_expert_gate.weight") and weights[name].dim() == 1:
            weights[name] = weights[name].unsqueeze(0)  # [hidden] as a [1, hidden] projection
    if config.architecture in GGUF_HYBRIDS.values():
        hybrid_weights_from_gguf(config, weights)
    if config.architecture == "gemma4":  # (its experts beside the MLP, in every layer)
        gemma4_gguf.weights_from_gguf(config, weights, where)
    elif config.num_experts:  # layers without a router have a dense MLP
        config.dense_mlp_layers = tuple(layer for layer in range(config.num_layers)
                                        if f"model.layers.{layer}.mlp.gate.weight" not in weights)
    # (any layer's: a hybrid's first layer may hold no attention)
    config.attention_bias = any(name.endswith(".self_attn.q_proj.bias") for name in weights)
    config.mlp_bias = any(f"model.layers.0.mlp.{part}gate_proj.bias" in weights for part in ("", "experts.0."))
    if config.architecture in PERMUTED_QK_ARCHITECTURES:
        _unpermute_qk(weights, config)
    if config.architecture == "deepseek_v2":
        deepseek2.join_kv_b(weights, config, where)
    if config.vocab_size == 0 and "model.embed_tokens.weight" in weights:
        config.vocab_size = weights["model.embed_tokens.weight"].shape[0]
    return config, weights, md


def _layer_of(gguf_name: str) -> int:
    """The block a GGUF tensor belongs to (blk.N.*), -1 for the model's own (token_embd, output, ...)."""
    m = re.match(r"blk\.(\d+)\.", gguf_name)
    return int(m.group(1)) if m else -1


def _unpermute_qk(weights: dict[str, Weight], config: ModelConfig) -> None:
    """Undo llama.cpp's Q/K row interleaving so the model runs HF's rotate-half RoPE."""
    for layer in range(config.num_layers):
        for proj, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            if name not in weights:
                continue
            order = qk_row_order(heads, config.head_dim, to_gguf=False)
            w = weights[name]
            if len(order) != w.shape[0]:
                raise ModelLoadError(f"tensor {name}: {w.shape[0]} rows, expected {len(order)}")
            weights[name] = w.rows(order) if isinstance(w, QuantTensor) else w[order]
