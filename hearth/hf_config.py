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


def experts_from_hf(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """The ModelConfig fields of an MoE family's config.json (none for a dense one)."""
    if arch == "deepseek_v2":
        return _deepseek_experts_from_hf(hf)
    if arch not in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
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
        norm_topk_prob=True if arch == "mixtral" else bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
        dense_mlp_layers=tuple(sorted(dense)) if experts else (),
    )


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
    elif arch == "qwen3_5" and "text_config" in hf:  # the image-text model: hearth runs its text model
        text = hf["text_config"]
        if not isinstance(text, dict):
            raise ModelLoadError(f"text_config = {text!r}: expected an object")
        return hybrid_fields_from_hf({**text, "tie_word_embeddings": hf.get("tie_word_embeddings",
                                                                            text.get("tie_word_embeddings", False))}, arch)
    if arch == "qwen3_5" and (hf.get("hidden_act") or "silu") != "silu":  # its convolution's activation too
        raise ModelLoadError(f"hidden_act={hf['hidden_act']!r} is not implemented by hearth for qwen3_5")
    return hf


def _lfm2_mlp_width(hf: dict[str, Any]) -> int:
    width = int(hf.get("block_ff_dim") or hf["intermediate_size"])
    if hf.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        if hf.get("block_ffn_dim_multiplier") is not None:
            multiple = int(hf.get("block_multiple_of") or 256)
            width = multiple * -(-int(float(hf["block_ffn_dim_multiplier"]) * width) // multiple)
    return width


def hybrid_from_hf(hf: dict[str, Any], arch: str, rope: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a hybrid family (lfm2: short convolutions; qwen3_5: Gated DeltaNet
    and gated attention); none for other families."""
    if arch not in ("lfm2", "qwen3_5"):
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
_IMPLEMENTED_BY = {"attn_logit_softcapping": ("gemma2", "gemma3"), "final_logit_softcapping": ("gemma2", "gemma3"),
                   "partial_rotary_factor": ("qwen3_5",)}


def refuse_unimplemented(hf: dict[str, Any], where: str, arch: str) -> None:
    rope = hf.get("rope_parameters") or {}  # transformers >= 5 may put the rotary fraction here
    for name, inactive in _INACTIVE_FIELDS.items():
        value = hf.get(name, rope.get(name))
        if value not in inactive and arch not in _IMPLEMENTED_BY.get(name, ()):
            raise ModelLoadError(f"{where}: {name}={value!r} is not implemented by hearth")


# quantization_config's quant_method values whose weights hearth reads (hearth/loading/library_quant.py)
LIBRARY_QUANTIZATIONS = ("gptq", "awq", "fp8")


def refuse_quantized_or_multimodal(hf: dict[str, Any], where: str) -> None:
    """A checkpoint hearth would misread refused by name, before any tensor is looked for: weights
    quantized by a library other than LIBRARY_QUANTIZATIONS (bitsandbytes, ...; their tensors are
    packed integers under other names) and models with an image encoder (vision_config)."""
    quantization = hf.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method", "unnamed") if isinstance(quantization, dict) else quantization
        if method not in LIBRARY_QUANTIZATIONS:
            raise ModelLoadError(
                f"{where}: the weights are quantized by {method!r} (quantization_config), which hearth does not read "
                f"(it reads {', '.join(LIBRARY_QUANTIZATIONS)}); convert the original checkpoint to GGUF with "
                "llama.cpp (convert_hf_to_gguf.py, then llama-quantize) or `hearth convert` / `hearth quantize`, "
                "or load the unquantized bf16/fp16 checkpoint")
    # Qwen3.5 is published only as an image-text model: its text model runs (the vision tower's tensors
    # are left unloaded, with a log line; images are refused by the server)
    # SmolVLM / Idefics3 run whole, images included (hearth/vision_config.py)
    runs_text_model = hf.get("architectures") == ["Qwen3_5ForConditionalGeneration"]
    if hf.get("vision_config") is not None and not runs_text_model and vision_family(hf) is None:
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
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # (its text model: text_config, model.language_model.*)
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
            arch = {"gemma3_text": "gemma3", "qwen3_5_text": "qwen3_5"}.get(arch, arch)
    if arch not in supported:
        raise ModelLoadError(
            f"{where}: unsupported architecture {archs or hf.get('model_type')!r}; "
            f"hearth supports {', '.join(HF_ARCHITECTURES)}"
        )
    return arch
