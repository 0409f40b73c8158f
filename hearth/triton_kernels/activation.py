"""The gated MLP's activation: act(gate) * up in one pass, computed in float32.

gate and up are usually the two halves of one [T, 2I] matmul output, so both are strided views
(row stride 2I, last dim contiguous); the product comes back as a new contiguous [T, I] tensor in
gate's dtype. Activations: "silu" (llama, qwen), "gelu_tanh" (gemma's tanh approximation) and
"gelu" (exact, erf).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
BLOCK = 1024  # columns per program, at most
TILE_ELEMENTS = 4096  # rows per program: as many as fill a tile of this size (at least one)
SQRT_HALF = tl.constexpr(0.7071067811865476)
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _act_and_mul_kernel(gate_ptr, up_ptr, out_ptr, tokens, width, stride_gate, stride_up,
                        ACTIVATION: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    t = (tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS))[:, None]  # [BLOCK_ROWS, 1]
    c = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (t < tokens) & (c < width)
    g = tl.load(gate_ptr + t * stride_gate + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + t * stride_up + c, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == "silu":
        a = g * tl.sigmoid(g)
    elif ACTIVATION == "gelu":
        a = 0.5 * g * (1.0 + tl.erf(g * SQRT_HALF))
    else:  # gelu_tanh, with tanh(y) = 2 sigmoid(2y) - 1 (saturates cleanly at both ends)
        y = SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        a = g * tl.sigmoid(2.0 * y)  # = 0.5 g (1 + tanh(y))
    tl.store(out_ptr + t * width + c, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for gate, up [T, I] (rows may be strided); returns [T, I] in gate.dtype."""
    assert activation in ACTIVATIONS, f"unknown activation {activation!r}"
    assert gate.dim() == 2 and gate.shape == up.shape and gate.stride(1) == 1 and up.stride(1) == 1
    tokens, width = gate.shape
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(width))
    block_rows = max(1, TILE_ELEMENTS // block)
    _act_and_mul_kernel[(triton.cdiv(tokens, block_rows), triton.cdiv(width, block))](
        gate, up, out, tokens, width, gate.stride(0), up.stride(0), ACTIVATION=activation, BLOCK_ROWS=block_rows,
        BLOCK=block, num_warps=4,
    )
    return out
