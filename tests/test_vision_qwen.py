"""Images in: Qwen3-VL (transformers' Qwen3VLForConditionalGeneration with random weights in real image
shapes) against transformers' own processor and model, fp32: pixels, grids, token ids, M-RoPE positions,
logits and greedy tokens with one and two images of odd sizes, whole and in chunks that cut through an
image, on the cpu and reference backends, and on the gpu backend; what bad configs refuse."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hearth.engine.images import mrope_positions
from hearth.errors import ModelLoadError, RequestError
from hearth.sampling_params import SamplingParams
from models import make_qwen_vl, qwen_vl_processor
from test_vision import _hearth_logits, _image, _logits_match

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # as Qwen3-VL's chat template writes an image part
ONE = f"<|im_start|>user\nWhat is in {IMAGE}?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\nCompare {IMAGE} with{IMAGE} please<|im_end|>\n<|im_start|>assistant\n"
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# odd sizes: a landscape RGB, a tall RGBA, a tiny grey one (upscaled to min_pixels), one past max_pixels
IMAGES = ((0, 77, 131, "RGB"), (1, 250, 97, "RGBA"), (2, 13, 21, "L"), (3, 517, 403, "RGB"))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    import transformers

    from hearth import LLM

    folder = make_qwen_vl(tmp_path_factory.mktemp("qwen3_vl"))
    reference = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, qwen_vl_processor(folder), reference, LLM(str(folder), progress=False)


def _reference(qwen, text: str, images: list):
    _, processor, reference, _ = qwen
    inputs = processor(text=[text], images=images, return_tensors="pt")
    with torch.no_grad():
        logits = reference(**inputs).logits[0]
        out = reference.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    return inputs, logits, out[0, inputs["input_ids"].shape[1]:].tolist()


def test_pixels_grids_token_ids_and_positions_are_transformers(qwen):
    """Every image's patches bit for bit and its grid (Qwen2VLImageProcessor's PIL path: smart_resize
    up and down, RGBA on white, greyscale), the expanded prompt's token ids (Qwen3VLProcessor's), and the
    M-RoPE positions of every token with the rope delta after the images (Qwen3VLModel.get_rope_index)."""
    _, processor, reference, llm = qwen
    engine = llm.engine
    images = [_image(*spec) for spec in IMAGES]
    text = f"a{IMAGE}b{IMAGE}{IMAGE} c{IMAGE}."
    inputs = processor(text=[text], images=images, return_tensors="pt")
    mine = [engine.image_processor.process(image) for image in images]
    assert np.array_equal(np.concatenate([m.pixel_values for m in mine]), inputs["pixel_values"].numpy())
    assert [[1, 2 * m.grid[0], 2 * m.grid[1]] for m in mine] == inputs["image_grid_thw"].tolist()
    expanded = engine.prompt_with_images(text, {"image": images})
    assert expanded.token_ids == inputs["input_ids"][0].tolist()
    positions, delta = reference.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                      inputs["image_grid_thw"])
    ours = mrope_positions(np.arange(len(expanded.token_ids)), expanded.images)
    assert np.array_equal(ours, positions[:, 0].numpy())
    after = len(expanded.token_ids) + 5  # a decode after the prompt
    assert mrope_positions(np.array([after]), expanded.images).ravel().tolist() == [after + int(delta)] * 3
    from hearth.model_info import model_info

    assert model_info(qwen[0])["vision"]["deepstack_layers"] == [0, 2]  # hearth inspect's line


PIXELS = {"min_pixels": 64 * 64, "max_pixels": 160 * 160}  # (the folder's: 32 x 32 to 320 x 320)


def test_pixel_bounds_per_request(qwen):
    """mm_processor_kwargs' min_pixels and max_pixels (vLLM's for Qwen-VL) in place of the folder's: every image's
    patches, grid and the prompt's ids as transformers' processor makes them with those bounds (one image upscaled
    more, one downscaled more), each image another cache key than without them; bounds past the model's
    max_pixels, or a key Qwen's processor does not take, refused by name."""
    _, processor, _, llm = qwen
    engine = llm.engine
    images = [_image(*spec) for spec in IMAGES]
    text = f"a{IMAGE}b{IMAGE}{IMAGE} c{IMAGE}."
    inputs = processor(text=[text], images=images, return_tensors="pt",  # (transformers' name for them: size)
                       size={"shortest_edge": PIXELS["min_pixels"], "longest_edge": PIXELS["max_pixels"]})
    mine = [engine.image_processor.with_options(PIXELS).process(image) for image in images]
    assert np.array_equal(np.concatenate([m.pixel_values for m in mine]), inputs["pixel_values"].numpy())
    assert [[1, 2 * m.grid[0], 2 * m.grid[1]] for m in mine] == inputs["image_grid_thw"].tolist()
    expanded = engine.prompt_with_images(text, {"image": images}, PIXELS)
    assert expanded.token_ids == inputs["input_ids"][0].tolist()
    plain = engine.prompt_with_images(text, {"image": images})
    assert not {s.content_hash for s in expanded.images} & {s.content_hash for s in plain.images}
    for settings, message in (({"max_pixels": 640 * 640}, r"max_pixels <= 102,400 \(the model's\)"),
                              ({"min_pixels": 0}, "min_pixels 0 and max_pixels 102400"),
                              ({"size": {"longest_edge": 100}}, r"'size' is not a setting of Qwen3-VL's image processor "
                                                                r"\(it takes min_pixels, max_pixels\)")):
        with pytest.raises(RequestError, match=message):
            engine.add_request(None, ONE, GREEDY, multi_modal_data={"image": images[:1]}, mm_processor_kwargs=settings)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("text, which", [(ONE, (0,)), (TWO, (1, 0))], ids=["one-image", "two-images"])
