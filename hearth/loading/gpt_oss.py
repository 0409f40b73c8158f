"""gpt-oss's checkpoint layout in hearth's names. transformers' gpt_oss keeps a layer's experts fused,
transposed against nn.Linear's layout: gate_up_proj [experts, hidden, 2 x inter] with gate and up
interleaved by column (gate the even ones), down_proj [experts, inter, hidden], and their biases
beside (gate_up_proj_bias [experts, 2 x inter], down_proj_bias [experts, hidden]); its router is
`router`. hearth's SparseMoE has a GatedMLP per expert and names its router `gate`."""

from __future__ import annotations

import re

import torch

from hearth.errors import ModelLoadError

_FUSED = re.compile(r"(model\.layers\.\d+\.mlp)\.(?:experts\.(gate_up_proj|down_proj)(_bias)?|router\.(weight|bias))")


def split_fused_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` with each layer's fused experts split into one gate_proj, up_proj and down_proj
    (weights and biases) per expert, and the router under hearth's name."""
    out = {}
    for name, tensor in weights.items():
        m = _FUSED.fullmatch(name)
        if m is None:
            out[name] = tensor
            continue
        prefix, projection, bias, router = m.groups()
        if router is not None:
            out[f"{prefix}.gate.{router}"] = tensor
            continue
        if tensor.dim() != (2 if bias else 3):
            raise ModelLoadError(f"tensor {name}: shape {tuple(tensor.shape)}, expected {2 if bias else 3} dimensions "
                                 "(the experts stacked)")
        attr = "bias" if bias else "weight"
        stacked = tensor if bias else tensor.transpose(-1, -2)  # [experts, out, in] or [experts, out]
        parts = {"down_proj": stacked} if projection == "down_proj" else \
            {"gate_proj": stacked[:, 0::2], "up_proj": stacked[:, 1::2]}
        for part, rows in parts.items():
            for expert in range(rows.shape[0]):
                out[f"{prefix}.experts.{expert}.{part}.{attr}"] = rows[expert].contiguous()
    return out
