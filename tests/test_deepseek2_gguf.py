"""deepseek_v2 as llama.cpp's deepseek2 GGUF: `hearth convert` writes it, hearth reads it (the split
attn_k_b / attn_v_b layout of today's converter and the older whole attn_kv_b), against transformers on
a tiny random model of DeepSeek-V2's shape (a query LoRA, YaRN with mscale = mscale_all_dim); where
llama.cpp's converter and llama-cpp-python are here, against what they write and compute."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from hearth import LLM
from hearth.backend import choose_backend
from hearth.loading.convert import convert_hf_to_gguf
from hearth.loading.gguf import load_gguf
from hearth.loading.loader import load_model
from hearth.loading.safetensors import load_hf_folder
from hearth.quant import QuantTensor
from models import VOCAB_SIZE, load_hf_reference, make_hf_model
from optional import import_llama_cpp, llama_cpp_source
from test_engine import greedy, reference_greedy, token_ids
from test_model import _hearth_logits as paged_logits

TOKENS = torch.randint(0, VOCAB_SIZE, (45,), generator=torch.Generator().manual_seed(1)).tolist()
# DeepSeek-V2's YaRN (its config: mscale = mscale_all_dim = 0.707), with a factor that bites within 45 tokens
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The folder (kv_lora_rank 32: attn_v_b's rows are whole Q8_0 blocks, attn_k_b's 16 are not) and
    its F32 and Q8_0 files."""
    root = tmp_path_factory.mktemp("deepseek2")
    folder = make_hf_model(root / "m", "deepseek_v2", q_lora_rank=24, rope_parameters=YARN)
    return {"hf": folder, **{kind: convert_hf_to_gguf(folder, root / f"m-{kind}.gguf", kind, progress=False)
                             for kind in ("f32", "q8_0")}}


@pytest.fixture(scope="module")
def reference_logits(files) -> torch.Tensor:
    with torch.no_grad():
        return load_hf_reference(files["hf"])(torch.tensor([TOKENS])).logits[0]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _logits(path: Path, backend: str) -> torch.Tensor:
    model = load_model(path, progress=False, backend=choose_backend(torch.device("cpu"), torch.float32, backend)).model
    return paged_logits(model, TOKENS, (20, 1, 1, 23))


