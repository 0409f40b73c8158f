"""Tiny random models built with transformers: the references every model test compares against."""

from __future__ import annotations

from pathlib import Path

import torch

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "smollm3")
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")  # deepseek_v2: tests/test_latent_attention.py
VOCAB_SIZE = 320

_TEXT = (
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    "Once upon a time there was a little fox who lived in the forest. "
    "The quick brown fox jumps over the lazy dog. 0123456789 héllo wörld ünïcode\n"
)


def make_tokenizer(folder: Path) -> None:
    """A small byte-level BPE tokenizer.json with BOS/EOS and a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_TEXT] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = (  # ChatML; the tools' names (when given) in a system turn: tool calling in the model's format
        "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
        "{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(folder)


_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=1,
)


def hf_config(arch: str, **overrides):
    import transformers

    cls, extra = {**_dense_configs(transformers), **_expert_configs(transformers), **_hybrid_configs(transformers)}[arch]
    return cls(**{**_COMMON, **extra, **overrides})


def _dense_configs(transformers) -> dict:
    """{arch: (transformers' config class, what differs from _COMMON)} for the dense families."""
    return {
        "llama": (transformers.LlamaConfig, {}),
        "mistral": (transformers.MistralConfig, {"sliding_window": None}),
        "qwen2": (transformers.Qwen2Config, {"use_sliding_window": False}),
        "qwen3": (transformers.Qwen3Config, {"head_dim": 16, "use_sliding_window": False}),
        "gemma": (transformers.GemmaConfig, {"head_dim": 16, "hidden_activation": "gelu_pytorch_tanh"}),
        # a query scale other than head_dim's, soft-caps that bite, a window longer than the tests' sequences
        "gemma2": (transformers.Gemma2Config, {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 128,
                                               "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0}),
        # a local and a global layer, each with its RoPE base; linear scaling on the global one
        "gemma3": (transformers.Gemma3TextConfig, {
            "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}}),
        # Gemma 4's layout, small: sliding and full layers (the full ones with their own head_dim and one KV head,
        # v from k's projection), the last two reading the K/V of the last earlier layer of their kind (with an
        # MLP twice as wide), per-layer embeddings, a window shorter than the tests' sequences, proportional RoPE
        # on a quarter of the full layers' heads (transformers' default rope_parameters)
        "gemma4": (transformers.Gemma4TextConfig, {
            "num_hidden_layers": 5, "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1,
            "attention_k_eq_v": True, "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                            "full_attention"],
            "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB_SIZE, "sliding_window": 8,
            "final_logit_softcapping": 30.0, "pad_token_id": 0}),
        # a NoPE layer every 4, the layout llama.cpp's smollm3 assumes
        "smollm3": (transformers.SmolLM3Config, {"num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 0],
                                                 "tie_word_embeddings": False, "pad_token_id": None}),
        # q/k/v and gate/up stored merged; a window on every layer, shorter than the engine tests' sequences
        "phi3": (transformers.Phi3Config, {"sliding_window": 24, "pad_token_id": None}),
    }


def _expert_configs(transformers) -> dict:
    """The same for mixtures of experts and multi-head latent attention."""
    return {
        # mixtures of experts: 8 experts, 2 or 3 chosen per token; experts as wide as a block of the
        # quantized formats' (32) so that converted files quantize them
        "mixtral": (transformers.MixtralConfig, {"num_local_experts": 8, "num_experts_per_tok": 2,
                                                 "intermediate_size": 64, "sliding_window": None}),
        "qwen2_moe": (transformers.Qwen2MoeConfig, {"num_experts": 8, "num_experts_per_tok": 3,
                                                    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 96,
                                                    "norm_topk_prob": False, "use_sliding_window": False}),
        "qwen3_moe": (transformers.Qwen3MoeConfig, {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                                                    "moe_intermediate_size": 32, "norm_topk_prob": True,
                                                    "use_sliding_window": False}),
        "olmoe": (transformers.OlmoeConfig, {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
                                             "pad_token_id": None}),
        # DeepSeek-V2-Lite's shape, small: multi-head latent attention without a query LoRA; a dense
        # first layer, then 8 routed experts (2 chosen, scaled) and a shared MLP of 2 experts' width;
        # YaRN with a factor that bites within the tests' sequences and both of its temperatures
        "deepseek_v2": (transformers.DeepseekV2Config, {
            "num_hidden_layers": 3, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "first_k_dense_replace": 1,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 2, "moe_intermediate_size": 32,
            "routed_scaling_factor": 1.5, "topk_method": "greedy", "norm_topk_prob": False, "pad_token_id": None,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
                                "mscale": 0.707, "mscale_all_dim": 1.0}}),
        # gpt-oss's layout: sliding and full layers alternating (a window shorter than the tests' sequences),
        # attention sinks, 4 experts with biases (2 chosen) as wide as an MXFP4 block, the clamped SwiGLU
        # with a limit that bites, YaRN untruncated as gpt-oss's config has it
        "gpt_oss": (transformers.GptOssConfig, {
            "num_hidden_layers": 2, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
            "intermediate_size": 32, "sliding_window": 8, "swiglu_limit": 1.5, "pad_token_id": None,
            "max_position_embeddings": 2048,  # room for its chat template's system prompt and tools
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}}),
    }


def _hybrid_configs(transformers) -> dict:
    """The same for hybrids: layers with a state per sequence between attention layers."""
    return {
        # a short convolution (with biases), attention, a convolution; the MLP's width derived as LFM2's
        "lfm2": (transformers.Lfm2Config, {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"],
                                           "conv_bias": True, "conv_L_cache": 3, "block_multiple_of": 16,
                                           "norm_eps": 1e-5, "pad_token_id": None}),
        # Qwen3.5's pattern (three Gated DeltaNet layers, then gated attention) with partial RoPE; more
        # value heads than key heads, as in the real models
        "qwen3_5": (transformers.Qwen3_5TextConfig, {
            "num_hidden_layers": 4, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 8, "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4}),
        # Qwen3-Next's: Qwen3.5's layers (its projections fused per key head) with 8 experts (2 chosen, renormalised)
        # and a shared expert behind a sigmoid gate, but in layer 1 (mlp_only_layers), a dense MLP
        "qwen3_next": (transformers.Qwen3NextConfig, {
            "num_hidden_layers": 4, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 8, "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
            "norm_topk_prob": True, "mlp_only_layers": [1]}),
        # Granite 4.0-H's pattern, small: Mamba2 (4 heads of 32 in 2 groups, state 8), attention without
        # RoPE, Mamba2, each followed by 4 experts (2 chosen) and a shared MLP; its four multipliers
        "granitemoehybrid": (transformers.GraniteMoeHybridConfig, {
            "num_hidden_layers": 3, "layer_types": ["mamba", "attention", "mamba"], "mamba_n_heads": 4,
            "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "num_local_experts": 4,
            "num_experts_per_tok": 2, "intermediate_size": 32, "shared_intermediate_size": 48,
            "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2, "logits_scaling": 3.0}),
        # Nemotron-H's blocks of one mixer each: Mamba2 (4 heads of 16 in 2 groups, state 8), a relu2 MLP,
        # attention without RoPE, Nemotron 3's experts (8 ungated relu2 ones, 2 chosen by sigmoid score plus a
        # correction, scaled, and a shared one), Mamba2
        "nemotron_h": (transformers.NemotronHConfig, {
            "layers_block_type": ["mamba", "mlp", "attention", "moe", "mamba"], "head_dim": 16, "mamba_num_heads": 4,
            "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 8, "conv_kernel": 4, "layer_norm_epsilon": 1e-5,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 48, "routed_scaling_factor": 2.5}),
    }


def make_hf_model(folder: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Save a random `arch` model with transformers (fp32) and a tokenizer into `folder`."""
    import transformers

    torch.manual_seed(seed)
    config = hf_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # spread the weights so that logits are far from uniform
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # Gated DeltaNet's decays: a state that remembers a few tokens
                p.normal_(-2.0, 0.5)
            elif p.dim() == 1:  # (gemma to gemma3 store their norms' weights as w - 1)
                p.normal_(0.0 if arch in ("gemma", "gemma2", "gemma3") else 1.0, 0.2)
            else:
                p.normal_(0.0, 0.08)
        for name, b in model.named_buffers():  # nemotron_h's router correction: a choice other than by score alone
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
            elif name.endswith("layer_scalar"):  # gemma4's scale of each layer's output
                b.normal_(1.0, 0.2)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    make_tokenizer(folder)
    return folder


def add_mtp_weights(folder: Path, seed: int = 2) -> dict[str, torch.Tensor]:
    """Give a qwen3_5 / qwen3_next folder (make_hf_model's) the multi-token-prediction layer their checkpoints ship:
    mtp.layers.0.* a full-attention decoder layer (the tensors of the model's own attention layer, new values),
    mtp.fc [hidden, 2 x hidden] over [embedding, hidden state] and its three norms, spread as make_hf_model's;
    mtp_num_hidden_layers 1 in the config. Returns the mtp.* tensors."""
    import json

    from safetensors.torch import load_file, save_file

    config = json.loads((folder / "config.json").read_text())
    weights = load_file(folder / "model.safetensors")
    prefix = f"model.layers.{config['layer_types'].index('full_attention')}."
    generator = torch.Generator().manual_seed(seed)

    def spread(shape) -> torch.Tensor:
        noise = torch.randn(shape, generator=generator)
        return 1.0 + 0.2 * noise if len(shape) == 1 else 0.08 * noise

    hidden = config["hidden_size"]
    mtp = {"mtp.layers.0." + name.removeprefix(prefix): spread(t.shape) for name, t in weights.items()
           if name.startswith(prefix)}
    mtp |= {"mtp.fc.weight": spread((hidden, 2 * hidden))} | {
        f"mtp.{norm}.weight": spread((hidden,)) for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    save_file(weights | mtp, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config | {"mtp_num_hidden_layers": 1}, indent=2))
    return mtp


def make_draft_model(target: Path, folder: Path, noise: float, seed: int = 1) -> Path:
    """A draft for speculative decoding: the target's weights plus Gaussian noise of `noise` times their std
    (0: the target itself), with its tokenizer (the same vocabulary)."""
    import shutil

    model = load_hf_reference(target)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * noise * p.std())
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "chat_template.jinja":
            shutil.copy(f, folder / f.name)
    return folder


def load_hf_reference(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()


def make_spm_tokenizer(folder: Path, prefix_space: bool = True) -> int:
    """Replace the tokenizer in `folder` with a SentencePiece-style BPE (Llama 2 layout): "▁" for
    spaces, <unk>/<s>/</s> at ids 0..2, byte-fallback tokens <0x00>..<0xFF> at 3..258. Returns the
    number of tokens (about 420: give the model a vocab_size of at least that). prefix_space: a "▁" put
    before the text (Llama 2's); without it, Gemma's layout (spaces replaced, nothing prepended)."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # learn merges within words only, as SentencePiece does
    trained = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trained.train_from_iterator([_TEXT] * 20, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"]))
    learned = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    prepend = [normalizers.Prepend("▁")] if prefix_space else []
    tok.normalizer = normalizers.Sequence([*prepend, normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if prefix_space else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)
    fast.save_pretrained(folder)
    return len(vocab)


def hearth_logits(config, weights, token_ids: list[int], backend=None, device: str = "cpu") -> torch.Tensor:
    """hearth's logits [T, vocab] (float32, on the CPU) for one prompt, run through the paged model runner
    on `device` (backend: the reference one by default)."""
    return hearth_greedy(config, weights, token_ids, 0, backend, device)[0]


def hearth_greedy(config, weights, token_ids: list[int], steps: int, backend=None, device: str = "cpu"):
    """hearth's logits [T, vocab] (float32, on the CPU) for one prompt, its greedy continuation of `steps`
    tokens (a decode step each after the first) and the model, run through the paged model runner on
    `device` (backend: the reference one by default)."""
    from hearth.engine.runner import BatchEntry, ModelRunner
    from hearth.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(config, backend=backend)
    model.load_weights(weights, torch.float32)
    model.backend.prepare(model, torch.float32)
    model.to(device)
    block_size = 16
    blocks = list(range((len(token_ids) + max(steps - 1, 0) + block_size - 1) // block_size))
    runner = ModelRunner(model, num_blocks=len(blocks), block_size=block_size, device=torch.device(device),
                         kv_dtype=torch.float32)
    hidden, _ = runner.forward([BatchEntry(list(token_ids), 0, blocks)])
    logits, tokens = model.compute_logits(hidden).cpu(), []
    for step in range(steps):
        if step:
            hidden, _ = runner.forward([BatchEntry(tokens[-1:], len(token_ids) + step - 1, blocks)])
        tokens.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return logits, tokens, model


# SmolVLM-256M's image geometry (tiles of 512 pixels, patches of 16, a pixel shuffle of 4: 64 tokens a
# tile), its processor's longest edge halved (2 x 2 tiles and the global image at most: quick tests)
VLM_TILE, VLM_LONGEST_EDGE = 512, 1024
VLM_SPECIAL = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
               *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]


def make_vlm(folder: Path, seed: int = 0, text: dict | None = None, vision: dict | None = None,
             longest_edge: int = VLM_LONGEST_EDGE, spread: bool = True) -> Path:
    """A random SmolVLM (transformers' SmolVLMForConditionalGeneration: SigLIP, pixel shuffle, llama) in real
    image shapes with a tiny encoder and text model (text, vision: other sizes), its tokenizer (the image
    tokens added) and its processor's settings (Idefics3Processor: SmolVLM's needs num2words, and lays
    images out the same). spread: weights spread wider than transformers' init (logits far from uniform)."""
    import transformers

    make_tokenizer(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": VLM_SPECIAL})
    torch.manual_seed(seed)
    config = transformers.SmolVLMConfig(
        text_config={**_COMMON, "model_type": "llama", "vocab_size": 384, "max_position_embeddings": 4096,
                     **(text or {})},
        vision_config={"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": VLM_TILE, "patch_size": 16, **(vision or {})},
        scale_factor=4, image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    model = transformers.SmolVLMForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters() if spread else ():
            p.normal_(1.0 if p.dim() == 1 and "norm" in name else 0.0, 0.2 if p.dim() == 1 else 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    image_processor = transformers.Idefics3ImageProcessor(size={"longest_edge": longest_edge},
                                                          max_image_size={"longest_edge": VLM_TILE})
    processor = transformers.Idefics3Processor(image_processor, tokenizer, image_seq_len=64)
    processor.save_pretrained(folder)
    return folder


QWEN_VL_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def make_qwen_vl(folder: Path, seed: int = 0, max_pixels: int = 320 * 320, family: str = "qwen3_vl",
                 text: dict | None = None) -> Path:
    """A random Qwen3-VL (transformers' Qwen3VLForConditionalGeneration: a ViT of 3 blocks with deepstack
    from two of them, a qwen3 text model with interleaved M-RoPE) in real image shapes (patches of 16,
    merged 2 x 2) with tiny widths, its tokenizer (the vision tokens added) and its image and video processors'
    settings (Qwen2VLImageProcessor's, at most max_pixels an image; Qwen3VLVideoProcessor's, at most 6 x 64 x 64
    pixels a video, 8 frames: quick tests). family "qwen3_vl_moe":
    Qwen3VLMoeForConditionalGeneration (8 experts, 2 a token, layer 1 a dense MLP). family "qwen3_5":
    Qwen3_5ForConditionalGeneration (the encoder without deepstack; the hybrid text model of
    hf_config("qwen3_5") with half its head rotated). `text`: changes to the text config (any family). Weights
    spread wider than transformers' init (logits far from uniform)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor  # (saved, never run:
    # it needs torchvision)

    make_tokenizer(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VL_SPECIAL})
    tokenizer.save_pretrained(folder)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_VL_SPECIAL}
    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    vision = {"depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "patch_size": 16,
              "out_hidden_size": _COMMON["hidden_size"], "num_position_embeddings": 64}
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if family == "qwen3_5":
        text = {**_COMMON, **_hybrid_configs(transformers)["qwen3_5"][1], "head_dim": 32,
                "max_position_embeddings": 4096, "rope_parameters": {**rope, "partial_rotary_factor": 0.5},
                **(text or {})}
        model = transformers.Qwen3_5ForConditionalGeneration(
            transformers.Qwen3_5Config(text_config=text, vision_config=vision, **tokens))
    elif family == "qwen3_vl_moe":  # (experts 24 wide: neither stack square, so that a transposed one shows)
        text = {**_COMMON, "head_dim": 16, "max_position_embeddings": 4096, "rope_parameters": rope,
                "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "mlp_only_layers": [1],
                **(text or {})}
        model = transformers.Qwen3VLMoeForConditionalGeneration(transformers.Qwen3VLMoeConfig(
            text_config=text, vision_config={**vision, "deepstack_visual_indexes": [0, 2]}, **tokens))
    else:
        text = {**_COMMON, "head_dim": 16, "max_position_embeddings": 4096, "rope_parameters": rope, **(text or {})}
        model = transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(
            text_config=text, vision_config={**vision, "deepstack_visual_indexes": [0, 2]}, **tokens))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # Gated DeltaNet's decays: a state that remembers a few tokens
                p.normal_(-2.0, 0.5)
            else:
                p.normal_(1.0 if p.dim() == 1 and "norm" in name else 0.0, 0.2 if p.dim() == 1 else 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    Qwen2VLImageProcessorPil(patch_size=16, size={"shortest_edge": 32 * 32, "longest_edge": max_pixels},
                             image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(folder)
    Qwen3VLVideoProcessor(patch_size=16, size={"shortest_edge": 2 * 32 * 32, "longest_edge": 6 * 64 * 64},
                          image_mean=[0.5] * 3, image_std=[0.5] * 3, max_frames=8).save_pretrained(folder)
    return folder


def qwen_vl_processor(folder: Path):
    """transformers' Qwen3VLProcessor of the folder, made without its video processor (which needs
    torchvision; images never reach it)."""
    from unittest import mock

    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    with mock.patch.object(transformers.ProcessorMixin, "check_argument_for_proper_class", lambda *args: None):
        return transformers.Qwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
                                             tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
                                             video_processor=None)


GEMMA3_VL_SPECIAL = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def make_gemma3_vl(folder: Path, seed: int = 0, image_size: int = 224) -> Path:
    """A random Gemma 3 (transformers' Gemma3ForConditionalGeneration: SigLIP, the pooling projector, a gemma3 text
    model) in real image shapes (patches of 14, 8 x 8 pooled tokens of 2 x 2 patches) with tiny widths: its
    config as the published ones (no pooling head), a text model of a sliding and a global layer whose window (48)
    is shorter than a prompt with an image, its tokenizer (the image tokens added) and its processor
    (Gemma3Processor, the PIL image processor). Weights spread wider than transformers' init."""
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    make_tokenizer(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, extra_special_tokens=GEMMA3_VL_SPECIAL)
    torch.manual_seed(seed)
    text = {**_COMMON, **_dense_configs(transformers)["gemma3"][1], "vocab_size": 384, "sliding_window": 48,
            "max_position_embeddings": 4096}
    config = transformers.Gemma3Config(
        text_config=text, mm_tokens_per_image=64,
        vision_config={"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": image_size, "patch_size": 14, "vision_use_head": False},
        boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id,
        image_token_index=tokenizer.image_token_id)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():  # (Gemma's RMSNorms store w - 1; SigLIP's LayerNorms w)
            layer_norm = ("layer_norm" in name or "post_layernorm" in name) and name.endswith("weight")
            p.normal_(1.0 if layer_norm else 0.0, 0.2 if p.dim() == 1 else 0.08)
        projection = model.model.multi_modal_projector.mm_input_projection_weight  # (F16 in an mmproj file:
        projection.copy_(projection.half().float())  # values it holds exactly, so that both paths are one model)
    model.save_pretrained(folder, safe_serialization=True)
    image_processor = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size},
                                              image_mean=[0.5] * 3, image_std=[0.5] * 3)
    transformers.Gemma3Processor(image_processor, tokenizer, image_seq_length=64).save_pretrained(folder)
    return folder


GEMMA4_VL_SPECIAL = {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
                     "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>"}


def make_gemma4_vl(folder: Path, seed: int = 0, text: dict | None = None, vision: dict | None = None) -> Path:
    """A random Gemma 4 (transformers' Gemma4ForConditionalGeneration: its ViT with 2-D RoPE, 3 x 3 pooling and
    standardisation, embed_vision, the gemma4 text model of hf_config("gemma4") with images attending both ways on
    its sliding layers, whose window (8) is shorter than an image) in real image shapes (patches of 16, the
    processor's least budget: 70 soft tokens) with tiny widths, its tokenizer (the image and audio tokens added,
    as Gemma4Processor needs them) and its image processor's settings (Gemma4ImageProcessorPil's). Weights spread
    wider than transformers' init. text, vision: text_config's and vision_config's keys changed."""
    import transformers
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    make_tokenizer(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, extra_special_tokens=GEMMA4_VL_SPECIAL,
                                                           pad_token="<s>")  # (Gemma4Processor pads)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(seed)
    text = {**_COMMON, **_dense_configs(transformers)["gemma4"][1], "vocab_size": 384, "vocab_size_per_layer_input": 384,
            "max_position_embeddings": 4096, "use_bidirectional_attention": "vision", **(text or {})}
    vision = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "patch_size": 16, "pooling_kernel_size": 3,
              "position_embedding_size": 256, "standardize": True, **(vision or {})}
    model = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
        text_config=text, vision_config=vision, image_token_id=tokenizer.image_token_id,
        boi_token_id=tokenizer.boi_token_id, eoi_token_id=tokenizer.eoi_token_id, video_token_id=None,
        audio_token_id=None))
    with torch.no_grad():
        for name, p in model.named_parameters():  # (Gemma 4's norms: plain weights)
            p.normal_(1.0 if p.dim() == 1 and "norm" in name else 0.0, 0.2 if p.dim() == 1 else 0.08)
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # scores unscaled: softmaxes of scores of std 1,
                p.mul_(0.5)  # not 4, so that the layers do not magnify the encoder's roundings 100 times
        tower = model.model.vision_tower
        tower.std_bias.normal_(0.0, 0.5), tower.std_scale.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    Gemma4ImageProcessorPil(max_soft_tokens=70).save_pretrained(folder)
    return folder


def gemma4_vl_processor(folder: Path):
    """transformers' Gemma4Processor of the folder, made without its video processor (which needs torchvision;
    images never reach it)."""
    from unittest import mock

    import transformers
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, extra_special_tokens=GEMMA4_VL_SPECIAL)
    with mock.patch.object(transformers.ProcessorMixin, "check_argument_for_proper_class", lambda *args: None):
        return transformers.Gemma4Processor(Gemma4AudioFeatureExtractor(), Gemma4ImageProcessorPil.from_pretrained(
            folder), tokenizer, None, image_seq_length=70)
