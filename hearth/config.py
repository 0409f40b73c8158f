"""Architecture facts of a model (ModelConfig), read from an HF config.json or GGUF metadata (the
engine's options are hearth/engine_config.py's)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from hearth.errors import ModelLoadError
from hearth.hf_config import (
    architecture_from_hf,
    experts_from_hf,
    gemma2_from_hf,
    gemma4_from_hf,
    gpt_oss_from_hf,
    hybrid_fields_from_hf,
    hybrid_from_hf,
    latent_attention_from_hf,
    no_rope_layers_from_hf,
    refuse_quantized_or_multimodal,
    refuse_unimplemented,
    rope_scaling_from_hf,
    sliding_layers_from_hf,
)
from hearth.vision_config import (Gemma4VisionConfig, QwenVisionConfig, VisionConfig, mrope_section_of, text_config_of,
                                  vision_family, vision_from_hf)

# A sequence with at most this many new tokens this step (a decode: 1; the verification of k
# guesses: k + 1; a short chunk) reads its context through the block table with a decode kernel;
# longer ones (prompts) take per-sequence SDPA. vLLM calls it the decode threshold.
MAX_DECODE_QUERY_LEN = 16

# Architectures the one decoder covers, and what sets them apart.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "smollm3", "phi3",
                           "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "lfm2", "qwen3_5",
                           "qwen3_next", "granitemoehybrid", "nemotron_h", "gpt_oss", "gemma4")
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
# Gated DeltaNet and gated attention: Qwen3.5 and Qwen3-Next (its experts those of qwen2_moe)
QWEN_DELTA_NET = ("qwen3_5", "qwen3_next")

# What a layer of a hybrid model is (ModelConfig.layer_types): attention keeps K/V per token in the paged
# cache; the others keep a fixed-size state per sequence (the state cache, hearth/engine/state_slots.py), but
# MLP: nemotron_h's blocks of an MLP alone, which keep nothing
ATTENTION, SHORT_CONV, GATED_DELTA_NET, MAMBA2, MLP = "attention", "short_conv", "gated_delta_net", "mamba2", "mlp"
LAYER_KINDS = (ATTENTION, SHORT_CONV, GATED_DELTA_NET, MAMBA2, MLP)


@dataclass
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # of q and k; with multi-head latent attention, of their rotated part (qk_rope_head_dim)
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)
    attention_bias: bool = False  # q/k/v projections carry a bias (qwen2), and o_proj too (llama, qwen3, gemma)
    mlp_bias: bool = False  # gate/up/down carry a bias (llama's mlp_bias)
    # RMSNorm of q and k before RoPE: "head" over each head (qwen3), "all" over the whole projection (olmoe)
    qk_norm: str | None = None
    # gemma stores RMSNorm weights as (w - 1) and scales embeddings by sqrt(hidden)
    norm_weight_offset: float = 0.0
    embedding_scale: float = 1.0
    # Sliding-window attention (mistral, qwen2's use_sliding_window, gemma2/3's local layers): a query
    # attends to the last `sliding_window` positions, itself included
    sliding_window: int | None = None
    # layers that attend through the window (gemma2/3 alternate local and global layers); None: every layer
    sliding_layers: tuple[int, ...] | None = None
    local_rope_theta: float | None = None  # gemma3: the RoPE base of the sliding layers (unscaled); None: rope_theta
    # gemma2/3: scores scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5); attention scores
    # and final logits soft-capped as cap * tanh(x / cap); norms after attention and after the MLP too
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sandwich_norms: bool = False
    no_rope_layers: tuple[int, ...] = ()  # layers whose q and k are not rotated (smollm3's NoPE layers)
    # Mixture of experts (mixtral, qwen2_moe, qwen3_moe, olmoe): a layer's MLP is the sum of the top
    # `num_experts_per_tok` of `num_experts` gated MLPs of `moe_intermediate_size`, weighted by the
    # router's softmax over all experts (renormalised over the chosen ones when norm_topk_prob).
    num_experts: int = 0  # 0: a dense MLP in every layer
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # qwen2_moe: a dense MLP every token takes beside the routed ones, scaled by sigmoid(gate(x)); 0: none
    shared_expert_intermediate_size: int = 0
    dense_mlp_layers: tuple[int, ...] = ()  # layers of an MoE model with a dense MLP (qwen's mlp_only_layers)
    shared_expert_gated: bool = True  # qwen2_moe's shared expert is scaled by its gate; deepseek_v2's is not
    routed_scaling_factor: float = 1.0  # deepseek_v2: the chosen experts' weights times this
    # nemotron_h: the router's scores are sigmoids, chosen by score + a learned correction (DeepSeek-V3's noaux_tc)
    router_sigmoid: bool = False
    # deepseek_v2's group_limited_greedy: the experts in expert_groups groups, of which a token chooses
    # only among those of the topk_groups groups with the highest best scores; 0: no groups
    expert_groups: int = 0
    topk_groups: int = 0
    router_bias: bool = False  # gpt_oss: the router's logits carry a bias
    # gpt_oss's experts: (alpha, limit) of its clamped SwiGLU, gate clamped to at most limit and up to
    # [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate); None: the plain activation
    clamped_swiglu: tuple[float, float] | None = None
    attention_sinks: bool = False  # gpt_oss: a learned logit per head joins each attention softmax
    # Multi-head latent attention (deepseek_v2): K and V of every head come from one latent per token,
    # kv_lora_rank wide, which the cache holds with the rotated key part shared by all heads (head_dim
    # wide); each head's q and k have qk_nope_head_dim unrotated dimensions before the rotated ones, its
    # v v_head_dim. 0: ordinary attention.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # q made through a norm between two projections of this rank (0: by q_proj)
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # Hybrid models (lfm2, qwen3_5, granitemoehybrid, nemotron_h): each layer's kind (LAYER_KINDS); (): all attention
    layer_types: tuple[str, ...] = ()
    conv_kernel_size: int = 0  # the causal depthwise convolution's width (lfm2's conv_L_cache, qwen3_5's conv)
    conv_bias: bool = False  # lfm2: biases on the convolution and its projections; Mamba2: on the convolution
    # Gated DeltaNet (qwen3_5): q and k heads of linear_key_head_dim, v heads of linear_value_head_dim
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # the value heads' order: False, grouped by key head (a key head's run of value heads together, HF's);
    # True, tiled (value head j reads key head j % linear_num_key_heads: llama.cpp's qwen35 files)
    linear_value_heads_tiled: bool = False
    # Mamba2 (granitemoehybrid, nemotron_h): mamba_num_heads heads of mamba_head_dim, their B and C in
    # mamba_groups groups of ssm_state_size; dt clamped to time_step_limit; biases on in_proj and out_proj
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    ssm_state_size: int = 0
    mamba_groups: int = 0
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    # granitemoehybrid: each layer's additions to the residual stream times residual_multiplier, the logits
    # divided by logits_divisor (its logits_scaling)
    residual_multiplier: float = 1.0
    logits_divisor: float = 1.0
    # nemotron_h: a layer is one norm and one of attention, Mamba2 or an MLP (no MLP after the mixer)
    single_mixer_blocks: bool = False
    gated_mlp: bool = True  # False: the MLP is down(act(up(x))) (nemotron_h's, with relu2)
    attention_output_gate: bool = False  # qwen3_5: attention's output times sigmoid(a gate q_proj makes beside q)
    partial_rotary_factor: float = 1.0  # the share of q's and k's head dimensions RoPE rotates (the first ones)
    # M-RoPE (qwen3_vl, interleaved): a token has three positions (time, height, width; a text token's are
    # equal, an image's patch has its row's and column's) and frequency j turns by the one mrope_axes
    # picks; the counts of frequencies per axis. None: one position per token
    mrope_section: tuple[int, int, int] | None = None
    # Attention layers of other shapes (gemma4's full layers: wider heads, fewer KV heads): per layer its
    # head_dim and KV heads; (): head_dim and num_kv_heads in every layer
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    # KV sharing (gemma4's last num_kv_shared_layers): per layer, the earlier layer whose cached K/V it attends
    # over, itself where it keeps its own; (): every attention layer keeps its own
    kv_sources: tuple[int, ...] = ()
    # gemma4: v RMS-normed over each head without a weight; the layers whose v is their k projection's output
    # (attention_k_eq_v's full layers: no v_proj)
    value_norm: bool = False
    k_eq_v_layers: tuple[int, ...] = ()
    # gemma4's per-layer embeddings: each token gets a vector of per_layer_input_size for every layer, from a
    # table of per_layer_vocab_size tokens and a projection of its embedding, gated into the layer's output
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    double_wide_mlp_layers: tuple[int, ...] = ()  # gemma4: layers whose MLP is 2 x intermediate_size wide
    # qwen3_5 / qwen3_next: the multi-token-prediction layers the checkpoint holds and hearth loads (mtp.*; a
    # GGUF file's nextn blocks after the last layer), the draft of --speculative-method mtp (hearth/model/mtp.py)
    mtp_layers: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    # an image-text model's encoder and projector (hearth/vision_config.py)
    vision: VisionConfig | QwenVisionConfig | Gemma4VisionConfig | None = None

    @property
    def accepts_images(self) -> bool:
        """Whether the model reads images: it has a vision encoder (hearth/vision_config.py)."""
        return self.vision is not None

    @property
    def bidirectional_images(self) -> bool:
        """Whether an image's tokens attend to each other both ways in prefill, every one seeing the whole
        image (Gemma 3's; Gemma 4's on its sliding-window layers, where its text_config's
        use_bidirectional_attention is "vision"; the rest of the sequence stays causal)."""
        vision = self.vision
        return vision is not None and (vision.family == "gemma3" or self.bidirectional_images_sliding_only)

    @property
    def bidirectional_images_sliding_only(self) -> bool:
        """Whether those images see both ways on the sliding-window layers only (Gemma 4's; its full layers causal)."""
        return getattr(self.vision, "bidirectional", False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; "
                f"hearth supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self._check_sizes(_SIZE_LIMITS)
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim = {self.head_dim}: rotary embeddings need an even head size")
        for name in ("rms_norm_eps", "rope_theta", "embedding_scale", "routed_scaling_factor", "residual_multiplier",
                     "logits_divisor"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) <= 0:
                raise ModelLoadError(f"{name} = {getattr(self, name)!r}: expected a positive number")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelLoadError(f"sliding_window = {self.sliding_window}: expected a positive number of tokens")
        if not isinstance(self.hidden_act, str):
            raise ModelLoadError(f"hidden_act = {self.hidden_act!r}: expected an activation's name")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ModelLoadError(f"rope_scaling = {self.rope_scaling!r}: expected an object")
        for name in ("local_rope_theta", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value <= 0):
                raise ModelLoadError(f"{name} = {value!r}: expected a positive number")
        if self.qk_norm not in (None, "head", "all"):
            raise ModelLoadError(f"qk_norm = {self.qk_norm!r}: expected None, 'head' or 'all'")
        if self.num_experts:
            self._check_experts()
        if self.layer_types:
            self._check_state_layers()
        if self.layer_head_dims or self.layer_kv_heads or self.kv_sources:
            self._check_attention_layers()
        if any(not 0 <= layer < self.num_layers for layer in self.k_eq_v_layers + self.double_wide_mlp_layers):
            raise ModelLoadError(f"k_eq_v_layers {list(self.k_eq_v_layers)}, double-wide MLP layers "
                                 f"{list(self.double_wide_mlp_layers)}: expected layer numbers below {self.num_layers}")
        if self.per_layer_input_size:
            self._check_sizes(_PER_LAYER_INPUT_LIMITS)
        if self.kv_lora_rank or self.architecture == "deepseek_v2":  # never run as ordinary attention
            self._check_sizes(_LATENT_LIMITS)
            if not 0 <= self.q_lora_rank <= _QUERY_RANK_LIMIT:
                raise ModelLoadError(f"q_lora_rank = {self.q_lora_rank}: expected 0 to {_QUERY_RANK_LIMIT:,}")

    def _check_sizes(self, limits: dict[str, int]) -> None:
        for name, most in limits.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
                raise ModelLoadError(f"{name} = {value!r}: expected a whole number from 1 to {most:,}")

    def _check_experts(self) -> None:
        self._check_sizes(_EXPERT_LIMITS)
        if self.num_experts_per_tok > self.num_experts:
            raise ModelLoadError(f"num_experts_per_tok = {self.num_experts_per_tok}: more than the "
                                 f"{self.num_experts} experts")
        if not 0 <= self.shared_expert_intermediate_size <= _EXPERT_LIMITS["moe_intermediate_size"]:
            raise ModelLoadError(f"shared_expert_intermediate_size = {self.shared_expert_intermediate_size!r}: "
                                 "expected a whole number of at least 0")
        groups, chosen_groups = self.expert_groups, self.topk_groups
        if groups and (self.num_experts % groups or not 1 <= chosen_groups <= groups
                       or chosen_groups * (self.num_experts // groups) < self.num_experts_per_tok):
            raise ModelLoadError(f"n_group = {groups}, topk_group = {chosen_groups}: expected groups that split the "
                                 f"{self.num_experts} experts and leave {self.num_experts_per_tok} to choose from")
        if any(not 0 <= layer < self.num_layers for layer in self.dense_mlp_layers):
            raise ModelLoadError(f"dense MLP layers {list(self.dense_mlp_layers)}: expected layer numbers below "
                                 f"{self.num_layers}")

    def _check_state_layers(self) -> None:
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_KINDS):
            raise ModelLoadError(f"layer_types = {list(self.layer_types)!r}: expected one of {', '.join(LAYER_KINDS)} "
                                 f"for each of the {self.num_layers} layers")
        self._check_sizes({"conv_kernel_size": 1 << 8})
        if self.conv_kernel_size < 2 or ATTENTION not in self.layer_types:
            raise ModelLoadError(f"conv_kernel_size = {self.conv_kernel_size}, layer_types = {list(self.layer_types)}: "
                                 "hearth implements convolutions of 2 taps or more, and models with an attention layer")
        if GATED_DELTA_NET in self.layer_types:
            self._check_sizes(_DELTA_NET_LIMITS)
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ModelLoadError(f"linear_num_value_heads ({self.linear_num_value_heads}) is not a multiple of "
                                     f"linear_num_key_heads ({self.linear_num_key_heads})")
        if MAMBA2 in self.layer_types:
            self._check_sizes(_MAMBA2_LIMITS)
            if self.mamba_num_heads % self.mamba_groups:
                raise ModelLoadError(f"mamba_num_heads ({self.mamba_num_heads}) is not a multiple of the "
                                     f"{self.mamba_groups} groups")
            low, high = self.time_step_limit
            if not 0 <= low < high:
                raise ModelLoadError(f"time_step_limit = {list(self.time_step_limit)}: expected 0 <= low < high")
        if not 0 < self.partial_rotary_factor <= 1 or int(self.head_dim * self.partial_rotary_factor) % 2:
            raise ModelLoadError(f"partial_rotary_factor = {self.partial_rotary_factor!r}: expected a share of "
                                 f"head_dim ({self.head_dim}) that is a positive even number of dimensions")

    def _check_attention_layers(self) -> None:
        for name in ("layer_head_dims", "layer_kv_heads", "kv_sources"):
            values = getattr(self, name)
            if values and len(values) != self.num_layers:
                raise ModelLoadError(f"{name} = {list(values)}: expected one for each of the {self.num_layers} layers")
        for layer in range(self.num_layers):
            dim, heads = self.head_dim_of(layer), self.kv_heads_of(layer)
            if not 2 <= dim <= _SIZE_LIMITS["head_dim"] or dim % 2:
                raise ModelLoadError(f"layer {layer}: head_dim = {dim}: expected an even number up to "
                                     f"{_SIZE_LIMITS['head_dim']:,}")
            if not 1 <= heads <= self.num_heads or self.num_heads % heads:
                raise ModelLoadError(f"layer {layer}: {heads} KV heads do not divide the {self.num_heads} heads")
            source = self.kv_source(layer)
            if not 0 <= source <= layer or (source != layer and (
                    self.kv_source(source) != source or self.layer_type(source) != ATTENTION
                    or self.is_sliding_layer(source) != self.is_sliding_layer(layer))):
                raise ModelLoadError(f"layer {layer} reads the K/V of layer {source}: expected an earlier attention "
                                     "layer of the same kind (sliding or full) that keeps its own")

    def head_dim_of(self, layer: int) -> int:
        """The head size of a layer's q, k and v."""
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_kv_heads

    def kv_source(self, layer: int) -> int:
        """The layer whose cached K/V `layer` attends over: itself, or with KV sharing an earlier one."""
        return self.kv_sources[layer] if self.kv_sources else layer

    def keeps_kv_cache(self, layer: int) -> bool:
        """An attention layer that writes K/V of its own (not a state layer, not one that reads another's)."""
        return self.layer_type(layer) == ATTENTION and self.kv_source(layer) == layer

    @property
    def uniform_kv_cache(self) -> bool:
        """Every attention layer keeps its own K/V, all of one shape (pipeline and tensor parallelism's rule)."""
        return not (self.layer_head_dims or self.layer_kv_heads or self.kv_sources)

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else ATTENTION

    @property
    def is_hybrid(self) -> bool:
        """Some layer keeps a state per sequence rather than K/V per token."""
        return any(kind != ATTENTION for kind in self.layer_types)

    def state_shapes(self, layer: int) -> tuple[tuple[int, ...], ...]:
        """The state a layer keeps per sequence: () for attention and an MLP; a short convolution's window
        (the last conv_kernel_size - 1 inputs of each channel, [channels, kernel - 1]); a Gated DeltaNet's
        convolution window over q, k and v and its delta-rule state [value heads, key dim, value dim]; a
        Mamba2's convolution window over x, B and C and its SSM state [heads, state size, head dim]."""
        kind, window = self.layer_type(layer), self.conv_kernel_size - 1
        if kind == SHORT_CONV:
            return ((self.hidden_size, window),)
        if kind == GATED_DELTA_NET:
            keys, values = self.linear_num_key_heads * self.linear_key_head_dim, \
                self.linear_num_value_heads * self.linear_value_head_dim
            return ((2 * keys + values, window),
                    (self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim))
        if kind == MAMBA2:
            inner, groups = self.mamba_num_heads * self.mamba_head_dim, self.mamba_groups * self.ssm_state_size
            return ((inner + 2 * groups, window), (self.mamba_num_heads, self.ssm_state_size, self.mamba_head_dim))
        return ()

    def state_bytes_per_sequence(self, bytes_per_element: int) -> int:
        """Every layer's state of one sequence: convolution windows in the compute dtype (bytes_per_element),
        delta-rule and SSM states in float32 (they sum over the whole sequence)."""
        total = 0
        for layer in range(self.num_layers):
            for i, shape in enumerate(self.state_shapes(layer)):
                total += math.prod(shape) * (bytes_per_element if i == 0 else 4)
        return total

    def is_sliding_layer(self, layer: int) -> bool:
        return self.sliding_window is not None and (self.sliding_layers is None or layer in self.sliding_layers)

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    @classmethod
    def from_hf(cls, hf: dict[str, Any], where: str = "config.json") -> "ModelConfig":
        refuse_quantized_or_multimodal(hf, where)
        if vision_family(hf) is not None:
            return cls._image_text_from_hf(hf, where)
        arch = architecture_from_hf(hf, where, SUPPORTED_ARCHITECTURES)
        try:
            hf = hybrid_fields_from_hf(hf, arch)
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            kv_heads = int(hf.get("num_key_value_heads") or heads)
            head_dim = int(hf.get("head_dim") or hidden // heads)
            gemma = arch in GEMMA_ARCHITECTURES
            # transformers >= 5 writes rope_theta and the scaling into one "rope_parameters" object
            # (gemma3: one per layer type)
            rope = hf.get("rope_parameters") or {}
            local_rope = rope.get("sliding_attention")
            rope = rope.get("full_attention", rope)
            # transformers runs gemma with the tanh approximation whatever the config says
            act = "gelu_pytorch_tanh" if gemma else hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
            refuse_unimplemented(hf, where, arch)
            if arch == "deepseek_v2":  # q and k: head_dim is their rotated part, as transformers has it
                head_dim = int(hf["qk_rope_head_dim"])
            window = hf.get("sliding_window")
            if arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not hf.get("use_sliding_window", False):
                window = None  # their configs carry a window that is switched off
            # (a hybrid family's fields last: they override what the other families' rules give)
            return cls(**dict(
                architecture=arch,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                rope_scaling=rope_scaling_from_hf(hf, rope, head_dim),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
                hidden_act=act,
                attention_bias=bool(hf.get("attention_bias", hf.get("qkv_bias", arch in ("qwen2", "qwen2_moe")))),
                mlp_bias=bool(hf.get("mlp_bias", arch == "gpt_oss")),  # gpt_oss's experts carry biases
                sliding_window=int(window) if window is not None else None,
                sliding_layers=sliding_layers_from_hf(hf, arch) if window is not None else None,
                no_rope_layers=no_rope_layers_from_hf(hf) if arch == "smollm3" else (),
                qk_norm={"qwen3": "head", "qwen3_moe": "head", "gemma3": "head", "olmoe": "all", "lfm2": "head",
                         "qwen3_5": "head", "qwen3_next": "head"}.get(arch),
                norm_weight_offset=1.0 if gemma or arch in QWEN_DELTA_NET else 0.0,  # norms of (1 + w)
                embedding_scale=math.sqrt(hidden) if gemma else 1.0,
                **gemma2_from_hf(hf, arch, local_rope),
                **experts_from_hf(hf, arch), **gpt_oss_from_hf(hf, arch),
                **latent_attention_from_hf(hf, arch, heads, kv_heads),
            ) | hybrid_from_hf(hf, arch, rope) | gemma4_from_hf(hf, arch, rope, local_rope))
        except KeyError as e:
            raise ModelLoadError(f"{where}: missing required field {e.args[0]!r}") from None
        except ModelLoadError as e:
            raise ModelLoadError(f"{where}: {e}") from None
        except (TypeError, ValueError, AttributeError, OverflowError, ZeroDivisionError) as e:
            raise ModelLoadError(f"{where}: malformed field: {e}") from None

    @classmethod
    def _image_text_from_hf(cls, hf: dict[str, Any], where: str) -> "ModelConfig":
        """An image-text model's: its text model's config, with the vision config beside (vision_config.py)."""
        text = cls.from_hf(text_config_of(hf), where)
        try:
            vision = vision_from_hf(hf, text.vocab_size)
            if getattr(vision, "out_hidden_size", text.hidden_size) != text.hidden_size:
                raise ModelLoadError(f"vision_config.out_hidden_size = {vision.out_hidden_size}: the text model's "
                                     f"hidden_size is {text.hidden_size}")
            return dataclasses.replace(text, vision=vision, mrope_section=mrope_section_of(hf))
        except (ModelLoadError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{where}: {e}") from None

    def mtp_layer_config(self) -> "ModelConfig":
        """The config of the multi-token-prediction layers: full-attention decoder layers of this model's
        shapes (experts where the model has them), as Qwen3.5's and Qwen3-Next's checkpoints ship them."""
        return dataclasses.replace(self, num_layers=self.mtp_layers, layer_types=(), dense_mlp_layers=(),
                                   sliding_layers=None, vision=None, mtp_layers=0)

    def kv_cache_layout(self, layer: int) -> tuple[int, int, int]:
        """A layer's cache as (tensors, heads, values per head) per token: K and V of its KV heads x its
        head_dim, or with multi-head latent attention one tensor of one latent, kv_lora_rank +
        head_dim wide (the rotated key part after the latent)."""
        if self.kv_lora_rank:
            return 1, 1, self.kv_lora_rank + self.head_dim
        return 2, self.kv_heads_of(layer), self.head_dim_of(layer)

    def kv_bytes_per_token(self, bytes_per_element: float) -> int:
        """The cache of every layer that keeps one: the sum of tensors x heads x values, times bytes (q8_0: 34 / 32)."""
        values = sum(math.prod(self.kv_cache_layout(layer)) for layer in range(self.num_layers)
                     if self.keeps_kv_cache(layer))
        return round(values * bytes_per_element)

    @property
    def kv_window(self) -> int | None:
        """The window every layer attends through, or None where some layer sees the whole context:
        a running request's K/V older than its last kv_window positions are never read again."""
        every_layer = all(self.is_sliding_layer(layer) for layer in range(self.num_layers)
                          if self.layer_type(layer) == ATTENTION)
        return self.sliding_window if every_layer else None


# Bounds on a model's sizes (a few times the largest released models'): a damaged or hostile
# config must not make hearth allocate without limit.
_SIZE_LIMITS = {
    "vocab_size": 1 << 22, "hidden_size": 1 << 17, "intermediate_size": 1 << 20, "num_layers": 1 << 12,
    "num_heads": 1 << 12, "num_kv_heads": 1 << 12, "head_dim": 1 << 12, "max_position_embeddings": 1 << 24,
}
_LATENT_LIMITS = {"kv_lora_rank": 1 << 16, "qk_nope_head_dim": 1 << 12, "v_head_dim": 1 << 12}
_QUERY_RANK_LIMIT = 1 << 16
_DELTA_NET_LIMITS = {"linear_num_key_heads": 1 << 12, "linear_num_value_heads": 1 << 12, "linear_key_head_dim": 1 << 12,
                     "linear_value_head_dim": 1 << 12}
_MAMBA2_LIMITS = {"mamba_num_heads": 1 << 12, "mamba_head_dim": 1 << 12, "ssm_state_size": 1 << 12,
                  "mamba_groups": 1 << 12}
_PER_LAYER_INPUT_LIMITS = {"per_layer_input_size": 1 << 14, "per_layer_vocab_size": 1 << 22}
_EXPERT_LIMITS = {"num_experts": 1 << 12, "num_experts_per_tok": 1 << 12, "moe_intermediate_size": 1 << 20}
