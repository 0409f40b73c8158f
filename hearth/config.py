"""Architecture facts of a model (ModelConfig), read from an HF config.json or GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hearth.backend.base import MAX_DECODE_QUERY_LEN
from hearth.backend.kv_quant import kv_cache_dtype_name
from hearth.errors import ModelLoadError

# Guesses per request per step by default: the most; how many of them are made follows the
# request's acceptance and the batch (hearth/engine/speculation/guess_count.py, num_guesses). The built-in pair
# at batch 1, 2 threads: 4 -> 1.84x, 8 -> 2.20x, 12 -> 2.38x (docs/benchmarks.md).
DEFAULT_SPECULATIVE_TOKENS = 8

# Architectures the one decoder covers, and what sets them apart.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "smollm3", "phi3",
                           "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2")
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")

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
}


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
    extra: dict[str, Any] = field(default_factory=dict)

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

    def is_sliding_layer(self, layer: int) -> bool:
        return self.sliding_window is not None and (self.sliding_layers is None or layer in self.sliding_layers)

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    @classmethod
    def from_hf(cls, hf: dict[str, Any], where: str = "config.json") -> "ModelConfig":
        archs = hf.get("architectures") or []
        if not isinstance(archs, list):
            raise ModelLoadError(f"{where}: architectures = {archs!r}: expected a list of names")
        arch = next((HF_ARCHITECTURES[a] for a in archs if isinstance(a, str) and a in HF_ARCHITECTURES), None)
        if arch is None:
            arch = hf.get("model_type")
            arch = "gemma3" if arch == "gemma3_text" else arch
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{where}: unsupported architecture {archs or hf.get('model_type')!r}; "
                f"hearth supports {', '.join(HF_ARCHITECTURES)}"
            )
        try:
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
            act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
            if gemma:
                # transformers runs gemma with the tanh approximation whatever the config says
                act = "gelu_pytorch_tanh"
            _refuse_unimplemented(hf, where, arch)
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
                rope_scaling=_rope_scaling_from_hf(hf, rope, head_dim),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
                hidden_act=act,
                attention_bias=bool(hf.get("attention_bias", hf.get("qkv_bias", arch in ("qwen2", "qwen2_moe")))),
                mlp_bias=bool(hf.get("mlp_bias", False)),
                sliding_window=int(window) if window is not None else None,
                sliding_layers=_sliding_layers(hf, arch) if window is not None else None,
                no_rope_layers=_no_rope_layers(hf) if arch == "smollm3" else (),
                qk_norm={"qwen3": "head", "qwen3_moe": "head", "gemma3": "head", "olmoe": "all"}.get(arch),
                norm_weight_offset=1.0 if gemma else 0.0,
                embedding_scale=math.sqrt(hidden) if gemma else 1.0,
                **_gemma2_from_hf(hf, arch, local_rope),
                **_experts_from_hf(hf, arch),
                **_latent_attention_from_hf(hf, arch, heads, kv_heads),
            )
        except KeyError as e:
            raise ModelLoadError(f"{where}: missing required field {e.args[0]!r}") from None
        except ModelLoadError as e:
            raise ModelLoadError(f"{where}: {e}") from None
        except (TypeError, ValueError, AttributeError, OverflowError, ZeroDivisionError) as e:
            raise ModelLoadError(f"{where}: malformed field: {e}") from None

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
        return round(tensors * self.num_layers * heads * width * bytes_per_element)

    @property
    def kv_window(self) -> int | None:
        """The window every layer attends through, or None where some layer sees the whole context:
        a running request's K/V older than its last kv_window positions are never read again."""
        every_layer = all(self.is_sliding_layer(layer) for layer in range(self.num_layers))
        return self.sliding_window if every_layer else None


def _sliding_layers(hf: dict[str, Any], arch: str) -> tuple[int, ...] | None:
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


def _rope_scaling_from_hf(hf: dict[str, Any], rope: dict[str, Any], head_dim: int) -> dict[str, Any] | None:
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


