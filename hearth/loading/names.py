"""Tensor names: llama.cpp's GGUF names <-> hearth's (which are Hugging Face's)."""

from __future__ import annotations

import re

import torch

from hearth.config import ModelConfig
from hearth.errors import ModelLoadError
from hearth.loading.deepseek2 import SPLIT_KV_B

# GGUF per-layer suffix -> HF per-layer suffix
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # q, k and v in one matrix (phi3)
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # the router of a mixture of experts
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    # lfm2's short convolutions (llama.cpp keeps the convolution's weight 2-D: [channels, taps])
    "shortconv.conv.weight": "conv.conv.weight",
    "shortconv.in_proj.weight": "conv.in_proj.weight",
    "shortconv.out_proj.weight": "conv.out_proj.weight",
    # deepseek2's multi-head latent attention (its kv_b_proj in two halves: hearth/loading/deepseek2.py)
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    **SPLIT_KV_B,
}
# llama.cpp stacks the experts of a layer into one 3-D tensor per projection: [experts, rows, cols]
# (and gpt-oss's biases into one [experts, rows]; gemma4's gate and up into one, each expert's gate rows first)
_EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj",
                  "ffn_gate_up_exps": "gate_up_proj"}
_GGUF_EXPERT_STACK = re.compile(rf"blk\.(\d+)\.({'|'.join(_EXPERT_STACKS)})\.(weight|bias)")
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)")
# lfm2's checkpoint names -> hearth's (its attention's and MLP's are llama's under other names)
_LFM2_NAMES = {".operator_norm.": ".input_layernorm.", ".ffn_norm.": ".post_attention_layernorm.",
               ".feed_forward.w1.": ".mlp.gate_proj.", ".feed_forward.w3.": ".mlp.up_proj.",
               ".feed_forward.w2.": ".mlp.down_proj.", ".self_attn.out_proj.": ".self_attn.o_proj.",
               ".self_attn.q_layernorm.": ".self_attn.q_norm.", ".self_attn.k_layernorm.": ".self_attn.k_norm.",
               "model.embedding_norm.": "model.norm."}
