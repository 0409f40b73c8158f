"""Checkpoints quantized by a library (config.json's quantization_config), read into hearth's weights.

GPTQ (AutoGPTQ / GPTQModel, 2, 4 or 8 bits) and AWQ (AutoAWQ's GEMM layout, 4 bits) store a weight
W [out, in] as integers q, a zero point z and a float16 scale s per (group of `group_size` input
columns, output row): W[o, i] = s[g(i), o] * (q[i, o] - z[g(i), o]). The integer q - z times a
float16 scale is exactly a GGUF block of 32 values d * (code - offset) with d = s, where the 32
columns share a group: Q4_0 when q - z lies in [-8, 7] (symmetric 4-bit: z = 8), Q5_0 in [-16, 15]
(4-bit with zero points), Q8_0 in [-128, 127] (8-bit). Those blocks are the weight, multiplied by the
backends' block kernels: 4.5 bits a weight for symmetric GPTQ, 5.5 with zero points.

GPTQ's act-order (desc_act) assigns columns to groups by g_idx in any order: the columns are stored
sorted by group (QuantTensor.column_order) and each matmul takes its input in that order.
A scale that float16 cannot hold exactly (bf16 scales out of its range), groups that do not fill
whole blocks of 32 or levels beyond Q8_0's [-128, 127] (8-bit with zero points far from 128) fall
back to the dense matrix, computed exactly in float32.

fp8 (transformers' FineGrainedFP8: float8_e4m3fn weights times `weight_scale_inv` per block of
weight_block_size, per row or per tensor) is dequantized at load into the model's dtype.

Packing, as AutoGPTQ / AutoAWQ write it: a little-endian int32 holds 32 / bits values, value k at
bits [k * bits, (k + 1) * bits). GPTQ's qweight [in * bits / 32, out] packs along the input,
its qzeros [groups, out * bits / 32] along the output, storing z - 1 (checkpoint_format "gptq";
"gptq_v2" stores z); AWQ packs qweight [in, out / 8] and qzeros [groups, out / 8] along the output,
value k of a word being column AWQ_ORDER[k] of its 8.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from hearth.errors import ModelLoadError
from hearth.quant.tensor import QuantTensor

logger = logging.getLogger("hearth")
Q = GGMLQuantizationType

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: word value k is column AWQ_ORDER[k]
# block formats d * (code - offset) of 32 values: (qtype, offset, largest code)
_BLOCK_FORMATS = ((Q.Q4_0, 8, 15), (Q.Q5_0, 16, 31), (Q.Q8_0, 128, 255))
_BLOCK = 32


@dataclass(frozen=True)
class IntegerScheme:
    """What quantization_config says of a GPTQ or AWQ checkpoint."""

    method: str  # "gptq" or "awq"
    bits: int
    group_size: int  # -1: one group over the whole input
    zero_offset: int  # added to the stored zero points (GPTQ v1: 1)


def read_scheme(config: dict[str, Any], where: str) -> IntegerScheme | dict[str, Any]:
    """The checkpoint's quantization_config checked: an IntegerScheme (GPTQ, AWQ) or the fp8 config."""
    method = config.get("quant_method")
    if method == "fp8":
        if config.get("activation_scheme", "dynamic") != "dynamic":
            raise ModelLoadError(f"{where}: fp8 with activation_scheme {config['activation_scheme']!r} is not read "
                                 "by hearth (its weights with dynamic activation scaling are)")
        return config
    bits, group_size = config.get("bits", config.get("w_bit")), config.get("group_size", config.get("q_group_size"))
    if bits not in ((2, 4, 8) if method == "gptq" else (4,)):
        raise ModelLoadError(f"{where}: {method} with bits={bits!r} is not read by hearth "
                             f"(it reads {'2, 4 and 8' if method == 'gptq' else '4'} bits)")
    if not isinstance(group_size, int) or not (group_size == -1 or (group_size > 0 and group_size % _BLOCK == 0)):
        raise ModelLoadError(f"{where}: {method} group_size={group_size!r} is not read by hearth "
                             "(-1 or a multiple of 32)")
    if method == "awq":
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelLoadError(f"{where}: AWQ version {version!r} is not read by hearth (its GEMM layout is: "
                                 "version 'gemm')")
        return IntegerScheme("awq", 4, group_size, 0)
    layout = config.get("checkpoint_format", "gptq")
    if layout not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"{where}: GPTQ checkpoint_format {layout!r} is not read by hearth ('gptq', 'gptq_v2')")
    return IntegerScheme("gptq", bits, group_size, 1 if layout == "gptq" else 0)


