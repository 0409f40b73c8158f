"""Tiny random models built with transformers: the references every model test compares against."""

from __future__ import annotations

from pathlib import Path

import torch

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma")
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
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(folder)


def hf_config(arch: str, **overrides):
    import transformers

    common = dict(
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
    specific = {
        "llama": (transformers.LlamaConfig, {}),
        "mistral": (transformers.MistralConfig, {"sliding_window": None}),
        "qwen2": (transformers.Qwen2Config, {"use_sliding_window": False}),
        "qwen3": (transformers.Qwen3Config, {"head_dim": 16, "use_sliding_window": False}),
        "gemma": (transformers.GemmaConfig, {"head_dim": 16, "hidden_activation": "gelu_pytorch_tanh"}),
    }
    cls, extra = specific[arch]
    return cls(**{**common, **extra, **overrides})


def make_hf_model(folder: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Save a random `arch` model with transformers (fp32) and a tokenizer into `folder`."""
    import transformers

    torch.manual_seed(seed)
    config = hf_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # spread the weights so that logits are far from uniform
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(1.0 if arch != "gemma" else 0.0, 0.2)
            else:
                p.normal_(0.0, 0.08)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    make_tokenizer(folder)
    return folder


def load_hf_reference(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
