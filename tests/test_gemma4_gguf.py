"""Gemma 4's GGUF, as llama.cpp names and stores it (hearth/loading/gemma4_gguf.py): tiny random models in its real
layout (tests/models.py) with KV sharing as llama.cpp reads it (the last two layers, sliding and full, reading
layers 1 and 2), per-layer embeddings, layers of two shapes, v from k's projection in the full layers, a
double-wide MLP; and the variant with experts beside the MLP; Gemma's SentencePiece-style tokenizer (spaces as
"▁", nothing prepended, byte fallback). `hearth convert` writes them; hearth reads back the folder's config, its
logits on the file equal transformers' on the folder on both backends, and its tokenizer (llama.cpp's gemma4)
encodes as transformers' with a BOS. Where llama.cpp is at hand (llama-cpp-python, and its source tree's
convert_hf_to_gguf.py through LLAMA_CPP_SOURCE), llama.cpp's converter writes the same tensors and keys from the
same folders, and llama.cpp runs and tokenizes hearth's files as hearth does."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from hearth import LLM, SamplingParams
from hearth.errors import ModelLoadError
from hearth.loading.convert import convert_hf_to_gguf
from hearth.loading.gguf import config_from_metadata, load_gguf
from hearth.loading.gguf_reader import read_gguf
from hearth.loading.safetensors import load_hf_folder
from hearth.tokenizer import Tokenizer
from models import load_hf_reference, make_hf_model, make_spm_tokenizer
from optional import import_llama_cpp, llama_cpp_source
from test_hybrid_gguf import _CONVERTER, PROMPT, _hearth_logits

# the layout llama.cpp's KV sharing reads (transformers' rule gives the same layers): sliding, sliding, full,
# then layer 3 (sliding) sharing layer 1's K/V and layer 4 (full) layer 2's
DENSE = dict(layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                          "full_attention"])
# as tests/test_gemma4.py's: no per-layer embeddings, no sharing (so no double-wide layers), an output layer
EXPERTS = dict(DENSE, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
               hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False,
               tie_word_embeddings=False)
TEXTS = ["Once upon a time there was a little fox.", "héllo wörld ünïcode 0123 zzq~ 日本",
         "def f(n):\n    return n\n\n\nThe end", "a  b   c\n\nfox"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{case: (folder, hearth convert's f32 file, transformers' logits over PROMPT)}."""
    root = tmp_path_factory.mktemp("gemma4-gguf")
    (root / "tokenizer").mkdir()
    tokens = make_spm_tokenizer(root / "tokenizer", prefix_space=False)  # (Gemma's layout)
    out = {}
    for case, overrides in (("dense", DENSE), ("experts", EXPERTS)):
        folder = make_hf_model(root / case, "gemma4", vocab_size=tokens, vocab_size_per_layer_input=tokens,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2, **overrides)
        for f in (root / "tokenizer").iterdir():  # its tokenizer instead of the byte-level one
            shutil.copy(f, folder / f.name)
        (folder / "chat_template.jinja").unlink(missing_ok=True)
        with torch.no_grad():
            logits = load_hf_reference(folder)(torch.tensor([PROMPT])).logits[0]
        out[case] = (folder, convert_hf_to_gguf(folder, root / f"{case}.gguf", "f32", progress=False), logits)
    return out


@pytest.mark.parametrize("case", ["dense", "experts"])
def test_converted_file_runs_as_the_folder(case, converted):
    """llama.cpp's names (each one of gguf-py's gemma4 tensors) and keys; the folder's config read back; hearth's
    logits on the f32 file equal transformers' within 1e-4 on both backends, and the engine's greedy tokens
    transformers' (the dense model); the tokenizer (tokenizer.ggml.model gemma4) encodes and decodes as
    transformers' tokenizer, with llama.cpp's BOS."""
    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES
    from transformers import AutoTokenizer

    folder, path, want = converted[case]
    file = read_gguf(path)
    md = file.metadata
    names = {TENSOR_NAMES[t].format(bid=b) for t in MODEL_TENSORS[MODEL_ARCH.GEMMA4] for b in range(5)}
    assert {t.name.rsplit(".", 1)[0] for t in file.tensors} <= names
    written = {t.name for t in file.tensors}
    assert ("blk.3.attn_k.weight" in written) == (case == "experts") and "blk.2.attn_v.weight" not in written  # (layer
    # 3 shares K/V in the dense model; layer 2, a full one, takes v from k)
    assert (md["gemma4.attention.shared_kv_layers"], md["gemma4.attention.key_length_swa"],
            md["gemma4.attention.key_length"]) == ((2, 16, 32) if case == "dense" else (0, 16, 32))
    assert md["gemma4.attention.sliding_window_pattern"] == [True, True, False, True, False]
    assert md["tokenizer.ggml.model"] == "gemma4" and md["tokenizer.ggml.add_bos_token"] is True
    config, _, _ = load_gguf(path, progress=False)
    expected, _ = load_hf_folder(folder, progress=False)
    assert config == dataclasses.replace(expected, rms_norm_eps=config.rms_norm_eps)  # (stored as float32)
    assert config.rms_norm_eps == pytest.approx(expected.rms_norm_eps)
    for backend in ("reference", "cpu"):
        assert (_hearth_logits(path, backend) - want).abs().max().item() <= 1e-4
    if case == "dense":  # the engine on the file: transformers' greedy tokens
        with torch.no_grad():
            greedy = load_hf_reference(folder).generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False,
                                                        eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert LLM(path, progress=False).generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids == greedy
    tokenizer, theirs = Tokenizer.from_gguf_metadata(md), AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == [1, *theirs(text)["input_ids"]] and tokenizer.decode(ids[1:]) == text