def test_logits_and_greedy_tokens_equal_transformers(qwen, text, which):
    """fp32 logits of every position within 1e-4, whole and in two chunks cut inside the first image
    (the cpu backend); greedy tokens (decodes after the images: the rope delta) through LLM.generate."""
    images = [_image(*IMAGES[i]) for i in which]
    inputs, ref_logits, ref_tokens = _reference(qwen, text, images)
    llm = qwen[3]
    assert llm.engine.model.backend.name == "cpu"
    ids = _logits_match(llm.engine, text, images, inputs, ref_logits)
    cut = ids.index(llm.engine.model_config.vision.image_token_id) + 7  # inside a row of the first image
    _logits_match(llm.engine, text, images, inputs, ref_logits, cut)
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref_tokens


def test_gpu_backend_mrope(qwen):
    """The gpu backend (its Triton kernels interpreted on the CPU without a GPU): each token's M-RoPE angles
    through the rope kernel, logits of every position within 1e-4 of transformers'; greedy tokens, the decodes
    after the image in the decode graphs (capture off without a GPU) with its rope delta kept per row."""
    from hearth import LLM

    images = [_image(*IMAGES[0])]  # a grid of 2 x 4 merged patches: a rope delta of 4 - 8
    inputs, ref_logits, ref_tokens = _reference(qwen, ONE, images)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(str(qwen[0]), device=device, dtype="float32", backend="gpu", kv_cache_memory=1 << 22, progress=False,
              max_model_len=256)  # (the graphs' block tables, and so the decode kernel's splits, fit it)
    ids, logits = _hearth_logits(llm.engine, ONE, images)
    assert ids == inputs["input_ids"][0].tolist()
    torch.testing.assert_close(logits.cpu(), ref_logits, atol=1e-4, rtol=0)
    out = llm.generate({"prompt": ONE, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref_tokens
    assert llm.engine.model.backend_state["decode_graphs"].inputs.field("rope_delta", 1).item() == -4


def test_chunked_prefill_through_images_on_the_reference_backend(qwen):
    """The reference backend, chunks of 16 tokens through both images (each encoded once), then decodes:
    transformers' greedy tokens; the same prompt again hits the prefix cache and still gives them."""
    from hearth import LLM

    images = [_image(*IMAGES[0]), _image(*IMAGES[1])]
    ref_tokens = _reference(qwen, TWO, images)[2]
    llm = LLM(str(qwen[0]), progress=False, backend="reference", max_num_batched_tokens=16)
    for _ in range(2):
        out = llm.generate({"prompt": TWO, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
        assert out[0].outputs[0].token_ids == ref_tokens
    assert llm.engine.runner.encoder_cache.misses == 2
    assert llm.engine.block_manager.prefix_cache_hits > 0


def test_what_is_refused(qwen):
    """M-RoPE sections that do not fit the head, contiguous (not interleaved) sections, a text model of another
    family, and a prompt that names its images with another marker."""
    from hearth.config import ModelConfig

    config = json.loads((qwen[0] / "config.json").read_text())
    rope = config["text_config"]["rope_parameters"]
    for change, message in (({"mrope_section": [4, 4]}, "expected three counts"),
                            ({"mrope_interleaved": False}, "interleaved")):
        with pytest.raises(ModelLoadError, match=message):
            ModelConfig.from_hf({**config, "text_config": {**config["text_config"],
                                                           "rope_parameters": {**rope, **change}}})
    with pytest.raises(ModelLoadError, match="qwen3 text model"):
        ModelConfig.from_hf({**config, "text_config": {**config["text_config"], "model_type": "llama"}})
    with pytest.raises(RequestError, match=r"names 0 image\(s\) with <\|image_pad\|>"):
        qwen[3].engine.add_request(None, "a <image>", GREEDY, multi_modal_data={"image": [_image(0, 30, 40)]})
    with pytest.raises(RequestError, match="differ by more than 200 times"):  # (transformers' limit too)
        qwen[3].engine.add_request(None, ONE, GREEDY, multi_modal_data={"image": [_image(0, 1, 201)]})
    assert not qwen[3].engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    import transformers

    from hearth import LLM

    folder = make_qwen_vl(tmp_path_factory.mktemp("qwen3_5_vl"), family="qwen3_5")
    reference = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, qwen_vl_processor(folder), reference, LLM(str(folder), progress=False)


def test_qwen3_5_with_its_vision_tower(qwen3_5):
    """Qwen3.5's image-text folder runs whole: Qwen3-VL's encoder without deepstack before the hybrid text
    model (Gated DeltaNet and gated attention, half of each head rotated by M-RoPE). Two images: token
    ids, M-RoPE positions (Qwen3_5Model.get_rope_index), logits within 1e-4 in two chunks cut inside the
    first image, and greedy tokens, against transformers."""
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


def test_qwen3_5_images_on_the_gpu_backend(qwen3_5):
    """The gpu backend (its Triton kernels interpreted on the CPU without a GPU): Qwen3.5's hybrid layers, M-RoPE
    over half of each attention head, one small image (2 x 2 tokens): logits of every position within 1e-4 of
    transformers'."""
    from test_vision_gemma import gpu_logits_match

    images = [_image(*IMAGES[2])]
    inputs, ref_logits, _ = _reference(qwen3_5, ONE, images)
    gpu_logits_match(qwen3_5[0], ONE, images, inputs, ref_logits)
