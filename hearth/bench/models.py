"""Benchmark models: random weights in the exact shapes of real architectures.

No weights can be downloaded where hearth runs, yet speed depends only on shapes and
weight formats, not on what the weights learned. `make_model` writes a Hugging Face folder
(config.json as the real release has it, bf16 safetensors shards, a byte-level BPE
tokenizer covering the whole vocabulary with the real special-token ids) and converts it to
GGUF files (f16, q8_0, q4_0...) with hearth's own converter, which llama.cpp loads too.

    hearth bench make-model --arch tinyllama-1.1b --out models/tinyllama --gguf f16,q8_0,q4_0
    -> models/tinyllama/hf/  and  models/tinyllama/tinyllama-1.1b-{f16,q8_0,q4_0}.gguf
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from hearth.errors import HearthError

if TYPE_CHECKING:
    import torch

# torch is imported where it is used: the CLI reads ARCHS to build its parser, and --help imports no torch.


@dataclass(frozen=True)
class ArchSpec:
    """The architecture facts of one real release (its config.json, less the weights)."""

    name: str
    hf_architecture: str  # LlamaForCausalLM, Qwen2ForCausalLM
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    add_bos: bool = True
    parameters: int | None = None  # the published count, checked against the shapes
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def hf_config(self) -> dict[str, Any]:
        config = {
            "architectures": [self.hf_architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            **self.extra,
        }
        if self.model_type == "llama":
            config.update(attention_bias=False, mlp_bias=False)
        return config

    def tensor_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(HF name, shape) of every weight: what hearth's model of this config.json loads."""
        import torch

        from hearth.config import ModelConfig
        from hearth.loading.names import checkpoint_name
        from hearth.model.transformer import Transformer

        config = ModelConfig.from_hf(self.hf_config())
        with torch.device("meta"):
            model = Transformer(config, max_positions=1)
        yield from ((checkpoint_name(name, config.architecture), shape) for name, shape in model.checkpoint_shapes())

    def num_parameters(self) -> int:
        return sum(math.prod(shape) for _, shape in self.tensor_shapes())


_LLAMA3_ROPE = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}

_GEMMA = {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256}