def _no_rope_layers(hf: dict[str, Any]) -> tuple[int, ...]:
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


def _gemma2_from_hf(hf: dict[str, Any], arch: str, local_rope: dict[str, Any] | None) -> dict[str, Any]:
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


def _experts_from_hf(hf: dict[str, Any], arch: str) -> dict[str, Any]:
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


def _latent_attention_from_hf(hf: dict[str, Any], arch: str, heads: int, kv_heads: int) -> dict[str, Any]:
    """deepseek_v2's multi-head latent attention sizes (none for other families)."""
    if arch != "deepseek_v2":
        return {}
    if kv_heads != heads:  # the latent gives every head its own K and V
        raise ModelLoadError(f"num_key_value_heads = {kv_heads}: multi-head latent attention needs one per head "
                             f"({heads})")
    return dict(kv_lora_rank=int(hf["kv_lora_rank"]), qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
                v_head_dim=int(hf["v_head_dim"]),
                q_lora_rank=int(hf.get("q_lora_rank", 1536) or 0))  # 1536: transformers' default


# Bounds on a model's sizes (a few times the largest released models'): a damaged or hostile
# config must not make hearth allocate without limit.
_SIZE_LIMITS = {
    "vocab_size": 1 << 22, "hidden_size": 1 << 17, "intermediate_size": 1 << 20, "num_layers": 1 << 12,
    "num_heads": 1 << 12, "num_kv_heads": 1 << 12, "head_dim": 1 << 12, "max_position_embeddings": 1 << 24,
}
_LATENT_LIMITS = {"kv_lora_rank": 1 << 16, "qk_nope_head_dim": 1 << 12, "v_head_dim": 1 << 12}
_QUERY_RANK_LIMIT = 1 << 16
_EXPERT_LIMITS = {"num_experts": 1 << 12, "num_experts_per_tok": 1 << 12, "moe_intermediate_size": 1 << 20}

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
_IMPLEMENTED_BY = {"attn_logit_softcapping": ("gemma2", "gemma3"), "final_logit_softcapping": ("gemma2", "gemma3")}


