"""hearth.quant.formats against gguf.quants, the reference: bit-exact for every format."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from hearth.errors import ModelLoadError
from hearth.quant import SUPPORTED_QTYPES, QuantTensor, dequantize, quantize
from hearth.quant.formats import QUANTIZE_QTYPES

# Byte offsets of the float16 scale fields in each block format (d, dmin, m).
F16_FIELDS = {
    Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.TQ1_0: (52,), Q.TQ2_0: (64,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,), Q.IQ3_S: (0,), Q.IQ3_XXS: (0,),
    Q.IQ2_S: (0,), Q.IQ2_XS: (0,), Q.IQ2_XXS: (0,), Q.IQ1_S: (0,),
}
ROWS = 6
BLOCKS_PER_ROW = 3


def random_blocks(qtype: Q, seed: int) -> tuple[np.ndarray, tuple[int, int]]:
    """Random raw blocks (ROWS, bytes_per_row) with finite float16 scales, and the logical shape."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if qtype in (Q.F32, Q.F16, Q.BF16):
        cols = 64
        values = rng.standard_normal((ROWS, cols)).astype(np.float32) * 3
        dtype = {Q.F32: np.float32, Q.F16: np.float16}.get(qtype)
        raw = values.astype(dtype).view(np.uint8) if dtype else gguf_quants.quantize(values, qtype)
        return np.ascontiguousarray(raw).reshape(ROWS, -1), (ROWS, cols)
    blocks = rng.integers(0, 256, size=(ROWS * BLOCKS_PER_ROW, type_size), dtype=np.uint8)
    for offset in F16_FIELDS.get(qtype, ()):
        scale = (rng.standard_normal(ROWS * BLOCKS_PER_ROW) * 0.05).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    set_odd_scales(blocks, qtype, rng)
    return blocks.reshape(ROWS, -1), (ROWS, BLOCKS_PER_ROW * block_size)


def set_odd_scales(blocks: np.ndarray, qtype: Q, rng: np.random.Generator) -> None:
    """The scales kept outside a float16 field, set to finite values: MXFP4's e8m0 exponent (every
    subnormal and a range of normal ones), IQ1_M's float16 d spread over the top nibbles of its
    four scale words (a nibble in the high half of bytes 49, 51, 53, 55)."""
    if qtype == Q.MXFP4:
        blocks[:, 0] = rng.integers(0, 140, size=len(blocks))
        blocks[:3, 0] = (0, 1, 2)
    elif qtype == Q.IQ1_M:
        d = (rng.standard_normal(len(blocks)) * 0.05).astype(np.float16).view(np.uint16)
        for i in range(4):
            nibble = ((d >> (4 * i)) & 0x0F).astype(np.uint8)
            blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 0x0F) | (nibble << 4)


def assert_bit_exact(ours: torch.Tensor, ref: np.ndarray) -> None:
    assert ours.dtype == torch.float32
    ref_t = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))
    assert ours.shape == ref_t.shape
    assert torch.isfinite(ours).all()
    assert torch.equal(ours.view(torch.int32), ref_t.view(torch.int32)), (
        f"max abs diff {(ours - ref_t).abs().max().item()}")


@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_dequantize_matches_gguf(qtype, seed):
    raw, shape = random_blocks(qtype, seed)
    ref = gguf_quants.dequantize(raw, qtype).reshape(shape)
    ours = dequantize(torch.from_numpy(raw), qtype, shape)
    assert_bit_exact(ours, ref)
    # flat input gives the same answer
    assert torch.equal(dequantize(torch.from_numpy(raw.reshape(-1)), qtype, shape), ours)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda q: q.name)
def test_float_arrays_typed_or_raw(qtype):
    values = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    typed = values.to({Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}[qtype])
    expected = typed.float()
    assert torch.equal(dequantize(typed, qtype, (4, 32)), expected)
    raw = typed.contiguous().view(torch.uint8)
    assert torch.equal(dequantize(raw, qtype, (4, 32)), expected)
    assert torch.equal(dequantize(typed.reshape(-1), qtype, (128,)), expected.reshape(-1))


def test_chunked_path_matches_gguf(monkeypatch):
    """Tensors larger than one chunk are dequantized in pieces; the result is unchanged."""
    import hearth.quant.formats as formats

    monkeypatch.setattr(formats, "_CHUNK_ELEMENTS", 256 * 4)
    raw, shape = random_blocks(Q.Q4_K, 7)
    ref = gguf_quants.dequantize(raw, Q.Q4_K).reshape(shape)
    assert_bit_exact(dequantize(torch.from_numpy(raw), Q.Q4_K, shape), ref)


@pytest.mark.parametrize("qtype", QUANTIZE_QTYPES, ids=lambda q: q.name)
def test_quantize_matches_gguf(qtype):
    values = np.random.default_rng(3).standard_normal((5, 256)).astype(np.float32)  # whole ternary blocks
    values[0, :32] = 0.0  # an all-zero block
    ours = quantize(torch.from_numpy(values), qtype)
    ref = np.ascontiguousarray(gguf_quants.quantize(values, qtype)).view(np.uint8).reshape(5, -1)
    assert ours.dtype == torch.uint8 and ours.shape == ref.shape
    assert np.array_equal(ours.numpy(), ref)
    back = dequantize(ours, qtype, (5, 256))
    assert_bit_exact(back, gguf_quants.dequantize(ref, qtype).reshape(5, 256))


def test_quant_tensor_round_trip():
    values = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    qt = QuantTensor(quantize(values, Q.Q8_0), Q.Q8_0, (8, 64))
    assert qt.nbytes == 8 * 2 * 34
    picked = qt.rows(torch.tensor([5, 2]))
    assert torch.equal(picked.dequantize(), qt.dequantize()[[5, 2]])
    assert (qt.dequantize() - values).abs().max() < 0.05


def test_unsupported_type_raises():
    with pytest.raises(ModelLoadError, match="Q8_1.*Q4_K.*IQ4_XS"):
        dequantize(torch.zeros(40, dtype=torch.uint8), Q.Q8_1, (1, 32))
    with pytest.raises(ModelLoadError, match="Q4_K.*Q8_0"):
        quantize(torch.zeros(1, 256), Q.Q4_K)


def test_wrong_byte_count_raises():
    with pytest.raises(ModelLoadError, match="expected 68 bytes, got 67"):
        dequantize(torch.zeros(67, dtype=torch.uint8), Q.Q8_0, (2, 32))
    with pytest.raises(ModelLoadError, match="not a multiple"):
        dequantize(torch.zeros(34, dtype=torch.uint8), Q.Q8_0, (1, 33))
    with pytest.raises(ModelLoadError, match="not a multiple"):
        quantize(torch.zeros(2, 40), Q.Q4_0)
