"""The layers of hybrid models that keep a fixed-size state per sequence instead of K/V per token:
LFM2's short convolution, Qwen3.5's Gated DeltaNet and Mamba2 (Granite 4.0-H, Nemotron-H). They take
an attention layer's place in a DecoderLayer (hearth/model/transformer.py) and its call: (x, rotary
(unused), the layer's cache, meta); their cache is the layer's state in the state cache (the runner allocates it,
ModelConfig.state_shapes), and meta.state says each sequence's slot in it. The backend computes the
convolution, the delta rule and Mamba2's scan (hearth/backend/state_ops.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hearth.backend.base import Backend
from hearth.config import ModelConfig
from hearth.model.layers import Linear, MergedLinear, RMSNorm


class ConvWeight(nn.Module):
    """A depthwise Conv1d's parameters as checkpoints store them: weight [channels, 1, kernel], bias [channels]."""

    def __init__(self, channels: int, kernel: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None


class ShortConv(nn.Module):
    """LFM2's gated short convolution: in_proj makes B, C and x; y = C * conv(B * x), a causal
    depthwise convolution of conv_kernel_size taps; then out_proj. State: the convolution's window."""

    rope_index = 0  # (Transformer.ropes: unused)

    def __init__(self, config: ModelConfig, ops: Backend):
        super().__init__()
        self.ops = ops
        hidden, bias = config.hidden_size, config.conv_bias
        self.in_proj = Linear(hidden, 3 * hidden, bias)
        self.conv = ConvWeight(hidden, config.conv_kernel_size, bias)
        self.out_proj = Linear(hidden, hidden, bias)

    def forward(self, x: torch.Tensor, rotary, state: tuple[torch.Tensor], meta) -> torch.Tensor:  # [T, hidden]
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        y = self.ops.causal_conv1d(b * h, state[0], self.conv.weight[:, 0], self.conv.bias, meta.state)
        return self.out_proj(c * y)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear attention: q, k and v through a causal depthwise convolution (SiLU), q and k
    L2-normalised (q scaled by key_dim ** -0.5), the gated delta rule with decay exp(g), g =
    -exp(A_log) softplus(a + dt_bias), and beta = sigmoid(b); its output RMS-normed per head and gated
    by SiLU(z), then out_proj. State: the convolution's window and the delta rule's [v heads, dk, dv]."""

    rope_index = 0  # (Transformer.ropes: unused)

    def __init__(self, config: ModelConfig, ops: Backend):
        super().__init__()
        self.ops = ops
        self.key_heads, self.value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.tiled = config.linear_value_heads_tiled
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.split = [keys, keys, values]
        self.in_proj = MergedLinear(config.hidden_size, {"in_proj_qkv": 2 * keys + values, "in_proj_z": values,
                                                         "in_proj_b": self.value_heads, "in_proj_a": self.value_heads})
        self.conv1d = ConvWeight(2 * keys + values, config.conv_kernel_size, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.value_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.value_heads), requires_grad=False)
        self.norm = RMSNorm(self.value_dim, config.rms_norm_eps, ops)  # weights as they are (no 1 + w)
        self.out_proj = Linear(values, config.hidden_size)
        self.backend_state: dict = {}  # what the backend derives from the weights (emptied when they move)

    def _apply(self, fn, recurse=True):
        self.backend_state.clear()  # weight pointers change when tensors move
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor, rotary, state: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor:
        qkv, z, b, a = self.in_proj(x)
        out = self.ops.gated_delta_net_step(self, qkv, z, b, a, state, meta.state)  # a decode step's kernel
        return self.out_proj(self._mix(qkv, z, b, a, state, meta.state) if out is None else out)

    def _mix(self, qkv, z, b, a, state: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor:
        """in_proj's outputs to out_proj's input [T, value heads x value dim] in torch ops, the
        convolution and the delta rule the backend's."""
        tokens = qkv.shape[0]
        qkv = self.ops.causal_conv1d(qkv, state[0], self.conv1d.weight[:, 0], None, meta, "silu")
        q, k, v = qkv.float().split(self.split, dim=-1)
        q, k = (_l2_normalised(t.reshape(tokens, self.key_heads, self.key_dim)) for t in (q, k))
        if self.value_heads != self.key_heads:  # each key head serves a run of value heads (or every n-th: tiled)
            per_key = self.value_heads // self.key_heads
            q, k = (t.repeat(1, per_key, 1) if self.tiled else t.repeat_interleave(per_key, dim=1) for t in (q, k))
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # [T, v heads]
        out = self.ops.gated_delta_rule(q * self.key_dim**-0.5, k, v.reshape(tokens, self.value_heads, -1), g,
                                        b.float().sigmoid(), state[1], meta)
        out = self.norm(out.to(z.dtype)) * F.silu(z.float().view_as(out)).to(z.dtype)
        return out.reshape(tokens, -1)


class Mamba2(nn.Module):
    """Mamba2's mixer: in_proj makes a gate z, the convolution's input (x, then B and C of each of `groups`
    groups) and dt per head; x, B and C through a causal depthwise convolution (SiLU); per head, dt =
    softplus(dt + dt_bias) clamped to time_step_limit, the selective scan with decay exp(dt A), A =
    -exp(A_log), inputs dt x, keys B and queries C of the head's group, plus D x; then RMS-normed in
    `groups` groups after the gate's SiLU (transformers' gated RMSNorm, norm_before_gate=False), and
    out_proj. State: the convolution's window and the scan's [heads, state size, head dim]."""

    rope_index = 0  # (Transformer.ropes: unused)

    def __init__(self, config: ModelConfig, ops: Backend):
        super().__init__()
        self.ops = ops
        self.heads, self.head_dim, self.groups = config.mamba_num_heads, config.mamba_head_dim, config.mamba_groups
        self.state_size, self.eps, self.dt_limit = config.ssm_state_size, config.rms_norm_eps, config.time_step_limit
        inner, conv = self.heads * self.head_dim, self.heads * self.head_dim + 2 * self.groups * self.state_size
        self.split = [inner, conv, self.heads]
        self.in_proj = Linear(config.hidden_size, inner + conv + self.heads, config.mamba_proj_bias)
        self.conv1d = ConvWeight(conv, config.conv_kernel_size, config.conv_bias)
        self.dt_bias, self.A_log, self.D = (nn.Parameter(torch.empty(self.heads), requires_grad=False)
                                            for _ in range(3))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(inner), requires_grad=False)
        self.out_proj = Linear(inner, config.hidden_size, config.mamba_proj_bias)

    def forward(self, x: torch.Tensor, rotary, state: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor:
        tokens, per_group = x.shape[0], self.heads // self.groups
        z, xbc, dt = self.in_proj(x).split(self.split, dim=-1)
        xbc = self.ops.causal_conv1d(xbc, state[0], self.conv1d.weight[:, 0], self.conv1d.bias, meta.state, "silu")
        xs, b, c = xbc.float().split([self.split[0], *[self.groups * self.state_size] * 2], dim=-1)
        b, c = (t.reshape(tokens, self.groups, self.state_size).repeat_interleave(per_group, dim=1) for t in (b, c))
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)  # [T, heads]
        xs = xs.reshape(tokens, self.heads, self.head_dim)
        y = self.ops.ssm_scan(c, b, xs * dt[..., None], dt * -self.A_log.float().exp(), state[1], meta.state)
        y = (y + xs * self.D.float()[:, None]).reshape(tokens, -1) * F.silu(z.float())
        y = y.view(tokens, self.groups, -1)
        y = (y * torch.rsqrt(y.square().mean(-1, keepdim=True) + self.eps)).view(tokens, -1)
        return self.out_proj((self.norm.weight.float() * y).to(x.dtype))


def _l2_normalised(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dimension (the delta rule's q and k normalisation)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)
