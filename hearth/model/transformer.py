"""One config-driven decoder: llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3, gemma4 (its own decoder layer,
hearth/model/gemma4.py), smollm3, phi3, the
mixtures of experts mixtral, qwen2_moe, qwen3_moe, olmoe and gpt_oss (attention sinks), and deepseek_v2 (experts and multi-head
latent attention, hearth/model/latent_attention.py).

The model sees a flattened batch of tokens (every request's new tokens, end to end) and its
backend's attention metadata; it knows nothing about requests. Its operations (norms, RoPE and
the cache write, attention, activations) are the backend's (hearth/backend), chosen once when the
model is built.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import torch
from torch import nn

from hearth.backend.base import Backend
from hearth.config import ATTENTION, GATED_DELTA_NET, MAMBA2, MLP, SHORT_CONV, ModelConfig
from hearth.errors import ModelLoadError
from hearth.model.attention import Attention
from hearth.model.gemma4 import Gemma4DecoderLayer, PerLayerInputs
from hearth.model.latent_attention import LatentAttention
from hearth.model.layers import (MLP as UngatedMLP, GatedMLP, Linear, MergedLinear, RMSNorm, RotaryEmbedding, SparseMoE,
                                 longrope_factors)
from hearth.model.mtp import MultiTokenPredictor
from hearth.model.state_layers import GatedDeltaNet, Mamba2, ShortConv
from hearth.model.vision.gemma3 import GemmaVisionTower
from hearth.model.vision.gemma4 import Gemma4VisionTower
from hearth.model.vision.qwen3_vl import QwenVisionTower
from hearth.model.vision.siglip import VisionTower
from hearth.quant.kernels.memory import file_mappings, release_mappings, release_pages
from hearth.quant.tensor import HALF_QTYPES, QuantTensor, stack_rows


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP; with sandwich_norms (gemma2/3) their outputs are normed too, and the
    MLP's input norm is pre_feedforward_layernorm (post_attention_layernorm norms attention's output).
    With single_mixer_blocks (nemotron_h) a layer is its input norm and one module: attention, a state
    layer or (kind MLP) the MLP. Each addition to the residual stream times residual_multiplier (granite)."""

    def __init__(self, config: ModelConfig, ops: Backend, index: int):
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, config.rms_norm_eps, ops, config.norm_weight_offset)

        self.input_layernorm = norm()
        self.residual_multiplier = config.residual_multiplier
        # what mixes the tokens, under its checkpoint name: attention, or a hybrid model's state layer
        kind = config.layer_type(index)
        self.mixer_name = _MIXER_NAMES[kind]
        if kind == ATTENTION:
            mixer = (LatentAttention if config.kv_lora_rank else Attention)(config, ops, index)
        elif kind != MLP:
            mixer = {SHORT_CONV: ShortConv, GATED_DELTA_NET: GatedDeltaNet, MAMBA2: Mamba2}[kind](config, ops)
        self.mlp = None
        if kind == MLP or not config.single_mixer_blocks:
            self.mlp = (SparseMoE(config, ops) if config.is_moe_layer(index)
                        else GatedMLP(config, ops) if config.gated_mlp else UngatedMLP(config, ops))
        if kind != MLP:
            setattr(self, self.mixer_name, mixer)
        if config.single_mixer_blocks:
            return
        self.post_attention_layernorm = norm()
        self.sandwich_norms = config.sandwich_norms
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(self, x, residual, rotaries, kv_cache, meta):
        """x: what the previous layer adds to the residual stream (None before the first layer:
        then x is the stream). rotaries: the lookups of Transformer.ropes. Returns (this
        layer's addition, the stream): each add is fused into the norm that follows it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        mixer = getattr(self, self.mixer_name)
        if mixer is self.mlp:  # nemotron_h's MLP block
            return mixer(h), residual
        h = self._scaled(mixer(h, rotaries[mixer.rope_index], kv_cache, meta))
        if self.mlp is None:  # nemotron_h's attention and Mamba2 blocks
            return h, residual
        if not self.sandwich_norms:
            h, residual = self.post_attention_layernorm(h, residual)
            return self._scaled(self.mlp(h)), residual
        h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual

    def _scaled(self, addition: torch.Tensor) -> torch.Tensor:
        return addition if self.residual_multiplier == 1.0 else addition * self.residual_multiplier


# each image-text family's vision tower (the rest: SmolVLM's / Idefics3's, siglip.py)
_VISION_TOWERS = {"qwen3_vl": QwenVisionTower, "qwen3_5": QwenVisionTower, "gemma3": GemmaVisionTower,
                  "gemma4": Gemma4VisionTower}
# a layer's mixer under its checkpoint name, by kind (ModelConfig.layer_types); MLP: nemotron_h's block of an MLP alone
_MIXER_NAMES = {ATTENTION: "self_attn", SHORT_CONV: "conv", GATED_DELTA_NET: "linear_attn", MAMBA2: "mamba", MLP: "mlp"}


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int | None = None, backend: Backend | None = None):
        super().__init__()
        self.config = config
        self.backend = ops = backend or Backend()
        self.backend_state: dict = {}  # what the backend derives from the weights (emptied when they move)
        self.lora_rows = None  # with LoRA adapters: the step's adapters (hearth/model/lora.py's LoraRows)
        self.embed_tokens, lm_head = vocabulary_modules(config.vocab_size, config.hidden_size)
        layer = Gemma4DecoderLayer if config.architecture == "gemma4" else DecoderLayer
        self.layers = nn.ModuleList(layer(config, ops, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, config.norm_weight_offset)
        self.lm_head = lm_head
        self.mtp = None  # Qwen3.5's / Qwen3-Next's multi-token-prediction layers, where the checkpoint ships them
        if config.mtp_layers:
            mtp_config = config.mtp_layer_config()
            self.mtp = MultiTokenPredictor(config, ops, [layer(mtp_config, ops, i) for i in range(config.mtp_layers)])
        # gemma4: per token and layer an input of its own (hearth/model/gemma4.py), made from the embeddings
        self.per_layer_inputs = PerLayerInputs(config, ops) if config.per_layer_input_size else None
        # each table as wide as the heads of the layers it turns (gemma4's full layers: their own head_dim)
        self.rope = RotaryEmbedding(_heads_of(config, sliding=False), max_positions or config.max_position_embeddings,
                                    ops)
        self.local_rope = self.no_rope = None
        if config.local_rope_theta is not None:  # gemma3's sliding layers: their own base, unscaled
            local = dataclasses.replace(_heads_of(config, sliding=True), rope_theta=config.local_rope_theta,
                                        rope_scaling=None)
            self.local_rope = RotaryEmbedding(local, self.rope.max_positions, ops)
        if config.no_rope_layers:  # smollm3: frequencies 0, cos 1 and sin 0 at every position
            zeros = torch.zeros_like(self.rope.inv_freq)
            self.no_rope = RotaryEmbedding(config, self.rope.max_positions, ops, inv_freq=zeros)
        # an image-text model's encoder and projector (checkpoint names model.vision_model.*, model.connector.*;
        # Qwen3-VL's model.visual.*; Gemma 3's model.vision_tower.*, model.multi_modal_projector.*; Gemma 4's
        # model.vision_tower.*, model.embed_vision.*)
        self.vision = None
        if config.vision is not None:
            self.vision = _VISION_TOWERS.get(config.vision.family, VisionTower)(config.vision, config.hidden_size)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        # per layer (k, v), each [slots, kv_heads, head_dim]; with latent attention (latent,)
        # (ModelConfig.kv_cache_layout); a hybrid model's state layer: its states (ModelConfig.state_shapes)
        kv_caches: list[tuple[torch.Tensor, ...]],
        meta,  # the backend's attention metadata
        # rows [k] whose input is given (an image's embeddings in place of its placeholder tokens) and
        # their values [k, hidden]; None: every row's is its token's embedding. Values [k, (1 + D) *
        # hidden]: the input, then what the first D layers' outputs add at those rows (Qwen3-VL's deepstack)
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        width = self.config.hidden_size
        added = None
        if embeds is not None and embeds[1].shape[1] > width:
            added = (embeds[0], embeds[1][:, width:].unflatten(1, (-1, width)))  # [k, D, hidden]
        x = self.embed(input_ids, embeds)
        per_layer = None
        if self.per_layer_inputs is not None:  # (an image's rows: the pad token's table rows, transformers' gemma4)
            per_layer = self.per_layer_inputs(input_ids if embeds is None else input_ids.index_fill(
                0, embeds[0], self.config.vision.pad_token_id), x)
        x, residual = self.run_layers(x, None, positions, kv_caches, meta, added, per_layer)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]  # (gemma4's layers: x is the stream)

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor, embeds: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> torch.Tensor:  # [T] -> [T, hidden]
        x = self.embed_tokens(input_ids)
        if self.config.embedding_scale != 1.0:
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        if embeds is not None:
            rows, values = embeds
            x[rows] = values[:, :x.shape[1]].to(x.dtype)
        return x

    @torch.inference_mode()
    def run_layers(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                   kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta,
                   added: tuple[torch.Tensor, torch.Tensor] | None = None, per_layer: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every layer of self.layers (a pipeline stage's: its own) on x [T, hidden], what the layer
        before adds to the residual stream (None: x is the stream). Returns the same pair after the last.
        added: rows [k] and values [k, D, hidden], the d-th added to the stream after layer d.
        per_layer: gemma4's per-layer inputs [T, layers, width] (PerLayerInputs), the d-th to layer d."""
        rotary = self.rope(positions, x.dtype)
        stream = x if residual is None else residual + x  # the add the first layer's norm would fuse
        # (with LoRA adapters in the step: a backend's whole-layer path adds them, or declines)
        if added is None and (
                out := self.backend.decode_layers(self, stream, rotary, kv_caches, meta)) is not None:
            return out
        rotaries = self._rotaries(positions, x.dtype, rotary)
        kv_caches = self._layer_caches(kv_caches)
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(x, residual, rotaries, kv_cache, meta, *(() if per_layer is None else (per_layer[:, index],)))
            if added is not None and index < added[1].shape[1]:  # (x: the layer's addition to the stream)
                x = x.index_add(0, added[0], added[1][:, index].to(x.dtype))
        return x, residual

    @torch.inference_mode()
    def predict_next(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta) -> torch.Tensor:
        """The multi-token-prediction layer (hearth/model/mtp.py) on tokens [T] and the hidden states [T, hidden]
        they follow, at positions [T] (kv_caches: its own, one layer's). Returns its hidden states [T, hidden],
        whose compute_logits guess the token after each row's."""
        return self.mtp(self.embed(input_ids), hidden, self._rotaries(positions, hidden.dtype), kv_caches[0], meta)

    def mtp_view(self) -> Transformer:
        """A view of this model whose layers are its multi-token-prediction layers and whose config theirs
        (mtp_layer_config): what a runner beside the model lays out steps and allocates a cache for; its
        embeddings and LM head are the model's (predict_next runs it)."""
        view = self.layer_range(0, 0)
        view.layers, view.config, view.vision = self.mtp.layers, self.config.mtp_layer_config(), None
        return view

    def _layer_caches(self, kv_caches: list) -> list:
        """Each layer's K/V caches: a layer that shares K/V (gemma4) attends over its source layer's."""
        if not self.config.kv_sources:
            return kv_caches
        return [kv_caches[self.config.kv_source(layer)] for layer in range(len(kv_caches))]

    def _rotaries(self, positions: torch.Tensor, dtype: torch.dtype, rotary=None) -> tuple:
        """The lookups of the model's ropes (its own, gemma3's local one, smollm3's none) at the positions,
        by Attention.rope_index; rotary: the first, already looked up."""
        rotary = self.rope(positions, dtype) if rotary is None else rotary
        return rotary, *(None if rope is None else rope(positions, dtype) for rope in (self.local_rope, self.no_rope))

    def first_layers(self, num_layers: int) -> Transformer:
        """A view of this model that runs its first num_layers layers, then its final norm and LM head,
        every module shared (early exit's draft, hearth/engine/speculation/early_exit.py); its backend
        state its own (a decode path over its layers)."""
        return self.layer_range(0, num_layers)

    def layer_range(self, start: int, stop: int) -> Transformer:
        """first_layers' view of layers start..stop-1: from start > 0, only its run_layers means anything
        (it takes the residual stream after layer start - 1: CALM's segments, hearth/model/early_exit.py)."""
        view = copy.copy(self)
        view._modules = dict(self._modules)  # (copy.copy shares the dict: the model's layers would change)
        view.layers = nn.ModuleList(self.layers[start:stop])
        view.backend_state = {}
        return view

    @torch.inference_mode()
    def propagate_kv(self, start: int, stream: torch.Tensor, positions: torch.Tensor,
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]], slot_mapping: torch.Tensor) -> None:
        """CALM's state propagation: rows that leave the model after layer start - 1 (their residual
        stream there [k, hidden], at positions [k], K/V going to slot_mapping [k]) get the K/V of every
        later layer (kv_caches: all the model's) projected from that stream, through each layer's input norm."""
        rotaries = self._rotaries(positions, stream.dtype)
        for layer, kv_cache in zip(self.layers[start:], self._layer_caches(kv_caches)[start:]):
            attention = layer.self_attn
            attention.store_kv(layer.input_layernorm(stream), rotaries[attention.rope_index], kv_cache, slot_mapping)

    def _apply(self, fn, recurse=True):
        self.backend_state.clear()  # weight pointers change when tensors move
        return super()._apply(fn, recurse)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the final norm's weight is always dense)."""
        return self.norm.weight.dtype

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] fp32
        logits = self.lm_head(hidden).float()
        if self.config.logits_divisor != 1.0:  # granite's logits_scaling
            logits = logits / self.config.logits_divisor
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _load_rope_factors(self, weights: dict[str, torch.Tensor | QuantTensor]) -> set[str]:
        """A GGUF's frequency divisors: llama3's rope_freqs, or LongRoPE's list for this context
        (a config with the lists has them already). The names it takes."""
        scaling = self.config.rope_scaling or {}
        if scaling.get("rope_type") != "longrope":
            names, name = {"rope_freqs"}, "rope_freqs"
        elif "long_factor" in scaling:
            return set()
        else:
            names = {"rope_factors.long_factor", "rope_factors.short_factor"}
            name = "rope_factors." + longrope_factors(self.config, self.rope.max_positions)
            if name not in weights:
                raise ModelLoadError(f"LongRoPE without its factors: missing tensor {name}")
        if name in weights:
            self.rope.set_frequency_factors(_dense(weights[name], torch.float32))
        return names

    def load_weights(self, weights: dict[str, torch.Tensor | QuantTensor], dtype: torch.dtype) -> None:
        """Take every parameter from `weights` (HF names), checking presence and shape. A Linear's or
        an Embedding's weight stored as GGUF blocks or as an F16/BF16 matrix stays as stored, a
        QuantTensor, until the backend's `prepare(model, dtype)` gives it the backend's module; every
        other tensor becomes a dense Parameter of `dtype`. A MergedLinear's parts are laid out in one
        buffer (one module at a time, so that only one merged copy exists at once)."""
        weights = dict(weights)
        if "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # tied embeddings
        used = self._load_rope_factors(weights)
        # before the merged copies (and the backend's repacking): drop the pages of the file's mapping
        # that loading touched (reordered Q/K rows were copied out of it), so that resident memory never holds both
        release_mappings([w.data for w in weights.values() if isinstance(w, QuantTensor)])
        mappings = file_mappings([w.data if isinstance(w, QuantTensor) else w for w in weights.values()])
        merged = self._plan_merges(weights)

        def source(hf_name: str) -> torch.Tensor | QuantTensor | None:
            names = merged.get(hf_name, [hf_name])
            used.update(names)
            if hf_name not in merged:
                return weights.get(hf_name)
            missing = [name for name in names if name not in weights]
            if missing:
                raise ModelLoadError(f"missing tensor {missing[0]}")
            return concat_rows([weights[name] for name in names], mappings)

        for name, module in list(self.named_modules()):
            params = dict(module.named_parameters(recurse=False))
            if not params:
                continue
            hf_name = _checkpoint_module_name(name)
            found = {attr: source(f"{hf_name}.{attr}") for attr in params}
            for attr, param in params.items():
                if found[attr] is None:
                    raise ModelLoadError(f"missing tensor {hf_name}.{attr}")
                _check_shape(f"{hf_name}.{attr}", found[attr], param.shape)
            _take(module, found, dtype)
        unused = sorted(name for name in weights if name not in used and not _UNUSED_CHECKPOINT.search(name)
                        and name not in _shared_kv_projections(self.config))
        if unused:  # parts of the checkpoint hearth's model has no place for: refused, never dropped
            more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
            raise ModelLoadError(f"tensor {unused[0]}{more} is not part of the {self.config.architecture} model "
                                 "hearth implements")

    def checkpoint_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, shape) of every tensor load_weights takes, in module order (MergedLinear's parts
        by their own names; no lm_head when the embeddings are tied)."""
        shapes = []
        for name, module in self.named_modules():
            if isinstance(module, MergedLinear):
                prefix = _checkpoint_module_name(name.rpartition(".")[0])
                for part, size in zip(module.part_names, module.part_sizes):
                    shapes.append((f"{prefix}.{part}.weight", (size, module.in_features)))
                    if module.bias:
                        shapes.append((f"{prefix}.{part}.bias", (size,)))
            elif ".parts." not in name:
                hf_name = name if name.startswith(("lm_head", "mtp.")) else f"model.{name}"
                if hf_name == "lm_head" and self.config.tie_word_embeddings:
                    continue
                shapes += [(f"{hf_name}.{attr}", tuple(p.shape)) for attr, p in module.named_parameters(recurse=False)]
        return shapes

    def _plan_merges(self, weights: dict) -> dict[str, list[str]]:
        """Group each MergedLinear's parts by storage format (checking each part's presence and
        shape), or take the checkpoint's own merged matrix (phi3's qkv_proj, gate_up_proj); returns
        the checkpoint names behind each merged parameter name."""
        merged = {}
        for name, module in self.named_modules():
            if not isinstance(module, MergedLinear):
                continue
            prefix = _checkpoint_module_name(name.rpartition(".")[0])
            fused = f"{_checkpoint_module_name(name)}.weight"  # a checkpoint storing the merged matrix itself (phi3)
            if fused in weights:
                _check_shape(fused, weights[fused], (sum(module.part_sizes), module.in_features))
                module.set_groups([list(range(len(module.part_names)))])
                merged[f"{_checkpoint_module_name(name)}.parts.0.weight"] = [fused]
                continue
            part_weights = []
            for part, size in zip(module.part_names, module.part_sizes):
                hf_name = f"{prefix}.{part}.weight"
                if hf_name not in weights:
                    raise ModelLoadError(f"missing tensor {hf_name}")
                _check_shape(hf_name, weights[hf_name], (size, module.in_features))
                part_weights.append(weights[hf_name])
            groups: list[list[int]] = []
            for i, weight in enumerate(part_weights):
                if groups and _storage_format(weight) == _storage_format(part_weights[groups[-1][0]]):
                    groups[-1].append(i)
                else:
                    groups.append([i])
            module.set_groups(groups)
            for g, group in enumerate(groups):
                for attr in ("weight", "bias"):
                    parts = [f"{prefix}.{module.part_names[i]}.{attr}" for i in group]
                    merged[f"{_checkpoint_module_name(name)}.parts.{g}.{attr}"] = parts
        return merged


def _checkpoint_module_name(name: str) -> str:
    """The checkpoint's name of a module: the text model's under model., the vision tower's parts
    (vision.vision_model, vision.connector; vision.visual; vision.vision_tower, vision.multi_modal_projector)
    under model. as well."""
    if name.startswith(("lm_head", "mtp.")):
        return name
    return "model." + name.removeprefix("vision.")


def _heads_of(config: ModelConfig, sliding: bool) -> ModelConfig:
    """config with the head_dim of its first sliding (or full) layer: the width of that kind's rotary table."""
    layers = [layer for layer in range(config.num_layers) if config.is_sliding_layer(layer) == sliding]
    width = config.head_dim_of(layers[0]) if layers else config.head_dim
    return config if width == config.head_dim else dataclasses.replace(config, head_dim=width)