def _refuse_unimplemented(hf: dict[str, Any], where: str, arch: str) -> None:
    rope = hf.get("rope_parameters") or {}  # transformers >= 5 may put the rotary fraction here
    for name, inactive in _INACTIVE_FIELDS.items():
        value = hf.get(name, rope.get(name))
        if value not in inactive and arch not in _IMPLEMENTED_BY.get(name, ()):
            raise ModelLoadError(f"{where}: {name}={value!r} is not implemented by hearth")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (hearth/engine/speculation/), EngineConfig.speculative. Each field is the
    engine option (LLM keyword, --flag) of its name with `speculative_` before it where that is not
    already there: method is speculative_method, num_speculative_tokens stays num_speculative_tokens."""

    # None (off), "ngram" (prompt lookup), "lookahead" (Jacobi window and n-gram pool) or "draft"
    # (a smaller model with the target's vocabulary guesses: model)
    method: str | None = None
    model: str | None = None  # draft: the draft model (GGUF file, HF folder or "builtin"-style name)
    # the most guesses per request per step; None: DEFAULT_SPECULATIVE_TOKENS, or as many as a token
    # tree of tree_width branches fits (W x guesses below MAX_DECODE_QUERY_LEN)
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int = 2  # ngram: the shortest match of the last tokens that makes guesses
    prompt_lookup_max: int = 4  # ngram: the longest match looked for
    disable_by_batch_size: int = 32  # running requests at which guessing stops
    # False: every lookup that finds guesses makes num_speculative_tokens of them, whatever the batch,
    # acceptance or measured speed (deterministic: for tests and measurements)
    adaptive: bool = True
    # token-tree verification (hearth/engine/speculation/token_tree.py): the most branches of a request's
    # guesses, verified in one pass (ngram: the continuations of as many different earlier matches;
    # draft: the draft's top choices for the first guess, each followed by its own guesses); 1: a chain
    tree_width: int = 1

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(self.method in (None, "ngram", "lookahead", "draft"),
             f"speculative_method {self.method!r} is not implemented: ngram, lookahead or draft "
             f"(token trees of guesses: speculative_tree_width with ngram or draft)")
        need((self.method == "draft") == (self.model is not None),
             "speculative_method draft needs a speculative_model, and a speculative_model needs speculative_method draft")
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = min(DEFAULT_SPECULATIVE_TOKENS,
                                              (MAX_DECODE_QUERY_LEN - 1) // max(1, self.tree_width))
        need(self.num_speculative_tokens >= 1, "num_speculative_tokens must be at least 1")
        need(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
             "need 1 <= prompt_lookup_min <= prompt_lookup_max")
        need(self.disable_by_batch_size >= 1, "speculative_disable_by_batch_size must be at least 1")
        need(self.tree_width >= 1, "speculative_tree_width must be at least 1")
        need(self.tree_width == 1 or self.method in ("ngram", "draft"),
             "speculative_tree_width > 1 needs speculative_method ngram or draft (lookahead's guesses are one chain)")
        need(self.tree_width * self.num_speculative_tokens < MAX_DECODE_QUERY_LEN,
             f"speculative_tree_width x num_speculative_tokens must be below {MAX_DECODE_QUERY_LEN} (a tree's "
             f"rows, its root included, go through the decode kernels), got {self.tree_width} x "
             f"{self.num_speculative_tokens}")


@dataclass
class EngineConfig:
    """Budgets and switches of the engine; every field validated loudly."""

    dtype: str = "auto"  # auto (cpu: float32, cuda: bfloat16), float32, bfloat16, float16
    device: str = "auto"  # auto, cpu, cuda
    backend: str = "auto"  # auto, cpu, gpu, reference (hearth/backend)
    enforce_eager: bool = False  # gpu backend: no CUDA graphs
    kv_cache_memory: int | None = None  # bytes for K/V; None: a default from free memory
    kv_cache_dtype: str = "auto"  # auto (the compute dtype), float16, q8_0, fp8 / fp8_e4m3: hearth/backend/kv_quant.py
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context length
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    tensor_parallel_size: int = 1  # ranks the model is split over (hearth/distributed/tensor_parallel.py)
    pipeline_parallel_size: int = 1  # stages the layers are split into (hearth/distributed/pipeline_parallel.py)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # contrastive decoding's amateur (a model with the same vocabulary), for requests with contrastive_weight > 0
    contrastive_model: str | None = None

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(self.dtype in ("auto", "float32", "bfloat16", "float16"), f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        need(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), f"device must be auto, cpu or cuda, got {self.device!r}")
        need(self.backend in ("auto", "cpu", "gpu", "reference"), f"backend must be auto, cpu, gpu or reference, got {self.backend!r}")
        need(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory must be positive")
        self.kv_cache_dtype = kv_cache_dtype_name(self.kv_cache_dtype)  # fp8 -> fp8_e4m3; ValueError if unknown
        need(self.block_size >= 1, "block_size must be at least 1")
        need(self.max_num_seqs >= 1, "max_num_seqs must be at least 1")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be at least 1")
        need(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be at least 2")
        need(self.tensor_parallel_size >= 1, "tensor_parallel_size must be at least 1")
        need(self.pipeline_parallel_size >= 1, "pipeline_parallel_size must be at least 1")
        need(self.tensor_parallel_size == 1 or self.pipeline_parallel_size == 1,
             "tensor and pipeline parallelism together are not implemented: give tensor_parallel_size or "
             "pipeline_parallel_size, not both")
        need((self.tensor_parallel_size == 1 and self.pipeline_parallel_size == 1) or self.kv_cache_dtype == "auto",
             "a KV cache in another dtype than the compute dtype (kv_cache_dtype) is not implemented with tensor or "
             "pipeline parallelism")
        need(self.tensor_parallel_size == 1 or (self.speculative.model is None and self.contrastive_model is None),
             "a speculative_model or contrastive_model runs in one process: not with tensor_parallel_size > 1")
