"""The family-specific parts of a Hugging Face config.json, read for ModelConfig.from_hf (hearth/config.py):
sliding layers, RoPE scaling, NoPE layers, gemma2/3's caps and norms, experts, latent attention, and
the fields of features hearth refuses rather than run without."""

from __future__ import annotations

import math
from typing import Any

from hearth.errors import ModelLoadError
from hearth.vision_config import VISION_ARCHITECTURES, vision_family

# config.json's layer_types of hybrids -> ModelConfig's (config.py's ATTENTION, SHORT_CONV, GATED_DELTA_NET)
_HYBRID_LAYER_KINDS = {"full_attention": "attention", "conv": "short_conv", "linear_attention": "gated_delta_net"}


def sliding_layers_from_hf(hf: dict[str, Any], arch: str) -> tuple[int, ...] | None:
    """The layers that attend through the sliding window (None: every layer): config.json's
    layer_types, else each family's rule as transformers derives it."""
    layers = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types")
    if kinds is None:
        pattern = int(hf.get("sliding_window_pattern") or 6)
        after = int(hf.get("max_window_layers") or 0)
        local = {
            "gemma2": lambda i: i % 2 == 0,  # alternating, from a local layer
            "gemma3": lambda i: (i + 1) % pattern != 0,  # a global layer every `pattern`
            "qwen2": lambda i: i >= after, "qwen3": lambda i: i >= after,
            "qwen2_moe": lambda i: (i + 1) % 2 == 1 and i < after,
            "gpt_oss": lambda i: i % 2 == 0,  # alternating, from a sliding layer
        }.get(arch)
        if local is None:
            return None
        kinds = ["sliding_attention" if local(i) else "full_attention" for i in range(layers)]
    if len(kinds) != layers or set(kinds) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"layer_types = {kinds!r}: expected sliding_attention or full_attention for each layer")
    return tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")


def rope_scaling_from_hf(hf: dict[str, Any], rope: dict[str, Any], head_dim: int) -> dict[str, Any] | None:
    """The config's RoPE scaling; LongRoPE's (Phi-3's "su" too) made whole: its original context
    (in the scaling or at the top level), and its attention factor as transformers derives it."""
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if not isinstance(scaling, dict) or (scaling.get("rope_type") or scaling.get("type")) not in ("longrope", "su"):
        return scaling
    original = int(scaling.get("original_max_position_embeddings") or hf["original_max_position_embeddings"])
    for name in ("short_factor", "long_factor"):
        factors = scaling.get(name)
        if (not isinstance(factors, list) or len(factors) != head_dim // 2
                or not all(isinstance(f, (int, float)) and math.isfinite(f) and f > 0 for f in factors)):
            raise ModelLoadError(f"rope_scaling.{name}: expected {head_dim // 2} positive numbers")
    factor = scaling.get("factor") or int(hf.get("max_position_embeddings", 2048)) / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return {"rope_type": "longrope", "short_factor": scaling["short_factor"], "long_factor": scaling["long_factor"],
            "original_max_position_embeddings": original, "attention_factor": float(attention_factor)}


def no_rope_layers_from_hf(hf: dict[str, Any]) -> tuple[int, ...]:
    """smollm3's no_rope_layers (1: the layer rotates, 0: it does not), else one NoPE layer every
    no_rope_layer_interval layers, as transformers derives it."""
    layers = int(hf["num_hidden_layers"])
    uses_rope = hf.get("no_rope_layers")
    if uses_rope is None:
        interval = int(hf.get("no_rope_layer_interval") or 4)
        uses_rope = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(uses_rope) != layers or set(uses_rope) - {0, 1}:
        raise ModelLoadError(f"no_rope_layers = {uses_rope!r}: expected 0 or 1 for each layer")
    return tuple(i for i, use in enumerate(uses_rope) if not use)


