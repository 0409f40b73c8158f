"""Images in: Qwen3.5 with its vision tower (transformers' Qwen3_5ForConditionalGeneration with random weights in
real image shapes: Qwen3-VL's encoder without deepstack before the hybrid text model) against transformers' own
processor and model, fp32: token ids, M-RoPE positions, logits and greedy tokens with images and a video, from the
folder and from `hearth convert --mmproj`'s files, on the cpu and gpu backends."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hearth.engine.images import mrope_positions
from models import make_qwen_vl, qwen_vl_processor
from test_vision import _hearth_logits, _image, _logits_match
from test_vision_qwen import (GREEDY, IMAGES, ONE, TWO, _reference, _video_logits_match, _video_reference,
                              converted_like_llama_cpp)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    import transformers

    from hearth import LLM

    # (value heads as wide as key heads, as the published models' and llama.cpp's qwen35 have them)
    folder = make_qwen_vl(tmp_path_factory.mktemp("qwen3_5_vl"), family="qwen3_5", text={"linear_value_head_dim": 8})
    reference = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, qwen_vl_processor(folder), reference, LLM(str(folder), progress=False)


def test_qwen3_5_with_its_vision_tower(qwen3_5):
    """Qwen3.5's image-text folder runs whole: Qwen3-VL's encoder without deepstack before the hybrid text
    model (Gated DeltaNet and gated attention, half of each head rotated by M-RoPE). Two images: token
    ids, M-RoPE positions (Qwen3_5Model.get_rope_index), logits within 1e-4 in two chunks cut inside the
    first image, and greedy tokens, against transformers; a video of 4 frames beside an image, the same."""
    reference, llm = qwen3_5[2], qwen3_5[3]
    assert llm.engine.model_config.vision.deepstack_layers == ()
    images = [_image(*IMAGES[1]), _image(*IMAGES[0])]
    inputs, ref_logits, ref_tokens = _reference(qwen3_5, TWO, images)
    expanded = llm.engine.prompt_with_images(TWO, {"image": images})
    assert expanded.token_ids == inputs["input_ids"][0].tolist()
    positions, _ = reference.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                  inputs["image_grid_thw"])
    assert np.array_equal(mrope_positions(np.arange(len(expanded.token_ids)), expanded.images), positions[:, 0].numpy())
    cut = expanded.images[0].start + 9
    torch.testing.assert_close(_hearth_logits(llm.engine, TWO, images, cut)[1], ref_logits, atol=1e-4, rtol=0)
    out = llm.generate({"prompt": TWO, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref_tokens
    frames = np.random.default_rng(5).integers(0, 256, (4, 61, 40, 3), dtype=np.uint8)
    _video_logits_match(qwen3_5, frames, *_video_reference(qwen3_5, frames, None))


def test_qwen3_5_gguf_and_mmproj(qwen3_5, tmp_path):
    """`hearth convert --mmproj` of Qwen3.5's folder: llama.cpp's qwen35 text GGUF (its M-RoPE sections, read back
    only with the mmproj file) and a qwen3vl_merger file without deepstack layers; the pair gives transformers' fp32
    logits within 1e-4 with one image, and its greedy tokens."""
    from gguf import GGUFReader

    from hearth import LLM
    from hearth.cli import main

    text, mmproj = tmp_path / "text.gguf", tmp_path / "mmproj.gguf"
    assert main(["convert", str(qwen3_5[0]), str(text), "--type", "f32", "--mmproj", str(mmproj)]) == 0
    assert GGUFReader(mmproj).fields["clip.vision.is_deepstack_layers"].contents() == [False] * 3
    llm = LLM(str(text), mmproj=str(mmproj), progress=False)
    assert llm.engine.model_config.mrope_section == (4, 2, 2)
    assert LLM(str(text), progress=False).engine.model_config.mrope_section is None  # (a text model alone)
    images = [_image(*IMAGES[0])]
    inputs, ref_logits, ref_tokens = _reference(qwen3_5, ONE, images)
    _logits_match(llm.engine, ONE, images, inputs, ref_logits)
    out = llm.generate({"prompt": ONE, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref_tokens


def test_qwen3_5_images_on_the_gpu_backend(qwen3_5):
    """The gpu backend (its Triton kernels interpreted on the CPU without a GPU): Qwen3.5's hybrid layers, M-RoPE
    over half of each attention head, one small image (2 x 2 tokens): logits of every position within 1e-4 of
    transformers'."""
    from test_vision_gemma import gpu_logits_match

    images = [_image(*IMAGES[2])]
    inputs, ref_logits, _ = _reference(qwen3_5, ONE, images)
    gpu_logits_match(qwen3_5[0], ONE, images, inputs, ref_logits)


def test_llama_cpp_converts_the_same_qwen3_5_mmproj(qwen3_5, tmp_path):
    """llama.cpp's convert_hf_to_gguf.py (LLAMA_CPP_SOURCE: its source tree) writes from Qwen3.5's folder the same
    mmproj file as `hearth convert` (its text GGUF: tests/test_hybrid_gguf.py)."""
    from hearth.loading.mmproj import write_mmproj
    from optional import llama_cpp_source

    llama_cpp_source()
    ours = {"qwen3_5": write_mmproj(qwen3_5[0], tmp_path / "qwen3_5.gguf", "f32", progress=False)}
    converted_like_llama_cpp(qwen3_5[0], ours, {"qwen3_5": ["--mmproj", "--outtype", "f32"]}, tmp_path)
