"""BF16 weights laid out as pairs of 16 rows (hearth/quant/kernels/bf16_pairs.py, half_matmul.cpp's BF16_PAIRS):
the layout gives back its rows, half_matmul reads it as the dense product of the weight (activations rounded to
bf16 from `half_bf16_min_rows` rows where the pairs pay, else exact products), and HalfLinear lays a BF16 weight
out so exactly where the pairs pay."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from hearth.backend.cpu_linear import HalfLinear, cpu_linear
from hearth.quant import QuantTensor, kernels
from hearth.quant.kernels.bf16_pairs import pairs_layout, rows_of_pairs
from test_quant_linear import HALF, assert_within, dense, ext, half_reference, random_weight  # noqa: F401 (fixture)

# (rows, values): rows that are no whole group of 16, an odd K (a zero value pads its last pair), K cut into ranges
# of 2048 whose partial sums add up (4200: two whole ranges and a short one), rows past a block of 128 (300)
SHAPES = [(37, 119), (37, 4200), (300, 4200)]


@pytest.mark.parametrize("n, k", SHAPES)
def test_layout_gives_back_its_rows(n, k):
    g = torch.Generator().manual_seed(n + k)
    data = random_weight(Q.BF16, n, k, g)
    packed = pairs_layout(data, n, k)
    assert packed.shape == (-(-n // 16), (k + k % 2) * 32)
    assert torch.equal(rows_of_pairs(packed, n, k), data)


@pytest.mark.parametrize("n, k", SHAPES)
def test_half_matmul_reads_the_layout_as_the_dense_product(ext, n, k):
    """Every path (SIMD where the pairs pay, the plain loops), decode rows to a prefill, fp32 and bf16
    activations; and the weight as rows (F16, BF16) through the same K ranges and row blocks."""
    g = torch.Generator().manual_seed(n * k)
    for m in (1, 2, 7, 33, 300):
        x = torch.randn(m, k, generator=g)
        for qtype in HALF:
            data = random_weight(qtype, n, k, g)
            w = dense(data, qtype, k)
            layouts = [(data, int(qtype))] + ([(pairs_layout(data, n, k), kernels.BF16_PAIRS)] if qtype == Q.BF16 else [])
            for weight, read_as in layouts:
                for xs in (x, x.bfloat16()):
                    for portable in (False, True):
                        y = ext.half_matmul(xs, weight, read_as, n, portable)
                        assert_within(y, *half_reference(xs, w, read_as, portable))


def test_half_linear_lays_bf16_out_where_the_pairs_pay(ext):
    g = torch.Generator().manual_seed(7)
    n, k = 37, 119
    data = random_weight(Q.BF16, n, k, g)
    layer = cpu_linear(QuantTensor.of_half(data.view(torch.bfloat16)))
    assert isinstance(layer, HalfLinear)
    pairs = ext.module.half_bf16_min_rows() > 0
    assert layer.kernel_weight[2] == (kernels.BF16_PAIRS if pairs else int(Q.BF16))
    assert torch.equal(layer.half_rows(), data)
    assert torch.equal(layer.dequantize(), dense(data, Q.BF16, k))


def test_activation_sparsity_reads_a_laid_out_weight_as_its_rows(ext):
    """SparseColumnsLinear.of a HalfLinear takes the weight's rows (half_rows: unpacked where laid out in pairs):
    the masked product of the dense weight."""
    from hearth.backend.sparse_linear import SparseColumnsLinear

    g = torch.Generator().manual_seed(11)
    n, k = 37, 119
    data = random_weight(Q.BF16, n, k, g)
    w = dense(data, Q.BF16, k).double()
    sparse = SparseColumnsLinear.of(cpu_linear(QuantTensor.of_half(data.view(torch.bfloat16))), 0.5, ext)
    x = torch.randn(3, k, generator=g)
    masked = torch.where(x.abs() >= 0.5, x, torch.zeros(())).double()
    assert_within(sparse(x), masked @ w.T, 1e-5 * (masked.abs() @ w.abs().T) + 1e-6)
