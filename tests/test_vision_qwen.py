"""Images in: Qwen3-VL (transformers' Qwen3VLForConditionalGeneration with random weights in real image
shapes) against transformers' own processor and model, fp32: pixels, grids, token ids, M-RoPE positions,
logits and greedy tokens with one and two images of odd sizes, whole and in chunks that cut through an
image, on the cpu and reference backends, and on the gpu backend; what bad configs refuse."""

from __future__ import annotations

import json
import time

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


def test_image_token_bounds_of_the_engine(qwen):
    """image_min_tokens and image_max_tokens (llama.cpp's --image-min-tokens, --image-max-tokens) as the processor's
    area bounds, tokens x (16 x 2)^2 pixels (the most past the folder's 100 tokens: the operator's choice): every
    image's tokens within them, its patches, grid and the prompt's ids as transformers' processor makes them with
    the derived min_pixels and max_pixels; a least past the most refused by name."""
    from hearth.engine_config import EngineConfig
    from hearth.loading.loader import load_model

    least, most = 6, 150
    processor = load_model(qwen[0], progress=False, image_min_tokens=least, image_max_tokens=most).image_processor
    images = [_image(*spec) for spec in IMAGES]
    inputs = qwen[1](text=[IMAGE * len(images)], images=images, return_tensors="pt",
                     size={"shortest_edge": least * 32 ** 2, "longest_edge": most * 32 ** 2})
    mine = [processor.process(image) for image in images]
    assert np.array_equal(np.concatenate([m.pixel_values for m in mine]), inputs["pixel_values"].numpy())
    assert [[1, 2 * m.grid[0], 2 * m.grid[1]] for m in mine] == inputs["image_grid_thw"].tolist()
    assert [m.num_embeds for m in mine] == [8, 24, 8, 130]  # (the tiny one up past the least, the large one past 100)
    assert all(least <= m.num_embeds <= most for m in mine)
    assert sum(m.num_embeds for m in mine) == (inputs["input_ids"] == qwen[2].config.image_token_id).sum()
    with pytest.raises(ValueError, match="image_min_tokens 9 is more than image_max_tokens 8"):
        EngineConfig(image_min_tokens=9, image_max_tokens=8)


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
    with pytest.raises(ModelLoadError, match="qwen3 or qwen3_moe text model"):
        ModelConfig.from_hf({**config, "text_config": {**config["text_config"], "model_type": "llama"}})
    with pytest.raises(RequestError, match=r"names 0 image\(s\) with <\|image_pad\|>"):
        qwen[3].engine.add_request(None, "a <image>", GREEDY, multi_modal_data={"image": [_image(0, 30, 40)]})
    with pytest.raises(RequestError, match="differ by more than 200 times"):  # (transformers' limit too)
        qwen[3].engine.add_request(None, ONE, GREEDY, multi_modal_data={"image": [_image(0, 1, 201)]})
    assert not qwen[3].engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def qwen_gguf(qwen, tmp_path_factory):
    """`hearth convert --mmproj`'s F32 text GGUF and mmproj file of the Qwen3-VL folder."""
    from hearth.cli import main

    root = tmp_path_factory.mktemp("qwen3_vl_gguf")
    text, mmproj = root / "text.gguf", root / "mmproj.gguf"
    assert main(["convert", str(qwen[0]), str(text), "--type", "f32", "--mmproj", str(mmproj)]) == 0
    return text, mmproj


