"""Hugging Face folder -> GGUF file laid out as llama.cpp's convert_hf_to_gguf.py writes it.

The format itself is written by gguf.GGUFWriter (llama.cpp's own package). This module decides
what goes in: llama.cpp's architecture name and hyperparameter keys, its tensor names, its Q/K
row order for llama/mistral, gemma's (w + 1) norms, llama3 rope factors, the tokenizer metadata,
and one type per tensor. Tensors are written one at a time, so memory holds one converted tensor.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from gguf import (GGML_QUANT_SIZES, GGML_QUANT_VERSION, GGMLQuantizationType, GGUFWriter, LlamaFileType,
                  RopeScalingType, TokenType)

from hearth.config import ATTENTION, GEMMA_ARCHITECTURES, ModelConfig
from hearth.errors import ModelLoadError
from hearth.loading import deepseek2, gemma4_gguf
from hearth.loading.gguf import SWA_PATTERNS, smollm3_no_rope_layers
from hearth.loading.hybrid_gguf import (GGUF_HYBRIDS, add_hybrid_metadata, check_convertible, gguf_architecture,
                                        hybrid_value_for_gguf, hybrid_weights_for_gguf, layer_counts)
from hearth.loading.names import (LFM2_FINAL_NORM, NO_GGUF, PERMUTED_QK_ARCHITECTURES, gguf_expert_stack_name,
                                  hf_expert, hf_expert_name, hf_to_gguf, is_vision_tensor, qk_row_order)
from hearth.loading.safetensors import load_hf_folder, read_json
from hearth.quant import QuantTensor, quantize
from hearth.quant.quantizer import SEARCHED, WEIGHTED, quantize_rows
from hearth.tokenizer_gguf import LLAMA3_REGEX, QWEN2_REGEX

Q = GGMLQuantizationType

# --type -> (general.file_type, type of the 2-D weights)
OUT_TYPES: dict[str, tuple[LlamaFileType, GGMLQuantizationType]] = {
    "f32": (LlamaFileType.ALL_F32, Q.F32),
    "f16": (LlamaFileType.MOSTLY_F16, Q.F16),
    "bf16": (LlamaFileType.MOSTLY_BF16, Q.BF16),
    "q8_0": (LlamaFileType.MOSTLY_Q8_0, Q.Q8_0),
    "q4_0": (LlamaFileType.MOSTLY_Q4_0, Q.Q4_0),
    "q4_1": (LlamaFileType.MOSTLY_Q4_1, Q.Q4_1),
    "q5_0": (LlamaFileType.MOSTLY_Q5_0, Q.Q5_0),
    "q5_1": (LlamaFileType.MOSTLY_Q5_1, Q.Q5_1),
    # ternary (BitNet b1.58): for models trained with weights in {-1, 0, 1} times a scale; any
    # other model loses most of its weights' information to them
    "tq1_0": (LlamaFileType.MOSTLY_TQ1_0, Q.TQ1_0),
    "tq2_0": (LlamaFileType.MOSTLY_TQ2_0, Q.TQ2_0),
}
TERNARY_TYPES = (Q.TQ1_0, Q.TQ2_0)

# hearth architecture -> llama.cpp's general.architecture (llama.cpp runs mistral and mixtral as llama)
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
                      "gemma2": "gemma2", "gemma3": "gemma3", "smollm3": "smollm3", "phi3": "phi3",
                      "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe",
                      "lfm2": "lfm2", "gpt_oss": "gpt-oss", "deepseek_v2": "deepseek2", "qwen3_5": "qwen35",
                      "qwen3_next": "qwen3next", "granitemoehybrid": "granitehybrid",
                      "nemotron_h": "nemotron_h", "gemma4": "gemma4"}  # (hybrid_gguf.gguf_architecture)
# an image-text model's text model with M-RoPE (Qwen3-VL's) -> llama.cpp's architecture for it
_MROPE_ARCHITECTURES = {"qwen3": "qwen3vl", "qwen3_moe": "qwen3vlmoe"}
# HF tensors llama.cpp drops on purpose
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")


def convert_hf_to_gguf(hf_dir: str | Path, out_path: str | Path, out_type: str = "f16", progress: bool = True) -> Path:
    """Write the HF model folder `hf_dir` as one GGUF file at `out_path` (returned); an image-text
    model's text model only, as llama.cpp's converter does (its vision tower: mmproj.write_mmproj)."""
    file_type, weight_type = out_types(out_type)
    writer, _, plan = open_hf_folder(hf_dir, file_type, weight_type, progress, text_of_image_text=True)
    return write_gguf(writer, plan, out_path, f"converting to {out_type}", progress)


def out_types(out_type: str) -> tuple[LlamaFileType, GGMLQuantizationType]:
    """--type's general.file_type and the type of the 2-D weights."""
    if out_type not in OUT_TYPES:
        raise ModelLoadError(f"unknown output type {out_type!r}; choose one of {', '.join(OUT_TYPES)}")
    return OUT_TYPES[out_type]


