"""Triton quantized matmul: every kernel against gguf's own dequantizer and a float64 matmul.

Q8_0/Q4_0/Q5_0 blocks come from gguf's quantizer; gguf has none for Q4_K/Q5_K/Q6_K, so their blocks
are random bytes (every code, scale and min bit pattern) with realistic float16 super-block
scales. Without a GPU the kernels run in Triton's interpreter (tests/conftest.py).

Error bounds, per output, with S = sum_k |w_k| |x_k| and ref the float64 product of the exact
weights with x:
- GEMV: weights dequantized exactly, fp32 products and sums: |y - ref| <= K 2^-24 S.
- tl.dot kernel: the weight rounded to x's dtype (bf16: 2^-8, f16: 2^-11 relative, plus f16's
  subnormal step 2^-25 absolute), float32 x in tf32 (both operands, possibly truncated: 2^-9),
  then the same fp32 accumulation term.
- A bf16/f16 output adds its own rounding: 2^-8 / 2^-11 of |y|.
Triton's interpreter converts float32 to bf16 by truncation, not to nearest: there a bf16
rounding costs up to 2^-7. And it multiplies bf16 tl.dot operands as their raw uint16 bits
(numpy has no bf16): `_interpreter_bf16_dot` widens them to float32 first (exact), as a GPU's
bf16 tensor cores do.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import triton.language as tl
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as gguf_quants

import itertools

from hearth.triton_kernels.quant_matmul import (GEMV_CANDIDATES, GEMV_CONFIGS, GEMV_MAX_M, SUPPORTED_QTYPES, GemvConfig,
                                                TritonQuantWeight, shape_class)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, K = 103, 512  # N no multiple of any tile; K two K-quant super-blocks, 16 Q8_0/Q4_0 blocks
# byte offsets of each K-quant block's float16 super-block scales, and their ranges (|w| ~ 0.01-0.1)
_KQUANT_F16 = {Q.Q4_K: ((0, 2), 1e-4), Q.Q5_K: ((0, 2), 5e-5), Q.Q6_K: ((208,), 2e-5)}
# packed bytes per block after repacking / in the file
_RATIO = {Q.Q8_0: 1.0, Q.Q4_0: 1.0, Q.Q5_0: 1.0, Q.Q4_K: 148 / 144, Q.Q5_K: 180 / 176, Q.Q6_K: 1.0}
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_BF16_UNIT = 2.0 ** -7 if INTERPRETED else 2.0 ** -8
_UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: _BF16_UNIT, torch.float16: 2.0 ** -11}
# Q5_0 (GPTQ / AWQ weights with zero points) is Q4_0's path plus a bit plane: its dequantization and a
# GEMV and a tl.dot product are checked, not every dtype, row count and launch (the interpreter's time)
SWEPT_QTYPES = tuple(q for q in SUPPORTED_QTYPES if q != Q.Q5_0)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the GEMV's 1, 4 (3 used) and 8 rows; one tl.dot tile of 32 (two tiles of 128: test_matmul_over_two_row_tiles)
MATMUL_CASES = [*itertools.product(SWEPT_QTYPES, [1, 3, GEMV_MAX_M, 17], DTYPES),
                (Q.Q5_0, 3, torch.bfloat16), (Q.Q5_0, 17, torch.float16)]


pytestmark = pytest.mark.usefixtures("interpreter_bf16_dot")


def make_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """Real GGUF blocks, uint8 [rows, bytes_per_row]."""
    rng = np.random.default_rng(seed)
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q5_0):
        return gguf_quants.quantize((rng.standard_normal((rows, cols)) * 0.02).astype(np.float32), qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    offsets, scale = _KQUANT_F16[qtype]
    for offset in offsets:
        d = rng.uniform(0.1, 1.0, blocks.shape[0]) * scale * rng.choice([-1, 1], blocks.shape[0])
        blocks[:, offset:offset + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.fixture(scope="module", params=SUPPORTED_QTYPES, ids=lambda q: q.name)
def weight(request) -> tuple[TritonQuantWeight, np.ndarray]:
    """(the holder, gguf's dequantization float32 [N, K]) of one format."""
    blocks = make_blocks(request.param, N, K, seed=int(request.param))
    holder = TritonQuantWeight.from_blocks(torch.from_numpy(blocks), request.param, (N, K), DEVICE)
    return holder, gguf_quants.dequantize(blocks, request.param)


def check_product(y: torch.Tensor, x: torch.Tensor, w: np.ndarray, tensor_cores: bool) -> None:
    """y against x @ w^T in float64, within the bound of the module docstring."""
    xd, wd = x.double().cpu(), torch.from_numpy(w).double()
    ref, s = xd @ wd.T, xd.abs() @ wd.abs().T
    rel = x.shape[1] * 2.0 ** -24
    absolute = torch.zeros_like(ref)
    if tensor_cores:
        rel += 2.0 ** -9 if x.dtype == torch.float32 else _UNIT[x.dtype]
        if x.dtype == torch.float16:
            absolute = 2.0 ** -25 * xd.abs().sum(1, keepdim=True)
    out_unit = _UNIT[x.dtype] if x.dtype != torch.float32 else 0.0
    bound = (rel * s + absolute) * (1 + out_unit) + out_unit * ref.abs()
    assert y.dtype == x.dtype and y.shape == ref.shape
    err = (y.double().cpu() - ref).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g}, max excess {(err - bound).max():.3g}"


def test_dequantize_is_bit_exact(weight):
    holder, ref = weight
    out = holder.dequantize().cpu().numpy()
    assert out.dtype == np.float32 and np.array_equal(out.view(np.uint32), ref.view(np.uint32))