def test_mmproj_gguf_equals_transformers(qwen, qwen_gguf, tmp_path):
    """`hearth convert --mmproj` writes llama.cpp's qwen3vl text GGUF (its M-RoPE sections, the deepstack count) and
    qwen3vl_merger file (read back by gguf-py: the Conv3d's two frames as two kernels, the deepstack mergers under
    the encoder layers they read); the pair gives transformers' fp32 logits within 1e-4 with one image of an odd
    size, and its greedy tokens. Refused by name: a text model without Qwen's image tokens, a file without its
    position table."""
    import gguf

    from hearth import LLM
    from hearth.loading.loader import load_model

    text, mmproj = qwen_gguf
    fields = gguf.GGUFReader(text).fields
    assert fields["general.architecture"].contents() == "qwen3vl"
    assert [fields[f"qwen3vl.{key}"].contents() for key in ("rope.dimension_sections", "n_deepstack_layers")] == \
        [[4, 2, 2, 0], 2]
    reader = gguf.GGUFReader(mmproj)
    assert reader.fields["clip.projector_type"].contents() == "qwen3vl_merger"
    assert reader.fields["clip.vision.is_deepstack_layers"].contents() == [True, False, True]
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    assert {name for name in tensors if name.startswith("v.deepstack.")} == {
        f"v.deepstack.{layer}.{part}.{kind}" for layer in (0, 2) for part in ("norm", "fc1", "fc2")
        for kind in ("weight", "bias")}
    kernel = qwen[2].model.visual.patch_embed.proj.weight.detach()  # [hidden, 3, 2 frames, patch, patch]
    for frame, name in enumerate(("v.patch_embd.weight", "v.patch_embd.weight.1")):
        assert np.array_equal(tensors[name], kernel[:, :, frame].numpy())
    llm = LLM(str(text), mmproj=str(mmproj), progress=False)
    images = [_image(*IMAGES[0])]
    inputs, ref_logits, ref_tokens = _reference(qwen, ONE, images)
    ids, logits = _hearth_logits(llm.engine, ONE, images)
    assert ids == inputs["input_ids"][0].tolist()
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    out = llm.generate({"prompt": ONE, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref_tokens
    # a video: the file holds no video settings, so Qwen3VLVideoProcessor's defaults (frames upscaled to its least)
    frames = np.random.default_rng(6).integers(0, 256, (4, 45, 100, 3), dtype=np.uint8)
    patches, grid, placeholder = _video_reference(qwen, frames, None, defaults=True)
    assert np.array_equal(np.concatenate([g.pixel_values for g in llm.engine.video_processor.process(frames).groups]),
                          patches.numpy())
    _video_logits_match((*qwen[:3], llm), frames, patches, grid, placeholder)
    with pytest.raises(ModelLoadError, match=r"no <\|image_pad\|> token"):
        load_model("builtin", progress=False, mmproj=mmproj)
    with pytest.raises(ModelLoadError, match=r"at least 8,192 pixels \(the processor's min_pixels\) and at most 4,096 "
                                             r"\(image_max_tokens; .* the least passes the most"):
        load_model(text, progress=False, mmproj=mmproj, image_max_tokens=4)  # (clip.cpp's least: 8 tokens)
    (tmp_path / "bad.gguf").write_bytes(mmproj.read_bytes().replace(b"v.position_embd.weight",
                                                                     b"v.position_xxxx.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor v.position_embd.weight \[positions, hidden\]"):
        load_model(text, progress=False, mmproj=tmp_path / "bad.gguf")


def test_llama_cpp_converts_the_same_qwen3_vl_files(qwen, qwen_gguf, tmp_path):
    """llama.cpp's convert_hf_to_gguf.py (LLAMA_CPP_SOURCE: its source tree) writes from the same folder the same
    tensors (names, types, shapes, values) as `hearth convert`, the text GGUF's qwen3vl keys and the mmproj file's
    keys (but the general ones), in f32 and (the mmproj file) f16: the patch kernels F16, the position table F32
    (Qwen3.5's: tests/test_vision_qwen3_5.py)."""
    from hearth.loading.mmproj import write_mmproj
    from optional import llama_cpp_source

    llama_cpp_source()
    ours = {"text": qwen_gguf[0], "f32": qwen_gguf[1],
            "f16": write_mmproj(qwen[0], tmp_path / "f16.gguf", "f16", progress=False)}
    runs = {"text": ["--outtype", "f32"], "f32": ["--mmproj", "--outtype", "f32"], "f16": ["--mmproj", "--outtype", "f16"]}
    converted_like_llama_cpp(qwen[0], ours, runs, tmp_path)


def converted_like_llama_cpp(folder, ours: dict, runs: dict, tmp_path) -> None:
    """llama.cpp's converter run on `folder` with each of `runs`' arguments writes the clip.* and qwen3vl keys and
    the tensors of hearth's file of the same kind in `ours` (skipped without LLAMA_CPP_SOURCE)."""
    import subprocess
    import sys

    from gguf import GGUFReader

    from optional import llama_cpp_source
    from test_hybrid_gguf import _CONVERTER

    source = llama_cpp_source()
    subprocess.run([sys.executable, "-c", _CONVERTER, str(source), *("|".join(
        [*args, "--outfile", str(tmp_path / f"theirs-{kind}.gguf"), str(folder)]) for kind, args in runs.items())],
        check=True, capture_output=True)
    for kind, path in ours.items():
        readers = GGUFReader(path), GGUFReader(tmp_path / f"theirs-{kind}.gguf")
        keys = [{k: f.contents() for k, f in r.fields.items() if k.startswith("clip.") or k in (
            "qwen3vl.rope.dimension_sections", "qwen3vl.n_deepstack_layers", "general.architecture")} for r in readers]
        assert keys[0] == keys[1] and len(keys[0]) > 2, kind
        tensors = [{t.name: (t.tensor_type, np.array(t.data)) for t in r.tensors} for r in readers]
        assert sorted(tensors[0]) == sorted(tensors[1])
        for name, (qtype, values) in tensors[1].items():
            assert tensors[0][name][0] == qtype, (kind, name)
            np.testing.assert_array_equal(tensors[0][name][1], values, err_msg=f"{kind} {name}")


VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"  # as Qwen3-VL's chat template writes a video part


def _video_reference(qwen, frames: np.ndarray, fps: float | None, defaults: bool = False):
    """transformers' Qwen3VLVideoProcessor's output for frames taken as they are (do_sample_frames off), from its
    own smart_resize, patchify and Qwen3VLProcessor.replace_video_token; its resize (torchvision's, not installed
    here) as PIL's bicubic: the pixels, the grid and the video's placeholder text. defaults: the processor with its
    class's defaults (the published folders' settings), not the folder's."""
    from PIL import Image
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
    from transformers.video_utils import VideoMetadata

    processor = qwen[1]
    videos = processor.video_processor = Qwen3VLVideoProcessor() if defaults else \
        Qwen3VLVideoProcessor.from_pretrained(qwen[0])
    count, height, width = frames.shape[:3]
    height, width = smart_resize(count, height, width, temporal_factor=2, factor=32,
                                 min_pixels=videos.size["shortest_edge"], max_pixels=videos.size["longest_edge"])
    resized = np.stack([np.asarray(Image.fromarray(f).resize((width, height), Image.BICUBIC)) for f in frames])
    normalised = torch.from_numpy(((resized.astype(np.float32) / 255 - 0.5) / 0.5).transpose(0, 3, 1, 2))
    patches, *grid = videos.patchify(normalised[None], patch_size=16, merge_size=2, temporal_patch_size=2)
    grid = torch.tensor([grid])
    metadata = VideoMetadata(total_num_frames=count, fps=fps, frames_indices=list(range(count)))
    text = processor.replace_video_token({"video_grid_thw": grid, "video_metadata": [metadata]}, 0)
    return patches[0], grid, text


def test_videos_are_transformers(qwen):
    """A video of 5 frames (the last group padded with its last frame) beside an image: each frame group's patches,
    grid and timestamp text, the token ids, the M-RoPE positions (get_rope_index: a frame group placed as an image),
    logits within 1e-4 (two chunks cut inside the video) and greedy tokens, against transformers; frames as an
    array (fps unknown: 24) and as PIL images with their fps (_video_logits_match)."""
    from PIL import Image

    engine = qwen[3].engine
    frames = np.random.default_rng(3).integers(0, 256, (5, 45, 100, 3), dtype=np.uint8)
    for given, fps in ((frames, None), (([Image.fromarray(f) for f in frames], {"fps": 4.0}), 4.0)):
        patches, grid, placeholder = _video_reference(qwen, frames, fps)
        mine = engine.video_processor.process(given)
        assert np.array_equal(np.concatenate([g.pixel_values for g in mine.groups]), patches.numpy())
        assert [[1, *(2 * n for n in g.grid)] for g in mine.groups] == [[1, *grid[0, 1:].tolist()]] * 3
        assert engine.video_processor.placeholder_text(mine) == placeholder
    _video_logits_match(qwen, given, patches, grid, placeholder)


def _video_logits_match(qwen, video, patches: torch.Tensor, grid: torch.Tensor, placeholder: str) -> None:
    """A prompt with `video` (transformers' patches, grid and placeholder text of it) and an image: the token ids,
    the M-RoPE positions (get_rope_index: a frame group placed as an image), logits within 1e-4 (two chunks cut
    inside the video) and greedy tokens equal transformers'; run again, every group and the image come from the
    encoder cache."""
    _, processor, reference, llm = qwen
    engine = llm.engine
    image = _image(*IMAGES[0])
    text = f"<|im_start|>user\nWatch {VIDEO} then {IMAGE} now<|im_end|>\n<|im_start|>assistant\n"
    pictures = processor.image_processor(images=[image], return_tensors="pt")
    rows = int(pictures["image_grid_thw"][0].prod()) // 4
    ids = processor.tokenizer(text.replace(VIDEO, placeholder).replace("<|image_pad|>", "<|image_pad|>" * rows),
                              return_tensors="pt")["input_ids"]
    marks = (ids == reference.config.image_token_id).int() + 2 * (ids == reference.config.video_token_id).int()
    inputs = dict(input_ids=ids, mm_token_type_ids=marks, pixel_values_videos=patches, video_grid_thw=grid, **pictures)
    data = {"video": video, "image": [image]}
    expanded = engine.prompt_with_images(text, data)
    assert expanded.token_ids == ids[0].tolist()
    positions, _ = reference.model.get_rope_index(ids, marks, pictures["image_grid_thw"], grid)
    assert np.array_equal(mrope_positions(np.arange(ids.shape[1]), expanded.images), positions[:, 0].numpy())
    with torch.no_grad():
        ref_logits = reference(**inputs).logits[0]
        ref_tokens = reference.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)[0, ids.shape[1]:]
    cut = expanded.images[0].start + 2  # inside the video's first frame group
    torch.testing.assert_close(_hearth_logits(engine, text, data, cut)[1], ref_logits, atol=1e-4, rtol=0)
    misses = engine.runner.encoder_cache.misses
    out = llm.generate({"prompt": text, "multi_modal_data": data}, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref_tokens.tolist()
    assert engine.runner.encoder_cache.misses == misses  # (every group and the image: in the cache already)


def _video_file(frames: np.ndarray, codec: str = "mpeg4", container: str = "mp4") -> bytes:
    """frames (uint8 [T, H, W, 3]) encoded at 24 frames a second by PyAV."""
    import io

    import av

    out = io.BytesIO()
    with av.open(out, "w", format=container) as file:
        stream = file.add_stream(codec, rate=24)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            file.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        file.mux(stream.encode())
    return out.getvalue()


# a chat template that writes a video part as Qwen3-VL's does
VIDEO_TEMPLATE = ("{% for m in messages %}{% for p in m.content %}{% if p.type == 'video' %}" + VIDEO +
                  "{% else %}{{ p.text }}{% endif %}{% endfor %}{% endfor %}")


def test_video_files_are_decoded_and_sampled_as_transformers_samples_them(qwen):
    """6 frames at 24 fps, in mp4 and webm (whose header counts no frames): decoded by PyAV and sampled as
    transformers' Qwen3VLVideoProcessor.sample_frames samples them (frames 0, 2, 3, 5 at 2 fps, at least 4), each
    equal to PyAV's own decoding; a file of more frames than allowed refused from its header; frames given to the
    engine past the processor's max_frames (8), or one frame, refused."""
    import io
    from unittest import mock

    av = pytest.importorskip("av")
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    from hearth.videos import VideoError, VideoLimits, decode_video

    frames = np.random.default_rng(4).integers(0, 256, (6, 48, 64, 3), dtype=np.uint8)
    mp4 = _video_file(frames)
    with av.open(io.BytesIO(mp4)) as file:
        every = [f.to_ndarray(format="rgb24") for f in file.decode(video=0)]
    sampled = Qwen3VLVideoProcessor.from_pretrained(qwen[0]).sample_frames(VideoMetadata(total_num_frames=6, fps=24))
    limits = qwen[3].engine.video_processor.limits(5000)
    for data in (mp4, _video_file(frames, "libvpx", "webm")):
        decoded = decode_video(data, limits)
        assert decoded.indices.tolist() == sampled.tolist() and decoded.fps == 24
    assert all(np.array_equal(every[i], f) for i, f in zip(decoded.indices, decode_video(mp4, limits).frames))
    with pytest.raises(VideoError, match="has 6 frames; this server's limit is 4"):
        decode_video(mp4, VideoLimits(5000, 10**6, max_source_frames=4))
    with mock.patch.dict("sys.modules", {"av": None}), pytest.raises(VideoError, match="PyAV is not installed"):
        decode_video(mp4, limits)
    for bad, message in ((frames[:1], "has 1 frames"), (np.concatenate([frames, frames]), "has 12 frames")):
        with pytest.raises(RequestError, match=message):  # (the model's processor takes 2 to 8 frames)
            qwen[3].engine.add_request(None, VIDEO, GREEDY, multi_modal_data={"video": bad})


def test_the_server_takes_a_data_url_video_and_refuses_bad_ones(qwen):
    """vLLM's `video_url` part with an mp4 data URL: the server counts and answers what LLM.generate does with the
    file's sampled frames. A truncated file, bytes that are no video, an image's media type, frames past
    --max-image-pixels: each a 400 in under a second, the server healthy after."""
    import base64

    pytest.importorskip("av")

    import httpx

    from hearth.engine.async_engine import AsyncEngine
    from hearth.engine.engine import LLMEngine
    from hearth.engine_config import EngineConfig
    from hearth.server.app import build_app
    from hearth.server.limits import ServerLimits
    from hearth.videos import decode_video
    from test_server import serving

    mp4 = _video_file(np.random.default_rng(4).integers(0, 256, (6, 48, 64, 3), dtype=np.uint8))

    def url(data: bytes, media_type: str = "video/mp4") -> str:
        return f"data:{media_type};base64,{base64.b64encode(data).decode()}"

    def body(video_url: str) -> dict:
        return {"model": "qwen", "max_tokens": 4, "temperature": 0, "chat_template": VIDEO_TEMPLATE, "messages": [
            {"role": "user", "content": [{"type": "video_url", "video_url": {"url": video_url}},
                                         {"type": "text", "text": "What happens?"}]}]}

    engine = AsyncEngine(LLMEngine(qwen[0], EngineConfig(), progress=False))
    server_limits = ServerLimits(max_image_pixels=5000)
    try:
        with serving(build_app(engine, "qwen", limits=server_limits, trust_request_chat_template=True),
                     server_limits) as server, httpx.Client(base_url=server, timeout=60) as client:
            reply = client.post("/v1/chat/completions", json=body(url(mp4))).json()
            frames = decode_video(mp4, qwen[3].engine.video_processor.limits(5000))
            expected = qwen[3].generate({"prompt": VIDEO + "What happens?", "multi_modal_data": {"video": frames}},
                                        SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
            assert reply["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
            assert reply["choices"][0]["message"]["content"] == expected.outputs[0].text
            big = _video_file(np.zeros((4, 96, 128, 3), dtype=np.uint8))
            for video_url, message in ((url(mp4[:len(mp4) // 2]), "damaged, truncated or not a video"),
                                       (url(b"not a video, only text " * 4), "damaged, truncated or not a video"),
                                       (url(mp4, "image/png"), "not a video's"),
                                       (url(big), "128 x 96 = 12,288 pixels; this server's limit is 5,000")):
                times = []
                for _ in range(2):  # (the faster of two: the server's time, less a busy machine's noise)
                    start = time.perf_counter()
                    answer = client.post("/v1/chat/completions", json=body(video_url))
                    times.append(time.perf_counter() - start)
                assert answer.status_code == 400 and message in answer.json()["error"]["message"], answer.text
                assert min(times) < 1.0
            assert client.get("/health").status_code == 200
    finally:
        engine.shutdown()


def test_llm_chat_and_generate_take_videos(qwen, tmp_path, capsys):
    """LLM.chat with vLLM's `video_url` parts (an mp4 data URL, a webm file:// path): the token ids and greedy tokens
    LLM.generate gives for the files' sampled frames (compared with transformers in test_videos_are_transformers);
    `hearth generate --video` the same text (the video's part put before the prompt). A model without videos, PyAV
    missing, an unreadable file: each refused by name."""
    import base64
    import json
    from unittest import mock

    pytest.importorskip("av")
    from hearth import LLM
    from hearth.chat_images import conversation_media
    from hearth.cli import main
    from hearth.videos import VideoError, decode_video

    rng = np.random.default_rng(5)
    mp4 = _video_file(rng.integers(0, 256, (6, 48, 64, 3), dtype=np.uint8))
    webm = _video_file(rng.integers(0, 256, (5, 32, 48, 3), dtype=np.uint8), "libvpx", "webm")
    (tmp_path / "a.mp4").write_bytes(mp4)
    (tmp_path / "b.webm").write_bytes(webm)
    limits = qwen[3].engine.video_processor.limits(5000)
    frames = [decode_video(data, limits) for data in (mp4, webm)]
    params = SamplingParams(max_tokens=4, temperature=0)
    expected = qwen[3].generate({"prompt": f"{VIDEO}then{VIDEO}?", "multi_modal_data": {"video": frames}},
                                params, use_tqdm=False)[0]
    content = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(mp4).decode()}},
               {"type": "text", "text": "then"}, {"type": "video_url", "video_url": f"file://{tmp_path / 'b.webm'}"},
               {"type": "text", "text": "?"}]
    llm = LLM(str(qwen[0]), chat_template=VIDEO_TEMPLATE, progress=False)
    out = llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)[0]
    assert out.prompt_token_ids == expected.prompt_token_ids and out.outputs[0].token_ids == expected.outputs[0].token_ids
    with mock.patch.dict("sys.modules", {"av": None}), pytest.raises(VideoError, match="PyAV is not installed"):
        llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)
    with pytest.raises(VideoError, match="video 1: this model takes no videos"):
        conversation_media([{"role": "user", "content": content}], None)  # (LLM.chat's for a model without)
    with pytest.raises(RequestError, match="video 2: cannot read"):
        llm.chat([{"role": "user", "content": content[:2] + [{"type": "video_url", "video_url": "file:///no.mp4"}]}])

    capsys.readouterr()
    assert main(["generate", str(qwen[0]), "--video", str(tmp_path / "a.mp4"), "--prompt", "What happens?",
                 "--max-tokens", "4", "--temperature", "0", "--json"]) == 0
    reply = json.loads(capsys.readouterr().out)
    alone = qwen[3].generate({"prompt": VIDEO + "What happens?", "multi_modal_data": {"video": frames[:1]}}, params,
                             use_tqdm=False)[0]
    assert reply["text"] == alone.outputs[0].text and reply["prompt_tokens"] == len(alone.prompt_token_ids)
    assert main(["generate", "builtin", "--video", str(tmp_path / "missing.mp4"), "--prompt", "x"]) == 1
    assert "--video: cannot read" in capsys.readouterr().err
    assert main(["generate", "builtin", "--video", str(tmp_path / "a.mp4"), "--prompt", "x"]) == 1
    assert "--video: this model takes no videos" in capsys.readouterr().err
    _chat_with_media(qwen, tmp_path, frames[0], capsys)


def _chat_with_media(qwen, tmp_path, frames, capsys) -> None:
    """`hearth chat --image` with /video (a.mp4, whose sampled frames are `frames`) before its first message and
    /image before its second: each reply is what LLM.generate gives for the conversation written out by hand
    (the first message's image and video before its text, the second's image), and a /video of a missing file
    is said on stderr, the chat going on."""
    import io
    import json
    import sys
    from unittest import mock

    from hearth.cli import main
    from test_vision import IMAGE_PARTS_TEMPLATE

    images = [_image(*IMAGES[0]), _image(*IMAGES[2])]
    for name, image in zip(("a.png", "b.png"), images):
        image.save(tmp_path / name)
    (tmp_path / "chat.jinja").write_text(IMAGE_PARTS_TEMPLATE.replace(
        "{% if p.type == 'image' %}<image>", f"{{% if p.type == 'image' %}}{IMAGE}{{% elif p.type == 'video' %}}{VIDEO}"))
    lines = f"/video {tmp_path / 'a.mp4'}\n/video {tmp_path / 'no.mp4'}\nWhat happens?\n/image {tmp_path / 'b.png'}\nNow?\n"
    capsys.readouterr()
    with mock.patch.object(sys, "stdin", io.StringIO(lines)):
        assert main(["chat", str(qwen[0]), "--image", str(tmp_path / "a.png"), "--chat-template",
                     str(tmp_path / "chat.jinja"), "--temperature", "0", "--max-tokens", "3", "--json"]) == 0
    out, err = capsys.readouterr()
    replies = [json.loads(line) for line in out.splitlines()]
    assert "/video: cannot read" in err and "video attached to your next message: 2 so far" in err
    first = f"<|im_start|>user\n{IMAGE}{VIDEO}What happens?<|im_end|>\n<|im_start|>assistant\n"
    expected = qwen[3].generate({"prompt": first, "multi_modal_data": {"image": images[:1], "video": [frames]}},
                                SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    assert replies[0]["content"] == expected.outputs[0].text
    assert replies[0]["prompt_tokens"] == len(expected.prompt_token_ids)
    second = f"{first}{replies[0]['content']}<|im_end|>\n<|im_start|>user\n{IMAGE}Now?<|im_end|>\n<|im_start|>assistant\n"
    ids = qwen[3].engine.prompt_with_images(second, {"image": images, "video": [frames]}).token_ids
    assert replies[1]["prompt_tokens"] == len(ids)
