"""The transformer's building blocks: RMSNorm, rotary embedding, gated MLP, mixture of experts, linear."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hearth.config import ModelConfig
from hearth.backend.base import Backend
from hearth.errors import ModelLoadError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Backend, weight_offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.ops = ops
        self.weight_offset = weight_offset  # gemma stores w - 1

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); or, given the residual stream, (norm(residual + x), residual + x): the add
        fused into the norm's pass where the backend has a kernel for it."""
        return self.ops.rms_norm(x, self.weight, self.eps, self.weight_offset, residual)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (gemma4's v and router norms): x / sqrt(mean(x^2) + eps) over the last
    dimension, in float32."""
    y = x.float()
    return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Linear(nn.Module):
    """y = x W^T (+ b). The weight is a plain tensor; quantized holders replace this module."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(nn.Module):
    """Projections of one input (attention's q, k, v; the MLP's gate and up) as one matmul over
    their weights concatenated by rows: one kernel call and one pass over x instead of several.
    Parts stored in different formats (a GGUF file may hold v in Q6_K beside q and k in Q4_K)
    cannot share a matrix: `parts` has one Linear per run of neighbours in the same format
    (Transformer.load_weights groups them). forward returns each projection's output."""

    def __init__(self, in_features: int, out_features: dict[str, int], bias: bool = False):
        super().__init__()
        self.in_features, self.bias = in_features, bias
        self.part_names = tuple(out_features)  # the checkpoint's names, e.g. ("q_proj", "k_proj", "v_proj")
        self.part_sizes = tuple(out_features.values())
        self.set_groups([list(range(len(self.part_names)))])

    def set_groups(self, groups: list[list[int]]) -> None:
        """One Linear per group of consecutive parts (indices into part_names); weights come later."""
        self.groups = [[self.part_sizes[i] for i in group] for group in groups]
        with torch.device("meta"):
            self.parts = nn.ModuleList(Linear(self.in_features, sum(sizes), self.bias) for sizes in self.groups)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outputs = []
        for part, sizes in zip(self.parts, self.groups):
            outputs.extend(part(x).split_with_sizes(sizes, dim=-1))
        return outputs


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (llama, qwen) or GeGLU (gemma); gpt_oss's clamped SwiGLU
    (clamped_swiglu)."""

    def __init__(self, config: ModelConfig, ops: Backend, intermediate_size: int | None = None):
        super().__init__()
        self.ops = ops
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate_proj": size, "up_proj": size}, config.mlp_bias)
        self.down_proj = Linear(size, config.hidden_size, config.mlp_bias)
        self.activation = _ACTIVATIONS.get(config.hidden_act)
        if self.activation is None:
            raise ModelLoadError(f"unsupported activation {config.hidden_act!r}")
        self.clamped_swiglu = config.clamped_swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        if self.clamped_swiglu is not None:
            return self.down_proj(clamped_swiglu(gate, up, *self.clamped_swiglu))
        return self.down_proj(self.ops.act_and_mul(gate, up, self.activation))


class MLP(nn.Module):
    """down(act(up(x))), ungated: nemotron_h's, with relu2 (ReLU squared)."""

    def __init__(self, config: ModelConfig, ops: Backend, intermediate_size: int | None = None):
        super().__init__()
        if config.hidden_act != "relu2":
            raise ModelLoadError(f"unsupported activation {config.hidden_act!r} of an ungated MLP")
        size = intermediate_size or config.intermediate_size
        self.up_proj = Linear(config.hidden_size, size, config.mlp_bias)
        self.down_proj = Linear(size, config.hidden_size, config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation: gate clamped to at most limit, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


class ExpertMixture(nn.Module):
    """`num_experts` experts (GatedMLPs of moe_intermediate_size, or ungated MLPs where gated_mlp is False)
    and the sum of each token's chosen experts' outputs, weighted: what a mixture of experts computes once
    its router has chosen (SparseMoE's; gemma4's layers route on their own, hearth/model/gemma4.py).

    The step's (token, choice) pairs are grouped by expert and each chosen expert runs once on all
    its tokens: an expert's weights are read once per step, whatever the batch, and experts no token
    chose are not read at all. The experts are ordinary GatedMLPs, so quantized weights go through
    the same quantized modules as a dense MLP's."""

    def __init__(self, config: ModelConfig, ops: Backend):
        super().__init__()
        self.ops = ops
        self.backend_state: dict = {}  # what the backend derives from the experts' weights (emptied when they move)
        self.top_k = config.num_experts_per_tok
        expert = GatedMLP if config.gated_mlp else MLP
        self.experts = nn.ModuleList(expert(config, ops, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))

    def mix(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] through each token's chosen experts (chosen [T, k]), weighted (weights [T, k]) and summed."""
        weights, chosen = weights.to(x.dtype).reshape(-1), chosen.reshape(-1)  # [T * k], pair p is token p // k
        pairs_by_expert = chosen.argsort(stable=True)  # [P = T * k]
        counts = torch.bincount(chosen, minlength=len(self.experts))  # int64 [experts]
        tokens = pairs_by_expert // self.top_k
        routed = self.run_experts(x[tokens], counts)  # [P, hidden], pairs in expert order
        return torch.zeros_like(x).index_add_(0, tokens, routed * weights[pairs_by_expert, None])

    def _apply(self, fn, recurse=True):
        self.backend_state.clear()  # weight pointers change when tensors move
        return super()._apply(fn, recurse)

    def run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [P, hidden]: rows grouped by expert, counts[e] rows for expert e in expert order ->
        each row through its expert [P, hidden]: in one go where the backend has kernels for it,
        else expert by expert."""
        grouped = self.ops.run_experts(self, x, counts)
        if grouped is not None:
            return grouped.to(x.dtype)
        out = torch.empty_like(x)
        start = 0
        for expert, count in zip(self.experts, counts.tolist()):  # one host sync per layer
            if count:
                out[start : start + count] = expert(x[start : start + count])
                start += count
        return out


class SparseMoE(ExpertMixture):
    """Mixture of experts: each token takes the top-k of `num_experts` gated MLPs, weighted by the
    router's softmax over all experts (renormalised over the k when norm_topk_prob; times
    routed_scaling_factor; with expert groups, chosen only from the topk_groups groups whose best
    expert scores highest), plus a shared expert where the family has one: scaled by
    sigmoid(shared_expert_gate(x)) (qwen2_moe) or added as it is (deepseek_v2). With router_sigmoid
    (nemotron_h) the router scores each expert by sigmoid rather than softmax and chooses by the score
    plus a learned correction (e_score_correction_bias), weighting by the score alone; its experts
    and shared expert are ungated MLPs (gated_mlp False)."""

    def __init__(self, config: ModelConfig, ops: Backend):
        super().__init__(config, ops)
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.expert_groups, self.topk_groups = config.expert_groups, config.topk_groups
        self.gate = Linear(config.hidden_size, config.num_experts, config.router_bias)  # the router
        self.e_score_correction_bias = None
        if config.router_sigmoid:
            self.e_score_correction_bias = nn.Parameter(torch.empty(config.num_experts), requires_grad=False)
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:
            expert = GatedMLP if config.gated_mlp else MLP
            self.shared_expert = expert(config, ops, config.shared_expert_intermediate_size)
            if config.shared_expert_gated:
                self.shared_expert_gate = Linear(config.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        logits = self.gate(x).float()  # [T, experts], float32 as transformers
        if self.e_score_correction_bias is not None:
            return self._combine(x, *self._route_by_sigmoid(logits))
        probs = torch.softmax(logits, dim=-1)
        if self.expert_groups:  # experts outside the best groups score 0
            groups = probs.view(x.shape[0], self.expert_groups, -1)  # [T, groups, experts per group]
            best = groups.amax(dim=-1).topk(self.topk_groups, dim=-1).indices
            kept = torch.zeros(groups.shape[:2], dtype=torch.bool, device=x.device).scatter_(1, best, True)
            probs = groups.masked_fill(~kept[..., None], 0.0).view_as(probs)
        return self._combine(x, *probs.topk(self.top_k, dim=-1))

    def _route_by_sigmoid(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """nemotron_h's router: (weights, chosen experts) [T, k], chosen by sigmoid + correction."""
        scores = logits.sigmoid()
        chosen = (scores + self.e_score_correction_bias.float()).topk(self.top_k, dim=-1).indices
        return scores.gather(1, chosen), chosen

    def _combine(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The chosen experts' outputs (weights, chosen [T, k]) weighted and summed, and the shared expert's."""
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        out = self.mix(x, weights, chosen)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            out += shared if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out


# config.hidden_act -> the backends' activation names
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu"}


def _rope_kind(config: ModelConfig) -> str:
    scaling = config.rope_scaling or {}
    return scaling.get("rope_type") or scaling.get("type") or "default"


def longrope_factors(config: ModelConfig, max_positions: int) -> str:
    """Which of LongRoPE's two factor lists rotates every token of an engine whose context is
    max_positions: "long_factor" when that context passes the model's original one, else
    "short_factor". llama.cpp's rule (by its context size): every token of every request rotated
    alike, so that batching, chunked prefill and prefix caching cannot change a result.
    transformers chooses per forward call instead (long once the call reaches past the original
    context): the two agree while max_positions <= original, and on prompts longer than it."""
    return "long_factor" if max_positions > config.rope_scaling["original_max_position_embeddings"] else "short_factor"


def partial_rotary_order(config: ModelConfig) -> torch.Tensor | None:
    """Where RoPE rotates only the first r = head_dim x partial_rotary_factor dimensions (pairs i and
    i + r/2), the order of q's and k's dimensions under which rotate-half over the whole head (pairs j
    and j + head_dim/2) rotates the same pairs: the rotated halves first in each half of the head, the
    unrotated dimensions after them (rope_inv_freq's frequencies past r/2 are 0). None: all rotated."""
    dim, rotated = config.head_dim, int(config.head_dim * config.partial_rotary_factor)
    if rotated == dim:
        return None
    half, passed = rotated // 2, torch.arange(rotated, dim, device="cpu")
    unrotated = (dim - rotated) // 2
    return torch.cat([torch.arange(half, device="cpu"), passed[:unrotated], torch.arange(half, rotated, device="cpu"),
                      passed[unrotated:]])


def rope_inv_freq(config: ModelConfig, max_positions: int | None = None) -> torch.Tensor:
    """Rotary frequencies [head_dim / 2], with llama3 / linear / yarn / LongRoPE scaling applied
    (LongRoPE's by the engine's context, max_positions; a GGUF's factors come as tensors instead,
    Transformer.load_weights). With partial RoPE, the rotated share's, then 0s (partial_rotary_order)."""
    if config.partial_rotary_factor != 1.0:
        rotated = int(config.head_dim * config.partial_rotary_factor)
        inv_freq = rope_inv_freq(dataclasses.replace(config, head_dim=rotated, partial_rotary_factor=1.0), max_positions)
        return torch.cat([inv_freq, torch.zeros(config.head_dim // 2 - rotated // 2, device="cpu")])
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    kind = _rope_kind(config)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "proportional":  # gemma4's full layers: the head's first frequencies, the others 0 (not turned)
        turned = int(float(scaling.get("partial_rotary_factor", 1.0)) * dim // 2)
        inv_freq[turned:] = 0.0
        return inv_freq / float(scaling.get("factor", 1.0))
    if kind == "longrope":
        factors = scaling.get(longrope_factors(config, max_positions or config.max_position_embeddings))
        return inv_freq if factors is None else inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu")
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, config)
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
        return torch.where(medium, smoothed, scaled)
    raise ModelLoadError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3, yarn, longrope, "
                         "proportional)")


def _yarn_factor(config: ModelConfig) -> float:
    scaling = config.rope_scaling
    return float(scaling.get("factor") or config.max_position_embeddings / scaling["original_max_position_embeddings"])


def _yarn_inv_freq(inv_freq: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """YaRN as transformers computes it: the original frequencies where a dimension turns more than
    beta_fast times over the original context, divided by the factor where it turns less than
    beta_slow times, and a linear ramp between."""
    scaling, dim = config.rope_scaling, config.head_dim
    old_context = float(scaling["original_max_position_embeddings"])

    def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times over old_context
        return dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(config.rope_theta))

    low, high = dimension(float(scaling.get("beta_fast") or 32)), dimension(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((ramp - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    return inv_freq / _yarn_factor(config) * ramp + inv_freq * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `factor` times the original."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by: LongRoPE's or YaRN's attention factor (transformers'
    rules; LongRoPE's is worked out when the config is read), else 1."""
    kind, scaling = _rope_kind(config), config.rope_scaling
    if kind == "longrope":
        return float(scaling["attention_factor"])
    if kind != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = _yarn_factor(config), scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


class RotaryEmbedding(nn.Module):
    """HF's rotate-half RoPE over a precomputed cos/sin table (both scaled by LongRoPE's attention factor)."""

    def __init__(self, config: ModelConfig, max_positions: int, ops: Backend, inv_freq: torch.Tensor | None = None):
        super().__init__()
        self.ops = ops
        self.inv_freq = rope_inv_freq(config, max_positions) if inv_freq is None else inv_freq  # [head_dim / 2]
        self.attention_factor = rope_attention_factor(config) if inv_freq is None else 1.0
        self.max_positions = max_positions
        self._set_table(self.inv_freq)
        # M-RoPE (qwen3_vl): which of a token's positions (0 time, 1 height, 2 width) each frequency turns by
        # (a buffer: on the model's device, so that a decode step's CUDA graph copies nothing from the host)
        self.register_buffer("mrope_axes", None, persistent=False)
        if config.mrope_section is not None:
            self.mrope_axes = mrope_axes(config.mrope_section, len(self.inv_freq))

    def set_frequency_factors(self, factors: torch.Tensor) -> None:
        """llama.cpp's rope_freqs tensor: divisors of the base frequencies."""
        self._set_table(self.inv_freq / factors.float())

    def _set_table(self, inv_freq: torch.Tensor) -> None:
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        # [max_positions, head_dim / 2]; buffers so that .to(device) moves them
        self.register_buffer("cos", freqs.cos() * self.attention_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * self.attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """What the backend's rope_and_store_kv needs of positions [T] (M-RoPE: [3, T], each token's time,
        height and width positions): looked up once per step, used by every layer."""
        return self.ops.rotary(*self.tables(positions), dtype)

    def tables(self, positions: torch.Tensor | np.ndarray):
        """(cos, sin, rows): float32 tables [R, head_dim / 2] and each token's row in them ([T], the type of
        positions): the whole tables and the positions themselves, or with M-RoPE the step's own tables (each
        frequency's angle at the position of its axis) and rows 0..T-1."""
        if self.mrope_axes is None:
            return self.cos, self.sin, positions
        given = torch.as_tensor(positions)
        step_rows = given[self.mrope_axes.to(given.device)].T
        columns = torch.arange(step_rows.shape[1], device=step_rows.device)
        rows = torch.arange(len(step_rows), device=step_rows.device)
        return (self.cos[step_rows, columns], self.sin[step_rows, columns],
                rows.numpy() if isinstance(positions, np.ndarray) else rows)


def mrope_axes(section: tuple[int, int, int], half: int) -> torch.Tensor:
    """Interleaved M-RoPE's axis of each of the half head's frequencies (transformers' Qwen3-VL): frequency
    j turns by the height position where j % 3 == 1 and j < 3 * section[1], by the width position where
    j % 3 == 2 and j < 3 * section[2], else by the time position."""
    j = torch.arange(half, device="cpu")
    axes = torch.zeros(half, dtype=torch.int64, device="cpu")
    for axis in (1, 2):
        axes[(j % 3 == axis) & (j < 3 * section[axis])] = axis
    return axes
