"""One config-driven decoder: llama, mistral, qwen2, qwen3 and gemma.

The model sees a flattened batch of tokens (every request's new tokens, end to end) and
AttentionMetadata; it knows nothing about requests.
"""

from __future__ import annotations

import torch
from torch import nn

from hearth.config import ModelConfig
from hearth.errors import ModelLoadError
from hearth.model.attention import AttentionMetadata, paged_attention
from hearth.model.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, apply_rope
from hearth.quant import QuantTensor
from hearth.quant.linear import quantized_module, release_file_pages


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = Linear(config.hidden_size, self.num_heads * self.head_dim, bias)
        self.k_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias)
        self.v_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rotary: tuple[torch.Tensor, torch.Tensor],  # RotaryEmbedding's (cos, sin) of the tokens' positions
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rotary), apply_rope(k, rotary)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(tokens, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset)
        self.mlp = GatedMLP(config)

    def forward(self, x, rotary, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rotary, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.rope = RotaryEmbedding(config, max_positions or config.max_position_embeddings)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k, v), each [slots, kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        x = self.embed_tokens(input_ids)
        if self.config.embedding_scale != 1.0:
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        rotary = self.rope(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rotary, kv_cache, meta)
        return self.norm(x)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the final norm's weight is always dense)."""
        return self.norm.weight.dtype

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] fp32
        return self.lm_head(hidden).float()

    def load_weights(self, weights: dict[str, torch.Tensor | QuantTensor], dtype: torch.dtype,
                     device: torch.device | str = "cpu") -> None:
        """Take every parameter from `weights` (HF names), checking presence and shape. Weights
        kept in their storage format (GGUF blocks; F16/BF16 on a CPU) swap their Linear or
        Embedding for the quantized module hearth.quant.linear chooses."""
        weights = dict(weights)
        if "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # tied embeddings
        rope_freqs = weights.get("rope_freqs")
        if rope_freqs is not None:
            self.rope.set_frequency_factors(_dense(rope_freqs, torch.float32))
        release_file_pages(weights.values())
        for name, module in list(self.named_modules()):
            hf_name = name if name.startswith("lm_head") else f"model.{name}"
            source = weights.get(f"{hf_name}.weight")
            if source is None or not isinstance(module, (Linear, nn.Embedding)):
                continue
            swapped = quantized_module(module, source, weights.get(f"{hf_name}.bias"), dtype, device)
            if swapped is not None:
                _check_shape(f"{hf_name}.weight", source, module.weight)
                parent, _, child = name.rpartition(".")
                setattr(self.get_submodule(parent), child, swapped)
        for name, param in self.named_parameters():
            hf_name = name if name.startswith("lm_head") else f"model.{name}"
            source = weights.get(hf_name)
            if source is None:
                raise ModelLoadError(f"missing tensor {hf_name}")
            _check_shape(hf_name, source, param)
            owner, attr = name.rsplit(".", 1)
            setattr(self.get_submodule(owner), attr, nn.Parameter(_dense(source, dtype), requires_grad=False))


def _check_shape(hf_name: str, source: torch.Tensor | QuantTensor, param: torch.Tensor) -> None:
    if tuple(source.shape) != tuple(param.shape):
        raise ModelLoadError(
            f"tensor {hf_name}: shape {tuple(source.shape)}, expected {tuple(param.shape)} from the config"
        )


def _dense(weight: torch.Tensor | QuantTensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(weight, QuantTensor):
        return weight.dequantize(dtype)
    return weight.to(dtype)