_LFM2_ALIASES = tuple((re.compile(re.escape(theirs)), ours) for theirs, ours in _LFM2_NAMES.items())
# nemotron_h's checkpoint names -> hearth's: a block's one mixer is self_attn, mamba or mlp by its tensors
_NEMOTRON_H_ALIASES = (
    (re.compile(r"^backbone\.embeddings\."), "model.embed_tokens."), (re.compile(r"^backbone\.norm_f\."), "model.norm."),
    (re.compile(r"^backbone\.layers\.(\d+)\.norm\."), r"model.layers.\1.input_layernorm."),
    (re.compile(r"^backbone\.(layers\.\d+)\.mixer\.([qkvo]_proj)\."), r"model.\1.self_attn.\2."),
    (re.compile(r"^backbone\.(layers\.\d+)\.mixer\.(up_proj|down_proj)\."), r"model.\1.mlp.\2."),
    (re.compile(r"^backbone\.(layers\.\d+)\.mixer\.gate\.e_score_correction_bias$"),
     r"model.\1.mlp.e_score_correction_bias"),
    (re.compile(r"^backbone\.(layers\.\d+)\.mixer\.(gate|experts)\."), r"model.\1.mlp.\2."),
    (re.compile(r"^backbone\.(layers\.\d+)\.mixer\.shared_experts\."), r"model.\1.mlp.shared_expert."),
    (re.compile(r"^backbone\.(layers\.\d+)\.mixer\."), r"model.\1.mamba."),
)
# mixtral's checkpoint names -> the (qwen-style) names of hearth's modules
_HF_ALIASES = (
    (re.compile(r"\.block_sparse_moe\.gate\."), ".mlp.gate."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w1\."), r".mlp.experts.\1.gate_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w3\."), r".mlp.experts.\1.up_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w2\."), r".mlp.experts.\1.down_proj."),
    (re.compile(r"\.mlp\.shared_experts\."), ".mlp.shared_expert."),  # deepseek_v2's
    *_LFM2_ALIASES,
    *_NEMOTRON_H_ALIASES,
    (re.compile(r"^model\.language_model\."), "model."),  # an image-text model's text model (qwen3_5)
    (re.compile(r"^model\.text_model\."), "model."),  # idefics3's and smolvlm's
    # gemma4's per-layer embeddings (hearth/model/gemma4.py's PerLayerInputs)
    (re.compile(r"^model\.(embed_tokens_per_layer|per_layer_model_projection|per_layer_projection_norm)\."),
     r"model.per_layer_inputs.\1."),
)
# idefics3's / smolvlm's vision tower (hearth/model/vision/siglip.py, under the checkpoint's names), qwen3_vl's
# and gemma3's
_VISION_PREFIXES = ("model.vision_model.", "model.connector.", "model.visual.", "model.vision_tower.",
                    "model.multi_modal_projector.", "model.embed_vision.")
# gemma3's checkpoints (language_model.model.*, vision_tower.vision_model.* as published; transformers 5
# saves vision_tower.*) -> the names of transformers 5's modules, hearth's
_GEMMA3_VL_ALIASES = (
    (re.compile(r"^language_model\.model\."), "model."),
    (re.compile(r"^language_model\.lm_head\."), "lm_head."),
    (re.compile(r"^(model\.)?vision_tower\.(vision_model\.)?"), "model.vision_tower."),
    (re.compile(r"^multi_modal_projector\."), "model.multi_modal_projector."),
)
# the parts of a checkpoint hearth does not load, by family: Qwen3.5's vision tower where the config has no
# vision_config (hearth runs the text model, as transformers' Qwen3_5ForCausalLM does); Nemotron-H's
# multi-token-prediction layers (as transformers' NemotronHForCausalLM). (Qwen3.5's and Qwen3-Next's mtp.* are
# loaded: the draft of --speculative-method mtp, hearth/model/mtp.py.)
NOT_LOADED = {"qwen3_5": re.compile(r"^model\.visual\."), "nemotron_h": re.compile(r"^mtp\."),
              # Gemma4ForConditionalGeneration's image and audio towers (a config without vision_config: hearth
              # runs its text model)
              "gemma4": re.compile(r"^model\.(vision_tower|audio_tower|embed_vision|embed_audio)\.")}
# (gemma3's: SigLIP's attention-pooling head, which Gemma 3 leaves unused: vision_use_head true; gemma4's audio
# tower: hearth takes no audio)
NOT_LOADED_WITH_VISION = {"gemma3": re.compile(r"^(model\.)?vision_tower\.(vision_model\.)?head\."),
                          "gemma4": re.compile(r"^model\.(audio_tower|embed_audio)\.")}
# the families whose checkpoints' multi-token-prediction layers hearth runs (mtp.*: hearth/model/mtp.py)
MTP_ARCHITECTURES = ("qwen3_5", "qwen3_next")
_MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\.(.+)")
# llama.cpp's converter writes the MTP layers as blocks after the last layer, the rest of mtp.* in the first of
# them under DeepSeek's NextN names (conversion/qwen.py's _QwenMtpMixin); nextn.* as the family's layer names
_MTP_AS_BLOCK = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
                 "norm": "shared_head.norm"}
_NEXTN_NAMES = {"nextn.eh_proj.weight": "eh_proj.weight", "nextn.enorm.weight": "enorm.weight",
                "nextn.hnorm.weight": "hnorm.weight", "nextn.shared_head_norm.weight": "shared_head.norm.weight"}


def mtp_layer_count(names: list[str], declared: object, dedicated_embeddings: object, where: str) -> int:
    """How many multi-token-prediction layers a checkpoint's tensors hold (mtp.layers.N.*), checked against its
    config's mtp_num_hidden_layers where it gives one; an MTP with embeddings of its own is refused by name."""
    layers = {int(m.group(1)) for name in names if (m := _MTP_LAYER.fullmatch(name))}
    if not layers:
        return 0
    if layers != set(range(len(layers))) or declared not in (None, len(layers)):
        raise ModelLoadError(f"{where}: mtp_num_hidden_layers = {declared!r}, and the checkpoint holds MTP layers "
                             f"{sorted(layers)}")
    if dedicated_embeddings:
        raise ModelLoadError(f"{where}: mtp_use_dedicated_embeddings = {dedicated_embeddings!r} (an MTP with an "
                             "embedding table of its own) is not implemented by hearth")
    return len(layers)