# config.json values of the public releases (TinyLlama/TinyLlama-1.1B-Chat-v1.0,
# meta-llama/Llama-3.2-1B, Qwen/Qwen2.5-0.5B, and the families below) and hearth's default model shape.
ARCHS: dict[str, ArchSpec] = {s.name: s for s in (
    ArchSpec("tinyllama-1.1b", "LlamaForCausalLM", "llama", vocab_size=32000, hidden_size=2048,
             intermediate_size=5632, num_layers=22, num_heads=32, num_kv_heads=4,
             max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, parameters=1_100_048_384),
    # TinyLlama at 4 of its 22 layers (each layer and the vocabulary as the release's): files that
    # llama.cpp's i-quant searches make in minutes on a small machine, not the better part of an hour
    ArchSpec("tinyllama-1.1b-4l", "LlamaForCausalLM", "llama", vocab_size=32000, hidden_size=2048,
             intermediate_size=5632, num_layers=4, num_heads=32, num_kv_heads=4,
             max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    ArchSpec("llama-3.2-1b", "LlamaForCausalLM", "llama", vocab_size=128256, hidden_size=2048,
             intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
             max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
             tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
             rope_scaling=_LLAMA3_ROPE, parameters=1_235_814_400),
    ArchSpec("qwen2.5-0.5b", "Qwen2ForCausalLM", "qwen2", vocab_size=151936, hidden_size=896,
             intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
             max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
             tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643, attention_bias=True,
             add_bos=False, parameters=494_032_768,
             extra={"use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 24}),
    # Mixture of experts at full width, fewer layers (Qwen/Qwen3-30B-A3B has 48, mistralai/Mixtral-8x7B-v0.1 32):
    # each layer as the release's; the experts named as qwen's (mlp.experts.N.gate_proj), which hearth reads
    # for every family
    ArchSpec("qwen3-30b-a3b-4l", "Qwen3MoeForCausalLM", "qwen3_moe", vocab_size=151936, hidden_size=2048,
             intermediate_size=6144, num_layers=4, num_heads=32, num_kv_heads=4, max_position_embeddings=40960,
             rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=151643,
             eos_token_id=151645, add_bos=False,
             extra={"head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                    "use_sliding_window": False, "sliding_window": None}),
    ArchSpec("mixtral-8x7b-2l", "MixtralForCausalLM", "mixtral", vocab_size=32000, hidden_size=4096,
             intermediate_size=14336, num_layers=2, num_heads=32, num_kv_heads=8, max_position_embeddings=32768,
             rms_norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
             extra={"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None}),
    # deepseek-ai/DeepSeek-V2-Lite at 4 of its 27 layers (the dense first one and three of experts; 15.7B
    # parameters at full depth): multi-head latent attention, 64 routed experts (6 per token) and 2 shared,
    # YaRN to 160K positions.
    ArchSpec("deepseek-v2-lite-4l", "DeepseekV2ForCausalLM", "deepseek_v2", vocab_size=102400, hidden_size=2048,
             intermediate_size=10944, num_layers=4, num_heads=16, num_kv_heads=16, max_position_embeddings=163840,
             rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=100000,
             eos_token_id=100001,
             rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                           "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
             extra={"head_dim": 64, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2,
                    "num_experts_per_tok": 6, "moe_intermediate_size": 1408, "first_k_dense_replace": 1,
                    "moe_layer_freq": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
                    "scoring_func": "softmax", "topk_method": "greedy", "n_group": 1, "topk_group": 1}),
    # Qwen/Qwen3.5-0.8B's text model: Gated DeltaNet (16 key and 16 value heads of 128) three layers in four,
    # gated attention (8 heads of 256, 2 KV heads, a quarter rotated) in the fourth; its vision tower left out
    ArchSpec("qwen3.5-0.8b", "Qwen3_5ForCausalLM", "qwen3_5_text", vocab_size=248320, hidden_size=1024,
             intermediate_size=3584, num_layers=24, num_heads=8, num_kv_heads=2, max_position_embeddings=262144,
             rms_norm_eps=1e-6, rope_theta=10000000.0, tie_word_embeddings=True, bos_token_id=None,
             eos_token_id=248044, add_bos=False,
             extra={"head_dim": 256,
                    "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
                    "partial_rotary_factor": 0.25, "attn_output_gate": True}),
    # openai/gpt-oss-20b at 2 of its 24 layers (one sliding, one full), its experts unquantized (bf16, not
    # the release's MXFP4) and named per expert as hearth reads them: 32 experts (4 per token), sinks, YaRN
    ArchSpec("gpt-oss-20b-2l", "GptOssForCausalLM", "gpt_oss", vocab_size=201088, hidden_size=2880,
             intermediate_size=2880, num_layers=2, num_heads=64, num_kv_heads=8, max_position_embeddings=131072,
             rms_norm_eps=1e-5, rope_theta=150000.0, tie_word_embeddings=False, bos_token_id=199998,
             eos_token_id=200002, attention_bias=True, add_bos=False,
             rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                           "truncate": False, "original_max_position_embeddings": 4096},
             extra={"head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
                    "sliding_window": 128,
                    "swiglu_limit": 7.0, "hidden_act": "silu"}),
    # google/gemma-2-2b and google/gemma-3-1b-pt
    ArchSpec("gemma-2-2b", "Gemma2ForCausalLM", "gemma2", vocab_size=256000, hidden_size=2304,
             intermediate_size=9216, num_layers=26, num_heads=8, num_kv_heads=4, max_position_embeddings=8192,
             rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
             parameters=2_614_341_888,
             extra={**_GEMMA, "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    ArchSpec("gemma-3-1b", "Gemma3ForCausalLM", "gemma3_text", vocab_size=262144, hidden_size=1152,
             intermediate_size=6912, num_layers=26, num_heads=4, num_kv_heads=1, max_position_embeddings=32768,
             rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
             parameters=999_885_952,
             extra={**_GEMMA, "sliding_window": 512, "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0}),
    # the shape of hearth's built-in model (recipes/train_default_model.py, preset main)
    ArchSpec("hearth-tiny", "LlamaForCausalLM", "llama", vocab_size=4096, hidden_size=256,
             intermediate_size=688, num_layers=6, num_heads=4, num_kv_heads=2,
             max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=True, bos_token_id=0, eos_token_id=0),
)}


# ------------------------------------------------------------------ tokenizer

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def tokenizer_json(spec: ArchSpec) -> dict[str, Any]:
    """A byte-level BPE tokenizer.json whose vocabulary fills exactly spec.vocab_size ids.

    The 256 byte characters and merges of lowercase letter pairs (with and without a leading
    space) make every text encodable; the remaining ids are plain tokens "[id]" so that any
    sampled id decodes. The real special-token ids hold <bos> / <eos>."""
    if any(i is not None and not 0 <= i < spec.vocab_size for i in (spec.bos_token_id, spec.eos_token_id)):
        raise HearthError(f"{spec.name}: BOS/EOS ids outside the vocabulary of {spec.vocab_size}")
    specials = {spec.eos_token_id: "<|eos|>"}
    if spec.bos_token_id is not None and spec.bos_token_id != spec.eos_token_id:
        specials[spec.bos_token_id] = "<|bos|>"
    alphabet = list(_bytes_to_unicode().values())
    letters = "abcdefghijklmnopqrstuvwxyz"
    merges = [(a, b) for a in letters for b in letters] + [("Ġ", a) for a in letters]
    merged = [a + b for a, b in merges]
    pieces = iter(alphabet + merged)
    vocab: dict[str, int] = {}
    for i in range(spec.vocab_size):
        if i in specials:
            vocab[specials[i]] = i
        else:
            vocab[next(pieces, f"[{i}]")] = i
    if len(vocab) != spec.vocab_size or len(alphabet) + len(merged) + len(specials) > spec.vocab_size:
        raise HearthError(f"vocabulary of {spec.vocab_size} tokens is too small for a byte-level tokenizer")
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in sorted(specials.items())]
    post = None
    if spec.add_bos and spec.bos_token_id is not None:
        bos = specials[spec.bos_token_id]
        post = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos: {"id": bos, "ids": [spec.bos_token_id], "tokens": [bos]}}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges]},
    }


_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer_config(spec: ArchSpec) -> dict[str, Any]:
    bos = None if spec.bos_token_id is None else ("<|eos|>" if spec.bos_token_id == spec.eos_token_id else "<|bos|>")
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": "<|eos|>",
            "add_bos_token": spec.add_bos and bos is not None, "add_eos_token": False,
            "model_max_length": spec.max_position_embeddings, "chat_template": _CHAT_TEMPLATE}


# ------------------------------------------------------------------ weights

def _random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator, std: float) -> torch.Tensor:
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith(".bias"):
        return (torch.randn(shape, generator=generator) * std).to(torch.bfloat16)
    return (torch.randn(shape, generator=generator) * std).to(torch.bfloat16)


def write_hf_folder(spec: ArchSpec, folder: str | Path, seed: int = 0, std: float = 0.02,
                    shard_bytes: int = 2 << 30, progress: bool = True) -> Path:
    """Write `spec` with random bf16 weights as a Hugging Face folder (sharded safetensors)."""
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in spec.tensor_shapes():  # greedy: a new shard when this one would pass shard_bytes
        nbytes = math.prod(shape) * 2
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    total = spec.num_parameters() * 2
    num_shards = len(shards)
    weight_map: dict[str, str] = {}
    with tqdm(total=total, desc=f"random {spec.name}", unit="B", unit_scale=True, disable=not progress, leave=False) as bar:
        for index, members in enumerate(shards, 1):
            file = "model.safetensors" if num_shards == 1 else f"model-{index:05d}-of-{num_shards:05d}.safetensors"
            tensors = {}
            for name, shape in members:
                tensors[name] = _random_tensor(name, shape, generator, std)
                weight_map[name] = file
                bar.update(tensors[name].numel() * 2)
            save_file(tensors, str(folder / file), metadata={"format": "pt"})
            del tensors
    if num_shards > 1:
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (folder / "config.json").write_text(json.dumps(spec.hf_config(), indent=2))
    generation = {"bos_token_id": spec.bos_token_id, "eos_token_id": spec.eos_token_id}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json(spec), ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(spec), indent=2))
    (folder / "README.md").write_text(
        f"# {spec.name} (random weights)\n\nThe exact shapes of {spec.name} with random bf16 weights "
        f"(normal, std {std}, seed {seed}), written by `hearth bench make-model` for benchmarks only: "
        "it produces noise, not text.\n")
    return folder