def open_hf_folder(hf_dir: str | Path, file_type: LlamaFileType, weight_type: GGMLQuantizationType,
                   progress: bool, text_of_image_text: bool = False
                   ) -> tuple[GGUFWriter, ModelConfig, list[PlannedTensor]]:
    """A writer holding the folder's model and tokenizer metadata, its config, and every tensor to
    write with its GGUF name and type (the 2-D weights in `weight_type` where llama.cpp would).
    text_of_image_text: an image-text model's text model alone (else such a folder is refused)."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ModelLoadError(f"{hf_dir}: no such model folder")
    config, weights = load_hf_folder(hf_dir, progress=progress)
    if config.architecture == "gpt_oss":  # (before GPTQ / AWQ blocks are made dense: MXFP4 experts are refused)
        _check_gpt_oss(hf_dir, config, weights)
    # a GPTQ / AWQ checkpoint's weights (GGUF blocks as read) written from their exact dense values
    weights = {name: w.dequantize() if isinstance(w, QuantTensor) else w for name, w in weights.items()}
    if config.vision is not None:
        if not text_of_image_text:
            raise ModelLoadError(f"{hf_dir}: an image-text model: `hearth convert` it first (its text model, and "
                                 "with --mmproj its vision tower), then quantize the text model's GGUF")
        weights = {name: w for name, w in weights.items() if not is_vision_tensor(name)}
    if config.architecture not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{hf_dir}: hearth does not convert {config.architecture} models to GGUF "
                             f"({NO_GGUF.get(config.architecture, 'no llama.cpp layout')}); run the folder itself")
    if config.architecture == "lfm2" and config.conv_bias:
        raise ModelLoadError(f"{hf_dir}: lfm2 with conv_bias: llama.cpp's lfm2 has no tensors for the convolution's "
                             "and its projections' biases")
    hybrid = config.architecture in GGUF_HYBRIDS.values()
    if hybrid:
        check_convertible(config)
        weights = hybrid_weights_for_gguf(config, weights)
    if config.architecture == "gemma4":
        gemma4_gguf.check_convertible(config)
        weights = gemma4_gguf.weights_for_gguf(weights)
    plan = list(_plan_tensors(config, weights, weight_type))
    writer = GGUFWriter(None, _gguf_architecture(config, hybrid))
    _add_model_metadata(writer, config, hf_dir.name, file_type)
    add_tokenizer_metadata(writer, hf_dir, config.vocab_size, gemma4=config.architecture == "gemma4")
    return writer, config, plan


def _gguf_architecture(config: ModelConfig, hybrid: bool) -> str:
    if hybrid:
        return gguf_architecture(config)
    if config.mrope_section is not None:
        return _MROPE_ARCHITECTURES[config.architecture]
    return GGUF_ARCHITECTURES[config.architecture]


def write_gguf(writer: GGUFWriter, plan: list[PlannedTensor], out_path: str | Path, description: str,
               progress: bool, importance: dict[str, np.ndarray] | None = None) -> Path:
    """Write `writer`'s metadata and the planned tensors, each encoded in its type (weighed by its
    entry in `importance`, an importance matrix by tensor name, where it has one), to `out_path`
    (returned), one tensor in memory at a time; through a .part file, so that no half file is left."""
    from tqdm import tqdm

    out_path = Path(out_path)
    importance = importance or {}
    for name, shape, qtype, _ in plan:
        byte_shape = _byte_shape(shape, qtype)
        if qtype in (Q.F32, Q.F16):
            dtype = np.dtype(np.float32 if qtype == Q.F32 else np.float16)
            writer.add_tensor_info(name, shape, dtype, _nbytes(byte_shape))
        else:
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), _nbytes(byte_shape), raw_dtype=qtype)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    partial = out_path.with_name(out_path.name + ".part")
    try:
        writer.write_header_to_file(partial)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        bar = tqdm(plan, desc=description, unit="tensor", disable=not progress, leave=False)
        for name, _, qtype, source in bar:
            writer.write_tensor_data(encode_tensor(source(), qtype, importance.get(name)))
        writer.close()
        os.replace(partial, out_path)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return out_path


# ---------------------------------------------------------------- tensors

Source = Callable[[], torch.Tensor]
PlannedTensor = tuple[str, tuple[int, ...], GGMLQuantizationType, Source]  # name, shape (torch order), type, values


def _plan_tensors(
    config: ModelConfig, weights: dict[str, torch.Tensor], weight_type: GGMLQuantizationType
) -> Iterator[PlannedTensor]:
    """(GGUF name, shape, type, function giving the float32 values) of every tensor to write."""
    from hearth.model.layers import rope_inv_freq

    arch = config.architecture
    scaling = config.rope_scaling or {}
    if (scaling.get("rope_type") or scaling.get("type")) == "llama3":
        # llama.cpp divides its base frequencies by these factors (convert_hf_to_gguf.py does the same)
        base = dataclasses.replace(config, rope_scaling=None)
        factors = (rope_inv_freq(base) / rope_inv_freq(config)).float()
        yield "rope_freqs.weight", tuple(factors.shape), Q.F32, lambda: factors
    if arch == "gemma4":  # its full layers' proportional RoPE
        factors = gemma4_gguf.rope_freqs(config)
        yield "rope_freqs.weight", tuple(factors.shape), Q.F32, lambda: factors
    if scaling.get("rope_type") == "longrope":  # the two lists as llama.cpp's phi3 tensors
        for name, key in (("rope_factors_long.weight", "long_factor"), ("rope_factors_short.weight", "short_factor")):
            values = torch.tensor(scaling[key], dtype=torch.float32)
            yield name, tuple(values.shape), Q.F32, lambda values=values: values

    tied = config.tie_word_embeddings or arch in GEMMA_ARCHITECTURES
    stacks: set[tuple[int, str, str]] = set()  # (layer, projection, weight or bias) of the experts' tensors
    for hf_name, tensor in weights.items():
        if _IGNORED.fullmatch(hf_name) or (hf_name == "lm_head.weight" and tied):
            continue  # llama.cpp reads the output projection from token_embd when tied
        if (expert := hf_expert(hf_name)) is not None and config.num_experts:
            # (gemma4: gate and up in one stack, as llama.cpp's converter writes them)
            fused = arch == "gemma4" and expert[2] != "down_proj"
            stacks.add((expert[0], "gate_up_proj" if fused else expert[2], expert[3]))
            continue
        if arch == "deepseek_v2" and (halves := deepseek2.split_kv_b(config, hf_name, tensor)) is not None:
            for name, shape, values in halves:  # (the types as llama.cpp's: by the last dimension)
                yield name, shape, tensor_type(name, torch.empty(shape, device="meta"), weight_type), values
            continue
        name = hf_to_gguf(hf_name, config.sandwich_norms, arch)
        if arch == "lfm2" and hf_name == "model.norm.weight":
            name = LFM2_FINAL_NORM
        if name is None or name.startswith("rope_"):
            raise ModelLoadError(f"tensor {hf_name}: no llama.cpp name for it in a {arch} model")
        # the shape as stored (a convolution's [channels, taps], Mamba2's [heads, 1]): the values' on the meta device
        stored = _transform(config, hf_name, torch.empty(tensor.shape, device="meta"))()
        yield name, tuple(stored.shape), tensor_type(name, stored, weight_type), _transform(config, hf_name, tensor)
    for layer, projection, attr in sorted(stacks):
        yield _expert_stack(config, weights, layer, projection, attr, weight_type)


def _expert_stack(config: ModelConfig, weights: dict[str, torch.Tensor], layer: int, projection: str, attr: str,
                  weight_type: GGMLQuantizationType) -> PlannedTensor:
    """llama.cpp's one tensor [experts, rows, cols] for a layer's experts' `projection` ([experts, rows]
    for gpt-oss's biases; gate_up_proj: each expert's gate rows, then its up rows)."""
    parts = ("gate_proj", "up_proj") if projection == "gate_up_proj" else (projection,)
    names = [[hf_expert_name(layer, e, part, attr) for part in parts] for e in range(config.num_experts)]
    missing = [name for expert in names for name in expert if name not in weights]
    if missing:
        raise ModelLoadError(f"missing tensor {missing[0]}")
    first = weights[names[0][0]]
    shape = (len(names), sum(weights[n].shape[0] for n in names[0]), *first.shape[1:])
    name = gguf_expert_stack_name(layer, projection, attr)
    return name, shape, tensor_type(name, first, weight_type), lambda: torch.stack(
        [torch.cat([weights[n].float() for n in expert]) for expert in names])


def _check_gpt_oss(hf_dir: Path, config: ModelConfig, weights: dict[str, torch.Tensor | QuantTensor]) -> None:
    """A gpt-oss folder hearth writes: unquantized experts (not yet MXFP4 ones), and what llama.cpp's gpt-oss
    fixes (no GGUF key says otherwise, and hearth's reader takes the same): the clamped SwiGLU's alpha
    1.702 and limit 7, YaRN's betas 32 and 1 untruncated."""
    if any(isinstance(w, QuantTensor) for w in weights.values()):
        raise ModelLoadError(f"{hf_dir}: experts in MXFP4: hearth convert does not write MXFP4 yet; convert with "
                             "llama.cpp's convert_hf_to_gguf.py (which keeps them in MXFP4), or run the folder itself")
    scaling = config.rope_scaling or {}
    if config.clamped_swiglu != (1.702, 7.0) or (scaling.get("rope_type") or scaling.get("type")) != "yarn" or \
            float(scaling.get("beta_fast") or 32) != 32 or float(scaling.get("beta_slow") or 1) != 1 or \
            scaling.get("truncate", True) is not False:
        raise ModelLoadError(f"{hf_dir}: swiglu_alpha, swiglu_limit = {config.clamped_swiglu}, rope {scaling}: "
                             "llama.cpp's gpt-oss fixes (1.702, 7.0) and YaRN with betas 32 and 1, untruncated")


def tensor_type(name: str, tensor: torch.Tensor, weight_type: GGMLQuantizationType) -> GGMLQuantizationType:
    """llama.cpp's choice: norms, 1-D tensors, those not named *.weight (ssm_a), convolutions and MoE routers
    F32; weights (token_embd and output
    included, except with ternary types: the embeddings of ternary models are not ternary) in the
    requested type, F16 where a row is not a whole number of blocks."""
    if tensor.dim() <= 1 or not name.endswith(".weight") or weight_type == Q.F32 or name.endswith((
            "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "shortconv.conv.weight",
            "ssm_conv1d.weight")):
        return Q.F32
    if weight_type in TERNARY_TYPES and name in ("token_embd.weight", "output.weight"):
        return Q.F16
    block_size = GGML_QUANT_SIZES[weight_type][0]
    return weight_type if tensor.shape[-1] % block_size == 0 else Q.F16


def _transform(config: ModelConfig, hf_name: str, tensor: torch.Tensor) -> Source:
    def values() -> torch.Tensor:
        t = tensor.float()
        if config.architecture in PERMUTED_QK_ARCHITECTURES:
            # llama.cpp's "normal" RoPE rotates adjacent pairs: interleave the rotated halves
            for proj, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
                if hf_name.endswith((f"self_attn.{proj}.weight", f"self_attn.{proj}.bias")):
                    t = t[qk_row_order(heads, config.head_dim, to_gguf=True)]
        if config.architecture in GEMMA_ARCHITECTURES and hf_name.endswith("norm.weight"):
            t = t + 1.0  # gemma's RMSNorm multiplies by (1 + w); llama.cpp stores (1 + w)
        if hf_name.endswith("conv.conv.weight"):
            t = t.squeeze(1)  # llama.cpp's convolution weight: [channels, taps]
        if config.architecture in GGUF_HYBRIDS.values():
            t = hybrid_value_for_gguf(config, hf_name, t)
        if hf_name.endswith(_QUERY_SCALE_CARRIERS.get(config.architecture, ())):
            t = t * _query_scale_fold(config)
        return t

    return values


def _byte_shape(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> tuple[int, ...]:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return (*shape[:-1], shape[-1] // block_size * type_size)


def _nbytes(byte_shape: tuple[int, ...]) -> int:
    return int(np.prod(byte_shape))


def encode_tensor(values: torch.Tensor, qtype: GGMLQuantizationType, importance: np.ndarray | None = None) -> np.ndarray:
    """The tensor's bytes in `qtype`: K-quants, and the formats an importance matrix weighs when
    there is one, by hearth's C++ quantizer (llama.cpp's searches), the others by gguf."""
    values = values.detach().to("cpu", torch.float32).contiguous()
    if qtype == Q.F32:
        return values.numpy()
    if qtype == Q.F16:
        return values.to(torch.float16).numpy()
    byte_shape = _byte_shape(tuple(values.shape), qtype)
    if qtype in SEARCHED or (importance is not None and qtype in WEIGHTED):
        return quantize_rows(values, qtype, importance).reshape(byte_shape)
    return quantize(values, qtype).numpy().reshape(byte_shape)


# ---------------------------------------------------------------- model metadata

def _add_model_metadata(writer: GGUFWriter, config: ModelConfig, name: str, file_type: LlamaFileType) -> None:
    writer.add_type("model")
    writer.add_name(name)
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(GGML_QUANT_VERSION)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    gemma4 = config.architecture == "gemma4"
    widths, kv_heads = gemma4_gguf.layer_counts(config) if gemma4 else layer_counts(config)
    writer.add_feed_forward_length(widths)
    writer.add_block_count(config.num_layers + config.mtp_layers)  # (a hybrid's MTP blocks after its layers)
    writer.add_head_count(config.num_heads)
    if config.architecture == "deepseek_v2":  # its latent attention as multi-query attention (one KV head)
        writer.add_head_count_kv(1)
        deepseek2.add_metadata(writer, config)
    elif config.architecture == "lfm2":  # a count per layer, 0 for a short convolution (llama.cpp's lfm2)
        writer.add_head_count_kv([config.num_kv_heads * (config.layer_type(i) == ATTENTION)
                                  for i in range(config.num_layers)])
        writer.add_shortconv_l_cache(config.conv_kernel_size)
    else:
        writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    if not gemma4:  # (gemma4's: one per kind of layer, among its keys)
        writer.add_rope_dimension_count(int(config.head_dim * config.partial_rotary_factor))
    if config.architecture in GGUF_HYBRIDS.values():
        add_hybrid_metadata(writer, config)  # (key_length and value_length among them)
    elif gemma4:
        gemma4_gguf.add_metadata(writer, config)
    elif config.head_dim * config.num_heads != config.hidden_size and not config.kv_lora_rank:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)
        local = [config.is_sliding_layer(i) for i in range(config.num_layers)]
        period = SWA_PATTERNS.get(GGUF_ARCHITECTURES[config.architecture])  # (llama.cpp's names)
        if local != [period is None or i % period < period - 1 for i in range(config.num_layers)]:
            writer.add_sliding_window_pattern(local)  # where the layers depart from llama.cpp's default
    if config.architecture in ("gemma2", "gemma3"):
        _add_gemma2_metadata(writer, config)
    if config.architecture == "smollm3" and config.no_rope_layers != smollm3_no_rope_layers(config.num_layers):
        raise ModelLoadError(f"NoPE layers {list(config.no_rope_layers)}: llama.cpp's smollm3 has one every 4 layers "
                             "and no GGUF key for another layout")
    if config.num_experts and not config.kv_lora_rank:  # (deepseek2's: deepseek2.add_metadata)
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if not gemma4:  # llama.cpp fixes it per family; hearth reads it (gemma4's: always, as its converter)
            writer.add_expert_weights_norm(config.norm_topk_prob)
        if config.shared_expert_intermediate_size:
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    _add_rope_scaling(writer, config)
    if config.mrope_section is not None and config.architecture in _MROPE_ARCHITECTURES:  # (Qwen3-VL's text model)
        writer.add_rope_dimension_sections([*config.mrope_section, 0])
        writer.add_num_deepstack_layers(len(config.vision.deepstack_layers))


def _add_rope_scaling(writer: GGUFWriter, config: ModelConfig) -> None:
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    elif kind == "longrope":  # the factors: tensors (_plan_tensors)
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        writer.add_rope_scaling_attn_factors(scaling["attention_factor"])
    elif kind == "yarn" and config.architecture == "deepseek_v2":
        deepseek2.add_rope_scaling(writer, scaling)
    elif kind == "yarn" and config.architecture == "gpt_oss":  # its betas and ramp: _check_gpt_oss
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    elif kind not in (None, "default", "llama3", "proportional"):  # llama3, gemma4's proportional: rope_freqs
        raise ModelLoadError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3, longrope, and "
                             "gpt-oss's and deepseek_v2's yarn)")


def _add_gemma2_metadata(writer: GGUFWriter, config: ModelConfig) -> None:
    """Soft-caps, and what llama.cpp otherwise fixes per family (hearth's reader takes the same
    defaults, hearth/loading/gguf.py): written only where the model departs from them. (The query
    scale has no key llama.cpp reads: it is folded into the queries, _query_scale_fold.)"""
    if config.attn_logit_softcapping is not None:
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if config.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.local_rope_theta not in (None, 10000.0):
        writer.add_rope_freq_base_swa(config.local_rope_theta)


# The tensor that carries a gemma2/3 query scale llama.cpp does not compute (_query_scale_fold): the
# query projection, or gemma3's query norm, which would undo a scaled projection.
_QUERY_SCALE_CARRIERS = {"gemma2": ("self_attn.q_proj.weight", "self_attn.q_proj.bias"),
                         "gemma3": ("self_attn.q_norm.weight",)}


def _query_scale_fold(config: ModelConfig) -> float:
    """The factor on the queries that makes llama.cpp's attention scale the model's own.

    llama.cpp (0.3.36, src/models/gemma2.cpp, gemma3.cpp) scales gemma2/3 queries by 1/sqrt(head_dim),
    or 1/sqrt(hidden / heads) for the 27B models (46 layers for gemma2, 62 for gemma3), and reads no
    key for another scale (its own converter writes none: the published models all follow that
    rule). A model whose query_pre_attn_scalar S departs from that L gets sqrt(L / S) folded into its
    queries (a linear map before RoPE, which is linear too), so that llama.cpp, and hearth's reader
    with llama.cpp's defaults (hearth/loading/gguf.py), compute q.k / sqrt(S)."""
    big = config.num_layers == {"gemma2": 46, "gemma3": 62}[config.architecture]
    llama_cpp_scalar = config.hidden_size // config.num_heads if big else config.head_dim
    return math.sqrt(llama_cpp_scalar / (config.query_pre_attn_scalar or config.head_dim))


# ---------------------------------------------------------------- tokenizer metadata

_PRE_TOKENIZER_REGEXES = {  # Split regex -> llama.cpp's tokenizer.ggml.pre (the regexes loading rebuilds)
    LLAMA3_REGEX: "llama-bpe",
    QWEN2_REGEX: "qwen2",  # digits one by one
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+": "gpt-2",
}


def _components(node: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A tokenizer.json normalizer/pre-tokenizer/decoder, flattened out of its Sequences."""
    if not node:
        return []
    parts = node.get("pretokenizers") or node.get("normalizers") or node.get("decoders")
    if node.get("type") == "Sequence" and parts is not None:
        return [leaf for part in parts for leaf in _components(part)]
    return [node]


def _pre_name(pre_tokenizer: dict[str, Any] | None) -> str:
    """llama.cpp's name for the pre-tokenizer, recognised by its regex. llama.cpp itself hashes
    the tokenization of a test text; this recognises the common regexes and says "default" (llama.cpp's
    generic BPE split) for anything else."""
    for part in _components(pre_tokenizer):
        if part.get("type") == "Split":
            pattern = part.get("pattern") or {}
            return _PRE_TOKENIZER_REGEXES.get(pattern.get("Regex", ""), "default")
        if part.get("type") == "ByteLevel" and part.get("use_regex", True):
            return "gpt-2"
    return "default"


def add_tokenizer_metadata(writer: GGUFWriter, folder: Path, vocab_size: int, gemma4: bool = False) -> None:
    """tokenizer.ggml.* and tokenizer.chat_template from tokenizer.json and its companions. gemma4: a
    SentencePiece-style vocabulary as llama.cpp's gemma4 tokenizer (a byte-level one as any other)."""
    path = folder / "tokenizer.json"
    if not path.exists():
        raise ModelLoadError(f"{folder}: no tokenizer.json (hearth converts Hugging Face fast tokenizers only)")
    tok = read_json(path)
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ModelLoadError(f"{path}: tokenizer model {model.get('type')!r} is not supported (only BPE)")
    pieces = [p for key in ("normalizer", "pre_tokenizer", "decoder") for p in _components(tok.get(key))]
    spm = _is_sentencepiece(path, model, pieces)
    added = {int(a["id"]): a for a in tok.get("added_tokens") or []}
    tokens, types = _token_list(path, model, added, spm, vocab_size)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]

    gemma4 = gemma4 and spm
    if gemma4:
        gemma4_gguf.add_vocabulary(writer, tokens, types, merges, _adds_space_prefix(pieces), str(path))
    else:
        writer.add_tokenizer_model("llama" if spm else "gpt2")
        writer.add_tokenizer_pre("default" if spm else _pre_name(tok.get("pre_tokenizer")))
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        if spm:
            writer.add_token_scores(_merge_rank_scores(tokens, merges, added))
            writer.add_add_space_prefix(_adds_space_prefix(pieces))
        else:
            writer.add_token_merges(merges)
    _add_special_tokens(writer, folder, tok, {t: i for i, t in enumerate(tokens)}, vocab_size, always_bos=gemma4)



def _is_sentencepiece(path: Path, model: dict[str, Any], pieces: list[dict[str, Any]]) -> bool:
    """True for SentencePiece-style BPE (byte fallback, "▁" for spaces), False for byte-level BPE."""
    kinds = {p.get("type") for p in pieces}
    metaspace = "Metaspace" in kinds or any(
        p.get("type") == "Replace" and "▁" in (p.get("content"), (p.get("pattern") or {}).get("String")) for p in pieces
    )
    if "ByteLevel" in kinds:
        return False
    if model.get("byte_fallback") and metaspace:
        return True
    raise ModelLoadError(f"{path}: unsupported tokenizer (neither byte-level BPE nor SentencePiece-style BPE)")


def _token_list(path: Path, model: dict[str, Any], added: dict[int, dict[str, Any]], spm: bool,
                vocab_size: int) -> tuple[list[str], list[int]]:
    """Every id's text and llama.cpp token type, vocab_size of them (ids no token has: "[PAD<id>]")."""
    text_by_id = {i: t for t, i in model["vocab"].items()}
    text_by_id.update({i: a["content"] for i, a in added.items()})
    too_big = [i for i in text_by_id if i >= vocab_size]
    if too_big:
        raise ModelLoadError(f"{path}: token id {max(too_big)} is outside the model's vocab_size {vocab_size}")
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        text = text_by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        elif i in added:
            special = added[i].get("special") or (text.startswith("<|") and text.endswith("|>"))
            tokens.append(text)
            types.append(TokenType.CONTROL if special else TokenType.USER_DEFINED)
        elif spm and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text):
            tokens.append(text)
            types.append(TokenType.BYTE)
        else:
            tokens.append(text)
            types.append(TokenType.UNKNOWN if spm and text == model.get("unk_token") else TokenType.NORMAL)
    return tokens, types


