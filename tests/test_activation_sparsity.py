"""Activation sparsity (TEAL / CATS; docs/sparsity.md): the column-skipping kernel against a dense
matmul of the masked activations, the calibrated thresholds against the target sparsity on held-out
text, sparsity 0 against the dense model bit for bit, the cpu backend's sparse model against the
reference backend's masked dense one, and the errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hearth import LLM, SamplingParams
from hearth.backend.base import Backend
from hearth.backend.sparse_linear import SPARSE_MAX_ROWS, SparseColumnsLinear
from hearth.cli import main
from hearth.engine_config import SparsityConfig
from hearth.errors import HearthError
from hearth.loading.activation_thresholds import read_thresholds, write_thresholds
from hearth.loading.loader import load_model
from hearth.model.activation_sparsity import site_modules
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