def _shared_kv_projections(config: ModelConfig) -> set[str]:
    """The k/v projections and norms some checkpoints keep for layers that share an earlier layer's K/V
    (gemma4's), which nothing computes with (transformers ignores them too)."""
    return {f"model.layers.{layer}.self_attn.{part}.weight" for layer in range(config.num_layers)
            if config.kv_source(layer) != layer for part in ("k_proj", "v_proj", "k_norm", "v_norm")}


def vocabulary_modules(rows: int, hidden_size: int) -> tuple[nn.Embedding, Linear]:
    """The embedding table and the output layer, of `rows` tokens (a tensor-parallel rank's: its share)."""
    # from an empty weight: nn.Embedding's own random init on the meta device imports torch._dynamo (seconds)
    return nn.Embedding.from_pretrained(torch.empty(rows, hidden_size)), Linear(hidden_size, rows)


# checkpoint tensors nothing computes with: RoPE frequencies some old checkpoints saved
_UNUSED_CHECKPOINT = re.compile(r"rotary_emb\.inv_freq$")


def _storage_format(weight: torch.Tensor | QuantTensor) -> tuple:
    """Weights that can share one matrix: of one format and, where columns are stored reordered, one order."""
    if not isinstance(weight, QuantTensor):
        return (weight.dtype,)
    order = weight.column_order
    return (weight.qtype,) if order is None else (weight.qtype, order.numpy().tobytes())