def read_library_weights(weights: dict[str, torch.Tensor], config: dict[str, Any], where: str
                         ) -> dict[str, torch.Tensor | QuantTensor]:
    """`weights` (by HF name) with each quantized projection's packed tensors replaced by its `.weight`."""
    scheme = read_scheme(config, where)
    out: dict[str, torch.Tensor | QuantTensor] = {}
    suffix = ".weight_scale_inv" if isinstance(scheme, dict) else ".qweight"
    prefixes = [name.removesuffix(suffix) for name in weights if name.endswith(suffix)]
    if not prefixes:  # its weights are unquantized, or named as no documented layout names them
        raise ModelLoadError(f"{where}: quantization_config names {config.get('quant_method')!r}, but the checkpoint "
                             f"holds no {suffix.lstrip('.')} tensors: not a checkpoint of that library's layout")
    packed = {f"{p}.{part}" for p in prefixes for part in
              (("weight", "weight_scale_inv") if isinstance(scheme, dict) else ("qweight", "qzeros", "scales", "g_idx"))}
    for prefix in prefixes:
        try:
            out[f"{prefix}.weight"] = fp8_weight(weights, prefix, scheme) if isinstance(scheme, dict) \
                else integer_weight(weights, prefix, scheme)
        except (KeyError, ValueError) as e:
            raise ModelLoadError(f"{where}: {prefix}: not a {config.get('quant_method')} weight as documented "
                                 f"({e})") from None
    out.update((name, tensor) for name, tensor in weights.items() if name not in packed)
    return out


def _unpack(words: torch.Tensor, bits: int, axis: int) -> np.ndarray:
    """int32 words -> uint8 values, each word's 32 / bits values laid out along `axis` (0 or 1) in bit order."""
    w = words.numpy().view(np.uint32)
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    values = ((w[..., None] >> shifts) & ((1 << bits) - 1)).astype(np.uint8)  # [r, c, per]
    if axis == 1:
        return values.reshape(w.shape[0], -1)
    return values.transpose(0, 2, 1).reshape(-1, w.shape[1])


def integer_weight(weights: dict[str, torch.Tensor], prefix: str, scheme: IntegerScheme) -> QuantTensor | torch.Tensor:
    """The weight [out, in] of a GPTQ / AWQ projection: GGUF blocks where exact, else dense float32."""
    scales = weights[f"{prefix}.scales"]
    zeros = _unpack(weights[f"{prefix}.qzeros"], scheme.bits, 1)
    if scheme.method == "awq":
        q = _unpack(weights[f"{prefix}.qweight"], scheme.bits, 1)
        inverse = np.argsort(AWQ_ORDER)  # column j of 8 is word value inverse[j]
        q = q.reshape(q.shape[0], -1, 8)[:, :, inverse].reshape(q.shape[0], -1)
        zeros = zeros.reshape(zeros.shape[0], -1, 8)[:, :, inverse].reshape(zeros.shape[0], -1)
    else:
        q = _unpack(weights[f"{prefix}.qweight"], scheme.bits, 0)
    cols, rows = q.shape
    group_size = cols if scheme.group_size == -1 else scheme.group_size
    g_idx = weights.get(f"{prefix}.g_idx")
    groups = np.arange(cols) // group_size if g_idx is None else g_idx.numpy().astype(np.int64)
    if scales.shape != (math.ceil(cols / group_size), rows) or zeros.shape != scales.shape or groups.shape != (cols,):
        raise ValueError(f"shapes qweight {tuple(q.shape)}, scales {tuple(scales.shape)}, "
                         f"qzeros unpacked {zeros.shape}, g_idx {groups.shape} disagree")
    levels = q.astype(np.int16) - (zeros.astype(np.int16) + scheme.zero_offset)[groups]  # [in, out]
    order = np.argsort(groups, kind="stable")
    blocks = _blocks(levels[order].T, scales.float(), groups[order])
    if blocks is None:
        logger.warning("%s: %s weight kept dense (float32): its scales, groups or levels fit no block format",
                       prefix, scheme.method)
        return scales.float()[torch.from_numpy(groups)].T * torch.from_numpy(levels.T.astype(np.float32))
    trivial = np.array_equal(order, np.arange(cols))
    return QuantTensor(blocks[0], blocks[1], (rows, cols), None if trivial else torch.from_numpy(order))


