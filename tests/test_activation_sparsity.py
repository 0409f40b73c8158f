"""Activation sparsity (TEAL / CATS; docs/sparsity.md): the column-skipping kernel against a dense
matmul of the masked activations, the calibrated thresholds against the target sparsity on held-out
text, sparsity 0 against the dense model bit for bit, the cpu backend's sparse model against the
reference backend's masked dense one, and the errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from hearth import LLM, SamplingParams
from hearth.backend.base import Backend
from hearth.backend.sparse_linear import SPARSE_BLOCK_QTYPES, SPARSE_MAX_ROWS, SparseBlocksLinear, SparseColumnsLinear
from hearth.cli import main
from hearth.engine_config import SparsityConfig
from hearth.errors import HearthError
from hearth.loading.activation_thresholds import read_thresholds, write_thresholds
from hearth.loading.loader import load_model
from hearth.model.activation_sparsity import apply_activation_sparsity, site_modules
from hearth.perplexity import perplexity
from hearth.quant import kernels
from hearth.sparsify import calibrate, magnitude_histogram, quantiles

REPO = Path(__file__).resolve().parents[1]
CALIBRATION = (REPO / "README.md").read_text(encoding="utf-8")[:6000]
HELD_OUT = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")[:4000]

ext = kernels.extension()
needs_kernels = pytest.mark.skipif(ext is None, reason="hearth's C++ kernels did not build")


def masked_matmul(x: torch.Tensor, w: torch.Tensor, threshold: float) -> torch.Tensor:
    """TEAL's rule written out: y[m, n] = sum_k [|x[m, k]| >= t] x[m, k] W[n, k], in float64."""
    keep = (x.abs() >= threshold).double()
    return (x.double() * keep) @ w.double().T


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sparse_kernel_equals_masked_dense_matmul(dtype):
    generator = torch.Generator().manual_seed(7)
    for m, k, n in [(1, 64, 8), (1, 576, 1536), (3, 100, 37), (SPARSE_MAX_ROWS, 256, 1030), (2, 7, 3), (20, 96, 40)]:
        x = torch.randn(m, k, generator=generator)
        w = torch.randn(n, k, generator=generator).to(dtype)
        bias = torch.randn(n, generator=generator)
        threshold = float(x.abs().flatten().kthvalue(max(1, int(0.4 * x.numel()))).values)
        module = SparseColumnsLinear(w, bias, threshold, ext)
        expected = masked_matmul(x, w.float(), threshold) + bias.double()
        got = module(x)  # up to SPARSE_MAX_ROWS rows: the kernel; more: the masked GEMM
        scale = (x.abs().double() @ w.float().abs().double().T).max().item()
        assert got.dtype == torch.float32 and got.shape == (m, n)
        assert (got.double() - expected).abs().max().item() <= 1e-5 * scale, (m, k, n)


@needs_kernels
def test_sparse_kernel_never_reads_a_masked_column():
    """A column whose activations are all masked is skipped, not multiplied by zero: NaN weights there
    leave the output finite (0 * NaN would be NaN)."""
    x = torch.randn(2, 64)
    x[:, 10:20] = 0.01  # under the threshold in both rows
    w = torch.randn(48, 64)
    clean = masked_matmul(x, w, 0.1)
    w[:, 10:20] = float("nan")
    got = SparseColumnsLinear(w.half(), None, 0.1, ext)(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), masked_matmul(x, w.nan_to_num(0.0).half().float(), 0.1), rtol=1e-5,
                               atol=1e-4)
    assert torch.isfinite(clean).all()


# bits a weight of SparseBlocksLinear's layout at sparsity 0 (codes + scales; sparse_blocks.cpp): a
# masked column saves its codes' bits (4 or 8)
LAYOUT_BITS = {Q.Q4_0: 4 + 16 / 32, Q.Q4_1: 4 + 32 / 32, Q.Q4_K: 4 + 32 / 256 + 16 / 32, Q.Q8_0: 8 + 16 / 32,
               Q.Q6_K: 8 + 16 / 256 + 8 / 16}


