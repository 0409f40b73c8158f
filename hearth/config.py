"""Architecture facts of a model (ModelConfig), read from an HF config.json or GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hearth.errors import ModelLoadError

# Architectures the one decoder covers, and what sets them apart.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma")

HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
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
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)
    attention_bias: bool = False  # q/k/v projections carry a bias (qwen2), and o_proj too (llama, qwen3, gemma)
    mlp_bias: bool = False  # gate/up/down carry a bias (llama's mlp_bias)
    qk_norm: bool = False  # RMSNorm over each head of q and k (qwen3)
    # gemma stores RMSNorm weights as (w - 1) and scales embeddings by sqrt(hidden)
    norm_weight_offset: float = 0.0
    embedding_scale: float = 1.0
    # Sliding-window attention (mistral, qwen2's use_sliding_window): a query attends to the last
    # `sliding_window` positions. hearth attends to the whole context, which is the same thing as
    # long as a sequence fits in the window: sequences stop there (exact_context).
    sliding_window: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; "
                f"hearth supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name, most in _SIZE_LIMITS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
                raise ModelLoadError(f"{name} = {value!r}: expected a whole number from 1 to {most:,}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim = {self.head_dim}: rotary embeddings need an even head size")
        for name in ("rms_norm_eps", "rope_theta", "embedding_scale"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) <= 0:
                raise ModelLoadError(f"{name} = {getattr(self, name)!r}: expected a positive number")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelLoadError(f"sliding_window = {self.sliding_window}: expected a positive number of tokens")
        if not isinstance(self.hidden_act, str):
            raise ModelLoadError(f"hidden_act = {self.hidden_act!r}: expected an activation's name")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ModelLoadError(f"rope_scaling = {self.rope_scaling!r}: expected an object")

    @property
    def exact_context(self) -> int:
        """The longest sequence hearth computes as the model defines it."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, hf: dict[str, Any], where: str = "config.json") -> "ModelConfig":
        archs = hf.get("architectures") or []
        if not isinstance(archs, list):
            raise ModelLoadError(f"{where}: architectures = {archs!r}: expected a list of names")
        arch = next((HF_ARCHITECTURES[a] for a in archs if isinstance(a, str) and a in HF_ARCHITECTURES), None)
        if arch is None:
            arch = hf.get("model_type")
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
            gemma = arch == "gemma"
            # transformers >= 5 writes rope_theta and the scaling into one "rope_parameters" object
            rope = hf.get("rope_parameters") or {}
            act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
            if gemma:
                # transformers runs gemma with the tanh approximation whatever the config says
                act = "gelu_pytorch_tanh"
            _refuse_unimplemented(hf, where)
            window = hf.get("sliding_window")
            if arch in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
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
                rope_scaling=hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
                hidden_act=act,
                attention_bias=bool(hf.get("attention_bias", arch == "qwen2")),
                mlp_bias=bool(hf.get("mlp_bias", False)),
                sliding_window=int(window) if window is not None else None,
                qk_norm=arch == "qwen3",
                norm_weight_offset=1.0 if gemma else 0.0,
                embedding_scale=math.sqrt(hidden) if gemma else 1.0,
            )
        except KeyError as e:
            raise ModelLoadError(f"{where}: missing required field {e.args[0]!r}") from None
        except ModelLoadError as e:
            raise ModelLoadError(f"{where}: {e}") from None
        except (TypeError, ValueError, AttributeError, OverflowError, ZeroDivisionError) as e:
            raise ModelLoadError(f"{where}: malformed field: {e}") from None

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        """K and V, every layer: 2 x layers x kv_heads x head_dim x bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element


# Bounds on a model's sizes (a few times the largest released models'): a damaged or hostile
# config must not make hearth allocate without limit.
_SIZE_LIMITS = {
    "vocab_size": 1 << 22, "hidden_size": 1 << 17, "intermediate_size": 1 << 20, "num_layers": 1 << 12,
    "num_heads": 1 << 12, "num_kv_heads": 1 << 12, "head_dim": 1 << 12, "max_position_embeddings": 1 << 24,
}

# config.json fields of features hearth does not implement, with the values that switch them off:
# a config that switches one on is refused, never run without it.
_INACTIVE_FIELDS = {
    "partial_rotary_factor": (None, 1, 1.0),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
}


def _refuse_unimplemented(hf: dict[str, Any], where: str) -> None:
    rope = hf.get("rope_parameters") or {}  # transformers >= 5 may put the rotary fraction here
    for name, inactive in _INACTIVE_FIELDS.items():
        value = hf.get(name, rope.get(name))
        if value not in inactive:
            raise ModelLoadError(f"{where}: {name}={value!r} is not implemented by hearth")


@dataclass
class EngineConfig:
    """Budgets and switches of the engine; every field validated loudly."""

    dtype: str = "auto"  # auto (cpu: float32, cuda: bfloat16), float32, bfloat16, float16
    device: str = "auto"  # auto, cpu, cuda
    backend: str = "auto"  # auto, cpu, gpu, reference (hearth/backend)
    enforce_eager: bool = False  # gpu backend: no CUDA graphs
    kv_cache_memory: int | None = None  # bytes for K/V; None: a default from free memory
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context length
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    # speculative decoding (hearth/engine/speculative.py): None (off) or "ngram" (prompt lookup)
    speculative_method: str | None = None
    num_speculative_tokens: int = 4  # the most guesses per request per step
    prompt_lookup_min: int = 2  # ngram: the shortest match of the last tokens that makes guesses
    prompt_lookup_max: int = 4  # ngram: the longest match looked for
    speculative_disable_by_batch_size: int = 32  # running requests at which guessing stops
    # False: every lookup that finds guesses makes num_speculative_tokens of them, whatever the batch,
    # acceptance or measured speed (deterministic: for tests and measurements)
    speculative_adaptive: bool = True

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(self.dtype in ("auto", "float32", "bfloat16", "float16"), f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        need(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), f"device must be auto, cpu or cuda, got {self.device!r}")
        need(self.backend in ("auto", "cpu", "gpu", "reference"), f"backend must be auto, cpu, gpu or reference, got {self.backend!r}")
        need(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory must be positive")
        need(self.block_size >= 1, "block_size must be at least 1")
        need(self.max_num_seqs >= 1, "max_num_seqs must be at least 1")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be at least 1")
        need(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be at least 2")
        need(self.speculative_method in (None, "ngram"),
             f"speculative_method must be ngram (draft-model, lookahead and tree speculation are not "
             f"implemented yet), got {self.speculative_method!r}")
        need(self.num_speculative_tokens >= 1, "num_speculative_tokens must be at least 1")
        need(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
             "need 1 <= prompt_lookup_min <= prompt_lookup_max")
        need(self.speculative_disable_by_batch_size >= 1, "speculative_disable_by_batch_size must be at least 1")
