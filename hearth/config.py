"""Architecture facts of a model (ModelConfig), read from an HF config.json or GGUF metadata; the
engine's options (EngineConfig and its nested configs), each declared once (hearth/options.py)."""

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
    hybrid_fields_from_hf,
    hybrid_from_hf,
    latent_attention_from_hf,
    no_rope_layers_from_hf,
    refuse_quantized_or_multimodal,
    refuse_unimplemented,
    rope_scaling_from_hf,
    sliding_layers_from_hf,
)
from hearth.options import build, option, parse_size, section
from hearth.reasoning import FORMATS
from hearth.vision_config import VisionConfig, text_config_of, vision_family, vision_from_hf

# A sequence with at most this many new tokens this step (a decode: 1; the verification of k
# guesses: k + 1; a short chunk) reads its context through the block table with a decode kernel;
# longer ones (prompts) take per-sequence SDPA. vLLM calls it the decode threshold.
MAX_DECODE_QUERY_LEN = 16

# Guesses per request per step by default: the most; how many of them are made follows the
# request's acceptance and the batch (hearth/engine/speculation/guess_count.py, num_guesses). The built-in pair
# at batch 1, 2 threads: 4 -> 1.84x, 8 -> 2.20x, 12 -> 2.38x (docs/benchmarks.md).
DEFAULT_SPECULATIVE_TOKENS = 8

# Architectures the one decoder covers, and what sets them apart.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "smollm3", "phi3",
                           "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "lfm2", "qwen3_5")
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")

