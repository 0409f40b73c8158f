"""Quantized matmul: every path against dequantize-then-matmul, and models that stay quantized.

Tolerances (docs/quantized-matmul.md):
- half_matmul (F16/BF16 weights; fp32 activations, or bf16 ones, exact products in fp32; against BF16
  laid out in pairs, fp32 activations rounded to bf16 first) and the torch path: |y - ref| <= 1e-5 (|x| @ |W|^T);
- int8_matmul and packed_matmul (blocks in place, or repacked into tiles; activations rounded to
  int8 per block b of the weight's format, 32 values or 256 for K-quants: llama.cpp's q8_0 / q8_K): each activation is off
  by at most half its block's step amax_b / 127, so |y - ref| <= sum_b (amax_b / 254) sum_b |w|,
  plus the same fp32 term.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from torch import nn

from hearth.loading.convert import convert_hf_to_gguf
from hearth.loading.loader import load_model
from hearth.backend.cpu_linear import (HALF_MAX_ROWS, PACKED_QTYPES, WIDENED_PAST_ROWS, HalfLinear, Int8Linear,
                                       cpu_linear)
from hearth.backend.stored import DequantLinear, QuantEmbedding
from hearth.model.layers import Linear
from hearth.quant import QuantTensor, kernels
from hearth.quant.formats import dequantize
from models import VOCAB_SIZE, make_hf_model

BLOCK_QTYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.TQ2_0]
HALF = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}
ALL_QTYPES = BLOCK_QTYPES + list(HALF)
# byte offsets of the float16 scales in each block: set to sane values, the rest is random bits
_F16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q2_K: (80, 82),
               Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.TQ2_0: (64,), Q.TQ1_0: (52,)}
ROWS = (1, 2, 3, 5, 6, 8, 9, 33, 300)  # decode, a verification's few rows, tails of 8-row passes, a prefill


@pytest.fixture(scope="module")
def ext():
    ext = kernels.extension()
    if ext is None:
        pytest.skip("the C++ kernels could not be built here (no compiler?); the torch path is tested alone")
    return ext


def random_weight(qtype: Q, rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """uint8 [rows, bytes_per_row]: random codes, scales ~0.001-0.01 (every bit pattern of the codes)."""
    if qtype in HALF:
        return (torch.randn(rows, cols, generator=generator) * 0.05).to(HALF[qtype]).view(torch.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = torch.randint(0, 256, (rows * cols // block, size), generator=generator, dtype=torch.uint8)
    for offset in _F16_FIELDS[qtype]:
        scales = (torch.rand(blocks.shape[0], generator=generator) * 0.009 + 0.001).to(torch.float16)
        blocks[:, offset:offset + 2] = scales.view(torch.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def stored(data: torch.Tensor, qtype: Q, cols: int) -> QuantTensor:
    """random_weight's bytes as the QuantTensor loading gives."""
    return QuantTensor(data, qtype, (data.shape[0], cols))


def dense(data: torch.Tensor, qtype: Q, cols: int) -> torch.Tensor:
    if qtype in HALF:
        return data.view(HALF[qtype]).float()
    return dequantize(data, qtype, (data.shape[0], cols))


def shape_for(qtype: Q) -> tuple[int, int]:
    """Odd shapes: rows not a multiple of the 32-row tile, an odd number of blocks per row (half
    arrays: a row that is no whole number of SIMD vectors)."""
    if qtype in HALF:
        return 37, 119
    return 37, GGML_QUANT_SIZES[qtype][0] * 3


def fp32_tolerance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return 1e-5 * (x.abs().double() @ w.abs().double().T) + 1e-6


def half_reference(x: torch.Tensor, w: torch.Tensor, qtype, portable: bool = False):
    """half_matmul's (and HalfLinear's) reference and bound for x against w read as `qtype` (F16, BF16 rows, or
    kernels.BF16_PAIRS): the float64 product of the activations it multiplies (x, or x rounded to bf16 by
    torch against BF16_PAIRS from `half_bf16_min_rows` rows), within fp32 rounding."""
    rows = kernels.extension().module.half_bf16_min_rows() if kernels.extension() is not None else 0
    rounded = qtype == kernels.BF16_PAIRS and not portable and 0 < rows <= x.shape[0]
    xa = x.bfloat16().double() if rounded else x.double()
    return xa @ w.double().T, 1e-5 * (xa.abs() @ w.abs().double().T) + 1e-6


