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

from hearth.errors import ModelLoadError, RequestError
from models import gemma4_vl_processor, make_gemma4_vl
from test_vision import GREEDY, _hearth_logits, _image, _image_runs, _reference
from test_vision_gemma import _images_attend_both_ways, gpu_logits_match

ONE = "user: What is in <|image|>? model:"  # as Gemma 4's chat template writes an image part
TWO = "user: Compare <|image|> with<|image|> please model:"
# odd sizes: a landscape RGB, a tall RGBA, a tiny grey one (upscaled), a larger one, a sliver (one token high)
IMAGES = ((0, 77, 131, "RGB"), (1, 250, 97, "RGBA"), (2, 13, 21, "L"), (3, 517, 403, "RGB"), (4, 5, 400, "RGB"))


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    import transformers

    from hearth import LLM

    # (a position table of 512: room for a budget of 140 tokens, asked for per request, beside the folder's 70)
    folder = make_gemma4_vl(tmp_path_factory.mktemp("gemma4_vl"), vision={"position_embedding_size": 512})
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
    images = [_image(*IMAGES[0])]
    inputs, ref_logits, _ = _reference(gemma4, ONE, images)
    gpu_logits_match(gemma4[0], ONE, images, inputs, ref_logits)


BUDGET = {"max_soft_tokens": 140}  # in place of the folder's 70


def test_image_token_budget_per_request_and_by_flag(gemma4):
    """A budget of 140 soft tokens asked for per request (mm_processor_kwargs' max_soft_tokens) or by the engine's
    image_max_tokens (--image-max-tokens): every image's patches bit for bit and the prompt's ids as
    Gemma4ImageProcessorPil and Gemma4Processor make them with that budget; the same image at each budget its own
    encoder cache entry. A budget transformers does not take, one past the encoder's positions, another family's
    setting: refused by name."""
    from hearth.loading.loader import load_model

    folder, processor, _, llm = gemma4
    engine = llm.engine
    images = [_image(*IMAGES[i]) for i in (0, 1, 4)]
    text = "a<|image|>b<|image|> c<|image|>."
    inputs = processor(text=[text], images=[images], return_tensors="pt", **BUDGET)
    by_flag = load_model(folder, progress=False, image_max_tokens=140).image_processor
    for image_processor in (engine.image_processor.with_options(BUDGET), by_flag):
        mine = [image_processor.process(image) for image in images]
        for i, image in enumerate(mine):
            rows, cols, width = image.pixel_values.shape
            assert np.array_equal(image.pixel_values.reshape(rows * cols, width),
                                  inputs["pixel_values"][i, :rows * cols])
        assert [m.num_embeds for m in mine] == [135, 126, 105]  # (at 70: 60, 65, 70)
    assert engine.prompt_with_images(text, {"image": images}, BUDGET).token_ids == inputs["input_ids"][0].tolist()
    one, cache = [_image(5, 90, 150)], engine.runner.encoder_cache
    for settings, encoded in ((None, 1), (BUDGET, 1), (BUDGET, 0)):  # (the image again at 140: a hit)
        misses = cache.misses
        _hearth_logits(engine, ONE, one, settings=settings)
        assert cache.misses - misses == encoded
    for settings, message in (({"max_soft_tokens": 100}, "max_soft_tokens = 100: transformers' Gemma 4 processor"),
                              ({"max_soft_tokens": 280}, "840 patches long would pass the encoder's 512 positions"),
                              ({"do_pan_and_scan": True}, r"'do_pan_and_scan' is not a setting of Gemma 4's image "
                                                          r"processor \(it takes max_soft_tokens\)")):
        with pytest.raises(RequestError, match=message):
            engine.add_request(None, ONE, GREEDY, multi_modal_data={"image": one}, mm_processor_kwargs=settings)
    assert not engine.has_unfinished_requests()


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
                            ({"max_soft_tokens": 280}, "840 patches long would pass the encoder's 512 positions")):
        (tmp_path / "preprocessor_config.json").write_text(json.dumps({**settings, **change}))
        with pytest.raises(ModelLoadError, match=message):
            Gemma4ImageProcessor.from_hf_dir(tmp_path, model_config.vision)


