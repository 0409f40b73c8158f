"""Images in: Gemma 3 (transformers' Gemma3ForConditionalGeneration with random weights in real image shapes)
against transformers' own processor (Gemma3ImageProcessorPil: torchvision does not load here) and model, fp32:
pixels, token ids and image blocks, logits and greedy tokens with one and two images of odd sizes (the image
tokens attending to each other both ways, a sliding window shorter than the prompt), chunks that never cut an
image, the encoder and prefix caches; the published checkpoints' sparse config; what is refused."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from hearth.engine.kv_cache import BlockManager
from hearth.engine.request import ImageSpan, Request
from hearth.engine.scheduler import Scheduler
from hearth.errors import ModelLoadError, RequestError
from models import make_gemma3_vl
from test_vision import GREEDY, _hearth_logits, _image, _image_runs, _logits_match, _reference

ONE = "user: What is in <start_of_image>? model:"  # as Gemma 3's chat template writes an image part
TWO = "user: Compare <start_of_image> with<start_of_image> please model:"
# odd sizes: a landscape RGB, a tall RGBA, a tiny grey one (upscaled), one larger than the encoder's 224
IMAGES = ((0, 77, 131, "RGB"), (1, 250, 97, "RGBA"), (2, 13, 21, "L"), (3, 517, 403, "RGB"))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    import transformers

    from hearth import LLM

    folder = make_gemma3_vl(tmp_path_factory.mktemp("gemma3_vl"))
    reference = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, transformers.AutoProcessor.from_pretrained(folder), reference, LLM(str(folder), device="cpu", progress=False)


@pytest.fixture(scope="module")
def two_images(gemma):
    images = [_image(*IMAGES[1]), _image(*IMAGES[0])]
    return images, *_reference(gemma, TWO, images)


def test_pixels_token_ids_and_image_blocks_are_transformers(gemma):
    """Every image's pixels bit for bit (Gemma3ImageProcessorPil: resized to 224 x 224 whatever its aspect,
    RGBA on white, greyscale), the expanded prompt's ids (Gemma3Processor's boi, 64 soft tokens, eoi), and
    each image's span: the run of tokens transformers' token_type_ids mark, one bidirectional block each."""
    _, processor, _, llm = gemma
    engine = llm.engine
    images = [_image(*spec) for spec in IMAGES]
    text = "a<start_of_image>b<start_of_image><start_of_image> c<start_of_image>."
    inputs = processor(text=[text], images=[images], return_tensors="pt")
    mine = [engine.image_processor.process(image) for image in images]
    assert np.array_equal(np.concatenate([m.pixel_values for m in mine]), inputs["pixel_values"].numpy())
    expanded = engine.prompt_with_images(text, {"image": images})
    assert expanded.token_ids == inputs["input_ids"][0].tolist()
    assert [(s.start, s.end) for s in expanded.images] == _image_runs(inputs["token_type_ids"][0].numpy())
    from hearth.model_info import model_info

    assert model_info(gemma[0])["vision"]["tokens_per_tile"] == 64  # hearth inspect's line


@pytest.mark.parametrize("which", [(0,), (1, 0)], ids=["one-image", "two-images"])
def test_logits_and_greedy_tokens_equal_transformers(gemma, which, request):
    """fp32 logits of every position within 1e-4, whole and in two chunks cut at the first image's start (the
    cpu backend); cut inside the image instead, the first rows miss the later ones they attend to (far from
    transformers: what the scheduler never lets happen); greedy tokens through LLM.generate."""
    text = ONE if len(which) == 1 else TWO
    images = [_image(*IMAGES[i]) for i in which]
    inputs, ref_logits, ref_tokens = request.getfixturevalue("two_images")[1:] if len(which) == 2 else \
        _reference(gemma, text, images)
    _images_attend_both_ways(gemma[3], text, images, inputs, ref_logits, ref_tokens)


def _images_attend_both_ways(llm, text: str, images: list, inputs, ref_logits: torch.Tensor, ref_tokens: list[int]
                             ) -> int:
    """The cpu backend's logits are transformers' whole and cut at the first image's start, far from them cut
    20 rows into it; greedy tokens through LLM.generate. Returns where the first image starts."""
    assert llm.engine.model.backend.name == "cpu"
    ids = _logits_match(llm.engine, text, images, inputs, ref_logits)
    start = ids.index(llm.engine.model_config.vision.image_token_id)
    _logits_match(llm.engine, text, images, inputs, ref_logits, start)
    inside = _hearth_logits(llm.engine, text, images, start + 20)[1]
    assert (inside[start:start + 20] - ref_logits[start:start + 20]).abs().max() > 1e-2
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref_tokens
    return start


def test_gpu_backend_images_both_ways(gemma, two_images):
    """The gpu backend's prefill kernel (interpreted on the CPU without a GPU), each image's rows seeing the whole
    image, the sliding layer's window shorter than the prompt: logits of every position within 1e-4 of the cpu
    backend's with two images, which the test above holds to transformers'. (Not transformers' own here: on
    the H200 of 2026-11-27, torch 2.11, transformers' Gemma 3 sat 1.2e-3 from both hearth backends, which
    agreed to 2e-6 there; under the project's torch 2.13 all three agree to 2e-6.)"""
    images, inputs, _, _ = two_images
    gpu_logits_match(gemma[0], TWO, images, inputs, _hearth_logits(gemma[3].engine, TWO, images)[1])


def gpu_logits_match(folder, text: str, images: list, inputs, ref_logits) -> None:
    """On the gpu backend (Triton's interpreter without a GPU): the prompt's ids and every position's logits
    within 1e-4 of transformers'."""
    from hearth import LLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(str(folder), device=device, dtype="float32", backend="gpu", kv_cache_memory=1 << 22, progress=False)
    ids, logits = _hearth_logits(llm.engine, text, images)
    assert ids == inputs["input_ids"][0].tolist()
    torch.testing.assert_close(logits.cpu(), ref_logits, atol=1e-4, rtol=0)


def test_chunks_keep_images_whole_and_the_caches_hit(gemma, two_images):
    """The reference backend, chunks of 16 tokens: no chunk ends inside an image (the one that reaches an image
    runs to its end), each image encoded once, transformers' greedy tokens; the same prompt again: the prefix
    cache and the encoder cache hit, the same tokens; an image repeated in one prompt: encoded once; a prefix hit
    that ends inside an image (its blocks made with the whole image in view): the rest of it, the same tokens."""
    from hearth import LLM

    images, _, _, ref_tokens = two_images
    llm = LLM(str(gemma[0]), progress=False, backend="reference", max_num_batched_tokens=16)
    engine = llm.engine
    chunks, schedule = [], engine.scheduler.schedule

    def recording():
        out = schedule()
        chunks.extend((r.num_computed_tokens, r.num_computed_tokens + n, r.images) for r, n in out.scheduled)
        return out

    engine.scheduler.schedule = recording
    for _ in range(2):
        out = llm.generate({"prompt": TWO, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
        assert out[0].outputs[0].token_ids == ref_tokens
    assert not [c for c in chunks for i in c[2] if i.start < c[1] < i.end]
    assert any(end - start > 16 for start, end, _ in chunks)  # (an image's 64 tokens in one chunk)
    cache = engine.runner.encoder_cache
    assert (cache.misses, engine.block_manager.prefix_cache_hits > 0) == (2, True)
    hits, twice = cache.hits, [_image(*IMAGES[2])] * 2
    out = llm.generate({"prompt": TWO, "multi_modal_data": {"image": twice}}, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == _reference(gemma, TWO, twice)[2]
    assert (cache.misses, cache.hits - hits) == (3, 1)
    # a prompt whose last cached block ends inside its image: run again, the rest of the image from there
    short, image, chunks[:] = "a<start_of_image>", [_image(*IMAGES[3])], []
    expected = _reference(gemma, short, image)[2]
    for _ in range(2):
        out = llm.generate({"prompt": short, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
        assert out[0].outputs[0].token_ids == expected
    span = chunks[0][2][0]  # (64: the prefix hit; the chunk from it ends past the image, as every chunk does)
    assert [start for start, _, _ in chunks if span.start < start < span.end] == [64]
    assert not [c for c in chunks for i in c[2] if i.start < c[1] < i.end]


def test_scheduler_keeps_images_whole():
    """whole_images: a chunk that would end inside an image ends before it; one that starts at (or, after a
    prefix-cache hit, inside) an image runs to its end over the budget; without it chunks cut anywhere."""
    def request() -> Request:
        return Request("r", list(range(120)), images=[ImageSpan(10, 74, b"i" * 16, None, 64)])

    def chunks(whole: bool) -> list[int]:
        scheduler = Scheduler(BlockManager(64, 16), max_num_seqs=2, max_num_batched_tokens=16, whole_images=whole)
        scheduler.add_request(request())
        sizes = []
        while scheduler.has_unfinished_requests() and sum(sizes) < 120:
            out = scheduler.schedule()
            sizes += [n for _, n in out.scheduled]
            scheduler.update_after_step(out)
        return sizes

    assert chunks(True)[:4] == [10, 64, 16, 16]
    assert chunks(False)[:3] == [16, 16, 16]
    assert Scheduler(BlockManager(64, 16), 2, 16, whole_images=True)._whole_images(request(), 30, 16) == 44


def test_published_config_reads_as_transformers_fills_it(gemma):
    """google/gemma-3-4b-it's config.json names few text fields (transformers fills Gemma3TextConfig's
    defaults): hearth reads it as the whole config transformers makes of it; its checkpoint names
    (language_model.model.*, vision_tower.vision_model.*) are the ones hearth's modules take."""
    import transformers

    from hearth.config import ModelConfig
    from hearth.loading.names import canonical_hf_name

    published = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
                 "eoi_token_index": 256000, "image_token_index": 262144, "mm_tokens_per_image": 256,
                 "model_type": "gemma3",
                 "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                                 "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                 "sliding_window": 1024},
                 "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                                   "model_type": "siglip_vision_model", "num_attention_heads": 16,
                                   "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
    full = transformers.Gemma3Config(**{k: v for k, v in published.items() if k != "model_type"}).to_dict()
    config, whole = ModelConfig.from_hf(published), ModelConfig.from_hf(full)
    assert dataclasses.replace(config, rope_scaling=None) == dataclasses.replace(whole, rope_scaling=None)
    assert config.rope_scaling.items() <= whole.rope_scaling.items()  # (transformers' adds rope_theta)
    assert (config.num_heads, config.head_dim, config.vocab_size, config.rope_theta) == (8, 256, 262208, 1e6)
    assert (config.vision.scale_factor, config.vision.tokens_per_tile) == (4, 256)
    assert [canonical_hf_name(n) for n in ("language_model.model.layers.0.mlp.up_proj.weight",
                                           "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
                                           "multi_modal_projector.mm_input_projection_weight")] == [
        "model.layers.0.mlp.up_proj.weight", "model.vision_tower.encoder.layers.0.mlp.fc1.weight",
        "model.multi_modal_projector.mm_input_projection_weight"]


# pan and scan's settings (crops of 64 pixels or more, at most 3), given to transformers' processor too
# (Gemma3Processor's call defaults switch it off whatever the image processor's settings say)
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 64, "pan_and_scan_max_num_crops": 3,
                "pan_and_scan_min_ratio_to_activate": 1.2}


def test_pan_and_scan_crops_layout_and_logits_are_transformers(gemma, tmp_path):
    """With pan and scan on, asked for per request (mm_processor_kwargs) or by the folder's settings: each image's
    whole and crops pixel for pixel as Gemma3ImageProcessorPil cuts them (a wide image in 3, a tall one in 3, one in
    2, a near-square one and a short wide one (crops under 64 pixels) in none), Gemma3Processor's sentence around
    them token for token, each whole image's and crop's tokens one block both ways (token_type_ids' runs); with
    two images, crops among them, transformers' logits within 1e-4 (whole and cut at the second crop's start); with
    one, its greedy tokens. An image that pan and scan leaves whole (its pixels and tokens the same either way) is
    another entry of the encoder cache and no prefix-cache hit with pan and scan than without; with it again, both
    hit."""
    import functools

    from hearth.image_processor_gemma import GemmaImageProcessor

    llm = gemma[3]
    engine = llm.engine
    (tmp_path / "processor_config.json").write_text((gemma[0] / "processor_config.json").read_text())
    settings = json.loads((tmp_path / "processor_config.json").read_text())
    settings["image_processor"].update(PAN_AND_SCAN)
    (tmp_path / "processor_config.json").write_text(json.dumps(settings))
    by_folder = GemmaImageProcessor.from_hf_dir(tmp_path, engine.model_config.vision)
    reference = (gemma[0], functools.partial(gemma[1], **PAN_AND_SCAN), gemma[2], llm)
    images = [_image(0, 77, 331), _image(1, 250, 97, "RGBA"), _image(2, 130, 97, "L"), _image(3, 100, 110),
              _image(4, 40, 300)]
    text = "a<start_of_image>b<start_of_image><start_of_image> c<start_of_image>.<start_of_image>"
    inputs = reference[1](text=[text], images=[images], return_tensors="pt")
    crops = gemma[1].image_processor(images, **PAN_AND_SCAN)["num_crops"]
    for processor in (by_folder, engine.image_processor.with_options(PAN_AND_SCAN)):
        mine = [processor.process(image) for image in images]
        assert [m.rows for m in mine] == list(crops) == [3, 3, 2, 0, 0]
        assert np.array_equal(np.concatenate([m.pixel_values for m in mine]), inputs["pixel_values"].numpy())
    expanded = engine.prompt_with_images(text, {"image": images}, PAN_AND_SCAN)
    assert expanded.token_ids == inputs["input_ids"][0].tolist()
    assert [run for s in expanded.images for run in s.blocks()] == _image_runs(inputs["token_type_ids"][0].numpy())
    square, cache = [images[3]], engine.runner.encoder_cache  # (no crops: its pixels and tokens the same either way)
    start = engine.prompt_with_images(ONE, {"image": square}).images[0].start
    ref_tokens = _reference(reference, ONE, square)[2]
    for settings, encoded in ((None, 1), (PAN_AND_SCAN, 1), (PAN_AND_SCAN, 0)):
        misses = cache.misses
        out = llm.generate({"prompt": ONE, "multi_modal_data": {"image": square}, "mm_processor_kwargs": settings},
                           GREEDY, use_tqdm=False)
        assert cache.misses - misses == encoded
        assert (out[0].num_cached_tokens > start) == (encoded == 0)  # (a prefix-cache hit into the image or not)
        assert out[0].outputs[0].token_ids == ref_tokens
    two = [images[0], images[3]]
    inputs, ref_logits, _ = _reference(reference, TWO, two)
    ids = _logits_match(engine, TWO, two, inputs, ref_logits, settings=PAN_AND_SCAN)
    expanded = engine.prompt_with_images(TWO, {"image": two}, PAN_AND_SCAN)
    second_crop = expanded.images[0].runs[2][0] - expanded.images[0].start + ids.index(
        engine.model_config.vision.image_token_id)
    _logits_match(engine, TWO, two, inputs, ref_logits, second_crop, PAN_AND_SCAN)


def test_per_request_settings_refused_by_name(gemma):
    """mm_processor_kwargs with a key Gemma 3's processor does not take, or a value out of its bounds: a RequestError
    (a ValueError) that names it, from LLM.generate, nothing left queued."""
    llm, image = gemma[3], _image(0, 40, 60)
    for settings, message in (({"do_pan_and_scan": True, "max_crops": 2}, r"'max_crops' is not a setting of Gemma 3's"),
                              ({"pan_and_scan_max_num_crops": 1000}, "pan_and_scan_max_num_crops 1000 \\(1 to 16\\)"),
                              ({"do_pan_and_scan": "yes"}, "do_pan_and_scan 'yes' \\(true or false\\)"),
                              ({"pan_and_scan_min_ratio_to_activate": float("nan")}, "ratio_to_activate nan"),
                              ([("do_pan_and_scan", True)], "mm_processor_kwargs is an object")):
        with pytest.raises(ValueError, match=message):
            llm.generate({"prompt": ONE, "multi_modal_data": {"image": [image]}, "mm_processor_kwargs": settings},
                         GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_what_is_refused(gemma, tmp_path):
    """An image token count that is no square dividing the patches, an image size the processor does not resize
    to, steps switched off; a prompt that holds image placeholder tokens of its own."""
    from hearth.config import ModelConfig
    from hearth.image_processor_gemma import GemmaImageProcessor

    config = json.loads((gemma[0] / "config.json").read_text())
    model_config = ModelConfig.from_hf(config)
    for tokens in (60, 49):
        with pytest.raises(ModelLoadError, match=f"mm_tokens_per_image = {tokens}: expected a square"):
            ModelConfig.from_hf({**config, "mm_tokens_per_image": tokens})
    processor = json.loads((gemma[0] / "processor_config.json").read_text())
    for change, message in (({"do_rescale": False}, "do_rescale"), ({"do_normalize": False}, "do_normalize"),
                            ({"size": {"height": 448, "width": 448}}, "size 448 x 448")):
        (tmp_path / "processor_config.json").write_text(json.dumps(
            {**processor, "image_processor": {**processor["image_processor"], **change}}))
        with pytest.raises(ModelLoadError, match=message):
            GemmaImageProcessor.from_hf_dir(tmp_path, model_config.vision)
    with pytest.raises(RequestError, match="holds 65 image placeholder tokens .* where its images take 64"):
        gemma[3].engine.add_request(None, "a<image_soft_token>b<start_of_image>", GREEDY,
                                    multi_modal_data={"image": [_image(0, 30, 40)]})
    assert not gemma[3].engine.has_unfinished_requests()


def test_mmproj_gguf_equals_transformers(gemma, two_images, tmp_path):
    """`hearth convert --mmproj` (F32) writes a gemma3 text GGUF and llama.cpp's gemma3 mmproj file (read back by
    gguf-py's reader: clip-impl.h's tensor names, the input projection F16 and the soft-embedding norm's whole
    weight, Gemma3VisionModel's); the two files give transformers' logits within 1e-4 with two images, and
    its greedy tokens."""
    import gguf

    from hearth import LLM
    from hearth.cli import main

    text, mmproj = tmp_path / "text.gguf", tmp_path / "mmproj.gguf"
    assert main(["convert", str(gemma[0]), str(text), "--type", "f32", "--mmproj", str(mmproj)]) == 0
    reader = gguf.GGUFReader(mmproj)
    assert (reader.fields["clip.projector_type"].contents(), gguf.GGUFReader(text).fields[
        "general.architecture"].contents()) == ("gemma3", "gemma3")
    tensors = {t.name: t for t in reader.tensors}
    per_layer = {f"v.blk.{i}.{part}.{kind}" for i in range(2) for kind in ("weight", "bias") for part in
                 ("attn_q", "attn_k", "attn_v", "attn_out", "ln1", "ln2", "ffn_up", "ffn_down")}
    assert set(tensors) == {"v.patch_embd.weight", "v.patch_embd.bias", "v.position_embd.weight", "v.post_ln.weight",
                            "v.post_ln.bias", "mm.input_projection.weight", "mm.soft_emb_norm.weight", *per_layer}
    assert tensors["mm.input_projection.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    norm = gemma[2].model.multi_modal_projector.mm_soft_emb_norm.weight
    assert np.array_equal(tensors["mm.soft_emb_norm.weight"].data, (norm.detach() + 1).numpy())
    llm = LLM(str(text), mmproj=str(mmproj), progress=False)
    images, inputs, ref_logits, ref_tokens = two_images
    ids, logits = _hearth_logits(llm.engine, TWO, images)
    assert ids == inputs["input_ids"][0].tolist()
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    out = llm.generate({"prompt": TWO, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref_tokens
    from hearth.loading.loader import load_model

    with pytest.raises(ModelLoadError, match="no <image_soft_token> token"):  # (a text model of another family)
        load_model("builtin", progress=False, mmproj=mmproj)