def mtp_as_block(name: str, num_layers: int) -> str:
    """A checkpoint's mtp.* tensor under the layer name llama.cpp's converter gives it (MTP layer i: layer
    num_layers + i; fc and the norms: the first MTP block's eh_proj, enorm, hnorm, shared_head.norm)."""
    if m := _MTP_LAYER.fullmatch(name):
        return f"model.layers.{num_layers + int(m.group(1))}.{m.group(2)}"
    module, _, attr = name.removeprefix("mtp.").partition(".")
    return f"model.layers.{num_layers}.{_MTP_AS_BLOCK[module]}.{attr}"


def mtp_of_block(name: str, num_layers: int) -> str:
    """mtp_as_block's inverse (a name of the model's own layers, or no layer's, as it is)."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m is None or int(m.group(1)) < num_layers:
        return name
    rest = m.group(2)
    for module, block in _MTP_AS_BLOCK.items():
        if rest.startswith(block + ".") and int(m.group(1)) == num_layers:
            return f"mtp.{module}.{rest.removeprefix(block + '.')}"
    return f"mtp.layers.{int(m.group(1)) - num_layers}.{rest}"


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
    "rope_factors_long.weight": "rope_factors.long_factor",  # LongRoPE's (phi3): divisors of the base frequencies
    "rope_factors_short.weight": "rope_factors.short_factor",
    # gemma4's per-layer embeddings (hearth/model/gemma4.py's PerLayerInputs)
    "per_layer_token_embd.weight": "model.per_layer_inputs.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_inputs.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_inputs.per_layer_projection_norm.weight",
}
# gemma2/3 norm attention's and the MLP's outputs too; llama.cpp's ffn_norm is then the MLP's input norm
_SANDWICH_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# gpt-oss: post_attention_norm is the MLP's input norm (there is no ffn_norm); its sinks and router bias
_GPT_OSS_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k != "ffn_norm.weight"},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.bias": "mlp.gate.bias",
}
# the attention and MLP names of the hybrids llama.cpp's converter writes (not phi3's fused attn_qkv)
_HYBRID_COMMON = {k: v for k, v in _LAYER_NAMES.items() if k != "attn_qkv.weight"}
# qwen35 / qwen3next: Gated DeltaNet layers (llama.cpp's ssm_* and the linear attention's attn_qkv and
# attn_gate), post_attention_norm the MLP's input norm; qwen3next's in_proj_b and in_proj_a fused per key
# head as ssm_ba (hearth/loading/hybrid_gguf.py)
_DELTA_NET_LAYER_NAMES = {
    **{k: v for k, v in _HYBRID_COMMON.items() if k != "ffn_norm.weight"},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",  # (llama.cpp's -exp(A_log))
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    **_NEXTN_NAMES,
}
# granitehybrid / nemotron_h(_moe): Mamba2 layers; nemotron_h's router correction
_MAMBA2_LAYER_NAMES = {
    **_HYBRID_COMMON,
    **{f"ssm_{gguf}.{attr}": f"mamba.{hf}.{attr}" for gguf, hf in (("in", "in_proj"), ("out", "out_proj"),
                                                                  ("conv1d", "conv1d")) for attr in ("weight", "bias")},
    "ssm_dt.bias": "mamba.dt_bias",
    "ssm_a": "mamba.A_log",  # (llama.cpp's -exp(A_log), [heads, 1])
    "ssm_d": "mamba.D",  # ([heads, 1])
    "ssm_norm.weight": "mamba.norm.weight",  # ([groups, inner / groups])
    "exp_probs_b.bias": "mlp.e_score_correction_bias",
}
# gemma4: gemma3's sandwich norms (not phi3's fused attn_qkv), the layer's output scale, the per-layer input's
# gate, projection and norm; with experts, the router (its weight and the scale on its input), each expert's
# output scale (beside the down projections) and the norms around the experts (stacked: ffn_gate_up_exps and
# ffn_down_exps, hearth/loading/gemma4_gguf.py)
_GEMMA4_LAYER_NAMES = {
    **{k: v for k, v in _SANDWICH_LAYER_NAMES.items() if k != "attn_qkv.weight"},
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
}
# a family's own layer names, where they are not _LAYER_NAMES (or gemma2/3's _SANDWICH_LAYER_NAMES)
_FAMILY_LAYER_NAMES = {"gemma4": _GEMMA4_LAYER_NAMES, "gpt_oss": _GPT_OSS_LAYER_NAMES,
                       "qwen3_5": _DELTA_NET_LAYER_NAMES, "qwen3_next": _DELTA_NET_LAYER_NAMES,
                       "granitemoehybrid": _MAMBA2_LAYER_NAMES, "nemotron_h": _MAMBA2_LAYER_NAMES}
_HF_LAYER = {v: k for k, v in _LAYER_NAMES.items()}
_HF_FAMILY_LAYER = {arch: {v: k for k, v in names.items()} for arch, names in _FAMILY_LAYER_NAMES.items()}
_HF_LAYER["mlp.gate_up_proj.weight"] = "ffn_up.weight"  # phi3: llama.cpp's ffn_up holds gate and up
_HF_SANDWICH_LAYER = {v: k for k, v in _SANDWICH_LAYER_NAMES.items()}
_HF_GLOBAL = {v: k for k, v in _GLOBAL_NAMES.items()}

# llama.cpp's converter permutes the rows of Q and K for these architectures so that its
# "normal" RoPE (adjacent pairs) matches HF's rotate-half; other architectures run NEOX RoPE.
# (granitehybrid's and nemotron_h's attention goes through its LlamaModel too, RoPE or not)
PERMUTED_QK_ARCHITECTURES = ("llama", "mistral", "mixtral", "smollm3", "granitemoehybrid", "nemotron_h")

# architectures hearth runs from HF folders only (no GGUF either way), and why (none today)
NO_GGUF: dict[str, str] = {}

# GGUF tensors some files carry that nothing computes with (old llama.cpp's precomputed RoPE)
UNUSED_GGUF_TENSORS = re.compile(r"blk\.\d+\.attn_rot_embd")


# lfm2: llama.cpp's token_embd_norm is its final norm (HF's embedding_norm, applied after the last layer)
LFM2_FINAL_NORM = "token_embd_norm.weight"


def gguf_to_hf(name: str, sandwich_norms: bool = False, architecture: str = "") -> str | None:
    """The HF name of a GGUF tensor, or None when hearth does not know it. sandwich_norms: a
    gemma2/3 layer's names; architecture: a family's own layer names (gemma4, gpt_oss, the hybrids)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    names = _FAMILY_LAYER_NAMES.get(architecture) or (_SANDWICH_LAYER_NAMES if sandwich_norms else _LAYER_NAMES)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    return None