def activation_group(module: SparseBlocksLinear, rows: int) -> int:
    """Activations per int8 scale: the sparse kernel's sub-block (Q6_K: 16, else 32); int8_matmul's (a
    K-quant's 256: q8_K) where the module takes it (more than SPARSE_MAX_ROWS rows, or no re-layout)."""
    if rows > SPARSE_MAX_ROWS or not module.skips_columns:
        return GGML_QUANT_SIZES[module.qtype][0]
    return 16 if module.qtype == Q.Q6_K else 32


def int8_bound(kept: torch.Tensor, w: torch.Tensor, group: int) -> torch.Tensor:
    """|y - kept @ W^T| bound of int8 activations per `group` values (each kept activation off by at most
    amax / 254 of its group and row), plus fp32 rounding: [M, N]."""
    (m, k), n = kept.shape, w.shape[0]
    step = kept.abs().reshape(m, k // group, group).amax(-1).double() / 254  # [M, K / group]
    return step @ w.abs().double().reshape(n, k // group, group).sum(-1).T + 1e-5 * kept.abs().double() @ w.abs().double().T


@needs_kernels
def test_sparse_block_kernel_equals_the_masked_dequantized_matmul():
    """Q8_0, Q4_0, Q4_1, Q4_K, Q6_K weights re-laid out column by column: sparse_matmul against gguf's
    dequantizer and a float64 matmul of the masked activations, within the bound of rounding the kept
    activations to int8 (each off by at most amax / 254 of its sub-block of S values and row); a
    column every row masks is never read (its codes overwritten: the same output bit for bit);
    threshold 0 is the whole product, a threshold over every |x| gives 0."""
    from test_quant_linear import random_weight

    g = torch.Generator().manual_seed(11)
    for qtype in SPARSE_BLOCK_QTYPES:
        n, k = 128, 512
        data = random_weight(qtype, n, k, g)  # random codes, sane fp16 scales
        w = torch.from_numpy(gguf_dequantize(data.numpy(), qtype)).reshape(n, k).double()
        for m in (1, 3, SPARSE_MAX_ROWS, 11):  # 11: a prefill's rows (the masked input through int8_matmul)
            x = torch.randn(m, k, generator=g)
            x[:, 40] = 1e-3  # under the threshold in every row
            for threshold in (0.0, float(x.abs().flatten().kthvalue(int(0.4 * x.numel())).values), 99.0):
                module = SparseBlocksLinear.from_blocks(data, qtype, (n, k), None, threshold, ext)
                assert module.layout.numel() * 8 == LAYOUT_BITS[qtype] * n * k
                kept = x * (x.abs() >= threshold)
                got = module(x)
                bound = int8_bound(kept, w, activation_group(module, m))
                assert ((got.double() - kept.double() @ w.T).abs() - bound).max() <= 1e-9, (qtype.name, m, threshold)
                if threshold == 99.0:
                    assert not got.any()
                elif threshold > 0 and m <= SPARSE_MAX_ROWS:
                    bits = 4 if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K) else 8
                    module.layout[40 * n * bits // 8:41 * n * bits // 8] = 0x5A  # column 40's codes
                    assert torch.equal(module(x), got)


def test_histogram_quantiles_match_torch_quantile():
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(3)) * 0.3
    found = quantiles(magnitude_histogram(x), (0.0, 0.25, 0.4, 0.5, 0.9))
    expected = [0.0] + [torch.quantile(x.abs(), s).item() for s in (0.25, 0.4, 0.5, 0.9)]
    assert found == pytest.approx(expected, rel=0.01)


@pytest.fixture(scope="module")
def thresholds_file(tmp_path_factory) -> Path:
    loaded = load_model("builtin", progress=False)
    thresholds = calibrate(loaded.model, loaded.tokenizer.encode(CALIBRATION), 256, torch.device("cpu"), "builtin")
    return write_thresholds(tmp_path_factory.mktemp("sparsity") / "builtin.json", thresholds)


def test_thresholds_give_the_target_sparsity_on_held_out_text(thresholds_file):
    loaded = load_model("builtin", progress=False)
    thresholds = read_thresholds(thresholds_file)
    shares: dict[float, list[float]] = {s: [] for s in (0.25, 0.4, 0.5)}
    hooks = []
    for key, module in site_modules(loaded.model).items():
        def measure(_, args, key=key):
            for s in shares:
                shares[s].append((args[0].abs() < thresholds.at(s)[key]).double().mean().item())

        hooks.append(module.register_forward_pre_hook(measure))
    perplexity(loaded.model, loaded.tokenizer.encode(HELD_OUT), 256, torch.device("cpu"))
    for hook in hooks:
        hook.remove()
    for s, measured in shares.items():
        assert sum(measured) / len(measured) == pytest.approx(s, abs=0.03)
        assert max(abs(m - s) for m in measured) < 0.12  # every input of every layer, each window


@needs_kernels
def test_sparsity_zero_is_dense_and_the_cpu_kernels_equal_the_masked_reference(thresholds_file):
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    prompts = ["The KV cache", "Speculative decoding is"]

    def run(**options):
        outputs = LLM("builtin", progress=False, **options).generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    assert run(activation_sparsity=0.0, activation_thresholds=str(thresholds_file)) == run()  # bit for bit

    sparse = SparsityConfig(0.4, str(thresholds_file))
    ids = load_model("builtin", progress=False).tokenizer.encode(HELD_OUT)
    cpu = load_model("builtin", progress=False, sparsity=sparse)
    reference = load_model("builtin", progress=False, backend=Backend(), sparsity=sparse)
    skipping = [m for m in cpu.model.modules() if isinstance(m, SparseColumnsLinear)]
    assert len(skipping) == 4 * cpu.config.num_layers  # q/k/v, o, gate/up, down: every projection's input
    nll = [perplexity(m.model, ids, 64, torch.device("cpu"))["nll"] for m in (cpu, reference)]
    dense = perplexity(load_model("builtin", progress=False).model, ids, 64, torch.device("cpu"))["nll"]
    assert nll[0] == pytest.approx(nll[1], rel=1e-4) and nll[0] != dense


@needs_kernels
@pytest.mark.parametrize("out_type", ["builtin", "k-quant mix"])
def test_a_sparse_model_keeps_the_one_call_decode_path(tmp_path, out_type):
    """Every projection sparse (the built-in model's F16: SparseColumnsLinear; Q4_K, Q6_K: re-laid-out
    SparseBlocksLinear; Q5_K: its blocks as stored, masked), decode steps still run cpu_decode.py's one
    call, and its logits equal the modules' (the same kernels, also three sequences at once); on the
    modules' path every projection's output equals the masked reference on its own input (the
    dequantized weight, the activations under the threshold zeroed, float64) within the int8 bound
    (F16: fp32 rounding). (A whole-model comparison with a masked reference amplifies tiny
    differences: an activation near a threshold masked on one side and kept on the other.) On AVX-512 VNNI
    builds the K-quants are packed tiles, which have no re-layout: each masked by ThresholdedLinear, off the
    one-call path (docs/sparsity.md), its output still the masked reference's."""
    from test_quant_linear import _assert_close, _batch_decode, _decode_path_builder, _logits

    from hearth.backend.cpu import cpu_kernels
    from hearth.backend.cpu_decode import CpuDecodePath

    if out_type == "builtin":
        build = lambda: load_model("builtin", progress=False).model  # noqa: E731
    else:
        build = _decode_path_builder(tmp_path, out_type)
    dense = build()
    tokens = torch.randint(0, dense.config.vocab_size, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    thresholds = calibrate(dense, tokens, 40, torch.device("cpu"), out_type).at(0.4)
    model, modules_only = build(), build()
    for m in (model, modules_only):
        apply_activation_sparsity(m, thresholds)
    modules_only.backend_state["decode_path"] = None
    projections = [m for m in modules_only.modules() if hasattr(m, "threshold")]
    tiles = out_type != "builtin" and kernels.extension().vnni
    assert len(projections) >= 4 * len(model.layers)
    _assert_sparse_modules(projections, out_type, tiles)
    assert (CpuDecodePath.for_model(model, cpu_kernels()) is None) == tiles
    # each projection's weight as gguf dequantizes the file's blocks (from a fresh copy: not re-laid out for
    # sparsity; in groups of 8 rows on AVX2 builds, whose blocks gguf_blocks rebuilds byte for byte)
    originals = dict(dense.named_modules())
    # (packed tiles: their own decoding, tested against gguf's in test_quant_linear)
    weights = {p: p.weight_t.T.float() if isinstance(p, SparseColumnsLinear) else originals[name].dequantize() if tiles
               else torch.from_numpy(gguf_dequantize(originals[name].gguf_blocks().numpy(), p.qtype)).reshape(p.out_features, -1)
               for name, p in modules_only.named_modules() if p in projections}
    checked = []

    def check(module, args, out):
        kept, w = args[0] * (args[0].abs() >= module.threshold), weights[module]
        if isinstance(module, SparseColumnsLinear):
            bound = 1e-5 * kept.abs().double() @ w.abs().double().T
        else:
            bound = int8_bound(kept, w, GGML_QUANT_SIZES[module.inner.qtype][0] if tiles else
                               activation_group(module, kept.shape[0]))
        assert ((out.double() - kept.double() @ w.double().T).abs() - bound).max() <= 1e-9
        checked.append(module)

    hooks = [p.register_forward_hook(check) for p in projections]
    chunks = [16] + [1] * 6  # a prefill (modules), then decodes (the one-call path)
    ours, modules = _logits(model, tokens, chunks), _logits(modules_only, tokens, chunks)
    for hook in hooks:
        hook.remove()
    assert set(checked) == set(projections)
    assert (model.backend_state["decode_path"] is None) == tiles
    _assert_close(ours[16:], modules[16:])
    _assert_close(_batch_decode(model, tokens), _batch_decode(modules_only, tokens))  # three sequences at once


def _assert_sparse_modules(projections: list, out_type: str, tiles: bool) -> None:
    """The built-in model's F16: SparseColumnsLinear; the k-quant mix's Q4_K, Q6_K re-laid out, Q5_K masked
    (SparseBlocksLinear); VNNI tiles: ThresholdedLinear around the packed module."""
    from hearth.backend.sparse_linear import SparseLinear, ThresholdedLinear

    if tiles:
        assert all(isinstance(m, ThresholdedLinear) and m.inner.codes is not None for m in projections)
    elif out_type == "builtin":
        assert all(isinstance(m, SparseColumnsLinear) for m in projections)
    else:
        assert all(isinstance(m, SparseLinear) for m in projections)
        assert {(m.qtype, m.skips_columns) for m in projections} == {(Q.Q4_K, True), (Q.Q6_K, True), (Q.Q5_K, False)}


def test_bad_values_get_clear_errors(thresholds_file, tmp_path, capsys):
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"activation_sparsity must be in \[0, 1\)"):
            LLM("builtin", progress=False, activation_sparsity=bad, activation_thresholds=str(thresholds_file))
    with pytest.raises(ValueError, match="needs activation_thresholds"):
        SparsityConfig(0.4, None)
    not_json, other_json = tmp_path / "a.json", tmp_path / "b.json"
    not_json.write_text("thresholds?")
    other_json.write_text(json.dumps({"format": "something else"}))
    draft_shape = json.loads(thresholds_file.read_text())
    for path, message in [(tmp_path / "missing.json", "cannot read"), (not_json, "not JSON"),
                          (other_json, "not an activation thresholds file")]:
        with pytest.raises(HearthError, match=message):
            load_model("builtin", progress=False, sparsity=SparsityConfig(0.4, str(path)))
    with pytest.raises(HearthError, match="another model"):  # the built-in draft has another shape
        load_model("builtin-draft", progress=False, sparsity=SparsityConfig(0.4, str(thresholds_file)))
    assert draft_shape["model"]["num_layers"] != load_model("builtin-draft", progress=False).config.num_layers
    assert main(["perplexity", "builtin", "--text", "hello there", "--activation-sparsity", "2"]) == 1
    assert "activation_sparsity must be in [0, 1)" in capsys.readouterr().err
    from hearth.backend.gpu import GpuBackend  # (its sparse_linear needs no GPU to refuse)

    with pytest.raises(ValueError, match="not implemented on the gpu backend"):
        GpuBackend.sparse_linear(None, None, 0.1)


def test_cli_sparsify_writes_a_file_the_engine_reads(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["sparsify", "builtin", "--text", CALIBRATION[:1500], "--ctx", "128", "-o", str(out)]) == 0
    assert "thresholds of 24 inputs" in capsys.readouterr().out
    config = load_model("builtin", progress=False).config
    read_thresholds(out).check(config, out)  # the built-in model's shape: accepted
    assert main(["sparsify", "builtin", "--text", "hi", "--ctx", "1", "-o", str(out)]) == 1
    assert "--ctx must be at least 2" in capsys.readouterr().err