def q8_tolerance(x: torch.Tensor, w: torch.Tensor, block: int = 32) -> torch.Tensor:
    """|x - dequant(quant(x))| <= amax_b / 254 in each block of `block` values: the bound of the
    int8-activation kernels' error."""
    m, k = x.shape
    step = x.abs().reshape(m, k // block, block).amax(-1).double() / 254  # [M, K/block]
    w_abs = w.abs().double().reshape(w.shape[0], k // block, block).sum(-1)  # [N, K/block]
    return 1.001 * step @ w_abs.T + fp32_tolerance(x, w)


def activation_block(qtype: Q) -> int:
    """Values per activation scale in int8_matmul: a K-quant's super-block (q8_K), else 32 (q8_0)."""
    return 256 if GGML_QUANT_SIZES[qtype][0] == 256 else 32


def assert_within(y: torch.Tensor, ref: torch.Tensor, tolerance: torch.Tensor) -> None:
    excess = ((y.double() - ref).abs() - tolerance).max().item()
    assert excess <= 0, f"error exceeds the tolerance by {excess:.3g}"


@pytest.mark.parametrize("qtype", ALL_QTYPES, ids=lambda q: q.name)
def test_kernels_equal_dequantize_then_matmul(ext, qtype):
    """Every kernel against gguf's dequantizer (through hearth.quant.formats, bit-exact to it) and a
    float64 matmul, for odd shapes: 37 weight rows (no whole number of 16- or 32-row groups), an
    odd number of blocks per row, and 1 to 300 activation rows. Packed tiles (every format but
    TQ2_0): unpacked by the kernels, the same weight bit for bit, and zero in the padding rows."""
    g = torch.Generator().manual_seed(int(qtype))
    n, k = shape_for(qtype)
    data = random_weight(qtype, n, k, g)
    w = dense(data, qtype, k)
    assert torch.equal(ext.dequantize_rows(data, int(qtype), k), w)  # the kernels' block layouts, bit-exact
    packed = ext.repack(data, int(qtype), n, k) if qtype in PACKED_QTYPES else None
    if packed is not None:
        assert torch.equal(ext.dequantize_packed(*packed, int(qtype), k), torch.cat([w, torch.zeros(64 - n, k)]))
    for m in ROWS:
        x = torch.randn(m, k, generator=g)
        ref = x.double() @ w.double().T
        int8_bound = q8_tolerance(x, w, activation_block(qtype)) if qtype not in HALF else None
        for portable in (False, True):  # SIMD paths and the plain C++ loops
            if qtype in HALF:
                for xs in (x, x.bfloat16()):  # fp32, and bf16 compute: activations that are bf16 already
                    assert_within(ext.half_matmul(xs, data, int(qtype), n, portable), *half_reference(xs, w, qtype, portable))
            if packed is not None:
                assert_within(ext.packed_matmul(x, *packed, int(qtype), n, portable), ref, int8_bound)
        if qtype not in HALF:
            for path in ext.int8_paths:  # every code path this build has (AVX-512, AVX2, plain loops)
                assert_within(ext.int8_matmul(x, data, int(qtype), n, path), ref, int8_bound)
        weight = stored(data, qtype, k)
        assert_within(DequantLinear(weight)(x), ref, fp32_tolerance(x, w))  # the reference's tiles
        layer = cpu_linear(weight)  # HalfLinear: BF16 read as BF16_PAIRS where laid out so
        read_as = getattr(layer, "kernel_weight", (0, 0, qtype))[2]
        assert_within(layer(x), *((ref, int8_bound) if qtype not in HALF else half_reference(x, w, read_as)))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_int8_kernel_on_blocks_from_ggufs_quantizer(ext, qtype):
    """Blocks as gguf's quantizer writes them from real-valued weights (not only random bytes)."""
    import gguf

    g = torch.Generator().manual_seed(17)
    n, k = 45, 96
    values = torch.randn(n, k, generator=g) * 0.05
    data = torch.from_numpy(gguf.quantize(values.numpy(), qtype)).view(torch.uint8).reshape(n, -1)
    w = torch.from_numpy(gguf.dequantize(data.numpy(), qtype)).reshape(n, k)
    for m in (1, 7):
        x = torch.randn(m, k, generator=g)
        ref = x.double() @ w.double().T
        assert_within(ext.int8_matmul(x, data, int(qtype), n), ref, q8_tolerance(x, w))


@pytest.mark.parametrize("qtype", BLOCK_QTYPES, ids=lambda q: q.name)
def test_compiled_paths_agree_with_each_other(ext, qtype):
    """Every SIMD path (AVX-512, AVX2) and the portable loops: the same int8 activations and integer
    dot products, summed in another fp32 order. 9 rows: in place, whole passes of rows and a
    remainder; 37: tiles decoded per call on VNNI builds (from 24 rows)."""
    g = torch.Generator().manual_seed(7)
    n, k = 70, 512
    data = random_weight(qtype, n, k, g)
    w = dense(data, qtype, k)
    for m in (9, 37):
        x = torch.randn(m, k, generator=g)
        plain = ext.int8_matmul(x, data, int(qtype), n, "portable").double()
        for path in ext.int8_paths:
            assert_within(ext.int8_matmul(x, data, int(qtype), n, path), plain, fp32_tolerance(x, w))


@pytest.mark.parametrize("qtype", [Q.TQ1_0, Q.TQ2_0], ids=lambda q: q.name)
def test_ternary_weights_multiply_as_their_dequantization(ext, qtype):
    """BitNet-style weights (d * {-1, 0, 1}) as gguf's quantizer writes them, and random blocks:
    the cpu backend's module (TQ1_0 repacked to TQ2_0 at load, then the int8 kernel) against gguf's dequantizer
    and a float64 matmul."""
    import gguf

    g = torch.Generator().manual_seed(int(qtype))
    n, k = 37, 768
    ternary = torch.randint(-1, 2, (n, k), generator=g).float() * (torch.rand(n, 1, generator=g) * 0.05 + 0.01)
    quantized = torch.from_numpy(gguf.quantize(ternary.numpy(), qtype)).view(torch.uint8).reshape(n, -1)
    block, size = GGML_QUANT_SIZES[qtype]
    random = torch.randint(0, 256, (n * k // block, size), generator=g, dtype=torch.uint8)
    scale = _F16_FIELDS[qtype][0]
    random[:, scale:scale + 2] = torch.full((random.shape[0],), 0.02, dtype=torch.float16).view(torch.uint8).reshape(-1, 2)
    for data in (quantized, random.reshape(n, -1)):
        w = torch.from_numpy(gguf.dequantize(data.numpy(), qtype)).reshape(n, k)
        layer = cpu_linear(QuantTensor(data, qtype, (n, k)))
        assert layer.qtype == Q.TQ2_0 and isinstance(layer, Int8Linear)  # the int8 kernel, both formats
        for m in (1, 5, 33):
            x = torch.randn(m, k, generator=g)
            assert_within(layer(x), x.double() @ w.double().T, q8_tolerance(x, w, 256))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q5_0], ids=lambda q: q.name)
def test_dequant_linear_module_shapes_bias_and_dtype(qtype):
    """The reference's module: leading dimensions kept, any compute dtype, the blocks themselves
    (no copy), dequantize-then-matmul exact up to fp32 rounding (no activation rounded)."""
    g = torch.Generator().manual_seed(3)
    data = random_weight(qtype, 40, 64, g)
    bias = torch.randn(40, generator=g)
    layer = DequantLinear(stored(data, qtype, 64), bias)
    w = layer.dequantize()
    assert torch.equal(w, dense(data, qtype, 64))
    x = torch.randn(2, 3, 64, generator=g)  # leading dimensions kept
    ref = F.linear(x, w, bias).double().reshape(6, 40)
    assert_within(layer(x).reshape(6, 40), ref, fp32_tolerance(x.reshape(6, 64), w))
    y = layer(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 40)
    assert layer.qweight.data_ptr() == data.data_ptr()  # the blocks themselves, not a copy


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0], ids=lambda q: q.name)
def test_int8_linear_module_bias_and_storage(ext, qtype):
    """The cpu backend's module: the same weight packed or not, with its bias, within the
    int8-activation bound; the blocks in place, or repacked into as many bytes."""
    g = torch.Generator().manual_seed(3)
    data = random_weight(qtype, 40, 64, g)
    bias = torch.randn(40, generator=g)
    layer = cpu_linear(stored(data, qtype, 64), bias)
    assert isinstance(layer, Int8Linear)
    w = layer.dequantize()
    assert torch.equal(w, dense(data, qtype, 64))  # packed or not, the same weight
    x = torch.randn(6, 64, generator=g)
    assert_within(layer(x), F.linear(x, w, bias).double(), q8_tolerance(x, w))
    # a prefill chunk's rows: Q5_0 blocks in place (no VNNI) widened to fp32 tiles, the activations unrounded
    in_place = layer.codes is None and layer.kernel_qtype < kernels.ROWS8
    assert layer.widened_past_rows == (WIDENED_PAST_ROWS.get(qtype) if in_place and not ext.vnni else None)
    for rows in (95, 97):
        x = torch.randn(rows, 64, generator=g)
        widened = layer.widened_past_rows is not None and rows > layer.widened_past_rows
        assert_within(layer(x), F.linear(x, w, bias).double(), fp32_tolerance(x, w) if widened else q8_tolerance(x, w))
    if in_place:
        assert layer.qweight.data_ptr() == data.data_ptr()  # the blocks themselves, not a copy
    elif layer.codes is None:  # Q8_0 / Q4_0 / Q4_1 on AVX2: groups of 8 rows (5 here), as many bytes as the blocks
        assert layer.qweight.shape == (5, 8 * data.shape[1])
    if layer.codes is None:  # the blocks for what reads them as stored (activation sparsity): the file's bytes
        assert torch.equal(layer.gguf_blocks(), data)
    else:  # on a CPU with VNNI: repacked, the same number of bytes (one 32-row tile here + padding)
        assert layer.codes.numel() + layer.terms.numel() == data.numel() * 64 // 40