# What a layer of a hybrid model is (ModelConfig.layer_types): attention keeps K/V per token in the paged
# cache; the others keep a fixed-size state per sequence (the state cache, hearth/engine/state_slots.py)
ATTENTION, SHORT_CONV, GATED_DELTA_NET = "attention", "short_conv", "gated_delta_net"


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
    # deepseek_v2's group_limited_greedy: the experts in expert_groups groups, of which a token chooses
    # only among those of the topk_groups groups with the highest best scores; 0: no groups
    expert_groups: int = 0
    topk_groups: int = 0
    # Multi-head latent attention (deepseek_v2): K and V of every head come from one latent per token,
    # kv_lora_rank wide, which the cache holds with the rotated key part shared by all heads (head_dim
    # wide); each head's q and k have qk_nope_head_dim unrotated dimensions before the rotated ones, its
    # v v_head_dim. 0: ordinary attention.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # q made through a norm between two projections of this rank (0: by q_proj)
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # Hybrid models (lfm2, qwen3_5): each layer's kind (ATTENTION, SHORT_CONV, GATED_DELTA_NET); (): all attention
    layer_types: tuple[str, ...] = ()
    conv_kernel_size: int = 0  # the causal depthwise convolution's width (lfm2's conv_L_cache, qwen3_5's conv)
    conv_bias: bool = False  # lfm2: biases on the convolution and its projections
    # Gated DeltaNet (qwen3_5): q and k heads of linear_key_head_dim, v heads of linear_value_head_dim
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    attention_output_gate: bool = False  # qwen3_5: attention's output times sigmoid(a gate q_proj makes beside q)
    partial_rotary_factor: float = 1.0  # the share of q's and k's head dimensions RoPE rotates (the first ones)
    extra: dict[str, Any] = field(default_factory=dict)
    vision: VisionConfig | None = None  # an image-text model's encoder and projector (hearth/vision_config.py)

    @property
    def accepts_images(self) -> bool:
        """Whether the model reads images: it has a vision encoder (hearth/vision_config.py)."""
        return self.vision is not None

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
        for name in ("rms_norm_eps", "rope_theta", "embedding_scale", "routed_scaling_factor"):
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
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {ATTENTION, SHORT_CONV, GATED_DELTA_NET}:
            raise ModelLoadError(f"layer_types = {list(self.layer_types)!r}: expected one of {ATTENTION}, {SHORT_CONV}, "
                                 f"{GATED_DELTA_NET} for each of the {self.num_layers} layers")
        self._check_sizes({"conv_kernel_size": 1 << 8})
        if self.conv_kernel_size < 2 or ATTENTION not in self.layer_types:
            raise ModelLoadError(f"conv_kernel_size = {self.conv_kernel_size}, layer_types = {list(self.layer_types)}: "
                                 "hearth implements convolutions of 2 taps or more, and models with an attention layer")
        if GATED_DELTA_NET in self.layer_types:
            self._check_sizes(_DELTA_NET_LIMITS)
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ModelLoadError(f"linear_num_value_heads ({self.linear_num_value_heads}) is not a multiple of "
                                     f"linear_num_key_heads ({self.linear_num_key_heads})")
        if not 0 < self.partial_rotary_factor <= 1 or int(self.head_dim * self.partial_rotary_factor) % 2:
            raise ModelLoadError(f"partial_rotary_factor = {self.partial_rotary_factor!r}: expected a share of "
                                 f"head_dim ({self.head_dim}) that is a positive even number of dimensions")

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else ATTENTION

    @property
    def is_hybrid(self) -> bool:
        """Some layer keeps a state per sequence rather than K/V per token."""
        return any(kind != ATTENTION for kind in self.layer_types)

    @property
    def num_attention_layers(self) -> int:
        return sum(self.layer_type(layer) == ATTENTION for layer in range(self.num_layers))

    def state_shapes(self, layer: int) -> tuple[tuple[int, ...], ...]:
        """The state a layer keeps per sequence: () for attention; a short convolution's window (the last
        conv_kernel_size - 1 inputs of each channel, [channels, kernel - 1]); a Gated DeltaNet's
        convolution window over q, k and v and its delta-rule state [value heads, key dim, value dim]."""
        kind, window = self.layer_type(layer), self.conv_kernel_size - 1
        if kind == SHORT_CONV:
            return ((self.hidden_size, window),)
        if kind == GATED_DELTA_NET:
            keys, values = self.linear_num_key_heads * self.linear_key_head_dim, \
                self.linear_num_value_heads * self.linear_value_head_dim
            return ((2 * keys + values, window),
                    (self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim))
        return ()

    def state_bytes_per_sequence(self, bytes_per_element: int) -> int:
        """Every layer's state of one sequence: convolution windows in the compute dtype (bytes_per_element),
        delta-rule states in float32 (they sum over the whole sequence)."""
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
            return cls(
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
                mlp_bias=bool(hf.get("mlp_bias", False)),
                sliding_window=int(window) if window is not None else None,
                sliding_layers=sliding_layers_from_hf(hf, arch) if window is not None else None,
                no_rope_layers=no_rope_layers_from_hf(hf) if arch == "smollm3" else (),
                qk_norm={"qwen3": "head", "qwen3_moe": "head", "gemma3": "head", "olmoe": "all", "lfm2": "head",
                         "qwen3_5": "head"}.get(arch),
                norm_weight_offset=1.0 if gemma or arch == "qwen3_5" else 0.0,  # norms of (1 + w)
                embedding_scale=math.sqrt(hidden) if gemma else 1.0,
                **gemma2_from_hf(hf, arch, local_rope),
                **experts_from_hf(hf, arch),
                **latent_attention_from_hf(hf, arch, heads, kv_heads),
                **hybrid_from_hf(hf, arch, rope),
            )
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
            return dataclasses.replace(text, vision=vision_from_hf(hf, text.vocab_size))
        except (ModelLoadError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{where}: {e}") from None

    def kv_cache_layout(self) -> tuple[int, int, int]:
        """Each layer's cache as (tensors, heads, values per head) per token: K and V of num_kv_heads x
        head_dim, or with multi-head latent attention one tensor of one latent, kv_lora_rank +
        head_dim wide (the rotated key part after the latent)."""
        if self.kv_lora_rank:
            return 1, 1, self.kv_lora_rank + self.head_dim
        return 2, self.num_kv_heads, self.head_dim

    def kv_bytes_per_token(self, bytes_per_element: float) -> int:
        """The cache of every layer: tensors x layers x heads x values x bytes (q8_0: 34 / 32 bytes)."""
        tensors, heads, width = self.kv_cache_layout()
        return round(tensors * self.num_attention_layers * heads * width * bytes_per_element)

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
_EXPERT_LIMITS = {"num_experts": 1 << 12, "num_experts_per_tok": 1 << 12, "moe_intermediate_size": 1 << 20}

def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class CacheConfig:
    """The paged KV cache (vLLM's CacheConfig)."""

    block_size: int = option(16, help="tokens per KV block", cli=False)
    kv_cache_memory: int | None = option(
        None, parse=parse_size,
        help="KV cache budget, e.g. 2GiB (default: max_num_seqs contexts, capped by 80%% of free GPU memory; on a "
             "CPU by a quarter of free memory, 4 GiB and 4x the weights' bytes)")
    kv_cache_dtype: str = option(
        "auto", choices=["auto", "float16", "q8_0", "fp8", "fp8_e4m3"],
        help="how K and V are stored: auto (the compute dtype), float16 (llama.cpp's default: half a float32 "
             "cache), q8_0 (llama.cpp's 8-bit blocks: about 2x the tokens of a 16-bit cache, 3.8x of a float32 "
             "one), fp8 or fp8_e4m3 (one e4m3 byte a value, scale 1.0: 2x the tokens of a 16-bit cache; gpu "
             "backend, sm_89 and newer)")
    enable_prefix_caching: bool = option(True, flag="--no-prefix-caching",
                                         help="no reuse of the KV blocks of a prompt's cached prefix")
    kv_cache_dir: str | None = option(
        None, metavar="DIR",
        help="a disk tier under the prefix cache: full blocks the KV cache evicts are written to DIR (one "
             "checked file each) and loaded back when a prompt's prefix needs them, also after a restart")
    kv_cache_dir_size: int = option(4 * 2**30, parse=parse_size, metavar="SIZE",
                                    help="the disk tier's bound (4GiB by default; e.g. 512MiB): least recently used "
                                         "blocks are removed past it")

    def __post_init__(self) -> None:
        from hearth.kv_format import kv_cache_dtype_name  # imports torch: not for --help

        _need(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory must be positive")
        _need(self.kv_cache_dir_size > 0, "kv_cache_dir_size must be positive")
        self.kv_cache_dtype = kv_cache_dtype_name(self.kv_cache_dtype)  # fp8 -> fp8_e4m3; ValueError if unknown
        _need(self.block_size >= 1, "block_size must be at least 1")


@dataclass
class SchedulerConfig:
    """What one step may run (vLLM's SchedulerConfig): hearth/engine/scheduler.py."""

    max_num_seqs: int = option(256, help="sequences run at once; the KV cache holds this many contexts "
                                         "(default %(default)s)")
    max_num_batched_tokens: int = option(2048, help="tokens one step computes, prompt chunks and decodes "
                                                    "together")
    max_model_len: int | None = option(None, help="the longest context in tokens (default: the model's)")
    enable_chunked_prefill: bool = option(True, flag="--no-chunked-prefill",
                                          help="a prompt is computed whole in one step, never in chunks")
    async_scheduling: bool | None = option(
        None, negatable=True,
        help="schedule and lay out the next step while the current one computes, and process its tokens "
             "while the next one does (outputs are the same; steps that need a token first, such as structured "
             "output, penalties or speculation, run synchronously). Default: on with a GPU (the host's work "
             "hides behind the device's); on a CPU only where torch's threads leave a core free (with every "
             "core computing, Python is 0.3-3%% of a SmolLM2 step and handing the pass to a thread costs "
             "about that: docs/benchmarks.md)")

    def __post_init__(self) -> None:
        _need(self.max_num_seqs >= 1, "max_num_seqs must be at least 1")
        _need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be at least 1")
        _need(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be at least 2")


@dataclass
class ParallelConfig:
    """The model split over processes (vLLM's ParallelConfig): docs/distributed.md."""

    tensor_parallel_size: int = option(
        1, help="split the model over N processes by heads and vocabulary rows (CPUs: gloo; GPUs: NCCL, or "
                "gloo where ranks share a GPU; docs/distributed.md)")  # hearth/distributed/tensor_parallel.py
    pipeline_parallel_size: int = option(
        1, help="split the model's layers into N stages, one process each (docs/distributed.md)")

    def __post_init__(self) -> None:
        _need(self.tensor_parallel_size >= 1, "tensor_parallel_size must be at least 1")
        _need(self.pipeline_parallel_size >= 1, "pipeline_parallel_size must be at least 1")
        _need(self.tensor_parallel_size == 1 or self.pipeline_parallel_size == 1,
              "tensor and pipeline parallelism together are not implemented: give tensor_parallel_size or "
              "pipeline_parallel_size, not both")

    @property
    def split(self) -> bool:
        """The model runs over several processes."""
        return self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1


SPECULATIVE_METHODS = ("ngram", "lookahead", "draft", "early-exit")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (hearth/engine/speculation/), EngineConfig.speculative. The options' flat
    names (LLM's keywords, the flags) say speculative where the field's own name does not: method is
    speculative_method, num_speculative_tokens stays num_speculative_tokens."""

    # None (off), "ngram" (prompt lookup), "lookahead" (Jacobi window and n-gram pool), "draft" (a
    # smaller model with the target's vocabulary guesses: model) or "early-exit" (the model's own first
    # exit_layer layers guess)
    method: str | None = option(
        None, keyword="speculative_method", choices=list(SPECULATIVE_METHODS),
        help="ngram: guesses copied from the request's own text (prompt lookup); lookahead: from the model's own "
             "earlier guesses (a Jacobi window and an n-gram pool); draft: guesses from --speculative-model; "
             "early-exit: from the model's first --exit-layer layers (self-speculation); all verified by the "
             "model in one pass")
    model: str | None = option(  # draft: a GGUF file, HF folder or "builtin"-style name
        None, keyword="speculative_model", metavar="PATH",
        help="draft: the draft model (GGUF file or HF folder with the model's vocabulary)")
    # early-exit: how many of the model's first layers (then its final norm and LM head) draft
    exit_layer: int | None = option(
        None, metavar="N", help="early-exit: the draft is the model's first N layers, its final norm and LM head "
                                "(1 to the model's layers - 1)")
    # the most guesses per request per step; None: DEFAULT_SPECULATIVE_TOKENS, or as many as a token
    # tree of tree_width branches fits (W x guesses below MAX_DECODE_QUERY_LEN)
    num_speculative_tokens: int | None = option(
        None, help="the most guesses per request per step (default 8; with token trees as many as fit)")
    prompt_lookup_min: int = option(2, help="ngram: the shortest match that makes guesses")
    prompt_lookup_max: int = option(4, help="ngram: the longest match looked for")
    disable_by_batch_size: int = option(
        32, keyword="speculative_disable_by_batch_size",
        help="running requests at which guessing stops (fewer guesses as the batch grows)")
    # False: every lookup that finds guesses makes num_speculative_tokens of them, whatever the batch,
    # acceptance or measured speed (deterministic: for tests and measurements)
    adaptive: bool = option(
        True, keyword="speculative_adaptive", flag="--no-speculative-adaptive",
        help="always the full number of guesses (no adapting to batch, acceptance or measured speed)")
    # token-tree verification (hearth/engine/speculation/token_tree.py): the most branches of a request's
    # guesses, verified in one pass (ngram: the continuations of as many different earlier matches;
    # draft: the draft's top choices for the first guess, each followed by its own guesses); 1: a chain
    tree_width: int = option(
        1, keyword="speculative_tree_width", metavar="W",
        help="ngram, draft, early-exit: verify up to W branches of guesses at once through a token-tree mask "
             "(ngram: W different earlier matches; draft: its top W first guesses, each followed by its own); W x "
             "--num-speculative-tokens below 16; 1: one chain")

    def __post_init__(self) -> None:
        _need(self.method is None or self.method in SPECULATIVE_METHODS,
              f"speculative_method {self.method!r} is not implemented: {', '.join(SPECULATIVE_METHODS)} "
              f"(token trees of guesses: speculative_tree_width with ngram, draft or early-exit)")
        self.model = None if self.model is None else str(self.model)  # a Path as a str
        _need((self.method == "draft") == (self.model is not None),
              "speculative_method draft needs a speculative_model, and a speculative_model needs speculative_method draft")
        _need((self.method == "early-exit") == (self.exit_layer is not None),
              "speculative_method early-exit needs an exit_layer, and an exit_layer needs speculative_method early-exit")
        _need(self.exit_layer is None or self.exit_layer >= 1, f"exit_layer must be at least 1, got {self.exit_layer}")
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = min(DEFAULT_SPECULATIVE_TOKENS,
                                              (MAX_DECODE_QUERY_LEN - 1) // max(1, self.tree_width))
        _need(self.num_speculative_tokens >= 1, "num_speculative_tokens must be at least 1")
        _need(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
              "need 1 <= prompt_lookup_min <= prompt_lookup_max")
        _need(self.disable_by_batch_size >= 1, "speculative_disable_by_batch_size must be at least 1")
        _need(self.tree_width >= 1, "speculative_tree_width must be at least 1")
        _need(self.tree_width == 1 or self.method in ("ngram", "draft", "early-exit"),
              "speculative_tree_width > 1 needs speculative_method ngram, draft or early-exit (lookahead's guesses "
              "are one chain)")
        _need(self.tree_width * self.num_speculative_tokens < MAX_DECODE_QUERY_LEN,
              f"speculative_tree_width x num_speculative_tokens must be below {MAX_DECODE_QUERY_LEN} (a tree's "
              f"rows, its root included, go through the decode kernels), got {self.tree_width} x "
              f"{self.num_speculative_tokens}")


@dataclass
class ReasoningConfig:
    """Thinking models (hearth/reasoning.py's formats): EngineConfig.reasoning."""

    parser: str | None = option(
        None, keyword="reasoning_parser", choices=sorted(FORMATS),
        help="the model's thinking markers: deepseek_r1 or qwen3 (<think>...</think>), gpt_oss (harmony's analysis "
             "channel); replies then carry reasoning_content apart from content, and budgets apply")
    budget: int = option(
        -1, keyword="reasoning_budget", metavar="N",
        help="with --reasoning-parser: after N tokens of thinking the engine closes the section (</think>) and "
             "the answer follows; a request's thinking_token_budget overrides it (-1: no limit, 0: no thinking)")

    def __post_init__(self) -> None:
        _need(self.parser is None or self.parser in FORMATS,
              f"reasoning_parser must be one of {', '.join(sorted(FORMATS))}, got {self.parser!r}")
        _need(self.budget >= -1, f"reasoning_budget must be -1 (no limit) or at least 0, got {self.budget}")
        _need(self.budget == -1 or self.parser is not None, "reasoning_budget needs a reasoning_parser")


@dataclass
class LoRAConfig:
    """LoRA adapters served beside the model (vLLM's LoRAConfig): hearth/model/lora.py, docs/lora.md."""

    enable_lora: bool = option(False, help="serve PEFT LoRA adapters, chosen per request by name (model: NAME)")
    # NAME=PATH entries; given any, enable_lora is implied
    lora_modules: tuple[str, ...] = option(
        (), flag="--lora", metavar="NAME=PATH",
        help="a PEFT LoRA adapter folder to load at start, served as NAME (repeatable; implies --enable-lora)")
    max_loras: int = option(4, help="adapters loaded at once (each a slot in every adapted projection)")
    max_lora_rank: int = option(16, help="the highest adapter rank r taken (slots are this wide)")

    def __post_init__(self) -> None:
        self.lora_modules = tuple(self.lora_modules or ())
        for entry in self.lora_modules:
            name, _, path = str(entry).partition("=")
            _need(bool(name) and bool(path), f"a LoRA module is NAME=PATH, got {entry!r}")
        self.enable_lora = self.enable_lora or bool(self.lora_modules)
        _need(self.max_loras >= 1, "max_loras must be at least 1")
        _need(self.max_lora_rank >= 1, "max_lora_rank must be at least 1")

    def named_paths(self) -> list[tuple[str, str]]:
        """(NAME, PATH) of each lora_modules entry."""
        return [tuple(str(entry).split("=", 1)) for entry in self.lora_modules]


@dataclass
class SparsityConfig:
    """Activation sparsity (TEAL / CATS): projection inputs under a calibrated magnitude zeroed (docs/sparsity.md)."""

    activation_sparsity: float = option(0.0, help="the share of each projection's input zeroed (0: dense)")
    activation_thresholds: str | None = option(None, metavar="FILE", help="the thresholds file of `hearth sparsify`")

    def __post_init__(self) -> None:
        _need(0 <= self.activation_sparsity < 1, f"activation_sparsity must be in [0, 1), got {self.activation_sparsity}")
        _need(not self.activation_sparsity or self.activation_thresholds is not None,
              "activation_sparsity needs activation_thresholds: a file written by `hearth sparsify MODEL --text-file F`")


@dataclass
class EngineConfig:
    """The engine's options, each declared once (hearth/options.py: LLM's keywords and the CLI's flags
    come from here); every field validated loudly."""

    dtype: str = option("auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="the compute dtype (auto: float32 on a CPU, bfloat16 on a GPU)")
    device: str = option("auto", help="auto, cpu or cuda")
    backend: str = option("auto", choices=["auto", "cpu", "gpu", "reference"],
                          help="the kernels the model runs (auto: gpu on CUDA, cpu for float32 on a CPU)")
    enforce_eager: bool = option(False, help="gpu backend: no CUDA graphs")
    seed: int = option(0, help="the seed of the engine's shared random numbers", cli=False)
    cache: CacheConfig = section(CacheConfig, "KV cache")
    scheduler: SchedulerConfig = section(SchedulerConfig, "scheduler")
    parallel: ParallelConfig = section(ParallelConfig, "parallelism")
    speculative: SpeculativeConfig = section(SpeculativeConfig, "speculative decoding")
    reasoning: ReasoningConfig = section(ReasoningConfig, "reasoning")
    chat_template: str | None = option(
        None, metavar="FILE", help="the chat template to use instead of the model's: a Jinja file, or the template "
                                   "itself")
    lora: LoRAConfig = section(LoRAConfig, "LoRA adapters")
    sparsity: SparsityConfig = section(SparsityConfig, "activation sparsity")
    # contrastive decoding's amateur (a model with the same vocabulary), for requests with contrastive_weight > 0
    contrastive_model: str | None = option(
        None, metavar="PATH", group="contrastive decoding",
        help="the amateur model (same vocabulary) for requests with contrastive_weight > 0")

    @classmethod
    def from_options(cls, **options: Any) -> "EngineConfig":
        """From flat vLLM-style keywords (max_num_seqs=8, speculative_method="ngram"), each to its nested
        config; TypeError for an unknown one."""
        return build(cls, options, "EngineConfig.from_options()")

    def __post_init__(self) -> None:
        _need(self.dtype in ("auto", "float32", "bfloat16", "float16"), f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        _need(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), f"device must be auto, cpu or cuda, got {self.device!r}")
        _need(self.backend in ("auto", "cpu", "gpu", "reference"), f"backend must be auto, cpu, gpu or reference, got {self.backend!r}")
        _need(not self.parallel.split or self.cache.kv_cache_dtype == "auto",
              "a KV cache in another dtype than the compute dtype (kv_cache_dtype) is not implemented with tensor or "
              "pipeline parallelism")
        one_process = self.speculative.model is None and self.contrastive_model is None
        _need(self.parallel.tensor_parallel_size == 1 or one_process,
              "a speculative_model or contrastive_model runs in one process: not with tensor_parallel_size > 1")
        _need(not self.parallel.split or self.speculative.method != "early-exit",
              "speculative_method early-exit runs the model's first layers in one process: not with tensor or "
              "pipeline parallelism")
        self.contrastive_model = None if self.contrastive_model is None else str(self.contrastive_model)  # a Path
        _need(not self.sparsity.activation_sparsity or not (self.parallel.split or self.lora.enable_lora),
              "activation_sparsity with tensor or pipeline parallelism or LoRA adapters is not implemented")
        if self.lora.enable_lora:
            _need(not self.parallel.split, "LoRA adapters with tensor or pipeline parallelism are not implemented")
            _need(self.speculative.method is None, "speculative decoding with LoRA adapters is not implemented: give "
                                                   "speculative_method or enable_lora, not both")