def is_vision_tensor(name: str) -> bool:
    """Whether a checkpoint tensor (by hearth's name) is an image-text model's vision tower's."""
    return name.startswith(_VISION_PREFIXES)


def canonical_hf_name(name: str) -> str:
    """A checkpoint's tensor name as hearth's modules name it (mixtral's block_sparse_moe.experts.N.w1
    is mlp.experts.N.gate_proj, deepseek_v2's mlp.shared_experts is mlp.shared_expert). An image-text
    model's vision tower keeps its own names (its out_proj is no lfm2 attention's)."""
    for pattern, replacement in _GEMMA3_VL_ALIASES:
        name = pattern.sub(replacement, name)
    if is_vision_tensor(name):
        return name
    for pattern, replacement in _HF_ALIASES:
        name = pattern.sub(replacement, name)
    return name


# granitemoehybrid's MLPs: its shared MLP (gate and up in one matrix, input_linear) is the layer's MLP, or
# a mixture of experts' shared expert; its experts are stacked, [experts, rows, cols] per projection
_GRANITE_SHARED_MLP = re.compile(r"\.shared_mlp\.(input_linear|output_linear)\.weight$")
_GRANITE_EXPERTS = re.compile(r"\.block_sparse_moe\.(input_linear|output_linear)\.weight$")
_GRANITE_PROJECTIONS = {"input_linear": "gate_up_proj", "output_linear": "down_proj"}


