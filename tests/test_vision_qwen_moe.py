"""Images in: Qwen3-VL-MoE (transformers' Qwen3VLMoeForConditionalGeneration with random weights in real image
shapes) against transformers' own processor and model, fp32, from its folder in both expert layouts and from the
qwen3vlmoe GGUF with its mmproj file; llama.cpp's converter writes the same text GGUF."""

from __future__ import annotations

import numpy as np
import torch

from models import make_qwen_vl, qwen_vl_processor
from test_vision import _image, _logits_match
from test_vision_qwen import GREEDY, IMAGES, ONE, TWO, _reference


def test_qwen3_vl_moe(tmp_path):
    """Qwen3-VL-MoE's folder runs whole: Qwen3-VL's encoder with deepstack before a qwen3_moe text model (its
    router renormalising the top 2 of 8 experts; a dense MLP where mlp_only_layers says), its experts stacked as
    transformers 5 saves them and as the published checkpoints hold them (each stack transposed). One image and
    two: logits within 1e-4 of transformers' (two chunks cut inside the first image), greedy tokens; the same
    logits from `hearth convert --mmproj`'s qwen3vlmoe text GGUF and its mmproj file."""
    import shutil

    import transformers
    from gguf import GGUFReader
    from safetensors.torch import load_file, save_file

    from hearth import LLM
    from hearth.cli import main

    folder = make_qwen_vl(tmp_path / "saved", family="qwen3_vl_moe")
    processor = qwen_vl_processor(folder)
    reference = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), progress=False)
    assert (llm.engine.model_config.num_experts, llm.engine.model_config.dense_mlp_layers) == (8, (1,))
    published = shutil.copytree(folder, tmp_path / "published")
    tensors = load_file(folder / "model.safetensors")
    save_file({name: t.transpose(1, 2).contiguous() if ".experts." in name else t for name, t in tensors.items()},
              published / "model.safetensors", metadata={"format": "pt"})
    for text, which in ((ONE, (2,)), (TWO, (1, 0))):
        images = [_image(*IMAGES[i]) for i in which]
        inputs, ref_logits, ref_tokens = _reference((folder, processor, reference, llm), text, images)
        cut = _logits_match(llm.engine, text, images, inputs, ref_logits).index(reference.config.image_token_id) + 5
        _logits_match(llm.engine, text, images, inputs, ref_logits, cut)
        out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
        assert out[0].outputs[0].token_ids == ref_tokens
    _logits_match(LLM(str(published), progress=False).engine, text, images, inputs, ref_logits)
    gguf, mmproj = tmp_path / "text.gguf", tmp_path / "mmproj.gguf"  # (llama.cpp's converter has no dense layer)
    assert main(["convert", str(folder), str(gguf), "--type", "f32", "--mmproj", str(mmproj)]) == 0
    assert GGUFReader(gguf).fields["general.architecture"].contents() == "qwen3vlmoe"
    _logits_match(LLM(str(gguf), mmproj=str(mmproj), progress=False).engine, text, images, inputs, ref_logits)


def test_llama_cpp_converts_the_same_qwen3_vl_moe_text(tmp_path):
    """llama.cpp's convert_hf_to_gguf.py (LLAMA_CPP_SOURCE: its source tree) writes from a Qwen3-VL-MoE folder in the
    published layout (each expert stack transposed: the one its converter reads) the same tensors (names, shapes,
    values) and qwen3vlmoe M-RoPE and deepstack keys as `hearth convert` from transformers 5's layout; experts in
    every layer (llama.cpp's qwen3vlmoe has no dense one)."""
    import shutil
    import subprocess
    import sys

    from gguf import GGUFReader
    from safetensors.torch import load_file, save_file

    from hearth.loading.convert import convert_hf_to_gguf
    from optional import llama_cpp_source
    from test_hybrid_gguf import _CONVERTER

    source = llama_cpp_source()
    folder = make_qwen_vl(tmp_path / "saved", family="qwen3_vl_moe", text={"mlp_only_layers": []})
    published = shutil.copytree(folder, tmp_path / "published")
    save_file({name: t.transpose(1, 2).contiguous() if ".experts." in name else t
               for name, t in load_file(folder / "model.safetensors").items()},
              published / "model.safetensors", metadata={"format": "pt"})
    subprocess.run([sys.executable, "-c", _CONVERTER, str(source), "|".join(
        ["--outtype", "f32", "--outfile", str(tmp_path / "theirs.gguf"), str(published)])], check=True,
        capture_output=True)
    readers = GGUFReader(convert_hf_to_gguf(folder, tmp_path / "ours.gguf", "f32", progress=False)), \
        GGUFReader(tmp_path / "theirs.gguf")
    keys = [{k: r.fields[k].contents() for k in ("general.architecture", "qwen3vlmoe.rope.dimension_sections",
                                                  "qwen3vlmoe.n_deepstack_layers")} for r in readers]
    assert keys[0] == keys[1] == {**keys[1], "general.architecture": "qwen3vlmoe"}
    tensors = [{t.name: np.array(t.data) for t in r.tensors} for r in readers]
    assert sorted(tensors[0]) == sorted(tensors[1])
    for name, values in tensors[1].items():
        np.testing.assert_array_equal(tensors[0][name], values, err_msg=name)
