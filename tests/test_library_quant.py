"""GPTQ, AWQ and fp8 checkpoints (config.json's quantization_config) read by hearth.

Each checkpoint is built here from known integer weights, packed as AutoGPTQ / GPTQModel and
AutoAWQ document their layouts (written out below in numpy, independently of hearth's unpacking);
the reference is transformers running the dense weights those integers stand for,
W[o, i] = s[g(i), o] * (q[i, o] - z[g(i), o]) computed in float32. The gpu backend runs them on a GPU
or, without one, in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from safetensors.torch import load_file, save_file

from hearth.backend import choose_backend
from hearth.backend.gpu_linear import TritonQuantLinear
from hearth.errors import ModelLoadError
from hearth.loading.convert import convert_hf_to_gguf
from hearth.loading.library_quant import read_library_weights
from hearth.loading.loader import read_model
from hearth.quant import QuantTensor
from hearth.triton_kernels import quant_matmul
from hearth.triton_kernels.quant_matmul import GemvConfig
from models import hearth_greedy, hearth_logits, load_hf_reference, make_hf_model

TOKENS = [3, 17, 42, 99, 7, 250, 31, 8, 64, 5]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's GEMM packing: the k-th 4 bits of a word hold column AWQ_ORDER[k]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the gpu backend's: without a GPU, Triton's interpreter
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A float32 llama of one layer with in_features 128 and 256 (groups of 128 fit) and its transformers model."""
    folder = make_hf_model(tmp_path_factory.mktemp("library") / "dense", "llama", hidden_size=128,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    return folder, load_hf_reference(folder)


def pack_words(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """uint values -> int32 words, 32 / bits consecutive values along `axis` in one word, the first in the low bits."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, per) << (np.arange(per, dtype=np.uint32) * bits)
    return np.moveaxis(np.bitwise_or.reduce(v, axis=-1), -1, axis).view(np.int32)


def integer_projection(weight: torch.Tensor, scheme: dict, rng: np.random.Generator):
    """Known integers for a projection of weight's shape: q [in, out], zeros [groups, out], float16
    scales [groups, out] and g_idx [in]; and the dense weight [out, in] they stand for."""
    out_features, in_features = weight.shape
    bits, group = scheme["bits"], scheme["group_size"]
    groups = in_features // group
    g_idx = np.arange(in_features) // group
    if scheme.get("desc_act"):  # act-order: columns quantized in a permuted order, the groups following it
        g_idx = g_idx[rng.permutation(in_features)]
    q = rng.integers(0, 1 << bits, size=(in_features, out_features))
    zeros = np.full((groups, out_features), 1 << (bits - 1)) if scheme["sym"] else \
        rng.integers(0, 1 << bits, size=(groups, out_features))
    if scheme["method"] == "gptq" and not scheme["sym"]:
        zeros = np.maximum(zeros, 1)  # GPTQ v1 stores z - 1 in `bits` bits: z >= 1
    scales = (weight.abs().amax().item() / (1 << bits) * (0.5 + rng.random((groups, out_features)))).astype(np.float16)
    dense = scales.astype(np.float32)[g_idx] * (q - zeros[g_idx]).astype(np.float32)
    return q, zeros, scales, g_idx, torch.from_numpy(dense.T.copy())


def packed_tensors(prefix: str, q, zeros, scales, g_idx, scheme: dict) -> dict[str, torch.Tensor]:
    bits = scheme["bits"]
    if scheme["method"] == "awq":  # [in, out / 8] and [groups, out / 8], columns in AWQ_ORDER within a word
        reorder = lambda x: x.reshape(x.shape[0], -1, 8)[:, :, AWQ_ORDER].reshape(x.shape[0], -1)  # noqa: E731
        tensors = {"qweight": pack_words(reorder(q), 4, 1), "qzeros": pack_words(reorder(zeros), 4, 1)}
    else:  # GPTQ: qweight [in * bits / 32, out] packed along the input, qzeros [groups, out * bits / 32] storing z - 1
        tensors = {"qweight": pack_words(q, bits, 0), "qzeros": pack_words(zeros - 1, bits, 1),
                   "g_idx": g_idx.astype(np.int32)}
    tensors["scales"] = scales
    return {f"{prefix}.{name}": torch.from_numpy(np.ascontiguousarray(t)) for name, t in tensors.items()}


def quantized_folder(dense_folder, folder, scheme: dict, seed: int = 0):
    """`dense_folder`'s model with every layer projection replaced by known integers packed per `scheme`;
    returns the folder and the dense weights (by HF name) the integers stand for."""
    shutil.copytree(dense_folder, folder)
    tensors = load_file(folder / "model.safetensors")
    rng, references = np.random.default_rng(seed), {}
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        prefix = name.removesuffix(".weight")
        q, zeros, scales, g_idx, references[name] = integer_projection(tensors.pop(name), scheme, rng)
        tensors.update(packed_tensors(prefix, q, zeros, scales, g_idx, scheme))
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": scheme["method"], "bits": scheme["bits"],
                                     "group_size": scheme["group_size"], "desc_act": scheme.get("desc_act", False),
                                     "sym": scheme["sym"], **({"version": "gemm", "zero_point": True}
                                                              if scheme["method"] == "awq" else {})}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, references


def reference_logits(model, references: dict[str, torch.Tensor]) -> torch.Tensor:
    state = {name: p.clone() for name, p in model.state_dict().items()}
    with torch.no_grad():
        model.load_state_dict({**state, **references})
        logits = model(torch.tensor([TOKENS])).logits[0]
        model.load_state_dict(state)
    return logits


SCHEMES = {
    "gptq-sym-g128": ({"method": "gptq", "bits": 4, "group_size": 128, "sym": True}, Q.Q4_0),
    "gptq-asym-g32-act-order": ({"method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": True},
                                Q.Q5_0),
    "gptq-8bit-g64": ({"method": "gptq", "bits": 8, "group_size": 64, "sym": True}, Q.Q8_0),
    "awq-gemm-g64": ({"method": "awq", "bits": 4, "group_size": 64, "sym": False}, Q.Q5_0),
}


@pytest.mark.parametrize("name", SCHEMES)
def test_checkpoint_loads_as_the_dense_weights_it_stands_for(dense, tmp_path, monkeypatch, name):
    scheme, qtype = SCHEMES[name]
    folder, references = quantized_folder(dense[0], tmp_path / name, scheme)
    config, weights, _ = read_model(folder, progress=False)
    for hf_name, want in references.items():
        got = weights[hf_name]
        assert isinstance(got, QuantTensor) and got.qtype == qtype, hf_name
        assert (got.column_order is not None) == scheme.get("desc_act", False)
        assert torch.equal(got.dequantize(), want), hf_name  # bit-exact: the blocks hold the same products
    want = reference_logits(dense[1], references)
    # the reference backend (dequantized, float32 matmuls); for act-order a decode step too (on the gpu backend:
    # the GEMV, the interpreter's seconds, so for one scheme)
    exact, tokens, _ = hearth_greedy(config, weights, TOKENS, 2 if scheme.get("desc_act") else 1)
    torch.testing.assert_close(exact, want, rtol=1e-4, atol=1e-4)
    kernels = hearth_logits(config, weights, TOKENS, choose_backend(torch.device("cpu"), torch.float32, "cpu"))
    assert ((kernels - want).abs().max() / want.abs().max()).item() < 0.08  # int8 activations' rounding
    check_gpu_backend(config, weights, references, qtype, monkeypatch, exact, tokens)
    if scheme.get("desc_act"):  # hearth convert writes the exact dense values
        written = {t.name: t for t in GGUFReader(convert_hf_to_gguf(folder, tmp_path / "out.gguf", "f32",
                                                                     progress=False)).tensors}
        got = np.asarray(written["blk.0.ffn_down.weight"].data)
        assert np.array_equal(got, references["model.layers.0.mlp.down_proj.weight"].numpy())


def check_gpu_backend(config, weights, references, qtype, monkeypatch, exact: torch.Tensor, tokens: list[int]) -> None:
    """On the gpu backend every projection stays in its blocks (Triton kernels); its logits are the
    reference backend's `exact` (exact weights, fp32 sums; a GPU's tl.dot takes float32 in tf32) and its
    greedy continuation is the reference's `tokens`."""
    if INTERPRETED:  # the interpreter runs a program at a time: the GEMV's fewest programs (every launch is tested)
        for key in list(quant_matmul.GEMV_CONFIGS):
            monkeypatch.setitem(quant_matmul.GEMV_CONFIGS, key, GemvConfig(block_n=32, block_k=256))
    logits, gpu_tokens, model = hearth_greedy(config, weights, TOKENS, len(tokens),
                                              choose_backend(torch.device(DEVICE), torch.float32, "gpu"), DEVICE)
    kept = [m for m in model.modules() if isinstance(m, TritonQuantLinear) and m.qtype == qtype]
    assert sum(m.in_features * m.out_features for m in kept) == sum(w.numel() for w in references.values())
    assert ((logits - exact).abs().max() / exact.abs().max()).item() < (1e-5 if INTERPRETED else 1e-2)
    assert gpu_tokens == tokens


def test_8bit_zero_points_beyond_q8_0_stay_dense():
    """8-bit q - z of [-255, 254] fits no block format exactly: the weight is dense float32 (logged), not an error."""
    scheme = {"method": "gptq", "bits": 8, "group_size": 32, "sym": False}
    q, zeros, scales, g_idx, want = integer_projection(torch.ones(64, 96), scheme, np.random.default_rng(1))
    packed = packed_tensors("proj", q, zeros, scales, g_idx, scheme)
    got = read_library_weights(packed, {"quant_method": "gptq", "bits": 8, "group_size": 32, "sym": False}, "test")
    assert not isinstance(got["proj.weight"], QuantTensor) and torch.equal(got["proj.weight"], want)


def test_fp8_blocks_are_read_dense(dense, tmp_path):
    folder = shutil.copytree(dense[0], tmp_path / "fp8")
    tensors, references = load_file(folder / "model.safetensors"), {}
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        rows, cols = tensors[name].shape
        scale = torch.rand(-(-rows // 128), -(-cols // 128)) * 0.01 + 0.001
        values = (tensors[name] / 0.01).to(torch.float8_e4m3fn)
        tensors[name], tensors[name + "_scale_inv"] = values, scale
        expanded = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        references[name] = values.float() * expanded
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    config, weights, _ = read_model(folder, progress=False)
    assert all(torch.equal(weights[n], want) for n, want in references.items())
    torch.testing.assert_close(hearth_logits(config, weights, TOKENS), reference_logits(dense[1], references),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("quantization, message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size=100"),
])
def test_unread_quantizations_are_refused_by_name(dense, tmp_path, quantization, message):
    folder = shutil.copytree(dense[0], tmp_path / "q")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(ModelLoadError, match=message):
        read_model(folder, progress=False)
