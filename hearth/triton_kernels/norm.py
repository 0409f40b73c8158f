"""RMSNorm, with the residual add fused into the same pass over the row.

norm(v) = v * rsqrt(mean(v^2) + eps) * (weight + weight_offset), all in float32, rounded once to
x's dtype (gemma stores weight - 1 and passes weight_offset = 1). Given the residual stream, the
kernel first forms s = residual + x (rounded to x's dtype, as a separate torch add would), writes
s back into the residual in place and normalizes s: the decoder layer's add costs no extra pass.

Rows may be strided (a [T, hidden] view) and x may be [T, heads, head_dim] (q/k norms over a view
of a merged projection): a row's elements are contiguous, rows are addressed by two strides. A
program normalizes BLOCK_ROWS rows of the whole row width (hidden <= 8192 or so fits a tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ELEMENTS = 2048  # rows per program: as many as fill a tile of this size (at least one)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    rows, inner, stride_outer, stride_inner, eps, weight_offset,
    N: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BLOCK_ROWS]
    c = tl.arange(0, BLOCK_N)
    mask = (r < rows)[:, None] & (c < N)[None, :]
    x_offsets = (r // inner) * stride_outer + (r % inner) * stride_inner
    x = tl.load(x_ptr + x_offsets[:, None] + c[None, :], mask=mask, other=0.0)  # [BLOCK_ROWS, BLOCK_N]
    dense = r[:, None] * N + c[None, :]  # residual and output are contiguous
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + dense, mask=mask, other=0.0)
        x = (residual.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + dense, x.to(residual_ptr.dtype.element_ty), mask=mask)
    x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 1) / N + eps)  # [BLOCK_ROWS]
    w = tl.load(weight_ptr + c, mask=c < N, other=0.0).to(tl.float32) + weight_offset
    y = x * inv_rms[:, None] * w[None, :]
    tl.store(out_ptr + dense, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [T, hidden] or [T, heads, head_dim], last dim contiguous
    weight: torch.Tensor,  # [hidden]
    eps: float,
    weight_offset: float = 0.0,
    residual: torch.Tensor | None = None,  # contiguous, x's shape: updated in place to residual + x
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) as a new contiguous tensor in x.dtype; with `residual`, (norm(residual + x), residual)
    after writing residual + x into `residual`."""
    assert x.dim() in (2, 3) and x.stride(-1) == 1, "x must be [T, N] or [T, H, N] with contiguous rows"
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.is_contiguous()
    if residual is not None:
        assert residual.shape == x.shape and residual.is_contiguous()
    inner, stride_inner = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    rows = x.numel() // n
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out if residual is None else (out, residual)
    block_n = triton.next_power_of_2(n)
    block_rows = max(1, TILE_ELEMENTS // block_n)
    _rms_norm_kernel[(triton.cdiv(rows, block_rows),)](
        x, residual if residual is not None else x, weight, out,
        rows, inner, x.stride(0), stride_inner, float(eps), float(weight_offset),
        N=n, HAS_RESIDUAL=residual is not None, BLOCK_ROWS=block_rows, BLOCK_N=block_n,
        num_warps=min(8, max(1, block_n * block_rows // 512)),
    )
    return out if residual is None else (out, residual)