def test_file_as_llama_cpp_lays_it_out(files):
    reader = gguf.GGUFReader(files["q8_0"])
    fields = {f.name: f.contents() for f in reader.fields.values()}
    tensors = {t.name: t for t in reader.tensors}
    assert fields["general.architecture"] == "deepseek2" and fields["deepseek2.attention.head_count_kv"] == 1
    assert (fields["deepseek2.attention.key_length"], fields["deepseek2.attention.value_length"]) == (32 + 8, 32)
    assert (fields["deepseek2.attention.key_length_mla"], fields["deepseek2.attention.value_length_mla"]) == (24, 12)
    assert fields["deepseek2.leading_dense_block_count"] == 1 and fields["deepseek2.expert_shared_count"] == 2
    assert fields["deepseek2.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.0707)
    # ggml's dimensions, innermost first: attn_k_b {nope, rank, heads}, attn_v_b {rank, v, heads}
    k_b, v_b = tensors["blk.0.attn_k_b.weight"], tensors["blk.0.attn_v_b.weight"]
    assert (list(k_b.shape), k_b.tensor_type) == ([16, 32, 4], gguf.GGMLQuantizationType.F16)
    assert (list(v_b.shape), v_b.tensor_type) == ([32, 12, 4], gguf.GGMLQuantizationType.Q8_0)
    assert "blk.0.attn_kv_b.weight" not in tensors and "blk.1.ffn_gate_exps.weight" in tensors


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_f32_file_matches_transformers(files, reference_logits, backend):
    assert _relative_error(_logits(files["f32"], backend), reference_logits) <= 1e-4


def test_greedy_from_the_file_and_q8_0(files):
    """Greedy tokens from the F32 file are transformers'; the Q8_0 file holds the folder's weights within
    Q8_0's rounding (kv_b_proj rebuilt from its halves) and decodes."""
    prompts = [TOKENS[:7], TOKENS[10:22]]
    llm = LLM(files["f32"], kv_cache_memory=1 << 20, progress=False)
    assert token_ids(llm.generate(prompts, greedy(8), use_tqdm=False)) == reference_greedy(files["hf"], prompts, 8)
    _, folder = load_hf_folder(files["hf"], progress=False)
    _, weights, _ = load_gguf(files["q8_0"], progress=False)
    for name in ("model.layers.1.self_attn.kv_b_proj.weight", "model.layers.2.self_attn.q_b_proj.weight"):
        got = weights[name].dequantize() if isinstance(weights[name], QuantTensor) else weights[name]
        assert _relative_error(got.float(), folder[name].float()) <= 1 / 127
    quantized = LLM(files["q8_0"], kv_cache_memory=1 << 20, progress=False)
    assert all(len(ids) == 8 for ids in token_ids(quantized.generate(prompts, greedy(8), use_tqdm=False)))


def _older_layout(source: Path, out: Path) -> Path:
    """`source` as older converters wrote it: kv_b_proj whole (attn_kv_b), the per-head sizes in
    key_length / value_length, no _mla keys."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, "deepseek2")
    sizes = {"deepseek2.attention.key_length": 24, "deepseek2.attention.value_length": 12}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name.endswith("_mla"):
            continue
        writer.add_key_value(field.name, sizes.get(field.name, field.contents()), field.types[0],
                             field.types[-1] if len(field.types) > 1 else None)
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    for name, values in tensors.items():
        if name.endswith("attn_v_b.weight"):
            continue
        if name.endswith("attn_k_b.weight"):  # [heads, rank, nope] and [heads, v, rank] -> [heads x (nope + v), rank]
            v_b = tensors[name.replace("attn_k_b", "attn_v_b")]
            name, values = name.replace("attn_k_b", "attn_kv_b"), np.concatenate(
                [values.transpose(0, 2, 1), v_b], axis=1).reshape(-1, v_b.shape[-1])
        writer.add_tensor(name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_older_layout_with_attn_kv_b(files, reference_logits, tmp_path):
    older = _older_layout(files["f32"], tmp_path / "older.gguf")
    assert _relative_error(_logits(older, "cpu"), reference_logits) <= 1e-4


def test_refused_by_name(tmp_path, files):
    """What llama.cpp's deepseek2 cannot say: YaRN's mscale other than mscale_all_dim, V3's sigmoid routing."""
    from hearth.errors import ModelLoadError
    from hearth.loading.gguf import config_from_metadata

    other = make_hf_model(tmp_path / "m", "deepseek_v2")  # tests/models.py's: mscale 0.707, mscale_all_dim 1
    with pytest.raises(ModelLoadError, match="mscale equal to mscale_all_dim"):
        convert_hf_to_gguf(other, tmp_path / "m.gguf", "f32", progress=False)
    reader = gguf.GGUFReader(files["f32"])
    md = {f.name: f.contents() for f in reader.fields.values()}
    with pytest.raises(ModelLoadError, match="expert_gating_func = 2"):
        config_from_metadata({**md, "deepseek2.expert_gating_func": 2}, "m.gguf")


# ---------------------------------------------------------------- llama.cpp itself (optional)

# llama.cpp's converter with its vocabulary step left out: it recognises the pre-tokenizers of published
# models by hash, and the tests' tokenizer is none of them (the tensors and model keys are what is compared)
_RUN_CONVERTER = """
import runpy, sys
source, folder, out = sys.argv[1:]
sys.path[:0] = [source, source + "/gguf-py"]
from conversion import deepseek
deepseek.DeepseekV2Model.set_vocab = lambda self: None
sys.argv = ["convert_hf_to_gguf.py", folder, "--outtype", "f32", "--outfile", out]
runpy.run_path(source + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def test_llama_cpp_converter_writes_the_same(files, tmp_path):
    source = llama_cpp_source()
    out = tmp_path / "llama-cpp.gguf"
    subprocess.run([sys.executable, "-c", _RUN_CONVERTER, str(source), str(files["hf"]), str(out)], check=True,
                   capture_output=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    theirs, ours = gguf.GGUFReader(out), gguf.GGUFReader(files["f32"])
    their_tensors, our_tensors = {t.name: t for t in theirs.tensors}, {t.name: t for t in ours.tensors}
    assert set(their_tensors) == set(our_tensors)
    for name, t in their_tensors.items():
        assert (list(t.shape), t.tensor_type) == (list(our_tensors[name].shape), our_tensors[name].tensor_type), name
        assert np.array_equal(np.asarray(t.data), np.asarray(our_tensors[name].data)), name

    def model_keys(reader):
        return {f.name: f.contents() for f in reader.fields.values() if f.name.startswith("deepseek2.")}

    assert model_keys(theirs) == model_keys(ours)


def test_llama_cpp_agrees(files):
    llama_cpp = import_llama_cpp()
    llm = llama_cpp.Llama(model_path=str(files["f32"]), logits_all=True, n_ctx=64, n_threads=2, verbose=False)
    llm.eval(TOKENS)
    theirs = torch.from_numpy(np.array(llm.scores[: len(TOKENS)]))
    # llama.cpp keeps its KV cache in f16: 4.6e-4 measured
    assert _relative_error(_logits(files["f32"], "cpu"), theirs) <= 2e-3