@pytest.mark.parametrize("qtype", list(HALF), ids=lambda q: q.name)
def test_half_weights_with_activations_of_their_dtype(qtype):
    """bf16 / f16 compute against a weight of that dtype (the reference's module), at every batch
    size: within that dtype's rounding of the result (119 products accumulated in fp32, rounded
    once); float32 activations (the cpu backend's module where the kernels built): exact products of
    them (rounded to bf16 first where the kernels take bf16 pairs: half_reference)."""
    g = torch.Generator().manual_seed(13)
    n, k = shape_for(qtype)
    data = random_weight(qtype, n, k, g)
    w = dense(data, qtype, k)
    weight = QuantTensor.of_half(data.view(HALF[qtype]))
    layer, layer32 = DequantLinear(weight), cpu_linear(weight)
    assert isinstance(layer32, HalfLinear) == (kernels.extension() is not None)
    for m in (1, 7, 33, 300):  # decode, small batches, a batch of decodes, a prefill
        x = torch.randn(m, k, generator=g).to(HALF[qtype])
        ref = x.double() @ w.double().T
        y = layer(x)
        assert y.dtype == HALF[qtype]
        unit = 2.0 ** -8 if qtype == Q.BF16 else 2.0 ** -11  # the dtype's rounding unit
        assert_within(y, ref, unit * ref.abs() + 1e-5 * (x.abs().double() @ w.abs().double().T) + 1e-6)
        read_as = layer32.kernel_weight[2] if isinstance(layer32, HalfLinear) else qtype  # BF16_PAIRS where laid out so
        assert_within(layer32(x.float()), *half_reference(x.float(), w, read_as))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.BF16], ids=lambda q: q.name)