def _merge_rank_scores(tokens: list[str], merges: list[str], added: dict[int, Any]) -> list[float]:
    """llama.cpp's SentencePiece tokenizer merges the adjacent pair whose result scores highest.
    tokenizer.json keeps no scores (llama.cpp's LlamaHfVocab writes a constant -1000, which loses the
    merge order), so a token scores minus the rank of the merge that makes it."""
    rank: dict[str, int] = {}
    for r, merge in enumerate(merges):
        rank.setdefault(merge.replace(" ", ""), r)
    return [-1000.0 if i in added else -float(rank.get(t, 0)) for i, t in enumerate(tokens)]


def _adds_space_prefix(pieces: list[dict[str, Any]]) -> bool:
    for p in pieces:
        if p.get("type") == "Prepend":
            return True
        if p.get("type") == "Metaspace":
            return p.get("prepend_scheme", "always" if p.get("add_prefix_space", True) else "never") != "never"
    return False


def _add_special_tokens(
    writer: GGUFWriter, folder: Path, tok: dict[str, Any], ids: dict[str, int], vocab_size: int,
    always_bos: bool = False
) -> None:
    """bos/eos/unk/pad ids, add_bos/add_eos and the chat template, as llama.cpp's SpecialVocab
    (always_bos: add_bos true whatever the folder says, gemma4's).

    Ids come from tokenizer_config.json's tokens, else generation_config.json, else config.json."""
    def optional_json(name: str) -> dict[str, Any]:
        return read_json(folder / name) if (folder / name).exists() else {}

    tok_config = optional_json("tokenizer_config.json")
    sources = (optional_json("generation_config.json"), optional_json("config.json"))
    for kind, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                      ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        token = tok_config.get(f"{kind}_token")
        if isinstance(token, dict):
            token = token.get("content")
        token_id = ids.get(token) if isinstance(token, str) else None
        for source in sources:
            if token_id is None:
                value = source.get(f"{kind}_token_id")
                token_id = value[0] if isinstance(value, list) and value else value
        if isinstance(token_id, int) and 0 <= token_id < vocab_size:
            add(token_id)

    add_bos, add_eos = tok_config.get("add_bos_token"), tok_config.get("add_eos_token")
    post = tok.get("post_processor") or {}
    if post.get("type") == "TemplateProcessing" and (add_bos is None or add_eos is None):
        single = post.get("single") or []
        add_bos = add_bos if add_bos is not None else bool(single) and "SpecialToken" in single[0]
        add_eos = add_eos if add_eos is not None else bool(single) and "SpecialToken" in single[-1]
    if add_bos is not None or always_bos:
        writer.add_add_bos_token(bool(add_bos) or always_bos)
    if add_eos is not None:
        writer.add_add_eos_token(bool(add_eos))

    template = tok_config.get("chat_template")
    if template is None and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if template:
        writer.add_chat_template(template)