def gemma2_from_hf(hf: dict[str, Any], arch: str, local_rope: dict[str, Any] | None) -> dict[str, Any]:
    """The ModelConfig fields of gemma2 and gemma3 (none for other families)."""
    if arch not in ("gemma2", "gemma3"):
        return {}
    local_theta = None
    if arch == "gemma3":
        if local_rope is not None:
            if local_rope.get("rope_type", "default") != "default":
                raise ModelLoadError(f"RoPE scaling {local_rope.get('rope_type')!r} of the sliding layers is not "
                                     "implemented by hearth")
            local_theta = float(local_rope["rope_theta"])
        else:
            local_theta = float(hf.get("rope_local_base_freq") or 10000.0)
    capping = {name: float(hf[name]) if hf.get(name) is not None else None
               for name in ("attn_logit_softcapping", "final_logit_softcapping")}
    return dict(
        local_rope_theta=local_theta,
        query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]) if hf.get("query_pre_attn_scalar") else None,
        sandwich_norms=True,
        **capping,
    )


# transformers' defaults for a gemma4 config without rope_parameters
_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
_GEMMA4_LAYER_FIELDS = {"head_dim", "num_key_value_heads"}  # what per_layer_config may set, as transformers' gemma4 does


def gemma4_from_hf(hf: dict[str, Any], arch: str, rope: dict[str, Any], local_rope: dict[str, Any] | None
                   ) -> dict[str, Any]:
    """gemma4's fields (none for other families), as transformers' Gemma4TextConfig derives them: sliding and
    full layers (the last one full), the full layers' own head_dim and KV heads (per_layer_config, or
    global_head_dim / num_global_key_value_heads), KV sharing in the last num_kv_shared_layers (each reads the
    last earlier layer of its kind that keeps its own), per-layer embeddings, the experts beside the MLP."""
    if arch != "gemma4":
        return {}
    if hf.get("use_bidirectional_attention") == "all":  # ("vision": images only; hearth's text stays causal)
        raise ModelLoadError("use_bidirectional_attention='all' is not implemented by hearth")
    layers = int(hf["num_hidden_layers"])
    kinds = list(hf.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                           for i in range(layers)])
    kinds[-1:] = ["full_attention"]  # transformers forces the last layer full
    sliding = sliding_layers_from_hf({**hf, "layer_types": kinds}, arch)
    full = [i for i in range(layers) if i not in sliding]
    if not hf.get("rope_parameters"):
        rope, local_rope = _GEMMA4_ROPE["full_attention"], _GEMMA4_ROPE["sliding_attention"]
    if (local_rope or {}).get("rope_type", "default") != "default":
        raise ModelLoadError(f"RoPE scaling {local_rope.get('rope_type')!r} of the sliding layers is not implemented "
                             "by hearth")
    head_dims, kv_heads = _gemma4_layer_shapes(hf, layers, full)
    shared = int(hf.get("num_kv_shared_layers") or 0)
    sources = _gemma4_kv_sources(kinds, layers - shared)
    width, experts = int(hf.get("hidden_size_per_layer_input", 256) or 0), bool(hf.get("enable_moe_block"))
    if width and int(hf.get("vocab_size_per_layer_input", 262_144)) < int(hf["vocab_size"]):
        raise ModelLoadError(f"vocab_size_per_layer_input = {hf['vocab_size_per_layer_input']}: fewer than the "
                             f"{hf['vocab_size']} tokens (transformers' gemma4 cannot look the others up either)")
    return dict(
        hidden_act=hf.get("hidden_activation") or "gelu_pytorch_tanh", tie_word_embeddings=bool(
            hf.get("tie_word_embeddings", True)), sliding_layers=sliding, qk_norm="head", value_norm=True,
        embedding_scale=math.sqrt(int(hf["hidden_size"])), query_pre_attn_scalar=1.0,  # attention scores unscaled
        final_logit_softcapping=float(hf["final_logit_softcapping"]) if hf.get("final_logit_softcapping") else None,
        sandwich_norms=True, rope_theta=float(rope["rope_theta"]),
        rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
        local_rope_theta=float(local_rope["rope_theta"]), layer_head_dims=head_dims, layer_kv_heads=kv_heads,
        kv_sources=sources if shared else (), k_eq_v_layers=tuple(full) if hf.get("attention_k_eq_v") else (),
        double_wide_mlp_layers=tuple(range(layers - shared, layers)) if hf.get("use_double_wide_mlp") else (),
        per_layer_input_size=width, per_layer_vocab_size=int(hf.get("vocab_size_per_layer_input", 262_144)) if width
        else 0, num_experts=int(hf["num_experts"]) if experts else 0,
        num_experts_per_tok=int(hf["top_k_experts"]) if experts else 0,
        moe_intermediate_size=int(hf["moe_intermediate_size"]) if experts else 0, norm_topk_prob=experts,
    )