def test_quant_embedding_dequantizes_only_the_rows_looked_up(qtype):
    """Torch's dequantizer, and the cpu backend's embedding (the kernels' decoding for block formats)."""
    from hearth.backend.cpu import CpuBackend

    g = torch.Generator().manual_seed(5)
    n, k = 50, 256
    data = random_weight(qtype, n, k, g)
    ids = torch.tensor([[3, 49, 0], [3, 7, 7]])
    on_kernels = CpuBackend().stored_module(nn.Embedding(n, k), stored(data, qtype, k), torch.float32)
    assert (on_kernels.dequantize_rows == kernels.extension().dequantize_rows) == (qtype not in HALF)
    for embedding in (QuantEmbedding(stored(data, qtype, k), torch.float32), on_kernels):
        assert torch.equal(embedding(ids), dense(data, qtype, k)[ids])


class _RoundedInputLinear(Linear):
    """A dense Linear whose input is first rounded to int8 per `block` values as llama.cpp's q8_0 /
    q8_K do (d = amax / 127, round to nearest): the int8 kernels' arithmetic, written in torch."""

    def __init__(self, in_features: int, out_features: int, bias: bool, block: int):
        super().__init__(in_features, out_features, bias)
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = x.reshape(-1, x.shape[-1] // self.block, self.block)
        step = blocks.abs().amax(-1, keepdim=True) / 127
        rounded = torch.round(blocks / torch.where(step > 0, step, 1)) * step
        return super().forward(rounded.reshape(x.shape))


def _dense_copy(model: nn.Module, round_inputs: bool = False) -> nn.Module:
    """The same model with every quantized module replaced by its dequantized dense twin (with
    round_inputs, one that rounds its input as the int8 kernels do)."""
    for name, module in list(model.named_modules()):
        parent, _, child = name.rpartition(".")
        if isinstance(module, (Int8Linear, DequantLinear)):
            if round_inputs:  # (a format in groups of 8 rows: its activations rounded per 32 values)
                in_groups = getattr(module, "kernel_qtype", 0) > kernels.ROWS8
                twin = _RoundedInputLinear(module.in_features, module.out_features, module.bias is not None,
                                           32 if in_groups else activation_block(module.qtype))
            else:
                twin = Linear(module.in_features, module.out_features, module.bias is not None)
            twin.weight = nn.Parameter(module.dequantize(), requires_grad=False)
            if module.bias is not None:
                twin.bias = module.bias
        elif isinstance(module, QuantEmbedding):
            twin = nn.Embedding.from_pretrained(_dequantize_embedding(module))
        else:
            continue
        setattr(model.get_submodule(parent), child, twin)
    return model


def _dequantize_embedding(module: QuantEmbedding) -> torch.Tensor:
    return module(torch.arange(module.num_embeddings))


def _logits(model, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    from hearth.engine.runner import BatchEntry, ModelRunner

    runner = ModelRunner(model, 8, 16, torch.device("cpu"), torch.float32)
    table, out, start = list(range(8)), [], 0
    for size in chunks:
        hidden, _ = runner.forward([BatchEntry(tokens[start:start + size], start, table)])
        out.append(model.compute_logits(hidden))
        start += size
    return torch.cat(out)


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    folder = make_hf_model(root / "llama", "llama", tie_word_embeddings=True)
    return {t: convert_hf_to_gguf(folder, root / f"llama-{t}.gguf", t, progress=False) for t in ("q8_0", "q4_0")}


@pytest.mark.parametrize("out_type", ["q8_0", "q4_0"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-path"])
def test_gguf_model_stays_quantized_and_matches_the_dense_path(tiny_ggufs, monkeypatch, out_type, compiled):
    if not compiled:
        monkeypatch.setattr(kernels, "extension", lambda: None)
    elif kernels.extension() is None:
        pytest.skip("the C++ kernels could not be built here")
    model = load_model(tiny_ggufs[out_type], progress=False).model
    qtype = Q.Q8_0 if out_type == "q8_0" else Q.Q4_0
    # every matmul weight kept as blocks over the memory map; no float copy of one exists
    layers = [m for m in model.modules() if isinstance(m, (Int8Linear, DequantLinear))]
    # per layer q/k/v merged, o, gate/up merged, down; then the lm_head
    assert len(layers) == 2 * 4 + 1 and not any(isinstance(m, Linear) for m in model.modules())
    assert {m.qtype for m in layers} == {qtype, Q.F16}  # intermediate 112 is no whole number of blocks: F16
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.embed_tokens.qtype == qtype
    assert all(p.dim() == 1 for p in model.parameters())  # norms only: no dense matrix
    packed = getattr(model.lm_head, "codes", None) is not None
    in_groups = getattr(model.lm_head, "kernel_qtype", 0) > kernels.ROWS8  # Q4_0 on AVX2: groups of 8 rows
    if not packed and not in_groups:  # tied: one table (packed or in groups, the lm_head holds the only resident copy)
        assert model.lm_head.qweight.data_ptr() == model.embed_tokens.qweight.data_ptr()
    assert packed == (compiled and kernels.extension().vnni)  # packed where it pays

    tokens = torch.randint(0, VOCAB_SIZE, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    reference_model = _dense_copy(load_model(tiny_ggufs[out_type], progress=False).model)
    # a prefill then decodes; decodes only. Compiled, Q8_0/Q4_0 run packed_matmul with int8 activations,
    # off by ~0.5% per matmul; through this random model (weights std 0.08) that grows to ~2% of the
    # largest logit, without changing the argmax. The torch path is exact up to fp32 rounding.
    tolerance = 3e-2 if compiled else 1e-4
    for chunks in ([37, 1, 1, 1], [1] * 12):
        ours, reference = _logits(model, tokens, chunks), _logits(reference_model, tokens, chunks)
        error = ((ours - reference).abs().max() / reference.abs().max()).item()
        assert error <= tolerance, (chunks, error)
        assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-path"])
def test_merged_projections_group_parts_by_format(tmp_path, monkeypatch, compiled):
    """q/k/v and gate/up run as one matmul per run of neighbours stored alike; parts in other
    formats stay separate. The result equals transformers' with the dequantized weights."""
    import gguf
    from safetensors.torch import load_file

    from hearth.backend.cpu import CpuBackend, cpu_kernels
    from hearth.config import ModelConfig
    from hearth.model.transformer import Transformer
    from models import hf_config, load_hf_reference
    from test_model import _hearth_logits

    if cpu_kernels() is None:
        pytest.skip("the C++ kernels could not be built here")
    if not compiled:
        monkeypatch.setattr(kernels, "extension", lambda: None)
    elif kernels.extension() is None:
        pytest.skip("the C++ kernels could not be built here")
    folder = make_hf_model(tmp_path / "qwen2", "qwen2")  # q/k/v biases merge too
    weights = load_file(folder / "model.safetensors")
    formats = {"q_proj": Q.Q8_0, "k_proj": Q.Q8_0, "v_proj": Q.Q5_0, "gate_proj": Q.Q4_0, "up_proj": Q.F16}
    reference = load_hf_reference(folder)
    for name in list(weights):
        kind = name.split(".")[-2]
        if kind not in formats or not name.endswith("weight"):
            continue
        if formats[kind] == Q.F16:
            weights[name] = weights[name].half()
            stored = weights[name].float()
        else:
            blocks = torch.from_numpy(gguf.quantize(weights[name].numpy(), formats[kind])).view(torch.uint8)
            weights[name] = QuantTensor(blocks.reshape(weights[name].shape[0], -1), formats[kind], tuple(weights[name].shape))
            stored = torch.from_numpy(gguf.dequantize(blocks.numpy(), formats[kind])).reshape(weights[name].shape)
        reference.get_parameter(name).data = stored.reshape(reference.get_parameter(name).shape)

    with torch.device("meta"):  # the cpu backend: its modules keep each part's format
        model = Transformer(ModelConfig.from_hf(hf_config("qwen2").to_dict()), backend=CpuBackend())
    model.load_weights(weights, torch.float32)
    model.backend.prepare(model, torch.float32)
    attention, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert [p.qtype for p in attention.qkv_proj.parts] == [Q.Q8_0, Q.Q5_0]  # q and k merged, v apart
    assert [p.out_features for p in attention.qkv_proj.parts] == [64 + 32, 32]
    assert [p.qtype for p in mlp.gate_up_proj.parts] == [Q.Q4_0, Q.F16]

    tokens = torch.randint(0, VOCAB_SIZE, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    ours = _hearth_logits(model, tokens, chunks=(27, 1, 1, 1))
    # compiled: packed Q8_0/Q4_0 round activations to int8 (see the test above)
    tolerance = 3e-2 if compiled else 1e-4
    assert ((ours - expected).abs().max() / expected.abs().max()).item() <= tolerance


def scaled_blocks(qtype: Q, rows: int, cols: int, std: float, generator: torch.Generator) -> torch.Tensor:
    """random_weight's blocks with every float16 scale multiplied alike, so that the weight's
    values have about `std` (w is linear in its scales): random codes a model can run on."""
    blocks = random_weight(qtype, rows, cols, generator)
    factor = std / dense(blocks, qtype, cols).std().item()
    flat = blocks.reshape(rows * cols // GGML_QUANT_SIZES[qtype][0], -1)
    for offset in _F16_FIELDS[qtype]:
        scales = flat[:, offset:offset + 2].contiguous().view(torch.float16).float() * factor
        flat[:, offset:offset + 2] = scales.to(torch.float16).view(torch.uint8)
    return blocks


# llama.cpp's Q4_K_M keeps some layers' v and down projections in Q6_K: q/k and v then merge
# into two parts of different formats; gate and up differ too here, to cover a two-part MLP
K_QUANT_MIX = {"q_proj": Q.Q4_K, "k_proj": Q.Q4_K, "v_proj": Q.Q6_K, "o_proj": Q.Q4_K,
               "gate_proj": Q.Q4_K, "up_proj": Q.Q5_K, "down_proj": Q.Q6_K}


def k_quant_mix_model(folder):
    """A fresh model of `folder`'s shapes with every projection as K-quant blocks (K_QUANT_MIX),
    the same blocks on every call."""
    from safetensors.torch import load_file

    from hearth.backend.cpu import CpuBackend
    from hearth.config import ModelConfig
    from hearth.model.transformer import Transformer

    weights = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(21)
    for name in sorted(weights):
        kind = name.split(".")[-2]
        if kind in K_QUANT_MIX and name.endswith("weight"):
            rows, cols = weights[name].shape
            weights[name] = QuantTensor(scaled_blocks(K_QUANT_MIX[kind], rows, cols, 0.08, g), K_QUANT_MIX[kind],
                                        (rows, cols))
    config = json.loads((folder / "config.json").read_text())
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_hf(config), backend=CpuBackend())
    model.load_weights(weights, torch.float32)
    model.backend.prepare(model, torch.float32)
    return model


def _decode_path_builder(tmp_path, out_type: str):
    """A function that builds a fresh model of `out_type` (the same weights each call)."""
    if out_type == "k-quant mix":
        folder = make_hf_model(tmp_path / "llama", "llama", hidden_size=256, intermediate_size=512)
        return lambda: k_quant_mix_model(folder)
    arch, window = ("mistral", {"sliding_window": 8}) if "window" in out_type else ("llama", {})
    folder = make_hf_model(tmp_path / arch, arch, intermediate_size=128, **window)
    path = convert_hf_to_gguf(folder, tmp_path / "model.gguf", out_type.split()[0], progress=False)
    return lambda: load_model(path, progress=False).model


# three sequences' block tables (blocks interleaved) and the tokens each has before the decodes
_TABLES, _PREFIXES = [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]], [5, 17, 33]


def _batch_decode(m, tokens: list[int]) -> torch.Tensor:
    """Three sequences of different lengths decoding together: the logits of 3 steps."""
    from hearth.engine.runner import BatchEntry, ModelRunner

    runner = ModelRunner(m, 12, 16, torch.device("cpu"), torch.float32)
    runner.forward([BatchEntry(tokens[:n], 0, t) for n, t in zip(_PREFIXES, _TABLES)])
    steps = []
    for s in range(3):
        hidden, last = runner.forward([BatchEntry([tokens[n + s]], n + s, t) for n, t in zip(_PREFIXES, _TABLES)])
        steps.append(m.compute_logits(hidden[last]))
    return torch.stack(steps)


def _verify(m, tokens: list[int], rows_per_step: list[list[int]]) -> torch.Tensor:
    """Steps of a few new rows per sequence (rows_per_step[s][i]: sequence i's in step s), the
    logits of every row, sequence by sequence."""
    from hearth.engine.runner import BatchEntry, ModelRunner

    runner = ModelRunner(m, 12, 16, torch.device("cpu"), torch.float32)
    done = list(_PREFIXES)
    runner.forward([BatchEntry(tokens[:n], 0, t) for n, t in zip(done, _TABLES)])
    logits = [[] for _ in _TABLES]
    for rows in rows_per_step:
        live = [i for i in range(3) if rows[i]]
        hidden, _ = runner.forward([BatchEntry(tokens[done[i]:done[i] + rows[i]], done[i], _TABLES[i]) for i in live])
        for i, o in zip(live, m.compute_logits(hidden).split([rows[i] for i in live])):
            logits[i].append(o)
            done[i] += rows[i]
    return torch.cat([torch.cat(rows) for rows in logits])


def _assert_close(ours: torch.Tensor, modules: torch.Tensor) -> None:
    torch.testing.assert_close(ours, modules, rtol=1e-4, atol=1e-4 * modules.abs().max().item())


@pytest.mark.parametrize("out_type", ["q8_0", "q4_1", "f16", "k-quant mix", "q8_0 sliding window"])
def test_cpu_decode_path_matches_the_modules_and_the_dense_path(tmp_path, out_type):
    """Every matmul on the int8 kernel (or half_matmul: f16): decode-only steps run cpu_decode.py's
    one-call path; its logits equal the modules' (same kernels, same order) and the dequantized
    dense model's within the int8-activation tolerance above. GGUF files from hearth's converter (gguf's quantizer),
    a Q4_K_M-like mix of K-quants (hidden 256, intermediate 512: whole super-blocks), and mistral
    with an 8-token window (the decodes past it)."""
    from hearth.backend.cpu import cpu_kernels
    from hearth.backend.cpu_decode import CpuDecodePath

    if kernels.extension() is None or cpu_kernels() is None:
        pytest.skip("the C++ kernels could not be built here")
    build = _decode_path_builder(tmp_path, out_type)
    model = build()
    assert CpuDecodePath.for_model(model, cpu_kernels()) is not None
    modules_only = build()
    modules_only.backend_state["decode_path"] = None
    dense = _dense_copy(build())
    assert CpuDecodePath.for_model(dense, cpu_kernels()) is None  # dense matmuls: the modules' path
    if out_type == "k-quant mix":
        assert [p.qtype for p in model.layers[0].self_attn.qkv_proj.parts] == [Q.Q4_K, Q.Q6_K]

    tokens = torch.randint(0, VOCAB_SIZE, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    chunks = [20] + [1] * 10  # a prefill (modules), then decodes (the one-call path)
    ours, modules, reference = (_logits(m, tokens, chunks) for m in (model, modules_only, dense))
    assert model.backend_state["decode_path"] is not None
    _assert_close(ours[20:], modules[20:])
    error = ((ours - reference).abs().max() / reference.abs().max()).item()
    if out_type == "k-quant mix":
        # q8_K rounds 256 activations to one scale, 8x coarser steps than q8_0 where one value
        # stands out: through this model that moves logits by ~12% of the largest. The same
        # rounding written in torch on the dense weights (per 32 values for Q4_K in groups of 8
        # rows, on AVX2 builds) lands within ~1% of ours.
        rounded = _logits(_dense_copy(build(), round_inputs=True), tokens, chunks)
        assert ((ours - rounded).abs().max() / rounded.abs().max()).item() <= 3e-2
        assert error <= 0.2 and (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9
    else:
        assert error <= 3e-2 and (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9

    # three sequences of different lengths decoding together, blocks interleaved
    _assert_close(_batch_decode(model, tokens), _batch_decode(modules_only, tokens))

    # verification steps (a few new rows per sequence, 1, 4 and 3 side by side) take the one-call
    # path too; each row's logits equal the modules' in the same step, and those of the same
    # tokens decoded one at a time
    path_calls = []
    original = model.backend_state["decode_path"]
    model.backend_state["decode_path"] = lambda *a: path_calls.append(1) or original(*a)
    ours = _verify(model, tokens, [[1, 4, 3], [2, 1, 4]])
    assert len(path_calls) == 2  # both steps through the one-call path
    _assert_close(ours, _verify(modules_only, tokens, [[1, 4, 3], [2, 1, 4]]))  # the same steps
    _assert_close(ours, _verify(modules_only, tokens, [[1, 1, 1]] * 3 + [[0, 1, 1]] * 2 + [[0, 0, 1]] * 2))