def concat_rows(parts: list[torch.Tensor | QuantTensor], mappings: list[tuple[int, int]]) -> torch.Tensor | QuantTensor:
    """Weights of one storage format stacked by rows (a QuantTensor's rows are whole blocks), each
    written once into one buffer. The parts' file pages are given back (mappings: the file mappings
    that hold them, memory.file_mappings): the buffer holds the data now."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], QuantTensor):
        data = stack_rows([p.matrix() for p in parts])
        joined = QuantTensor(data, parts[0].qtype, (data.shape[0], parts[0].shape[1]), parts[0].column_order)
    else:
        joined = stack_rows(parts)
    release_pages([part.data if isinstance(part, QuantTensor) else part for part in parts], mappings)
    return joined


def _take(module: nn.Module, found: dict[str, torch.Tensor | QuantTensor], dtype: torch.dtype) -> None:
    """Put a module's tensors in: dense Parameters of `dtype`, but a Linear's or an Embedding's weight
    that is stored as GGUF blocks or an F16/BF16 matrix stays as stored (a QuantTensor, no copy)."""
    for attr, tensor in found.items():
        if attr == "weight" and isinstance(module, (Linear, nn.Embedding)) and _is_stored(tensor):
            del module.weight  # the Parameter: the backend's `prepare` swaps the module
            module.weight = tensor if isinstance(tensor, QuantTensor) else QuantTensor.of_half(tensor)
        else:
            setattr(module, attr, nn.Parameter(_dense(tensor, dtype), requires_grad=False))


def _is_stored(weight: torch.Tensor | QuantTensor) -> bool:
    return isinstance(weight, QuantTensor) or (weight.dim() == 2 and weight.dtype in HALF_QTYPES)


def _check_shape(hf_name: str, source: torch.Tensor | QuantTensor, expected: tuple[int, ...]) -> None:
    if tuple(source.shape) != tuple(expected):
        raise ModelLoadError(
            f"tensor {hf_name}: shape {tuple(source.shape)}, expected {tuple(expected)} from the config"
        )


def _dense(weight: torch.Tensor | QuantTensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(weight, QuantTensor):
        return weight.dequantize(dtype)
    return weight.to(dtype)