def _gemma4_layer_shapes(hf: dict[str, Any], layers: int, full: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each layer's head_dim and KV heads: config.json's per_layer_config, else global_head_dim (512) on the full
    layers and, with attention_k_eq_v, num_global_key_value_heads there."""
    overrides = hf.get("per_layer_config")
    if overrides is None:
        wide = {"head_dim": int(hf.get("global_head_dim", 512))}
        if hf.get("attention_k_eq_v") and hf.get("num_global_key_value_heads") is not None:
            wide["num_key_value_heads"] = int(hf["num_global_key_value_heads"])
        overrides = {layer: wide for layer in full}
    if not isinstance(overrides, dict) or not all(isinstance(v, dict) for v in overrides.values()):
        raise ModelLoadError(f"per_layer_config = {overrides!r}: expected an object of layer -> fields")
    overrides = {int(layer): fields for layer, fields in overrides.items()}
    unknown = sorted({name for fields in overrides.values() for name in fields} - _GEMMA4_LAYER_FIELDS)
    if unknown or not all(0 <= layer < layers for layer in overrides):
        raise ModelLoadError(f"per_layer_config: {unknown[0] if unknown else 'a layer number past the layers'} is not "
                             f"implemented by hearth (it reads {', '.join(sorted(_GEMMA4_LAYER_FIELDS))} per layer)")
    base = {"head_dim": int(hf.get("head_dim") or 256),
            "num_key_value_heads": int(hf.get("num_key_value_heads") or hf["num_attention_heads"])}
    shapes = [{**base, **overrides.get(layer, {})} for layer in range(layers)]
    return tuple(int(s["head_dim"]) for s in shapes), tuple(int(s["num_key_value_heads"]) for s in shapes)


def _gemma4_kv_sources(kinds: list[str], first_shared: int) -> tuple[int, ...]:
    """Per layer the layer whose K/V it attends over: itself before first_shared, after it the last layer
    before first_shared of the same kind (transformers' kv_sharing_modes' "store" layer)."""
    sources = list(range(first_shared))
    for layer in range(max(first_shared, 0), len(kinds)):
        same = [i for i in range(first_shared) if kinds[i] == kinds[layer]]
        if not same:
            raise ModelLoadError(f"num_kv_shared_layers = {len(kinds) - first_shared}: layer {layer} "
                                 f"({kinds[layer]}) has no earlier layer of its kind to share K/V with")
        sources.append(same[-1])
    return tuple(sources)


def experts_from_hf(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """The ModelConfig fields of an MoE family's config.json (none for a dense one)."""
    if arch == "deepseek_v2":
        return _deepseek_experts_from_hf(hf)
    if arch == "nemotron_h":
        return _nemotron_h_experts_from_hf(hf)
    if arch == "granitemoehybrid":  # softmax over the top k's logits (= over all, renormalised); an ungated shared MLP
        experts = int(hf.get("num_local_experts") or 0)
        return {} if not experts else dict(
            num_experts=experts, num_experts_per_tok=int(hf["num_experts_per_tok"]),
            moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True,
            shared_expert_intermediate_size=int(hf.get("shared_intermediate_size", 1024)), shared_expert_gated=False)
    if arch not in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "qwen3_next"):
        return {}
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    layers = int(hf["num_hidden_layers"])
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in hf.get("mlp_only_layers") or []} | {i for i in range(layers) if (i + 1) % step}
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        # mixtral's and olmoe's experts are intermediate_size wide; qwen's have their own size
        moe_intermediate_size=int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
        # gpt_oss: a softmax over the chosen experts' logits, the same as renormalising over them
        norm_topk_prob=True if arch in ("mixtral", "gpt_oss") else bool(hf.get("norm_topk_prob", arch == "qwen3_next")),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
        dense_mlp_layers=tuple(sorted(dense)) if experts else (),
    )