# the text layout llama.cpp's gemma4 reads (tests/test_gemma4_gguf.py's), heads llama.cpp's gemma4v holds
LLAMA_CPP_TEXT = {"layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                                  "full_attention"]}
LLAMA_CPP_VISION = {"num_key_value_heads": 4, "head_dim": 8}


@pytest.fixture(scope="module")
def gemma4_gguf(tmp_path_factory):
    """A Gemma 4 folder llama.cpp's files can hold, transformers' model of it and `hearth convert --mmproj`'s
    F32 text GGUF and mmproj file."""
    import transformers

    from hearth.cli import main

    root = tmp_path_factory.mktemp("gemma4_gguf")
    folder = make_gemma4_vl(root / "folder", text=LLAMA_CPP_TEXT, vision=LLAMA_CPP_VISION)
    text, mmproj = root / "text.gguf", root / "mmproj.gguf"
    assert main(["convert", str(folder), str(text), "--type", "f32", "--mmproj", str(mmproj)]) == 0
    reference = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, gemma4_vl_processor(folder), reference, text, mmproj


def test_mmproj_gguf_equals_transformers(gemma4_gguf):
    """`hearth convert --mmproj` writes llama.cpp's gemma4v file (read back by gguf-py: clip-impl.h's names, the
    patch projection as a convolution's kernel [hidden, 3, patch, patch], the position table [2, positions,
    hidden], the standardisation); the text GGUF with it gives transformers' fp32 logits within 1e-4 with one
    image of an odd size, and its greedy tokens."""
    import gguf

    from hearth import LLM

    folder, processor, reference, text, mmproj = gemma4_gguf
    reader = gguf.GGUFReader(mmproj)
    assert reader.fields["clip.vision.projector_type"].contents() == "gemma4v"
    tensors = {t.name: t for t in reader.tensors}
    per_layer = {f"v.blk.{i}.{part}.weight" for i in range(2) for part in (
        "attn_q", "attn_k", "attn_v", "attn_out", "attn_q_norm", "attn_k_norm", "ln1", "attn_post_norm", "ln2",
        "ffn_post_norm", "ffn_gate", "ffn_up", "ffn_down")}
    assert set(tensors) == {"v.patch_embd.weight", "v.position_embd.weight", "v.std_bias", "v.std_scale",
                            "mm.input_projection.weight", *per_layer}
    tower = reference.model.vision_tower
    kernel = tower.patch_embedder.input_proj.weight.detach().reshape(32, 16, 16, 3).permute(0, 3, 1, 2)
    assert np.array_equal(np.array(tensors["v.patch_embd.weight"].data), kernel.numpy())
    assert np.array_equal(np.array(tensors["v.position_embd.weight"].data),
                          tower.patch_embedder.position_embedding_table.detach().numpy())
    llm = LLM(str(text), mmproj=str(mmproj), progress=False)
    images = [_image(*IMAGES[0])]
    inputs, ref_logits, ref_tokens = _reference((folder, processor, reference, llm), ONE, images)
    ids, logits = _hearth_logits(llm.engine, ONE, images)
    assert ids == inputs["input_ids"][0].tolist()
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    out = llm.generate({"prompt": ONE, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref_tokens


def _with_audio(path, out):
    """The mmproj file at `path` with an audio encoder's key and one of its tensors (a.blk.0.attn_q), at `out`."""
    import gguf

    reader, writer = gguf.GGUFReader(path), gguf.GGUFWriter(out, "clip")
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            writer.add_key_value(name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1
                                 else None)
    writer.add_bool("clip.has_audio_encoder", True)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.add_tensor("a.blk.0.attn_q.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return out


def test_gemma4_mmproj_heads_audio_and_bad_files(gemma4, gemma4_gguf, tmp_path):
    """A vision tower with grouped keys and values and heads wider than hidden / heads (the first folder's) is
    written with clip.cpp's head_count_kv and head_dim keys and read back to the folder's encoder outputs; a file
    with an audio tower too (E2B's) loads its vision tower. Refused by name: a folder whose rope theta the file
    cannot hold, a file without its position table or with half the standardisation, a text model without Gemma
    4's image tokens."""
    import shutil

    import gguf

    from hearth.loading.loader import load_model
    from hearth.loading.mmproj import write_mmproj

    text, mmproj = gemma4_gguf[3], gemma4_gguf[4]
    gqa = write_mmproj(gemma4[0], tmp_path / "gqa.gguf", "f32", progress=False)
    fields = gguf.GGUFReader(gqa).fields
    assert [fields[f"clip.vision.attention.{k}"].contents() for k in ("head_count_kv", "head_dim")] == [2, 16]
    patches = gemma4[3].engine.image_processor.process(_image(*IMAGES[0])).pixel_values
    loaded = load_model(text, progress=False, mmproj=gqa, image_max_tokens=70)  # (the file's table: 140 by default)
    assert loaded.image_processor.max_soft_tokens == 70
    torch.testing.assert_close(loaded.model.vision.encode(patches), gemma4[3].engine.model.vision.encode(patches),
                               atol=1e-5, rtol=0)
    for model, file, tokens, message in ((text, mmproj, 140, "image_max_tokens = 140: max_soft_tokens = 140: an image "
                                                            "420 patches long would pass the encoder's 256 positions"),
                                         ("builtin", None, 70, "not for a model without a vision encoder")):
        with pytest.raises(ModelLoadError, match=message):
            load_model(model, progress=False, mmproj=file, image_max_tokens=tokens)
    with pytest.raises(ModelLoadError, match=r"image_min_tokens \(--image-min-tokens\) is implemented for Qwen3-VL's "
                                             r"and Qwen3.5's images \(min_pixels\), not for gemma4's"):
        load_model(text, progress=False, mmproj=mmproj, image_min_tokens=70)
    folder = shutil.copytree(gemma4_gguf[0], tmp_path / "theta")
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"]["rope_parameters"]["rope_theta"] = 10_000.0
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="rope_theta 10000.0: llama.cpp's gemma4v file holds no rope theta"):
        write_mmproj(folder, tmp_path / "theta.gguf", "f32", progress=False)
    tower = load_model(text, progress=False, mmproj=_with_audio(mmproj, tmp_path / "audio.gguf")).model.vision
    assert tower.vision_tower.std_scale.shape == (32,)  # (an audio tower beside it, as E2B's: left unread)
    good = mmproj.read_bytes()
    (tmp_path / "no-table.gguf").write_bytes(good.replace(b"v.position_embd.weight", b"v.position_xxxx.weight"))
    (tmp_path / "half.gguf").write_bytes(good.replace(b"v.std_scale", b"v.std_scalx"))
    for model, file, message in ((text, tmp_path / "no-table.gguf", "missing tensor v.position_embd.weight"),
                                 (text, tmp_path / "half.gguf", "missing tensor v.std_scale"),
                                 ("builtin", mmproj, r"no <\|image\|> token")):
        with pytest.raises(ModelLoadError, match=message):
            load_model(model, progress=False, mmproj=file)


def test_llama_cpp_converts_the_same_mmproj(gemma4_gguf, tmp_path):
    """llama.cpp's convert_hf_to_gguf.py --mmproj (LLAMA_CPP_SOURCE: its source tree) writes from the same folder
    the same keys (but the general ones) and tensors (names, types, shapes, values) as `hearth convert --mmproj`,
    in f32 and in f16 (the patch projection F16, the position table F32)."""
    import subprocess
    import sys

    from gguf import GGUFReader

    from hearth.loading.mmproj import write_mmproj
    from optional import llama_cpp_source
    from test_hybrid_gguf import _CONVERTER

    source = llama_cpp_source()
    ours = {"f32": gemma4_gguf[4], "f16": write_mmproj(gemma4_gguf[0], tmp_path / "f16.gguf", "f16", progress=False)}
    subprocess.run([sys.executable, "-c", _CONVERTER, str(source), *("|".join(
        ["--mmproj", "--outtype", kind, "--outfile", str(tmp_path / f"theirs-{kind}.gguf"), str(gemma4_gguf[0])])
        for kind in ours)], check=True, capture_output=True)
    for kind, path in ours.items():
        readers = GGUFReader(path), GGUFReader(tmp_path / f"theirs-{kind}.gguf")
        keys = [{k: f.contents() for k, f in r.fields.items() if not k.startswith(("GGUF.", "general."))}
                for r in readers]
        assert keys[0] == keys[1] and readers[0].fields["general.file_type"].contents() == (kind == "f16")
        tensors = [{t.name: (t.tensor_type, np.array(t.data)) for t in r.tensors} for r in readers]
        assert sorted(tensors[0]) == sorted(tensors[1])
        for name, (qtype, values) in tensors[1].items():
            assert tensors[0][name][0] == qtype, (kind, name)
            np.testing.assert_array_equal(tensors[0][name][1], values, err_msg=f"{kind} {name}")
