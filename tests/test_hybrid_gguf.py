"""GGUF of the hybrids, as llama.cpp names and stores them (hearth/loading/hybrid_gguf.py): Qwen3.5 (qwen35),
Qwen3-Next (qwen3next), Granite 4.0-H (granitehybrid), Nemotron-H (nemotron_h) and with experts
(nemotron_h_moe), and LFM2 (lfm2). Tiny random models in the real layer structure
(tests/models.py) with the shapes llama.cpp can hold (its Gated DeltaNet: key and value heads of one size;
Qwen3.5's M-RoPE sections within its rotated dimensions): `hearth convert` writes them, and hearth's logits on
the file, on the reference and cpu backends, equal transformers' on the folder; greedy tokens too. Where
llama.cpp is at hand (llama-cpp-python, and its source tree's convert_hf_to_gguf.py through
LLAMA_CPP_SOURCE), llama.cpp's own converter writes the same tensors (names, shapes, values) from the same
folders, and llama.cpp's logits on hearth's file agree with hearth's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hearth import LLM, SamplingParams
from hearth.backend import choose_backend
from hearth.engine.runner import BatchEntry, ModelRunner
from hearth.errors import ModelLoadError
from hearth.loading.convert import convert_hf_to_gguf
from hearth.loading.gguf_reader import read_gguf
from hearth.loading.loader import load_model
from hearth.loading.names import MTP_ARCHITECTURES
from models import add_mtp_weights, load_hf_reference, make_hf_model
from optional import import_llama_cpp, llama_cpp_source

PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 120, 33, 64, 11, 150, 2, 77, 31, 18]
# case -> (hearth's architecture, llama.cpp's, what differs from tests/models.py's config)
CASES = {
    "lfm2": ("lfm2", "lfm2", dict(conv_bias=False)),  # (its convolution stored 2-D: llama.cpp refused it 3-D)
    "qwen3_5": ("qwen3_5", "qwen35", dict(linear_value_head_dim=8, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
        "mrope_interleaved": True})),
    "qwen3_next": ("qwen3_next", "qwen3next", dict(linear_value_head_dim=8, mlp_only_layers=[])),
    "granitemoehybrid": ("granitemoehybrid", "granitehybrid", {}),
    "nemotron_h": ("nemotron_h", "nemotron_h",
                   dict(layers_block_type=["mamba", "mlp", "attention", "mlp", "mamba"])),
    "nemotron_h_moe": ("nemotron_h", "nemotron_h_moe",
                       dict(layers_block_type=["mamba", "moe", "attention", "moe", "mamba"])),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{case: (folder, hearth convert's f32 file, transformers' logits over PROMPT, its 4 greedy tokens)}."""
    root = tmp_path_factory.mktemp("hybrid-gguf")
    out = {}
    for case, (arch, _, overrides) in CASES.items():
        folder = make_hf_model(root / case, arch, **overrides)
        if arch in MTP_ARCHITECTURES:  # with the multi-token-prediction layer their checkpoints ship
            add_mtp_weights(folder)
        if arch == "granitemoehybrid":  # its layer kinds under the names of the released configs (both read alike)
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**config, "layer_types": ["mamba", "attention", "mamba"]}))
        reference = load_hf_reference(folder)
        with torch.no_grad():
            logits = reference(torch.tensor([PROMPT])).logits[0]
            greedy = reference.generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                                        pad_token_id=0)[0, len(PROMPT):].tolist()
        out[case] = (folder, convert_hf_to_gguf(folder, root / f"{case}.gguf", "f32", progress=False), logits, greedy)
    return out


def _hearth_logits(path: Path, backend: str) -> torch.Tensor:
    model = load_model(path, progress=False, backend=choose_backend(torch.device("cpu"), torch.float32, backend)).model
    runner = ModelRunner(model, 4, 16, torch.device("cpu"), torch.float32, num_state_slots=1)
    hidden, _ = runner.forward([BatchEntry(PROMPT, 0, [0, 1, 2, 3], state_slot=0)])
    return model.compute_logits(hidden)