def _nemotron_h_experts_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """nemotron_h's experts (its blocks of kind moe; the mlp blocks are dense): the top num_experts_per_tok
    of n_routed_experts by sigmoid score plus e_score_correction_bias, weighted by their scores
    (renormalised with norm_topk_prob) times routed_scaling_factor; ungated relu2 experts and a shared
    one beside them, unscaled."""
    kinds = _nemotron_h_layers(hf)
    if "moe" not in kinds:
        return {}
    if int(hf.get("n_group") or 1) != 1:
        raise ModelLoadError(f"n_group={hf['n_group']!r} is not implemented by hearth for nemotron_h")
    return dict(
        num_experts=int(hf["n_routed_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]), norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=int(hf["moe_shared_expert_intermediate_size"]), shared_expert_gated=False,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)), router_sigmoid=True,
        dense_mlp_layers=tuple(i for i, kind in enumerate(kinds) if kind != "moe"),
    )


def gpt_oss_from_hf(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """gpt_oss's fields (none for other families): attention sinks, a bias on the router (the experts'
    and attention's: mlp_bias, attention_bias), the experts' clamped SwiGLU."""
    if arch != "gpt_oss":
        return {}
    if (hf.get("hidden_act") or "silu") != "silu":
        raise ModelLoadError(f"hidden_act={hf['hidden_act']!r} is not implemented by hearth for gpt_oss")
    alpha, limit = float(hf.get("swiglu_alpha", 1.702)), float(hf.get("swiglu_limit", 7.0))
    if not (math.isfinite(alpha) and math.isfinite(limit) and limit > 0):
        raise ModelLoadError(f"swiglu_alpha = {alpha!r}, swiglu_limit = {limit!r}: expected finite numbers, a positive limit")
    return dict(attention_sinks=True, router_bias=True, clamped_swiglu=(alpha, limit))


def _deepseek_experts_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """deepseek_v2's experts as transformers runs them: dense MLPs in the first first_k_dense_replace
    layers, then the top num_experts_per_tok of n_routed_experts by softmax (greedy, or within the best
    groups: group_limited_greedy), times routed_scaling_factor, plus n_shared_experts experts' worth of
    an ungated shared MLP."""
    # (transformers' default, the values hearth implements); norm_topk_prob: transformers' deepseek_v2
    # ignores it where DeepSeek's own code renormalises, so that no reference says what true means
    for name, (default, implemented) in {
        "topk_method": ("greedy", ("greedy", "group_limited_greedy")), "scoring_func": ("softmax", ("softmax",)),
        "moe_layer_freq": (1, (1,)), "norm_topk_prob": (False, (False,)),
    }.items():
        if hf.get(name, default) not in implemented:
            raise ModelLoadError(f"{name}={hf.get(name, default)!r} is not implemented by hearth for deepseek_v2")
    grouped = hf.get("topk_method", "greedy") == "group_limited_greedy"
    experts = int(hf["n_routed_experts"])
    layers = int(hf["num_hidden_layers"])
    shared = int(hf.get("n_shared_experts") or 0)
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=False,
        shared_expert_intermediate_size=shared * int(hf["moe_intermediate_size"]),
        shared_expert_gated=False,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        dense_mlp_layers=tuple(range(min(layers, int(hf.get("first_k_dense_replace") or 0)))),
        expert_groups=int(hf["n_group"]) if grouped else 0,
        topk_groups=int(hf["topk_group"]) if grouped else 0,
    )


def latent_attention_from_hf(hf: dict[str, Any], arch: str, heads: int, kv_heads: int) -> dict[str, Any]:
    """deepseek_v2's multi-head latent attention sizes (none for other families)."""
    if arch != "deepseek_v2":
        return {}
    if kv_heads != heads:  # the latent gives every head its own K and V
        raise ModelLoadError(f"num_key_value_heads = {kv_heads}: multi-head latent attention needs one per head "
                             f"({heads})")
    return dict(kv_lora_rank=int(hf["kv_lora_rank"]), qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
                v_head_dim=int(hf["v_head_dim"]),
                q_lora_rank=int(hf.get("q_lora_rank", 1536) or 0))  # 1536: transformers' default


def hybrid_fields_from_hf(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """config.json of a hybrid family with its fields under the names the other families use (lfm2's
    norm_eps is rms_norm_eps, its block_* fields give the MLP's width as transformers derives it);
    every other family's as it is."""
    if arch == "lfm2":
        hf = {**hf, "rms_norm_eps": hf.get("norm_eps", 1e-5), "intermediate_size": _lfm2_mlp_width(hf),
              "tie_word_embeddings": hf.get("tie_embedding", hf.get("tie_word_embeddings", True))}
    elif arch in ("qwen3_5", "gemma4") and "text_config" in hf:  # the image-text model: hearth runs its text model
        text = hf["text_config"]
        if not isinstance(text, dict):
            raise ModelLoadError(f"text_config = {text!r}: expected an object")
        return hybrid_fields_from_hf({**text, "tie_word_embeddings": hf.get("tie_word_embeddings",
                                                                            text.get("tie_word_embeddings", False))}, arch)
    elif arch == "nemotron_h":  # its layers' kinds give their number; its MLP's activation is mlp_hidden_act
        legacy = {name: hf[old] for name, old in _NEMOTRON_H_LEGACY.items() if old in hf and name not in hf}
        hf = {**hf, **legacy, "rms_norm_eps": hf.get("layer_norm_epsilon", 1e-5), "head_dim": hf.get("head_dim") or 128,
              "hidden_act": hf.get("mlp_hidden_act", "relu2"), "num_hidden_layers": len(_nemotron_h_layers(hf)),
              "sliding_window": None}  # (its attention never reads the window its configs carry)
    elif arch == "qwen3_next":  # (its attention never reads a window, as transformers' deletes it)
        hf = {**hf, "sliding_window": None}
    elif arch == "granitemoehybrid" and not hf.get("num_local_experts"):  # dense: the shared MLP is the MLP
        hf = {**hf, "intermediate_size": hf.get("shared_intermediate_size", 1024)}
    # (the convolution's activation too)
    if arch in ("qwen3_5", "qwen3_next", "granitemoehybrid") and (hf.get("hidden_act") or "silu") != "silu":
        raise ModelLoadError(f"hidden_act={hf['hidden_act']!r} is not implemented by hearth for {arch}")
    return hf


# nemotron_h's fields under the older names its configs may carry (transformers reads both)
_NEMOTRON_H_LEGACY = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "time_step_min": "mamba_dt_min",
                      "use_conv_bias": "mamba_conv_bias"}


def _nemotron_h_layers(hf: dict[str, Any]) -> list[str]:
    """nemotron_h's layers_block_type, or its older hybrid_override_pattern (M: Mamba2, *: attention, -: MLP,
    E: experts), as transformers reads them."""
    kinds = hf.get("layers_block_type")
    if kinds is None:
        pattern = hf.get("hybrid_override_pattern")
        if not isinstance(pattern, str):
            raise ModelLoadError("nemotron_h without layers_block_type or hybrid_override_pattern")
        letters = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
        kinds = [letters.get(letter, letter) for letter in pattern]
    if not isinstance(kinds, list):
        raise ModelLoadError(f"layers_block_type = {kinds!r}: expected a list")
    return kinds


def _lfm2_mlp_width(hf: dict[str, Any]) -> int:
    width = int(hf.get("block_ff_dim") or hf["intermediate_size"])
    if hf.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        if hf.get("block_ffn_dim_multiplier") is not None:
            multiple = int(hf.get("block_multiple_of") or 256)
            width = multiple * -(-int(float(hf["block_ffn_dim_multiplier"]) * width) // multiple)
    return width


def hybrid_from_hf(hf: dict[str, Any], arch: str, rope: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a hybrid family (lfm2: short convolutions; qwen3_5 and qwen3_next: Gated
    DeltaNet and gated attention; granitemoehybrid and nemotron_h: Mamba2); none for other families."""
    if arch in ("granitemoehybrid", "nemotron_h"):
        return _mamba2_from_hf(hf, arch)
    if arch not in ("lfm2", "qwen3_5", "qwen3_next"):
        return {}
    layers = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types")
    if kinds is None and arch == "lfm2":
        attention = hf.get("full_attn_idxs")
        kinds = ["full_attention" if attention is None or i in attention else "conv" for i in range(layers)]
    elif kinds is None:
        interval = int(hf.get("full_attention_interval") or 4)
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    allowed = ("full_attention", "conv") if arch == "lfm2" else ("full_attention", "linear_attention")
    if not isinstance(kinds, list) or any(kind not in allowed for kind in kinds):
        raise ModelLoadError(f"layer_types = {kinds!r}: expected {' or '.join(allowed)} for each layer")
    fields = dict(layer_types=tuple(_HYBRID_LAYER_KINDS[kind] for kind in kinds))
    if arch == "lfm2":
        return fields | dict(conv_kernel_size=int(hf.get("conv_L_cache", 3)), conv_bias=bool(hf.get("conv_bias", False)))
    # rope's mrope_section / mrope_interleaved split the rotary frequencies among a token's time, height
    # and width positions: a text token's three are its one position, so they rotate as plain RoPE
    return fields | dict(
        conv_kernel_size=int(hf.get("linear_conv_kernel_dim", 4)),
        linear_num_key_heads=int(hf.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(hf.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(hf.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(hf.get("linear_value_head_dim", 128)),
        attention_output_gate=True,
        partial_rotary_factor=float(hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))),
    )


# Mamba2 families' layer kinds (transformers' names and the older ones its configs still carry) -> ModelConfig's
_MAMBA2_LAYER_KINDS = {"linear_attention": "mamba2", "mamba": "mamba2", "full_attention": "attention",
                       "attention": "attention", "mlp": "mlp", "moe": "mlp"}


def _mamba2_from_hf(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """granitemoehybrid's (Granite 4.0-H: Mamba2 and attention layers, each followed by an MLP or experts with
    a shared MLP; its multipliers; RoPE only with position_embedding_type rope) and nemotron_h's (Mamba2,
    attention and MLP blocks of one mixer each, attention without RoPE) fields, as transformers reads them."""
    granite = arch == "granitemoehybrid"
    kinds = hf.get("layer_types") if granite else _nemotron_h_layers(hf)
    if kinds is None:  # transformers' default: Mamba2 everywhere, which hearth refuses below
        kinds = ["mamba"] * int(hf["num_hidden_layers"])
    allowed = ("mamba", "attention") if granite else ("mamba", "attention", "mlp", "moe")
    if not isinstance(kinds, list) or any(_MAMBA2_LAYER_KINDS.get(kind, kind) not in
                                          {_MAMBA2_LAYER_KINDS[a] for a in allowed} for kind in kinds):
        raise ModelLoadError(f"layer_types = {kinds!r}: expected {', '.join(allowed)} for each layer (hearth "
                             f"does not implement {arch}'s other kinds)")
    hidden = int(hf["hidden_size"])
    heads = int(hf.get("mamba_n_heads" if granite else "mamba_num_heads") or 128)
    head_dim = hf.get("mamba_d_head" if granite else "mamba_head_dim") or "auto"
    head_dim = int(hf.get("mamba_expand", 2) * hidden // heads if head_dim == "auto" else head_dim)
    limit = [_json_float(bound) for bound in hf.get("time_step_limit") or (0.0, math.inf)]
    if not granite:  # transformers' nemotron_h clamps dt from time_step_min up (in its prompts; hearth in decodes too)
        limit = (float(hf.get("time_step_min", 0.001)), math.inf)
    if not granite and hf.get("moe_latent_size") is not None:
        raise ModelLoadError(f"moe_latent_size={hf['moe_latent_size']!r} is not implemented by hearth for {arch}")
    act = hf.get("hidden_act" if granite else "mamba_hidden_act") or "silu"
    if act != "silu":
        raise ModelLoadError(f"mamba_hidden_act={act!r} is not implemented by hearth for {arch}")
    layers = tuple(_MAMBA2_LAYER_KINDS[kind] for kind in kinds)
    rope = granite and hf.get("position_embedding_type") == "rope"
    return dict(
        layer_types=layers, no_rope_layers=() if rope else tuple(i for i, k in enumerate(layers) if k == "attention"),
        conv_kernel_size=int(hf.get("mamba_d_conv" if granite else "conv_kernel", 4)),
        conv_bias=bool(hf.get("mamba_conv_bias" if granite else "use_conv_bias", True)),
        mamba_num_heads=heads, mamba_head_dim=head_dim,
        ssm_state_size=int(hf.get("mamba_d_state" if granite else "ssm_state_size") or 128),
        mamba_groups=int(hf.get("mamba_n_groups" if granite else "n_groups") or 1),
        mamba_proj_bias=bool(hf.get("mamba_proj_bias", False) if granite else hf.get("use_bias", False)),
        time_step_limit=(float(limit[0]), float(limit[1])),
        embedding_scale=float(hf.get("embedding_multiplier") or 1.0) if granite else 1.0,
        residual_multiplier=float(hf.get("residual_multiplier") or 1.0) if granite else 1.0,
        logits_divisor=float(hf.get("logits_scaling") or 1.0) if granite else 1.0,
        query_pre_attn_scalar=float(hf.get("attention_multiplier") or 1.0) ** -2 if granite else None,
        single_mixer_blocks=not granite, gated_mlp=granite,
    )


def _json_float(value: Any) -> float:
    """A number of config.json, where transformers writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


# config.json fields of features hearth does not implement, with the values that switch them off:
# a config that switches one on is refused, never run without it.
_INACTIVE_FIELDS = {
    "partial_rotary_factor": (None, 1, 1.0),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "clip_qkv": (None,),  # olmoe
    "use_bidirectional_attention": (None, False),  # gemma3's encoder use
}
# of those, the ones some families implement
_IMPLEMENTED_BY = {"attn_logit_softcapping": ("gemma2", "gemma3"),
                   "final_logit_softcapping": ("gemma2", "gemma3", "gemma4"),
                   "partial_rotary_factor": ("qwen3_5", "qwen3_next"), "use_bidirectional_attention": ("gemma4",)}


def refuse_unimplemented(hf: dict[str, Any], where: str, arch: str) -> None:
    rope = hf.get("rope_parameters") or {}  # transformers >= 5 may put the rotary fraction here
    for name, inactive in _INACTIVE_FIELDS.items():
        value = hf.get(name, rope.get(name))
        if value not in inactive and arch not in _IMPLEMENTED_BY.get(name, ()):
            raise ModelLoadError(f"{where}: {name}={value!r} is not implemented by hearth")


# image-text (and audio) checkpoints whose text model hearth runs alone where config.json has no vision_config, their
# towers not loaded (loading/names.py's NOT_LOADED): no image or audio input reaches it (ModelConfig.accepts_images
# is False); with one, its images too (vision_config.py; the audio tower never loaded)
TEXT_MODEL_ONLY = ("gemma4",)
# quantization_config's quant_method values whose weights hearth reads (hearth/loading/library_quant.py)
LIBRARY_QUANTIZATIONS = ("gptq", "awq", "fp8")


def refuse_quantized_or_multimodal(hf: dict[str, Any], where: str) -> None:
    """A checkpoint hearth would misread refused by name, before any tensor is looked for: weights
    quantized by a library other than LIBRARY_QUANTIZATIONS (bitsandbytes, ...; their tensors are
    packed integers under other names) and models with an image encoder (vision_config)."""
    quantization = hf.get("quantization_config")
    # gpt-oss's released experts in MXFP4: kept in 4 bits as GGUF's MXFP4 blocks (hearth/loading/gpt_oss.py)
    gpt_oss_mxfp4 = hf.get("model_type") == "gpt_oss" and isinstance(quantization, dict) and \
        quantization.get("quant_method") == "mxfp4"
    if quantization is not None and not gpt_oss_mxfp4:
        method = quantization.get("quant_method", "unnamed") if isinstance(quantization, dict) else quantization
        if method not in LIBRARY_QUANTIZATIONS:
            raise ModelLoadError(
                f"{where}: the weights are quantized by {method!r} (quantization_config), which hearth does not read "
                f"(it reads {', '.join(LIBRARY_QUANTIZATIONS)}); convert the original checkpoint to GGUF with "
                "llama.cpp (convert_hf_to_gguf.py, then llama-quantize) or `hearth convert` / `hearth quantize`, "
                "or load the unquantized bf16/fp16 checkpoint")
    # SmolVLM / Idefics3, Qwen3-VL and Qwen3.5 run whole, images included (hearth/vision_config.py)
    if hf.get("vision_config") is not None and vision_family(hf) is None and hf.get("model_type") not in TEXT_MODEL_ONLY:
        raise ModelLoadError(
            f"{where}: a model with an image encoder (vision_config) of a family hearth does not implement "
            f"(hearth runs the images of {', '.join(sorted(VISION_ARCHITECTURES))}); load the text model's own "
            "checkpoint where one is published")


# config.json's architecture names -> hearth's
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",  # the text model (model_type gemma3_text)
    "SmolLM3ForCausalLM": "smollm3",
    "Phi3ForCausalLM": "phi3",  # q/k/v and gate/up stored merged
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "DeepseekV2ForCausalLM": "deepseek_v2",  # multi-head latent attention (hearth/model/latent_attention.py)
    # hybrids: attention layers between layers that keep a state per sequence (hearth/model/state_layers.py)
    "Lfm2ForCausalLM": "lfm2",  # short convolutions
    "Qwen3_5ForCausalLM": "qwen3_5",  # Gated DeltaNet (the text model, model_type qwen3_5_text)
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # (text_config, model.language_model.*; images: vision_config.py)
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",  # Granite 4.0-H: Mamba2
    "NemotronHForCausalLM": "nemotron_h",  # Mamba2
    "GptOssForCausalLM": "gpt_oss",  # attention sinks, sliding and full layers, experts with a clamped SwiGLU
    "Gemma4ForCausalLM": "gemma4",  # the text model (model_type gemma4_text; hearth/model/gemma4.py)
    "Gemma4ForConditionalGeneration": "gemma4",  # (text_config, model.language_model.*; images: vision_config.py)
}


def architecture_from_hf(hf: dict[str, Any], where: str, supported: tuple[str, ...]) -> str:
    """The architecture of a config.json: its `architectures`, else its model_type (one of `supported`)."""
    archs = hf.get("architectures") or []
    if not isinstance(archs, list):
        raise ModelLoadError(f"{where}: architectures = {archs!r}: expected a list of names")
    arch = next((HF_ARCHITECTURES[a] for a in archs if isinstance(a, str) and a in HF_ARCHITECTURES), None)
    if arch is None:
        arch = hf.get("model_type")
        if isinstance(arch, str):  # (another type is no architecture: refused below)
            arch = {"gemma3_text": "gemma3", "qwen3_5_text": "qwen3_5", "gemma4_text": "gemma4"}.get(arch, arch)
    if arch not in supported:
        raise ModelLoadError(
            f"{where}: unsupported architecture {archs or hf.get('model_type')!r}; "
            f"hearth supports {', '.join(HF_ARCHITECTURES)}"
        )
    return arch