def test_memory_is_the_file_size(weight):
    holder, _ = weight
    block_size, type_size = GGML_QUANT_SIZES[holder.qtype]
    file_bytes = N * K // block_size * type_size
    assert holder.nbytes == pytest.approx(_RATIO[holder.qtype] * file_bytes, abs=0.5)
    assert holder.nbytes <= 1.03 * file_bytes


@pytest.mark.parametrize("weight, m, dtype", MATMUL_CASES, indirect=["weight"],
                         ids=[f"{q.name}-{m}-{d}" for q, m, d in MATMUL_CASES])
def test_matmul(weight, m, dtype):
    holder, ref = weight
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
    check_product(holder.matmul(x), x, ref, tensor_cores=m > GEMV_MAX_M)


def test_matmul_over_two_row_tiles(weight):
    """140 rows: two tl.dot tiles of 128, the second partial. The second tile's rows are indexed and
    masked alike in every dtype (each dtype's own loads, casts and stores: test_matmul), so each format
    takes one of the three in turn (all three: 5x the CPU of the rest of test_matmul under the interpreter)."""
    holder, ref = weight
    dtype = DTYPES[SUPPORTED_QTYPES.index(holder.qtype) % len(DTYPES)]
    x = torch.randn(140, K, generator=torch.Generator().manual_seed(140)).to(dtype).to(DEVICE)
    check_product(holder.matmul(x), x, ref, tensor_cores=True)


@pytest.mark.parametrize("qtype", SWEPT_QTYPES, ids=lambda q: q.name)
def test_gemv_split_over_k(qtype):
    """Three K tiles of 512 split two and three ways: partial sums added in fp32."""
    k = 1536
    blocks = make_blocks(qtype, 20, k, seed=7)
    holder = TritonQuantWeight.from_blocks(torch.from_numpy(blocks), qtype, (20, k), DEVICE)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(DEVICE)
    for split_k in (2, 3):
        check_product(holder.gemv(x, split_k=split_k), x, gguf_quants.dequantize(blocks, qtype), tensor_cores=False)


@pytest.mark.parametrize("qtype", SWEPT_QTYPES, ids=lambda q: q.name)
def test_every_gemv_launch_a_sweep_may_pick(qtype):
    """Every (block_n, block_k) of GEMV_CANDIDATES (K split in two where it has two tiles: partial
    tiles, uneven splits) and every launch of GEMV_CONFIGS: within the GEMV's bound."""
    k = 1024
    blocks = make_blocks(qtype, 24, k, seed=11)  # 24 rows: partial row blocks of 16 and 32
    holder = TritonQuantWeight.from_blocks(torch.from_numpy(blocks), qtype, (24, k), DEVICE)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(DEVICE)
    ref = gguf_quants.dequantize(blocks, qtype)
    configs = [GemvConfig(n, k) for n, k in itertools.product(GEMV_CANDIDATES["block_n"], GEMV_CANDIDATES["block_k"])]
    configs += sorted(set(GEMV_CONFIGS.values()), key=repr)
    if INTERPRETED:  # the interpreter runs a launch's programs one by one: warps and programs_per_sm change nothing
        configs = list({(c.block_n, c.block_k): c for c in reversed(configs)}.values())
    for config in configs:
        check_product(holder.gemv(x, split_k=2, config=config), x, ref, tensor_cores=False)


def test_each_weight_takes_the_launch_of_its_shape_class(monkeypatch):
    """Llama-3.2-1B's matrices fall in their classes; a weight reads the table's entry for its class
    and format, else its class's entry for any format."""
    assert [shape_class(n, k) for n, k in ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048))] \
        == ["square", "square", "wide", "long_rows", "vocab"]
    tuned = GemvConfig(16, 1024, 8, 2)
    monkeypatch.setitem(GEMV_CONFIGS, ("long_rows", "Q4_K"), tuned)
    for qtype, expected in ((Q.Q4_K, tuned), (Q.Q4_0, GEMV_CONFIGS[("long_rows", "*")])):
        holder = TritonQuantWeight.from_blocks(torch.from_numpy(make_blocks(qtype, 16, 512, seed=1)), qtype, (16, 512),
                                               DEVICE)
        assert holder.gemv_config == expected


def test_gemm_takes_rows_with_a_stride():
    """x a column slice of a wider tensor (rows not contiguous with each other), as a fused QKV
    output would be."""
    blocks = make_blocks(Q.Q4_K, N, K, seed=3)
    holder = TritonQuantWeight.from_blocks(torch.from_numpy(blocks), Q.Q4_K, (N, K), DEVICE)
    wide = torch.randn(40, K + 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEVICE)
    x = wide[:, 32:32 + K]
    check_product(holder.gemm(x), x, gguf_quants.dequantize(blocks, Q.Q4_K), tensor_cores=True)


def test_rejects_what_it_cannot_hold():
    blocks = torch.from_numpy(make_blocks(Q.Q8_0, 4, 64, seed=0))
    with pytest.raises(ValueError, match="Q4_1 is not supported"):
        TritonQuantWeight.from_blocks(blocks, Q.Q4_1, (4, 64), DEVICE)
    with pytest.raises(ValueError, match="expected uint8 blocks"):
        TritonQuantWeight.from_blocks(blocks, Q.Q8_0, (4, 96), DEVICE)
    holder = TritonQuantWeight.from_blocks(blocks, Q.Q8_0, (4, 64), DEVICE)
    with pytest.raises(ValueError, match="x must be"):
        holder.matmul(torch.zeros(2, 32, device=DEVICE))