@pytest.mark.parametrize("case", list(CASES))
def test_converted_file_runs_as_the_folder(case, converted):
    """llama.cpp's architecture and tensor names (each one of gguf-py's for it); hearth's logits on the f32
    file equal transformers' within 1e-4 on both backends, and the engine's greedy tokens are transformers'."""
    from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES

    folder, path, want, greedy = converted[case]
    file = read_gguf(path)
    arch = CASES[case][1]
    assert file.metadata["general.architecture"] == arch
    known = next(MODEL_TENSORS[a] for a in MODEL_ARCH if MODEL_ARCH_NAMES[a] == arch)
    names = {TENSOR_NAMES[t].format(bid=b) for t in known for b in range(5)}
    if CASES[case][0] in MTP_ARCHITECTURES:  # (the installed gguf-py lists nextn tensors for them only from 0.3.36's)
        names |= {TENSOR_NAMES[t].format(bid=b) for t in MODEL_TENSOR if t.name.startswith("NEXTN_") for b in range(5)}
    assert {t.name.removesuffix(".weight").removesuffix(".bias") for t in file.tensors} <= names
    for backend in ("reference", "cpu"):
        assert (_hearth_logits(path, backend) - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert LLM(path, progress=False).generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids == greedy


def test_qwen3_5_decode_steps_run_in_one_kernel_call(converted, tmp_path, monkeypatch):
    """Qwen3.5 in F16 (every projection on the half kernels): its decode steps run cpu_kernels/'s decode_layers,
    Gated DeltaNet layers and gated attention (q/k norms, partial RoPE, the output gate) in the one call; two
    sequences' greedy tokens equal the reference backend's, and their log-probabilities the modules' within 1e-5."""
    from hearth.backend.base import Backend
    from hearth.backend.cpu_decode import CpuDecodePath
    from hearth.backend.cpu_linear import cpu_linear

    def cpu_matmuls(backend, module, weight, dtype):  # (the reference backend on the cpu backend's matmuls)
        embedding = isinstance(module, torch.nn.Embedding)
        return reference_module(backend, module, weight, dtype) if embedding else cpu_linear(weight, module.bias)

    reference_module, run, kernel_steps = Backend.stored_module, CpuDecodePath.__call__, []
    monkeypatch.setattr(CpuDecodePath, "__call__", lambda path, x, *args: kernel_steps.append(
        (out := run(path, x, *args)) is not None) or out)
    path = convert_hf_to_gguf(converted["qwen3_5"][0], tmp_path / "f16.gguf", "f16", progress=False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    runs = {}
    for name, backend in (("kernel", "cpu"), ("reference", "reference"), ("modules", "cpu")):
        with monkeypatch.context() as patch:
            patch.setattr(Backend, "stored_module", cpu_matmuls)
            if name == "modules":
                patch.setattr(CpuDecodePath, "for_model", classmethod(lambda cls, model, kernels: None))
            llm = LLM(path, backend=backend, progress=False)
            runs[name] = [o.outputs[0] for o in llm.generate([PROMPT, PROMPT[:9]], params, use_tqdm=False)]
        if name == "kernel":
            assert kernel_steps.count(True) >= 5 and isinstance(llm.engine.model.backend_state["decode_path"], CpuDecodePath)
    tokens = {name: [o.token_ids for o in outputs] for name, outputs in runs.items()}
    assert tokens["kernel"] == tokens["reference"] == tokens["modules"]
    for ours, theirs in zip(runs["kernel"], runs["modules"]):
        for step, want in zip(ours.logprobs, theirs.logprobs):
            assert step.keys() == want.keys() and max(abs(step[t] - want[t]) for t in want) <= 1e-5


@pytest.mark.parametrize("case", [case for case, (arch, *_) in CASES.items() if arch in MTP_ARCHITECTURES])
def test_the_mtp_layer_goes_through_the_file(case, converted):
    """Qwen3.5's and Qwen3-Next's MTP layer (mtp.*) goes into the file as llama.cpp's converter writes it (a block
    after the last layer with its nextn tensors, nextn_predict_layers 1) and comes back as the folder's: every
    tensor of hearth's MTP module equal (its norms stored as 1 + w), the model's layers as many as before."""
    folder, path, _, _ = converted[case]
    assert read_gguf(path).metadata[f"{CASES[case][1]}.nextn_predict_layers"] == 1
    ours, theirs = (load_model(p, progress=False).model for p in (path, folder))
    assert ours.config.mtp_layers == theirs.config.mtp_layers == 1 and len(ours.layers) == len(theirs.layers)
    want = theirs.mtp.state_dict()
    for name, got in ours.mtp.state_dict().items():
        offset = 1.0 if "norm" in name else 0.0  # (the folder's model: (1 + w); the file's: as stored)
        torch.testing.assert_close(got, want[name] + offset, rtol=0, atol=1e-6, msg=name)


def test_what_llama_cpp_cannot_hold_is_refused_by_name(tmp_path):
    """Key and value heads of two sizes (llama.cpp's qwen35 has one, ssm.state_size), Qwen3-Next's dense MLP
    layers (llama.cpp's qwen3next has experts in every layer), Nemotron-H with MLP and expert blocks both
    (llama.cpp's nemotron_h_moe runs every MLP block as experts): no file is left behind."""
    for arch, overrides, message in (
            ("qwen3_5", {}, "linear_key_head_dim 8 and linear_value_head_dim 12: llama.cpp's qwen35 has one size"),
            ("qwen3_next", dict(linear_value_head_dim=8), r"dense MLP layers \[1\]"),
            ("nemotron_h", {}, "both MLP and expert blocks")):
        folder = make_hf_model(tmp_path / arch, arch, **overrides)
        with pytest.raises(ModelLoadError, match=message):
            convert_hf_to_gguf(folder, tmp_path / f"{arch}.gguf", "f32", progress=False)
    assert not list(tmp_path.glob("*.gguf*"))


# ---------------------------------------------------------------- llama.cpp itself

# llama.cpp's converter on the tiny folders: its pre-tokenizer check knows only released tokenizers' hashes
# (the test's tiny BPE is none of them; the tensors are what is compared), so it is told "gpt-2"
_CONVERTER = """import sys
sys.path.insert(0, sys.argv[1])
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
import convert_hf_to_gguf
for args in sys.argv[2:]:
    sys.argv = ["convert_hf_to_gguf.py", *args.split("|")]
    convert_hf_to_gguf.main()
"""


@pytest.fixture(scope="module")
def llama_cpp_converted(converted, tmp_path_factory):
    """{case: llama.cpp's convert_hf_to_gguf.py's f32 file of the folder} (LLAMA_CPP_SOURCE: its source tree)."""
    source = llama_cpp_source()
    root = tmp_path_factory.mktemp("llama-cpp-converted")
    runs = []
    for case, (folder, *_) in converted.items():
        mtp = ["--no-mtp"] if CASES[case][0] == "nemotron_h" else []  # (hearth leaves its MTP out; Qwen's: kept)
        runs.append("|".join([*mtp, "--outtype", "f32", "--outfile", str(root / f"{case}.gguf"), str(folder)]))
    subprocess.run([sys.executable, "-c", _CONVERTER, str(source), *runs], check=True, capture_output=True)
    return {case: root / f"{case}.gguf" for case in converted}


@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_converts_the_same_tensors_and_runs_hearths_file(case, converted, llama_cpp_converted):
    """llama.cpp's converter and `hearth convert` write the same tensors from one folder (names, shapes, values:
    Qwen3.5's tiled value heads, Qwen3-Next's ssm_ba, -exp(A_log), Q/K rows, ...). llama.cpp runs hearth's file
    with hearth's logits: within 2e-3 of the largest (its KV cache in f16; measured 1.2e-3 at most, qwen3next)."""
    from gguf import GGUFReader

    folder, path, want, _ = converted[case]
    ours = {t.name: np.array(t.data) for t in GGUFReader(path).tensors}
    theirs = {t.name: np.array(t.data) for t in GGUFReader(llama_cpp_converted[case]).tensors}
    assert sorted(ours) == sorted(theirs)
    for name, values in theirs.items():
        assert ours[name].shape == values.shape, name
        np.testing.assert_allclose(ours[name], values, rtol=0, atol=1e-6, err_msg=name)
    llama_cpp = import_llama_cpp()
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=64, n_threads=1, verbose=False)
    llm.eval(PROMPT)
    got = torch.from_numpy(np.array(llm.scores[: len(PROMPT)]))
    assert (got - _hearth_logits(path, "cpu")).abs().max().item() <= 2e-3 * want.abs().max().item()