def test_what_llama_cpp_cannot_hold_is_refused_by_name(converted, tmp_path):
    """Converting: per-layer embeddings for fewer tokens than the vocabulary, another activation than GELU, a
    tokenizer that puts "▁" before the text (no file is left behind; the sharing that llama.cpp reads otherwise:
    tests/test_gemma4.py). Reading: shared_kv_layers whose layers llama.cpp would read from a layer of the
    other kind; rope_freqs other than proportional RoPE's."""
    folder, path, _ = converted["dense"]
    hf = json.loads((folder / "config.json").read_text())
    for fields, message in (({"vocab_size_per_layer_input": hf["vocab_size"] + 8}, "vocab_size_per_layer_input"),
                            ({"hidden_activation": "gelu"}, "hidden_activation 'gelu': llama.cpp's gemma4 runs GELU")):
        copy = tmp_path / "folder"
        shutil.copytree(folder, copy, dirs_exist_ok=True)
        (copy / "config.json").write_text(json.dumps({**hf, **fields}))
        with pytest.raises(ModelLoadError, match=message):
            convert_hf_to_gguf(copy, tmp_path / "out.gguf", "f32", progress=False)
    (copy / "config.json").write_text(json.dumps(hf))
    tokenizer = json.loads((folder / "tokenizer.json").read_text())  # Llama 2's normalizer: "▁" prepended
    tokenizer["normalizer"]["normalizers"].insert(0, {"type": "Prepend", "prepend": "▁"})
    (copy / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ModelLoadError, match="puts \"▁\" before the text"):
        convert_hf_to_gguf(copy, tmp_path / "out.gguf", "f32", progress=False)
    assert not list(tmp_path.glob("*.gguf*"))
    md = read_gguf(path).metadata
    with pytest.raises(ModelLoadError, match="shared_kv_layers = 3: llama.cpp's sharing layers read layers 0"):
        config_from_metadata({**md, "gemma4.attention.shared_kv_layers": 3}, str(path))
    reader = GGUFReader(shutil.copy(path, tmp_path / "freqs.gguf"), "r+")
    next(t for t in reader.tensors if t.name == "rope_freqs.weight").data[4:] = 2.0  # (the 1e30s)
    del reader
    with pytest.raises(ModelLoadError, match="hearth reads gemma4's proportional RoPE"):
        load_gguf(tmp_path / "freqs.gguf", progress=False)


# ---------------------------------------------------------------- llama.cpp itself

@pytest.fixture(scope="module")
def llama_cpp_converted(converted, tmp_path_factory):
    """{case: llama.cpp's convert_hf_to_gguf.py's f32 file of the folder} (LLAMA_CPP_SOURCE: its source tree)."""
    source = llama_cpp_source()
    root = tmp_path_factory.mktemp("llama-cpp-converted")
    runs = ["|".join(["--outtype", "f32", "--outfile", str(root / f"{case}.gguf"), str(folder)])
            for case, (folder, *_) in converted.items()]
    subprocess.run([sys.executable, "-c", _CONVERTER, str(source), *runs], check=True, capture_output=True)
    return {case: root / f"{case}.gguf" for case in converted}


# keys hearth writes that llama.cpp's gemma4 converter does not (their values are llama.cpp's defaults: the test)
_HEARTHS_OWN = ("gemma4.vocab_size", "tokenizer.ggml.add_eos_token")


@pytest.mark.parametrize("case", ["dense", "experts"])
def test_llama_cpp_converts_the_same_and_runs_hearths_file(case, converted, llama_cpp_converted):
    """llama.cpp's converter and `hearth convert` write the same tensors (names, types, shapes, values: rope_freqs,
    the stacked experts and their scales, the per-layer embeddings) and keys (but the general ones, and
    _HEARTHS_OWN); llama.cpp runs hearth's file with hearth's logits (within 6e-3 of the largest, its KV cache in
    f32; measured 4.9e-3 at most, experts, at one position: its GELU is a table of f16 values, and the random
    model is sensitive) and tokenizes as hearth."""
    folder, path, want = converted[case]
    ours, theirs = GGUFReader(path), GGUFReader(llama_cpp_converted[case])
    tensors = [{t.name: (t.tensor_type, np.array(t.data)) for t in r.tensors} for r in (ours, theirs)]
    assert sorted(tensors[0]) == sorted(tensors[1])
    for name, (qtype, values) in tensors[1].items():
        assert tensors[0][name][0] == qtype and tensors[0][name][1].shape == values.shape, name
        np.testing.assert_array_equal(tensors[0][name][1], values, err_msg=name)
    keys = [{k: f.contents() for k, f in r.fields.items() if not k.startswith(("GGUF.", "general."))}
            for r in (ours, theirs)]
    assert set(keys[0]) - set(keys[1]) == set(_HEARTHS_OWN) and set(keys[1]) <= set(keys[0])
    assert {k: v for k, v in keys[0].items() if k in keys[1]} == keys[1]
    assert keys[0]["tokenizer.ggml.add_eos_token"] is False
    assert keys[0]["gemma4.vocab_size"] == len(keys[1]["tokenizer.ggml.tokens"])
    llama_cpp = import_llama_cpp()
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=64, n_threads=1, verbose=False, type_k=0,
                          type_v=0)
    llm.eval(PROMPT)
    got = torch.from_numpy(np.array(llm.scores[: len(PROMPT)]))
    assert (got - _hearth_logits(path, "cpu")).abs().max().item() <= 6e-3 * want.abs().max().item()
    tokenizer = Tokenizer.from_gguf_metadata(read_gguf(path).metadata)
    for text in TEXTS:
        assert tokenizer.encode(text) == llm.tokenize(text.encode(), add_bos=True, special=False)
