"""The engine's options: EngineConfig and its nested configs (KV cache, scheduler, parallelism,
speculative decoding, reasoning, LoRA, activation sparsity), each option declared once
(hearth/options.py): its field, help, LLM keyword and CLI flag."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from hearth.config import MAX_DECODE_QUERY_LEN
from hearth.options import build, option, parse_size, parse_size_mib, section
from hearth.reasoning import FORMATS

# Guesses per request per step by default: the most; how many of them are made follows the
# request's acceptance and the batch (hearth/engine/speculation/guess_count.py, num_guesses). The built-in pair
# at batch 1, 2 threads: 4 -> 1.84x, 8 -> 2.20x, 12 -> 2.38x (docs/benchmarks.md).
DEFAULT_SPECULATIVE_TOKENS = 8
# Sequences run at once when max_num_seqs is not given (vLLM's); a hybrid model's are fewer where its budget
# holds fewer full-length contexts with their states (hearth/engine/memory.py, split_budget).
DEFAULT_MAX_NUM_SEQS = 256


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
        help="a disk tier under the prefix cache: full blocks the KV cache evicts (and, when a server stops, an engine closes "
             "or a model sleeps, those still cached) are written to DIR (one checked file each) and loaded back when a prompt's prefix "
             "needs them, also after a restart")
    kv_cache_dir_size: int = option(4 * 2**30, parse=parse_size, metavar="SIZE",
                                    help="the disk tier's bound (4GiB by default; e.g. 512MiB): least recently used "
                                         "blocks are removed past it")
    kv_cache_ram: int = option(
        0, parse=parse_size_mib, metavar="SIZE", aliases=("--cache-ram",),
        help="a host-RAM tier under the prefix cache, ahead of the disk tier: full blocks the KV cache evicts are "
             "kept in up to SIZE of RAM (e.g. 8GiB; a bare number is MiB, as llama.cpp's --cache-ram) and loaded "
             "back when a prompt's prefix needs them; least recently used first out. 0 (default): off")
    kv_cache_tier_dtype: str = option(
        "auto", choices=["auto", "q8_0"],
        help="how the RAM and disk tiers store a block: auto (the cache's own bytes, exact) or q8_0 (a 16- or "
             "32-bit cache's values as q8_0 blocks: 1.9x fewer bytes than float16, 3.8x than float32; the "
             "next tokens' logprobs move by 0.02-0.3 on the models measured, and a near tie may flip, "
             "docs/architecture.md; a q8_0 or fp8 cache is stored as it is)")

    def __post_init__(self) -> None:
        from hearth.kv_format import kv_cache_dtype_name  # imports torch: not for --help

        _need(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory must be positive")
        _need(self.kv_cache_dir_size > 0, "kv_cache_dir_size must be positive")
        _need(self.kv_cache_ram >= 0, "kv_cache_ram must be 0 (off) or positive")
        _need(self.kv_cache_tier_dtype in ("auto", "q8_0"), "kv_cache_tier_dtype must be auto or q8_0")
        self.kv_cache_dtype = kv_cache_dtype_name(self.kv_cache_dtype)  # fp8 -> fp8_e4m3; ValueError if unknown
        _need(self.block_size >= 1, "block_size must be at least 1")


@dataclass
class SchedulerConfig:
    """What one step may run (vLLM's SchedulerConfig): hearth/engine/scheduler.py."""

    max_num_seqs: int | None = option(
        None, help=f"sequences run at once (default {DEFAULT_MAX_NUM_SEQS}; a hybrid model's: as many as its KV budget "
                   "holds max_model_len requests with their states, at least one; given, it must fit beside one)")
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
        _need(self.max_num_seqs is None or self.max_num_seqs >= 1, "max_num_seqs must be at least 1")
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


SPECULATIVE_METHODS = ("ngram", "lookahead", "draft", "early-exit", "mtp", "multi-step")
LOOKAHEAD_MODES = ("chain", "full")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (hearth/engine/speculation/), EngineConfig.speculative. The options' flat
    names (LLM's keywords, the flags) say speculative where the field's own name does not: method is
    speculative_method, num_speculative_tokens stays num_speculative_tokens."""

    # None (off), "ngram" (prompt lookup), "lookahead" (Jacobi window and n-gram pool), "draft" (a
    # smaller model with the target's vocabulary guesses: model), "early-exit" (the model's own first
    # exit_layer layers guess) or "mtp" (the multi-token-prediction layer Qwen3.5's and Qwen3-Next's
    # checkpoints ship guesses from the model's hidden states: hearth/engine/mtp_draft.py) or "multi-step" (no
    # guesses: a greedy request's next k + 1 tokens in one call of the cpu backend: hearth/engine/speculation/multi_step.py)
    method: str | None = option(
        None, keyword="speculative_method", choices=list(SPECULATIVE_METHODS),
        help="ngram: guesses copied from the request's own text (prompt lookup); lookahead: from the model's own "
             "earlier guesses (a Jacobi window and an n-gram pool); draft: guesses from --speculative-model; "
             "early-exit: from the model's first --exit-layer layers (self-speculation); mtp: from the "
             "multi-token-prediction layer the model's checkpoint ships (Qwen3.5, Qwen3-Next); all verified by the "
             "model in one pass. multi-step: no guesses; a greedy request's next --num-speculative-tokens + 1 tokens, "
             "each the model's own, in one kernel call of the cpu backend (the host's work between steps once per "
             "call)")
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
    # lookahead (hearth/engine/speculation/lookahead.py): "chain" guesses one chain, a pool n-gram then the
    # Jacobi window's guesses; "full" is Fu et al.'s step, one token tree: a 2-D window of W positions x
    # N - 1 levels iterated through its own rows, and up to G pool n-grams beside it (lookahead_window.py)
    lookahead_mode: str = option(
        "chain", choices=list(LOOKAHEAD_MODES),
        help="lookahead: chain (one chain of guesses: a pool n-gram, then the Jacobi window's) or full (the "
             "paper's step: the 2-D window's W x (N - 1) rows and G pool n-grams verified in one token tree)")
    lookahead_window: int = option(
        3, metavar="W", help="lookahead full: the Jacobi window's positions (the rows' tree: (W + G) x (N - 1) "
                             "below 16)")
    lookahead_ngram: int = option(4, metavar="N", help="lookahead: the n-grams' length (the window's levels: N - 1)")
    lookahead_guesses: int = option(2, metavar="G", help="lookahead full: the most pool n-grams verified a step")

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
        _need(self.lookahead_mode in LOOKAHEAD_MODES, f"lookahead_mode must be one of {', '.join(LOOKAHEAD_MODES)}, "
                                                      f"got {self.lookahead_mode!r}")
        _need(self.lookahead_ngram >= 3 and self.lookahead_window >= 1 and self.lookahead_guesses >= 0,
              "need lookahead_ngram >= 3, lookahead_window >= 1 and lookahead_guesses >= 0")
        if self.num_speculative_tokens is None and self.lookahead_full:
            self.num_speculative_tokens = (self.lookahead_window + self.lookahead_guesses) * (self.lookahead_ngram - 1)
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = min(DEFAULT_SPECULATIVE_TOKENS,
                                              (MAX_DECODE_QUERY_LEN - 1) // max(1, self.tree_width))
        _need(self.num_speculative_tokens >= 1, "num_speculative_tokens must be at least 1")
        _need(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
              "need 1 <= prompt_lookup_min <= prompt_lookup_max")
        _need(self.disable_by_batch_size >= 1, "speculative_disable_by_batch_size must be at least 1")
        _need(self.tree_width >= 1, "speculative_tree_width must be at least 1")
        _need(self.tree_width == 1 or self.method in ("ngram", "draft", "early-exit"),
              "speculative_tree_width > 1 needs speculative_method ngram, draft or early-exit (lookahead makes "
              "trees of its own: lookahead_mode full)")
        _need(not self.lookahead_full or self.num_speculative_tokens < MAX_DECODE_QUERY_LEN,
              f"lookahead full: (lookahead_window + lookahead_guesses) x (lookahead_ngram - 1) rows must be below "
              f"{MAX_DECODE_QUERY_LEN} (the tree's rows, its root included, go through the decode kernels), got "
              f"{self.num_speculative_tokens}")
        _need(self.tree_width * self.num_speculative_tokens < MAX_DECODE_QUERY_LEN,
              f"speculative_tree_width x num_speculative_tokens must be below {MAX_DECODE_QUERY_LEN} (a tree's "
              f"rows, its root included, go through the decode kernels), got {self.tree_width} x "
              f"{self.num_speculative_tokens}")


    @property
    def lookahead_full(self) -> bool:
        """Lookahead decoding as published: its guesses are a token tree."""
        return self.method == "lookahead" and self.lookahead_mode == "full"

    @property
    def token_trees(self) -> bool:
        """Whether its guesses may form token trees (attention through tree masks)."""
        return self.tree_width > 1 or self.lookahead_full


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
    lora_dtype: str = option(
        "auto", choices=["auto", "bfloat16"],
        help="the adapters' matrices as kept: auto, the model's dtype (exact); bfloat16: half the bytes a step reads, "
             "each weight rounded to bfloat16")

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


def _layer_counts(text: str) -> tuple[int, ...]:
    """'15,22' -> (15, 22)."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:  # (argparse shows an ArgumentTypeError's message; EngineConfig raises it as a ValueError)
        raise LayerCountsError(f"not a comma-separated list of layer counts: {text!r} (example: 15,22)") from None


class LayerCountsError(argparse.ArgumentTypeError, ValueError):
    """A calm_exit_layers text that is not a list of layer counts."""


def _model_pair(text: str) -> tuple[str, ...]:
    """'small.gguf,large.gguf' -> its two paths (checked by CascadeConfig)."""
    return tuple(part.strip() for part in text.split(","))


@dataclass
class CascadeConfig:
    """A cascade (hearth/engine/cascade.py, docs/cascade.md): requests start on a small model and move to a large
    one (the same vocabulary) where the small model draws a token with a probability under defer_threshold."""

    models: tuple[str, ...] | None = option(
        None, keyword="cascade", metavar="SMALL,LARGE", parse=_model_pair,
        help="run two models (GGUF files, HF folders or builtin names, one vocabulary) as a cascade in place of MODEL: "
             "each request starts on SMALL and moves to LARGE, its tokens so far computed there, after a token SMALL "
             "drew with a probability under --defer-threshold")
    defer_threshold: float | None = option(
        None, metavar="T", help="with --cascade: the probability (0 to 1) under which a token SMALL drew moves its "
                                "request to LARGE (0: never, 1: after the first token)")

    def __post_init__(self) -> None:
        if self.models is None:
            _need(self.defer_threshold is None, "defer_threshold is for a cascade: give cascade (--cascade SMALL,LARGE) too")
            return
        self.models = _model_pair(self.models) if isinstance(self.models, str) else tuple(map(str, self.models))
        _need(len(self.models) == 2 and all(self.models),
              f"cascade takes two models, SMALL,LARGE (the small one first), got {','.join(self.models)!r}")
        _need(self.defer_threshold is not None, "a cascade needs defer_threshold: the probability (0 to 1) under "
                                                "which a token of the small model moves its request to the large one")
        _need(0 <= self.defer_threshold <= 1, f"defer_threshold is a probability, in [0, 1]; got {self.defer_threshold}")


@dataclass
class EngineConfig:
    """The engine's options, each declared once (hearth/options.py: LLM's keywords and the CLI's flags
    come from here); every field validated loudly."""

    dtype: str = option("auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="the compute dtype (auto: float32 on a CPU, bfloat16 on a GPU; on a CPU "
                             "auto keeps bf16 / f16 weights as stored for hearth's kernels, where bfloat16 and "
                             "float16 run the reference backend's torch ops)")
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
    mmproj: str | None = option(
        None, metavar="FILE", help="llama.cpp's mmproj GGUF: the vision projector of a GGUF text model (SmolVLM / "
                                   "Idefics3, Gemma 3, Gemma 4, Qwen3-VL, Qwen3.5), as llama-server's --mmproj")
    image_max_tokens: int | None = option(
        None, metavar="N", help="the most tokens an image becomes, as llama-server's --image-max-tokens: Gemma 4's "
                                "processor's max_soft_tokens (70, 140, 280, 560 or 1120; default: the folder's, 280 "
                                "for an mmproj file); Qwen3-VL's and Qwen3.5's max_pixels, N x (patch x merge)^2 "
                                "(default: the folder's, 4096 tokens for an mmproj file); a request's "
                                "mm_processor_kwargs may set max_soft_tokens, max_pixels too")
    image_min_tokens: int | None = option(
        None, metavar="N", help="Qwen3-VL, Qwen3.5: the fewest tokens an image becomes (min_pixels, N x (patch x "
                                "merge)^2; default: the folder's, 8 tokens for an mmproj file), as llama-server's "
                                "--image-min-tokens")
    lora: LoRAConfig = section(LoRAConfig, "LoRA adapters")
    sparsity: SparsityConfig = section(SparsityConfig, "activation sparsity")
    cascade: CascadeConfig = section(CascadeConfig, "cascade")
    calm_exit_layers: tuple[int, ...] | None = option(
        None, metavar="N,M", parse=_layer_counts, group="CALM early exit",
        help="the layer counts after which a request with a calm_threshold may leave the model, each softmax check an "
             "LM head pass (hearth/model/calm.py; default: half and three quarters of the model's layers)")
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
        _need(not self.parallel.split or self.speculative.method not in ("early-exit", "mtp"),
              f"speculative_method {self.speculative.method} runs the model's own layers in one process: not with "
              "tensor or pipeline parallelism")
        self.contrastive_model = None if self.contrastive_model is None else str(self.contrastive_model)  # a Path
        self.mmproj = None if self.mmproj is None else str(self.mmproj)
        for name in ("image_max_tokens", "image_min_tokens"):
            tokens = getattr(self, name)
            _need(tokens is None or (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0),
                  f"{name} must be a positive number of tokens, got {tokens!r}")
        _need(None in (self.image_min_tokens, self.image_max_tokens) or self.image_min_tokens <= self.image_max_tokens,
              f"image_min_tokens {self.image_min_tokens} is more than image_max_tokens {self.image_max_tokens}")
        if self.calm_exit_layers is not None:
            layers = self.calm_exit_layers
            layers = tuple(_layer_counts(layers) if isinstance(layers, str) else layers)
            _need(len(layers) > 0 and all(isinstance(n, int) and n >= 1 for n in layers),
                  f"calm_exit_layers must be layer counts of at least 1, got {self.calm_exit_layers!r}")
            self.calm_exit_layers = layers
        _need(not self.sparsity.activation_sparsity or not (self.parallel.split or self.lora.enable_lora),
              "activation_sparsity with tensor or pipeline parallelism or LoRA adapters is not implemented")
        _need(self.cascade.models is None or not self.lora.enable_lora,
              "a cascade with LoRA adapters is not implemented: give cascade or enable_lora, not both")
        _need(self.cascade.models is None or not self.scheduler.async_scheduling,
              "a cascade schedules its small model synchronously (a request moves between its steps): not with "
              "async_scheduling")
        if self.lora.enable_lora:
            _need(not self.parallel.split, "LoRA adapters with tensor or pipeline parallelism are not implemented")
            _need(self.speculative.method is None, "speculative decoding with LoRA adapters is not implemented: give "
                                                   "speculative_method or enable_lora, not both")
