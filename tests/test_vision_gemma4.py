"""Images in: Gemma 4 (transformers' Gemma4ForConditionalGeneration with random weights in real image shapes)
against transformers' own processor (Gemma4ImageProcessorPil; Gemma4Processor made without its video processor,
which needs torchvision) and model, fp32: patches, token ids and image blocks, logits and greedy tokens with one
and two images of odd sizes (each resized at its own aspect; the image tokens attending to each other both ways
on the sliding layers only, a window shorter than an image); what is refused."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from hearth.errors import ModelLoadError
from models import gemma4_vl_processor, make_gemma4_vl
from test_vision import _hearth_logits, _image, _image_runs, _reference
from test_vision_gemma import _images_attend_both_ways

ONE = "user: What is in <|image|>? model:"  # as Gemma 4's chat template writes an image part
TWO = "user: Compare <|image|> with<|image|> please model:"
# odd sizes: a landscape RGB, a tall RGBA, a tiny grey one (upscaled), a larger one, a sliver (one token high)
IMAGES = ((0, 77, 131, "RGB"), (1, 250, 97, "RGBA"), (2, 13, 21, "L"), (3, 517, 403, "RGB"), (4, 5, 400, "RGB"))


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    import transformers

    from hearth import LLM

    folder = make_gemma4_vl(tmp_path_factory.mktemp("gemma4_vl"))
    reference = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, gemma4_vl_processor(folder), reference, LLM(str(folder), progress=False)


def test_patches_token_ids_and_image_blocks_are_transformers(gemma4):
    """Every image's patches bit for bit (Gemma4ImageProcessorPil: resized at its aspect within 70 tokens' patches,
    RGBA on white, greyscale, a sliver one token high; transformers' padding to the budget left out), the expanded
    prompt's ids (boi, the image's own count of soft tokens, eoi), and each image's span: the run of tokens
    transformers' mm_token_type_ids mark, one block each."""
    _, processor, _, llm = gemma4
    engine = llm.engine
    images = [_image(*spec) for spec in IMAGES]
    text = "a<|image|>b<|image|><|image|> c<|image|>.<|image|>"
    inputs = processor(text=[text], images=[images], return_tensors="pt")
    mine = [engine.image_processor.process(image) for image in images]
    for i, image in enumerate(mine):
        rows, cols, width = image.pixel_values.shape
        assert np.array_equal(image.pixel_values.reshape(rows * cols, width), inputs["pixel_values"][i, :rows * cols])
        assert (inputs["image_position_ids"][i, :, 0] >= 0).sum() == rows * cols
    assert [m.num_embeds for m in mine] == [60, 65, 60, 63, 70]
    expanded = engine.prompt_with_images(text, {"image": images})
    assert expanded.token_ids == inputs["input_ids"][0].tolist()
    assert [(s.start, s.end) for s in expanded.images] == _image_runs(inputs["mm_token_type_ids"][0].numpy())
    from hearth.model_info import model_info

    assert model_info(gemma4[0])["vision"]["pool"] == 3  # hearth inspect's line


@pytest.mark.parametrize("which", [(0,), (1, 3)], ids=["one-image", "two-images"])
def test_logits_and_greedy_tokens_equal_transformers(gemma4, which):
    """fp32 logits of every position within 1e-4, whole and in two chunks cut at the first image's start (the
    cpu backend); cut inside the image, or with the image's tokens attending both ways on the full layers too
    (Gemma 3's rule), far from transformers; greedy tokens through LLM.generate."""
    text = ONE if len(which) == 1 else TWO
    images = [_image(*IMAGES[i]) for i in which]
    inputs, ref_logits, ref_tokens = _reference(gemma4, text, images)
    llm = gemma4[3]
    start = _images_attend_both_ways(llm, text, images, inputs, ref_logits, ref_tokens)
    if len(which) == 1:
        from hearth.backend.base import PrefillSequence

        mask = PrefillSequence.mask
        with pytest.MonkeyPatch.context() as patch:  # (the images' blocks on every layer)
            patch.setattr(PrefillSequence, "mask", lambda seq, window: mask(dataclasses.replace(seq, sliding_only=False),
                                                                             window))
            every_layer = _hearth_logits(llm.engine, text, images)[1]
        assert (every_layer[start:] - ref_logits[start:]).abs().max() > 1e-2


def test_gpu_backend_images_both_ways_on_the_sliding_layers(gemma4):
    """The gpu backend's prefill kernel (interpreted on the CPU without a GPU): an image's rows see the whole image
    on the sliding layers and causally on the full ones (GpuMetadata.full_layer_masks): logits of every position
    within 1e-4 of transformers' with one image."""
    from hearth import LLM

    images = [_image(*IMAGES[0])]
    inputs, ref_logits, _ = _reference(gemma4, ONE, images)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(str(gemma4[0]), device=device, dtype="float32", backend="gpu", kv_cache_memory=1 << 22, progress=False)
    ids, logits = _hearth_logits(llm.engine, ONE, images)
    assert ids == inputs["input_ids"][0].tolist()
    torch.testing.assert_close(logits.cpu(), ref_logits, atol=1e-4, rtol=0)


def test_what_is_refused(gemma4, tmp_path):
    """Clipped linears; processor settings that do not fit
    the encoder (another patch size, a budget transformers does not take, a side longer than the position table);
    a config without use_bidirectional_attention: images causal, chunks cut anywhere."""
    from hearth.config import ModelConfig
    from hearth.image_processor_gemma4 import Gemma4ImageProcessor

    config = json.loads((gemma4[0] / "config.json").read_text())
    model_config = ModelConfig.from_hf(config)
    assert model_config.bidirectional_images and model_config.accepts_images
    with pytest.raises(ModelLoadError, match="use_clipped_linears True"):
        ModelConfig.from_hf({**config, "vision_config": {**config["vision_config"], "use_clipped_linears": True}})
    causal = ModelConfig.from_hf({**config, "text_config": {**config["text_config"], "use_bidirectional_attention": None}})
    assert causal.accepts_images and not causal.bidirectional_images
    settings = json.loads((gemma4[0] / "preprocessor_config.json").read_text())
    for change, message in (({"patch_size": 14}, "do not fit the vision encoder"),
                            ({"max_soft_tokens": 100}, "max_soft_tokens = 100: transformers' Gemma 4 processor takes"),
                            ({"max_soft_tokens": 140}, "420 patches long would pass the encoder's 256 positions")):
        (tmp_path / "preprocessor_config.json").write_text(json.dumps({**settings, **change}))
        with pytest.raises(ModelLoadError, match=message):
            Gemma4ImageProcessor.from_hf_dir(tmp_path, model_config.vision)
