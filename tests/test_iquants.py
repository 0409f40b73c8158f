"""i-quants and MXFP4 through the kernels and the backends' modules.

The codebook formats (IQ4_NL, IQ4_XS, MXFP4) have int8 kernels: against gguf's dequantizer and a
float64 matmul within the int8-activation bound (tests/test_quant_linear.py says how it is
derived), for odd shapes, on every code path this build has. The grid formats (IQ1_S..IQ3_S) go
through the dequantizing module on every backend: within fp32 rounding of the same product.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from hearth.backend.cpu_linear import Int8Linear, cpu_linear
from hearth.backend.stored import DequantLinear
from hearth.quant import QuantTensor
from test_quant_linear import ROWS, assert_within, ext, fp32_tolerance, q8_tolerance  # noqa: F401 (ext: a fixture)

CODEBOOK_QTYPES = [Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4]
GRID_QTYPES = [Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_S, Q.IQ2_XS, Q.IQ2_XXS, Q.IQ1_S, Q.IQ1_M]


def random_iquant(qtype: Q, rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """uint8 [rows, bytes_per_row]: random codes, the block scale ~0.001-0.01 (MXFP4: 2^-12..2^-6;
    IQ1_M: its float16 d spread over the top nibbles of its scale words)."""
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = torch.randint(0, 256, (rows * cols // block, size), generator=generator, dtype=torch.uint8)
    n = blocks.shape[0]
    if qtype == Q.MXFP4:
        blocks[:, 0] = torch.randint(116, 123, (n,), generator=generator, dtype=torch.uint8)
        return blocks.reshape(rows, -1)
    d = (torch.rand(n, generator=generator) * 0.009 + 0.001).to(torch.float16).view(torch.int16).int() & 0xFFFF
    if qtype == Q.IQ1_M:
        for i in range(4):
            blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 0x0F) | (((d >> (4 * i)) & 0x0F) << 4).to(torch.uint8)
    else:
        blocks[:, 0], blocks[:, 1] = (d & 0xFF).to(torch.uint8), (d >> 8).to(torch.uint8)
    return blocks.reshape(rows, -1)


def gguf_dense(data: torch.Tensor, qtype: Q, cols: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(data.numpy(), qtype))).reshape(-1, cols)


@pytest.mark.parametrize("qtype", CODEBOOK_QTYPES, ids=lambda q: q.name)
def test_codebook_kernels_equal_dequantize_then_matmul(ext, qtype):
    """37 rows, an odd number of blocks per row, 1 to 300 activation rows: the kernels' own decoding
    bit-exact against gguf's, every int8 path and the cpu backend's module within the bound."""
    g = torch.Generator().manual_seed(int(qtype))
    n, k = 37, GGML_QUANT_SIZES[qtype][0] * 3
    data = random_iquant(qtype, n, k, g)
    w = gguf_dense(data, qtype, k)
    assert torch.equal(ext.dequantize_rows(data, int(qtype), k), w)
    layer = cpu_linear(QuantTensor(data, qtype, (n, k)))
    assert isinstance(layer, Int8Linear) and layer.codes is None  # read in place, never repacked
    for m in ROWS:
        x = torch.randn(m, k, generator=g)
        ref = x.double() @ w.double().T
        bound = q8_tolerance(x, w, GGML_QUANT_SIZES[qtype][0])  # q8_K for IQ4_XS, q8_0 for the others
        for path in ext.int8_paths:
            assert_within(ext.int8_matmul(x, data, int(qtype), n, path), ref, bound)
        assert_within(layer(x), ref, bound)


@pytest.mark.parametrize("qtype", GRID_QTYPES, ids=lambda q: q.name)
def test_grid_formats_multiply_as_their_dequantization(qtype):
    """The dequantizing module (cpu and reference backends; the gpu backend's on its device): gguf's
    dequantization times x within fp32 rounding, for a decode row and a prefill."""
    g = torch.Generator().manual_seed(int(qtype))
    n, k = 37, 768
    data = random_iquant(qtype, n, k, g)
    w = gguf_dense(data, qtype, k)
    layer = cpu_linear(QuantTensor(data, qtype, (n, k)))
    assert isinstance(layer, DequantLinear)
    for m in (1, 33):
        x = torch.randn(m, k, generator=g)
        assert_within(layer(x), x.double() @ w.double().T, fp32_tolerance(x, w))
