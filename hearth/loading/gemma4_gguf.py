"""llama.cpp's GGUF layout of Gemma 4 (gemma4), as its converter writes it (0.3.36: conversion/gemma.py's
Gemma4Model) and its graph reads it (src/models/gemma4.cpp): the metadata of its ModelConfig, read and written,
and the tensors it stores otherwise than the checkpoint (the names: hearth/loading/names.py):

- per kind of layer its head size (attention.key_length: the full layers', key_length_swa: the sliding ones')
  and per layer its KV heads (attention.head_count_kv) and MLP width (feed_forward_length: twice as wide in
  the double-wide layers); the local layers by attention.sliding_window_pattern;
- the full layers' proportional RoPE as a rotation over the whole head (rope.dimension_count) and the
  rope_freqs tensor: 1 for the turned frequencies, 1e30 (never turned) for the others;
- KV sharing as attention.shared_kv_layers: llama.cpp's last layers read the cache of the layer two before the
  first sharing one (sliding) or one before it (full); transformers' rule (the last earlier layer of the same
  kind) is the same for the released layouts, and `hearth convert` refuses a model where it is not;
- v from k's projection where a layer has no attn_v; the layer's output scale (layer_output_scale, 1 where
  absent); the experts' gate and up stacked in one tensor (ffn_gate_up_exps, each expert's gate rows first; read
  as ffn_gate_exps and ffn_up_exps too), the router's input scale (ffn_gate_inp.scale) and each expert's output
  scale (ffn_down_exps.scale);
- the tokenizer of a SentencePiece-style vocabulary as llama.cpp's gemma4 one (add_vocabulary; read by
  hearth/tokenizer_gguf.py).

Fixed by llama.cpp, with no key: GELU (tanh), scores unscaled, v normed without a weight, the router's
softmax renormalised over the chosen experts, experts in every layer that has a router. hearth's reader takes
the same; `hearth convert` refuses what that layout cannot hold.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np
import torch
from gguf import GGUFWriter

from hearth.config import ModelConfig
from hearth.errors import ModelLoadError
from hearth.loading.hybrid_gguf import per_layer
from hearth.quant import QuantTensor

Weight = torch.Tensor | QuantTensor

_NEVER_TURNED = 1e30  # llama.cpp's frequency divisor of the dimensions proportional RoPE leaves unturned
# tokens llama.cpp's converter makes user-defined (always rendered, for its chat parser)
_VISIBLE_TOKENS = {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>",
                   '<|"|>'}
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4  # (GGUF token types)
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_up_proj|gate_proj|up_proj|down_proj)\.weight")
_OWN_KV = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm)\.")


def _kv_sources(sliding: list[bool], shared: int) -> tuple[int, ...]:
    """Per layer the layer whose K/V it attends over, by llama.cpp's rule (the module's docstring); () without
    sharing."""
    first = len(sliding) - shared
    return (*range(first), *(first - 2 if sliding[i] else first - 1 for i in range(first, len(sliding)))) if shared \
        else ()


# ---------------------------------------------------------------- reading

def fields_from_metadata(md: dict[str, Any], get: Callable[..., Any]) -> dict[str, Any]:
    """The ModelConfig fields of a gemma4 file over the common ones (the rest from its tensors:
    weights_from_gguf)."""
    layers = int(get("block_count"))
    sliding = [bool(s) for s in get("attention.sliding_window_pattern")]
    head, head_swa = int(get("attention.key_length")), int(get("attention.key_length_swa"))
    if (int(get("attention.value_length")), int(get("attention.value_length_swa"))) != (head, head_swa):
        raise ModelLoadError("gemma4: keys and values of two sizes (attention.key_length, value_length and their "
                             "_swa): llama.cpp's gemma4 and hearth have one")
    if (int(md.get("gemma4.rope.dimension_count", head)), int(md.get("gemma4.rope.dimension_count_swa", head_swa))) \
            != (head, head_swa):
        raise ModelLoadError("gemma4: RoPE over part of a head (rope.dimension_count, dimension_count_swa) is not "
                             "implemented by hearth (the full layers' proportional RoPE comes as rope_freqs)")
    kv = per_layer(get("attention.head_count_kv"), layers, "gemma4.attention.head_count_kv")
    widths = per_layer(get("feed_forward_length"), layers, "gemma4.feed_forward_length")
    if len(sliding) != layers or any(w not in (widths[0], 2 * widths[0]) for w in widths):
        raise ModelLoadError(f"gemma4: sliding_window_pattern {sliding}, feed_forward_length {widths}: expected a flag "
                             "per layer and one width (twice it in double-wide layers)")
    width = int(md.get("gemma4.embedding_length_per_layer_input") or 0)
    vocab = int(md.get("gemma4.vocab_size") or len(md.get("tokenizer.ggml.tokens") or ()))
    cap = md.get("gemma4.final_logit_softcapping")
    theta = float(get("rope.freq_base", 10000.0))
    return dict(
        num_kv_heads=kv[sliding.index(True)] if any(sliding) else kv[0], head_dim=head_swa,
        sliding_window=int(get("attention.sliding_window")),  # (llama.cpp requires it)
        layer_head_dims=tuple(head_swa if s else head for s in sliding), layer_kv_heads=tuple(kv),
        kv_sources=_checked_kv_sources(sliding, int(md.get("gemma4.attention.shared_kv_layers") or 0)),
        intermediate_size=widths[0], double_wide_mlp_layers=tuple(i for i, w in enumerate(widths) if w != widths[0]),
        hidden_act="gelu_pytorch_tanh", qk_norm="head", value_norm=True, query_pre_attn_scalar=1.0,
        embedding_scale=float(np.sqrt(int(get("embedding_length")))), sandwich_norms=True,
        local_rope_theta=float(md.get("gemma4.rope.freq_base_swa", theta)),
        final_logit_softcapping=float(cap) if cap else None, per_layer_input_size=width,
        # (llama.cpp's table has a row for each token: weights_from_gguf checks it)
        per_layer_vocab_size=vocab if width else 0,
    )


def _checked_kv_sources(sliding: list[bool], shared: int) -> tuple[int, ...]:
    sources = _kv_sources(sliding, shared)
    if shared and (len(sliding) - shared < 2 or any(sliding[source] != s for source, s in zip(sources, sliding))):
        raise ModelLoadError(f"gemma4.attention.shared_kv_layers = {shared}: llama.cpp's sharing layers read layers "
                             f"{len(sliding) - shared - 2} (the sliding ones) and {len(sliding) - shared - 1} (the "
                             "full ones), which are not of those kinds")
    return sources


def weights_from_gguf(config: ModelConfig, weights: dict[str, Weight], where: str) -> None:
    """The weights (by hearth's names) of a gemma4 file as hearth's modules take them, in place, and what the
    config reads off them: the proportional RoPE of rope_freqs, the layers whose v is k's projection, tied
    embeddings, the per-layer embeddings' rows; each expert's gate and up apart."""
    config.rope_scaling = _proportional_rope(config, weights.pop("rope_freqs", None), where)
    for name in list(weights):  # (each expert's stacks, apart: the loader's)
        if not (m := _EXPERT.fullmatch(name)):
            continue
        stacked, prefix = weights.pop(name), f"model.layers.{m.group(1)}.experts.experts.{m.group(2)}."
        half = stacked.shape[0] // 2
        parts = (("gate_proj", 0, half), ("up_proj", half, half)) if m.group(3) == "gate_up_proj" else \
            ((m.group(3), 0, stacked.shape[0]),)  # (llama.cpp reads gate and up stacked apart too)
        for part, start, rows in parts:
            weights[prefix + f"{part}.weight"] = stacked.row_range(start, rows) if isinstance(stacked, QuantTensor) \
                else stacked[start:start + rows]
    shared = {i for i in range(config.num_layers) if config.kv_source(i) != i}
    for name in list(weights):  # (llama.cpp loads a sharing layer's own K/V tensors, and never uses them)
        if (m := _OWN_KV.match(name)) and int(m.group(1)) in shared:
            del weights[name]
    for layer in range(config.num_layers):
        weights.setdefault(f"model.layers.{layer}.layer_scalar", torch.ones(1))
    own = [i for i in range(config.num_layers) if i not in shared]
    missing_v = [i for i in own if f"model.layers.{i}.self_attn.v_proj.weight" not in weights]
    full = [i for i in range(config.num_layers) if not config.is_sliding_layer(i)]
    # (as transformers' attention_k_eq_v: every full layer, the sharing ones too, where all that keep K/V have no v)
    config.k_eq_v_layers = tuple(full) if missing_v and missing_v == [i for i in full if i in own] else tuple(missing_v)
    config.tie_word_embeddings = "lm_head.weight" not in weights
    table = weights.get("model.per_layer_inputs.embed_tokens_per_layer.weight")
    if table is not None and table.shape[0] != config.per_layer_vocab_size:
        raise ModelLoadError(f"{where}: per_layer_token_embd has {table.shape[0]} rows, expected one for each of the "
                             f"{config.per_layer_vocab_size} tokens")
    routed = [i for i in range(config.num_layers) if f"model.layers.{i}.router.proj.weight" in weights]
    if routed and len(routed) != config.num_layers:
        raise ModelLoadError(f"{where}: experts in layers {routed} only: hearth's gemma4 has them in every layer")


def _proportional_rope(config: ModelConfig, factors: Weight | None, where: str) -> dict[str, Any] | None:
    """The full layers' rope_scaling of their rope_freqs: the first frequencies turned (divisor 1), the others
    never (llama.cpp's 1e30)."""
    full = [config.head_dim_of(i) for i in range(config.num_layers) if not config.is_sliding_layer(i)]
    if not full:
        return None
    values = (factors.dequantize() if isinstance(factors, QuantTensor) else factors).float().reshape(-1) \
        if factors is not None else torch.empty(0)
    turned = int((values == 1.0).sum())
    if len(values) != full[0] // 2 or not bool((values[:turned] == 1.0).all() and (values[turned:] >= 1e20).all()):
        raise ModelLoadError(f"{where}: rope_freqs {values.tolist()[:8]}...: hearth reads gemma4's proportional RoPE "
                             f"(1 for each turned frequency, then 1e30), {full[0] // 2} values")
    return {"rope_type": "proportional", "partial_rotary_factor": 2 * turned / full[0], "rope_theta": config.rope_theta}


# ---------------------------------------------------------------- writing

def check_convertible(config: ModelConfig) -> None:
    """What llama.cpp's gemma4 layout cannot hold, refused by name."""
    full = {config.head_dim_of(i) for i in range(config.num_layers) if not config.is_sliding_layer(i)}
    local = {config.head_dim_of(i) for i in range(config.num_layers) if config.is_sliding_layer(i)}
    scaling = config.rope_scaling or {}
    problems = [
        (len(full) > 1 or len(local) > 1, f"head sizes {list(config.layer_head_dims)}: llama.cpp's gemma4 has one for "
                                          "the full layers and one for the sliding ones"),
        (config.hidden_act != "gelu_pytorch_tanh", f"hidden_activation {config.hidden_act!r}: llama.cpp's gemma4 "
                                                   "runs GELU (tanh)"),
        (config.attention_bias, "attention_bias: llama.cpp's gemma4 has no biases"),
        (scaling.get("rope_type") != "proportional" or float(scaling.get("factor", 1.0)) != 1.0,
         f"the full layers' RoPE {scaling}: llama.cpp's converter writes proportional RoPE, unscaled"),
        (config.per_layer_input_size and config.per_layer_vocab_size != config.vocab_size,
         f"vocab_size_per_layer_input {config.per_layer_vocab_size}: llama.cpp's gemma4 has a per-layer "
         f"embedding for each of the {config.vocab_size} tokens"),
    ]
    for failed, why in problems:
        if failed:
            raise ModelLoadError(why)
    shared = sum(config.kv_source(i) != i for i in range(config.num_layers))
    sliding = [config.is_sliding_layer(i) for i in range(config.num_layers)]
    if config.kv_sources and _kv_sources(sliding, shared) != config.kv_sources:
        raise ModelLoadError(f"num_kv_shared_layers = {shared}: the last layers read the K/V of layers "
                             f"{list(config.kv_sources[-shared:])} (the last earlier one of their kind), and "
                             f"llama.cpp's gemma4 has them read layer {len(sliding) - shared - 2} (sliding ones) and "
                             f"{len(sliding) - shared - 1} (full ones)")


def layer_counts(config: ModelConfig) -> tuple[int | list[int], int | list[int]]:
    """feed_forward_length and attention.head_count_kv: per layer where they differ between layers."""
    widths = [config.intermediate_size * (2 if i in config.double_wide_mlp_layers else 1)
              for i in range(config.num_layers)]
    kv = [config.kv_heads_of(i) for i in range(config.num_layers)]
    return (widths if config.double_wide_mlp_layers else widths[0]), (kv if len(set(kv)) > 1 else kv[0])


def add_metadata(writer: GGUFWriter, config: ModelConfig) -> None:
    """The family's keys beyond the common ones (convert.py's)."""
    layers = range(config.num_layers)
    full = next(config.head_dim_of(i) for i in layers if not config.is_sliding_layer(i))
    local = next((config.head_dim_of(i) for i in layers if config.is_sliding_layer(i)), config.head_dim)
    writer.add_shared_kv_layers(sum(config.kv_source(i) != i for i in layers))
    writer.add_embedding_length_per_layer_input(config.per_layer_input_size)
    writer.add_key_length(full)
    writer.add_value_length(full)
    writer.add_key_length_swa(local)
    writer.add_value_length_swa(local)
    writer.add_rope_dimension_count(full)  # (the turned share: rope_freqs)
    writer.add_rope_dimension_count_swa(local)
    writer.add_rope_freq_base_swa(config.local_rope_theta or config.rope_theta)
    if config.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)


def rope_freqs(config: ModelConfig) -> torch.Tensor:
    """The full layers' proportional RoPE as llama.cpp's frequency divisors [head_dim / 2] (converter's)."""
    full = next(config.head_dim_of(i) for i in range(config.num_layers) if not config.is_sliding_layer(i))
    turned = int(full * float(config.rope_scaling["partial_rotary_factor"]) / 2)
    return torch.tensor([1.0] * turned + [_NEVER_TURNED] * (full // 2 - turned), dtype=torch.float32)


def _token_types(tokens: list[str], types: list[int]) -> list[int]:
    """The token types llama.cpp's converter gives a gemma4 vocabulary (gguf's LlamaHfVocab): special tokens
    (the unknown one too) control, its chat parser's markers user-defined."""
    return [_USER_DEFINED if text in _VISIBLE_TOKENS else _CONTROL if kind == _UNKNOWN else kind
            for text, kind in zip(tokens, types)]


def weights_for_gguf(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's experts under the names convert.py stacks (mlp.experts.N.*: ffn_gate_up_exps and
    ffn_down_exps)."""
    return {name.replace(".experts.experts.", ".mlp.experts."): w for name, w in weights.items()}


def add_vocabulary(writer: GGUFWriter, tokens: list[str], types: list[int], merges: list[str], space_prefix: bool,
                   where: str) -> None:
    """A SentencePiece-style vocabulary (tokens, their types as convert.py reads them, the merges) as llama.cpp's
    gemma4 tokenizer, as its converter writes it (gguf's LlamaHfVocab): BPE by the merges over the text with its
    spaces as "▁" (nothing put before it), scores all -1000 (the BOS always added: convert.py)."""
    if space_prefix:
        raise ModelLoadError(f'{where}: a tokenizer that puts "▁" before the text: llama.cpp\'s gemma4 tokenizer '
                             "does not")
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_scores([-1000.0] * len(tokens))
    writer.add_token_types(_token_types(tokens, types))
    writer.add_token_merges(merges)
    writer.add_add_space_prefix(False)