def _blocks(levels: np.ndarray, scales: torch.Tensor, groups: np.ndarray) -> tuple[torch.Tensor, Q] | None:
    """levels int16 [out, in] (column i in group groups[i]) times scales float32 [groups, out] as GGUF
    blocks of 32 columns (uint8 [out, bytes a row] and their format), or None where no block format
    holds them exactly."""
    rows, cols = levels.shape
    if cols % _BLOCK or np.any(groups.reshape(-1, _BLOCK) != groups[::_BLOCK, None]):
        return None
    d = scales[torch.from_numpy(groups[::_BLOCK])].T.contiguous()  # [out, in / 32]
    half = d.half()
    if not torch.equal(half.float(), d):
        return None
    low, high = int(levels.min(initial=0)), int(levels.max(initial=0))
    fitting = [f for f in _BLOCK_FORMATS if -f[1] <= low and high <= f[2] - f[1]]
    if not fitting:  # 8-bit with zero points: q - z spans [-255, 255]
        return None
    qtype, offset, _ = fitting[0]
    codes = (levels + offset).astype(np.uint8).reshape(rows, cols // _BLOCK, _BLOCK)
    scale_bytes = half.numpy().view(np.uint8).reshape(rows, -1, 2)
    if qtype == Q.Q8_0:
        body = (codes.astype(np.int16) - offset).astype(np.int8).view(np.uint8)
    else:  # Q4_0 / Q5_0: value j's low nibble in byte j % 16, low half (j < 16) first
        nibbles = (codes[..., :16] & 0x0F) | ((codes[..., 16:] & 0x0F) << 4)
        body = nibbles
        if qtype == Q.Q5_0:  # then bit j of a little-endian uint32 is value j's fifth bit
            high_bits = ((codes >> 4) & 1).astype(np.uint32) << np.arange(_BLOCK, dtype=np.uint32)
            body = np.concatenate([high_bits.sum(axis=-1, dtype=np.uint32)[..., None].view(np.uint8), nibbles], -1)
    data = np.concatenate([scale_bytes, body], axis=-1).reshape(rows, -1)
    return torch.from_numpy(np.ascontiguousarray(data)), qtype


def fp8_weight(weights: dict[str, torch.Tensor], prefix: str, config: dict[str, Any]) -> torch.Tensor:
    """The dense float32 weight of an fp8 projection: e4m3 values times their block's (row's, tensor's) scale."""
    weight, scale = weights[f"{prefix}.weight"], weights[f"{prefix}.weight_scale_inv"].float()
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight of dtype {weight.dtype}, not float8_e4m3fn")
    rows, cols = weight.shape
    block = config.get("weight_block_size")
    if scale.numel() == 1:
        scale = scale.reshape(())
    elif block is not None and scale.shape == (math.ceil(rows / block[0]), math.ceil(cols / block[1])):
        scale = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    elif block is None and scale.numel() == rows:
        scale = scale.reshape(rows, 1)
    else:
        raise ValueError(f"weight_scale_inv of shape {tuple(scale.shape)} for a {rows}x{cols} weight "
                         f"(weight_block_size {block})")
    return weight.float() * scale
