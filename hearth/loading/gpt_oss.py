"""gpt-oss's checkpoint layout in hearth's names. transformers' gpt_oss keeps a layer's experts fused,
transposed against nn.Linear's layout: gate_up_proj [experts, hidden, 2 x inter] with gate and up
interleaved by column (gate the even ones), down_proj [experts, inter, hidden], and their biases
beside (gate_up_proj_bias [experts, 2 x inter], down_proj_bias [experts, hidden]); its router is
`router`. hearth's SparseMoE has a GatedMLP per expert and names its router `gate`.

OpenAI's released checkpoints keep the experts' weights in MXFP4 (quantization_config mxfp4):
`{proj}_blocks` uint8 [experts, out, in / 32, 16], two 4-bit codes a byte (element 2j in the low
nibble, 2j + 1 in the high one), and `{proj}_scales` uint8 [experts, out, in / 32], each block's
power of two (E8M0). They become GGUF's MXFP4 blocks (the scale byte, then 16 bytes with element j
in the low nibble and j + 16 in the high one: llama.cpp's repacking), kept in 4 bits."""

from __future__ import annotations

import re

import torch
from gguf import GGMLQuantizationType

from hearth.errors import ModelLoadError
from hearth.quant import QuantTensor

_FUSED = re.compile(r"(model\.layers\.\d+\.mlp)\.(?:experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?"
                    r"|router\.(weight|bias))")


def split_fused_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | QuantTensor]:
    """`weights` with each layer's fused experts split into one gate_proj, up_proj and down_proj
    (weights and biases) per expert, and the router under hearth's name."""
    out: dict[str, torch.Tensor | QuantTensor] = {}
    for name, tensor in weights.items():
        m = _FUSED.fullmatch(name)
        if m is None:
            out[name] = tensor
            continue
        prefix, projection, suffix, router = m.groups()
        if router is not None:
            out[f"{prefix}.gate.{router}"] = tensor
        elif suffix == "_scales":
            continue  # read with its blocks
        elif suffix == "_blocks":
            _put(out, prefix, projection, "weight", _mxfp4_rows(name, tensor, weights))
        else:
            bias = suffix == "_bias"
            if tensor.dim() != (2 if bias else 3):
                raise ModelLoadError(f"tensor {name}: shape {tuple(tensor.shape)}, expected {2 if bias else 3} "
                                     "dimensions (the experts stacked)")
            stacked = tensor if bias else tensor.transpose(-1, -2)  # [experts, out, in] or [experts, out]
            _put(out, prefix, projection, "bias" if bias else "weight",
                 [stacked[expert].contiguous() for expert in range(stacked.shape[0])])
    return out


def _put(out: dict, prefix: str, projection: str, attr: str, per_expert: list) -> None:
    """Each expert's rows of `projection` (gate_up's: gate the even rows, up the odd ones) under hearth's names."""
    for expert, rows in enumerate(per_expert):
        parts = {"down_proj": rows} if projection == "down_proj" else \
            {"gate_proj": _every_other_row(rows, 0), "up_proj": _every_other_row(rows, 1)}
        for part, value in parts.items():
            out[f"{prefix}.experts.{expert}.{part}.{attr}"] = value


def _every_other_row(rows: torch.Tensor | QuantTensor, first: int) -> torch.Tensor | QuantTensor:
    if isinstance(rows, QuantTensor):
        return rows.rows(torch.arange(first, rows.shape[0], 2))
    return rows[first::2].contiguous()


def _mxfp4_rows(name: str, blocks: torch.Tensor, weights: dict[str, torch.Tensor]) -> list[QuantTensor]:
    """Per expert, its weight [out, in] in GGUF's MXFP4 blocks, out of OpenAI's blocks and scales."""
    scales = weights.get(name.replace("_blocks", "_scales"))
    if scales is None:
        raise ModelLoadError(f"missing tensor {name.replace('_blocks', '_scales')}")
    if blocks.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != 16 or \
            scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ModelLoadError(f"tensor {name}: {blocks.dtype} {tuple(blocks.shape)} with scales {scales.dtype} "
                             f"{tuple(scales.shape)}: expected uint8 [experts, rows, blocks, 16] and [experts, rows, blocks]")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., 32] in element order
    gguf = torch.cat([scales.unsqueeze(-1), codes[..., :16] | (codes[..., 16:] << 4)], dim=-1)  # [..., 17]
    experts, rows, groups = scales.shape
    return [QuantTensor(expert.contiguous(), GGMLQuantizationType.MXFP4, (rows, groups * 32))
            for expert in gguf.reshape(experts, rows, groups * 17)]