def checkpoint_tensors(config: ModelConfig, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint tensor as hearth's modules take it: (name, tensor) pairs, one but for granitemoehybrid's
    stacks of experts (one per expert) and qwen3_next's fused projections (two each)."""
    architecture, has_experts = config.architecture, config.num_experts > 0
    if architecture == "qwen3_next" and (m := _QWEN3_NEXT_FUSED.search(name)):
        return _qwen3_next_projections(config, name[:m.start()], m.group(1), tensor)
    if architecture == "gemma4" and (m := _GEMMA4_EXPERTS.search(name)):
        return _gemma4_experts(name[:m.start()], m.group(1), tensor)
    if architecture == "qwen3_moe" and (m := _QWEN3_VL_MOE_EXPERTS.search(name)):
        return _qwen3_vl_moe_experts(config, canonical_hf_name(name[:m.start()]), m.group(1), tensor)
    if architecture == "granitemoehybrid":
        name = name.replace(".block_sparse_moe.router.layer.", ".mlp.gate.")
        if m := _GRANITE_SHARED_MLP.search(name):
            mlp = ".mlp.shared_expert." if has_experts else ".mlp."
            return [(name[:m.start()] + mlp + _GRANITE_PROJECTIONS[m.group(1)] + ".weight", tensor)]
        if m := _GRANITE_EXPERTS.search(name):
            projection = _GRANITE_PROJECTIONS[m.group(1)]
            return [(f"{name[:m.start()]}.mlp.experts.{e}.{projection}.weight", t) for e, t in enumerate(tensor.unbind())]
    return [(canonical_hf_name(name), tensor)]


# gemma4's experts beside the MLP, stacked: gate_up_proj [experts, 2 x width, hidden] (gate's rows, then up's),
# down_proj [experts, hidden, width]
_GEMMA4_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def _gemma4_experts(prefix: str, stack: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A gemma4 stack of experts as hearth's ExpertMixture takes it: each expert's projections."""
    if tensor.dim() != 3 or (stack == "gate_up_proj" and tensor.shape[1] % 2):
        raise ModelLoadError(f"{prefix}.experts.{stack}: shape {tuple(tensor.shape)}, expected [experts, rows, columns]")
    return _each_expert(f"{prefix}.experts.experts", stack, tensor)


def _each_expert(stem: str, stack: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A stack [experts, rows, columns] as each expert's projections, stem.E.PROJECTION.weight (gate_up_proj's
    gate rows first)."""
    names = ("gate_proj", "up_proj") if stack == "gate_up_proj" else ("down_proj",)
    return [(f"{stem}.{e}.{name}.weight", part.contiguous()) for e, expert in enumerate(tensor.unbind())
            for name, part in zip(names, expert.chunk(len(names)))]


# Qwen3-VL-MoE's experts, stacked: transformers 5's layout gate_up_proj [experts, 2 x width, hidden] (gate's rows,
# then up's), down_proj [experts, hidden, width]; the published checkpoints' each transposed (transformers
# transposes a stack whose shape is not its own, and so does hearth)
_QWEN3_VL_MOE_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def _qwen3_vl_moe_experts(config: ModelConfig, prefix: str, stack: str,
                          tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A Qwen3-VL-MoE stack of experts as hearth's qwen3_moe takes it: each expert's projections."""
    width, hidden = config.moe_intermediate_size, config.hidden_size
    rows, columns = (2 * width, hidden) if stack == "gate_up_proj" else (hidden, width)
    if tensor.dim() == 3 and tuple(tensor.shape[1:]) == (columns, rows):
        tensor = tensor.transpose(1, 2)
    if tensor.dim() != 3 or tensor.shape[0] != config.num_experts or tuple(tensor.shape[1:]) != (rows, columns):
        raise ModelLoadError(f"{prefix}.experts.{stack}: shape {tuple(tensor.shape)}, expected "
                             f"[{config.num_experts}, {rows}, {columns}] or [{config.num_experts}, {columns}, {rows}]")
    return _each_expert(f"{prefix}.experts", stack, tensor)


# qwen3_next's Gated DeltaNet projections, each fused and grouped by key head
_QWEN3_NEXT_FUSED = re.compile(r"\.(in_proj_qkvz|in_proj_ba)\.weight$")


def _qwen3_next_projections(config: ModelConfig, prefix: str, fused: str,
                            tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """qwen3_next's in_proj_qkvz (per key head: its q, its k, then its run of value heads' v and z) and
    in_proj_ba (per key head: its value heads' b, then a) as Qwen3.5's in_proj_qkv (every head's q, then
    k, then v), in_proj_z, in_proj_b and in_proj_a, the rows transformers' fix_query_key_value_ordering
    takes."""
    groups, dk, dv = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    per_group = config.linear_num_value_heads // groups
    sizes = [dk, dk, per_group * dv, per_group * dv] if fused == "in_proj_qkvz" else [per_group, per_group]
    if tensor.dim() != 2 or tensor.shape[0] != groups * sum(sizes):
        raise ModelLoadError(f"{prefix}.{fused}.weight: shape {tuple(tensor.shape)}, expected {groups * sum(sizes)} "
                             "rows")
    parts = [part.reshape(-1, tensor.shape[1]) for part in tensor.view(groups, sum(sizes), -1).split(sizes, dim=1)]
    pieces = ({"in_proj_qkv": torch.cat(parts[:3]), "in_proj_z": parts[3]} if fused == "in_proj_qkvz"
              else {"in_proj_b": parts[0], "in_proj_a": parts[1]})
    return [(f"{prefix}.{piece}.weight", weight) for piece, weight in pieces.items()]


# hearth's names -> a family's own checkpoint names, where transformers reads only those
_CHECKPOINT_NAMES = {"deepseek_v2": ((re.compile(r"\.mlp\.shared_expert\."), ".mlp.shared_experts."),),
                     "lfm2": tuple((re.compile(re.escape(ours)), theirs) for theirs, ours in _LFM2_NAMES.items())}


def checkpoint_name(name: str, architecture: str) -> str:
    """The name `architecture`'s checkpoints give hearth's tensor `name` (canonical_hf_name's inverse)."""
    for pattern, replacement in _CHECKPOINT_NAMES.get(architecture, ()):
        name = pattern.sub(replacement, name)
    return name


def gguf_expert_stack(name: str) -> tuple[int, str, str] | None:
    """(layer, projection, weight or bias) of a GGUF stack of experts (blk.N.ffn_gate_exps.weight), else None."""
    m = _GGUF_EXPERT_STACK.fullmatch(name)
    return (int(m.group(1)), _EXPERT_STACKS[m.group(2)], m.group(3)) if m else None


def hf_expert(name: str) -> tuple[int, int, str, str] | None:
    """(layer, expert, projection, weight or bias) of one expert's tensor in HF naming, else None."""
    m = _HF_EXPERT.fullmatch(name)
    return (int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)) if m else None


def hf_expert_name(layer: int, expert: int, projection: str, attr: str = "weight") -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{projection}.{attr}"


def gguf_expert_stack_name(layer: int, projection: str, attr: str = "weight") -> str:
    suffix = next(k for k, v in _EXPERT_STACKS.items() if v == projection)
    return f"blk.{layer}.{suffix}.{attr}"


def hf_to_gguf(name: str, sandwich_norms: bool = False, architecture: str = "") -> str | None:
    """The GGUF name of an HF tensor, or None when it has none (gguf_to_hf's inverse)."""
    if name in _HF_GLOBAL:
        return _HF_GLOBAL[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    names = _HF_FAMILY_LAYER.get(architecture) or (_HF_SANDWICH_LAYER if sandwich_norms else _HF_LAYER)
    if m and m.group(2) in names:
        return f"blk.{m.group(1)}.{names[m.group(2)]}"
    return None


def qk_row_order(num_heads: int, head_dim: int, to_gguf: bool) -> torch.Tensor:
    """Row indices that turn HF's Q/K rows into llama.cpp's order (or back).

    Within each head HF keeps the two rotated halves apart ([x0..x{d/2-1}, y0..]) and
    llama.cpp interleaves them ([x0, y0, x1, y1, ...]).
    """
    half = head_dim // 2
    within = torch.arange(head_dim).view(2, half).t().reshape(-1)  # gguf row j <- hf row within[j]
    if not to_gguf:
        within = torch.argsort(within)
    heads = torch.arange(num_heads).unsqueeze(1) * head_dim
    return (heads + within.unsqueeze(0)).reshape(-1)