def make_model(arch: str | ArchSpec, out: str | Path, gguf_types: list[str] | tuple[str, ...] = ("f16", "q8_0", "q4_0"),
               seed: int = 0, force: bool = False, progress: bool = True) -> dict[str, Any]:
    """Write DIR/hf (the HF folder) and DIR/<arch>-<type>.gguf; existing files are kept unless force.
    An architecture hearth writes no GGUF of gets its HF folder only, and the report's gguf_skipped says why."""
    from hearth.config import ModelConfig
    from hearth.loading.convert import GGUF_ARCHITECTURES, OUT_TYPES, convert_hf_to_gguf
    from hearth.loading.names import NO_GGUF

    spec = arch if isinstance(arch, ArchSpec) else ARCHS.get(arch)
    if spec is None:
        raise HearthError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    architecture = ModelConfig.from_hf(spec.hf_config()).architecture
    skipped = None
    if gguf_types and architecture not in GGUF_ARCHITECTURES:
        skipped = f"hearth writes no GGUF of {architecture} ({NO_GGUF.get(architecture, 'no llama.cpp layout')})"
        gguf_types = []
    bad = [t for t in gguf_types if t not in OUT_TYPES]
    if bad:
        raise HearthError(f"unknown GGUF type {bad[0]!r}; choose from {', '.join(OUT_TYPES)}")
    out = Path(out)
    hf = out / "hf"
    if force or not (hf / "config.json").exists() or not (hf / "tokenizer_config.json").exists():
        write_hf_folder(spec, hf, seed=seed, progress=progress)
    files = {"hf": str(hf)}
    for kind in gguf_types:
        path = out / f"{spec.name}-{kind}.gguf"
        if force or not path.exists():
            convert_hf_to_gguf(hf, path, kind, progress=progress)
        files[kind] = str(path)
    return {"arch": spec.name, "parameters": spec.num_parameters(), "files": files,
            **({"gguf_skipped": skipped} if skipped else {})}
