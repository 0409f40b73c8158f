"""Images in: SmolVLM (transformers' SmolVLMForConditionalGeneration with random weights in real image
shapes) against transformers' own processor and model, fp32: pixels, token ids, logits, greedy tokens;
the encoder and prefix caches; chunks through an image; the encoder budget; bad requests."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from hearth.engine.images import step_embeddings
from hearth.engine.kv_cache import BlockManager
from hearth.engine.request import ImageSpan, Request
from hearth.engine.runner import BatchEntry
from hearth.engine.scheduler import Scheduler
from hearth.errors import ModelLoadError, RequestError
from hearth.sampling_params import BeamSearchParams, SamplingParams
from models import make_hf_model, make_vlm

PROMPT = "<|im_start|>user\nWhat is in <image>?<|im_end|>\n<|im_start|>assistant\n"
TWO = "<|im_start|>user\nCompare <image> with<image> please<|im_end|>\n<|im_start|>assistant\n"
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _image(seed: int, height: int, width: int, mode: str = "RGB"):
    from PIL import Image

    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    import transformers

    from hearth import LLM

    folder = make_vlm(tmp_path_factory.mktemp("smolvlm"))
    processor = transformers.AutoProcessor.from_pretrained(folder)
    reference = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, processor, reference, LLM(str(folder), progress=False)


# odd sizes: a landscape RGB (2 x 2 tiles), a tall RGBA (2 x 1), a tiny grey one (upscaled, 2 x 2)
IMAGES = ((0, 300, 421, "RGB"), (1, 517, 203, "RGBA"), (2, 37, 45, "L"))


def _reference(vlm, text: str, images: list):
    """transformers' processor inputs, the model's logits of every position and its greedy tokens."""
    _, processor, reference, _ = vlm
    inputs = processor(text=[text], images=[images], return_tensors="pt")
    with torch.no_grad():
        logits = reference(**inputs).logits[0]
        out = reference.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    return inputs, logits, out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module")
def two_images(vlm):
    """Two images of odd sizes and transformers' processor ids, logits and greedy tokens for TWO with them."""
    images = [_image(*IMAGES[0]), _image(*IMAGES[1])]
    return images, *_reference(vlm, TWO, images)


def _hearth_logits(engine, text: str, images: list, cut: int | None = None, settings: dict | None = None
                   ) -> tuple[list[int], torch.Tensor]:
    """hearth's logits of every position of the prompt (in two chunks split at `cut`, else one); `images` a list of
    images, or multi_modal_data (videos too), made with the processor `settings` (a request's mm_processor_kwargs)."""
    vision = engine.model_config.vision
    expanded = engine.prompt_with_images(text, images if isinstance(images, dict) else {"image": images}, settings)
    ids = expanded.token_ids
    request = Request("logits", ids, images=expanded.images)
    assert engine.block_manager.allocate_slots(request, len(ids))
    pieces = []
    for start, end in ((0, cut), (cut, len(ids))) if cut else ((0, len(ids)),):
        embeds = step_embeddings(request, start, end - start, vision.image_token_id, engine.runner.encoder_cache,
                                 engine.model.vision.encode)
        hidden, _ = engine.runner.forward([BatchEntry(ids[start:end], start, request.block_table, embeds=embeds,
                                                      images=request.images,  # (a hybrid's state: slot 0)
                                                      state_slot=0 if engine.model_config.is_hybrid else None)])
        pieces.append(engine.model.compute_logits(hidden))
    engine.block_manager.free(request)
    return ids, torch.cat(pieces)


def _image_runs(marks: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run of 1 in a processor's token types [T] (token_type_ids, mm_token_type_ids): the
    tokens of one image each."""
    marked = np.flatnonzero(marks == 1)
    return [(int(run[0]), int(run[-1]) + 1) for run in np.split(marked, np.flatnonzero(np.diff(marked) > 1) + 1)]


def _logits_match(engine, text: str, images: list, inputs, ref_logits: torch.Tensor, cut: int | None = None,
                  settings: dict | None = None) -> list[int]:
    """hearth's prompt ids (returned) are the processor's, its logits transformers' within 1e-4 (fp32)."""
    ids, logits = _hearth_logits(engine, text, images, cut, settings)
    assert ids == inputs["input_ids"][0].tolist()
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    return ids


def test_pixels_and_token_ids_are_the_processors(vlm):
    """Every tile's pixel values bit for bit, and the expanded prompt's token ids, as transformers'
    Idefics3 processor makes them (RGB, RGBA composited on white, greyscale; split and upscaled)."""
    engine = vlm[3].engine
    for seed, height, width, mode in IMAGES:
        image = _image(seed, height, width, mode)
        inputs = vlm[1](text=[PROMPT], images=[[image]], return_tensors="pt")
        mine = engine.image_processor.process(image)
        assert np.array_equal(mine.pixel_values, inputs["pixel_values"][0].numpy())
        expanded = engine.prompt_with_images(PROMPT, {"image": image})
        assert expanded.token_ids == inputs["input_ids"][0].tolist()
        assert expanded.images[0].num_embeds == len(mine.pixel_values) * 64


def test_processor_settings_per_request(vlm):
    """mm_processor_kwargs as transformers' Idefics3 processor takes them (do_image_splitting, size, max_image_size
    at the encoder's tile): every tile's pixels and the prompt's ids as its processor makes them with those
    settings, and with splitting off fp32 logits within 1e-4 of transformers' model; the settings are part of each
    image's cache key (the folder's own, given, the same key as none); a key it does not take, a tile or a size it
    cannot, a setting of the wrong type: refused by name."""
    _, processor, reference, llm = vlm
    engine = llm.engine
    image = _image(*IMAGES[1])  # (517 x 203: 2 x 1 tiles and the global image with the folder's settings)
    plain = engine.prompt_with_images(PROMPT, {"image": image}).images[0].content_hash
    for settings in ({"size": {"longest_edge": 700}, "max_image_size": {"longest_edge": 512}},
                     {"size": {"longest_edge": 300}}, {"do_image_splitting": False}):
        inputs = processor(text=[PROMPT], images=[[image]], return_tensors="pt", **settings)
        assert np.array_equal(engine.image_processor.with_options(settings).process(image).pixel_values,
                              inputs["pixel_values"][0].numpy())
        expanded = engine.prompt_with_images(PROMPT, {"image": image}, settings)
        assert expanded.token_ids == inputs["input_ids"][0].tolist() and expanded.images[0].content_hash != plain
    with torch.no_grad():
        ref_logits = reference(**inputs).logits[0]  # (one tile)
    _logits_match(engine, PROMPT, [image], inputs, ref_logits, settings=settings)
    same = {"do_image_splitting": True, "size": {"longest_edge": 1024}}  # (the folder's)
    assert engine.prompt_with_images(PROMPT, {"image": image}, same).images[0].content_hash == plain
    for settings, message in (({"max_image_size": {"longest_edge": 256}}, r"this model's tiles are 512 pixels"),
                              ({"size": {"longest_edge": 2048}}, r"expected 1 to 1024 pixels \(the model's"),
                              ({"size": 512}, r"size is \{'longest_edge': N\}"),
                              ({"do_image_splitting": "no"}, "do_image_splitting is true or false"),
                              ({"do_pan_and_scan": True}, r"'do_pan_and_scan' is not a setting of SmolVLM / Idefics3's "
                                                          r"image processor \(it takes do_image_splitting, size, "
                                                          r"max_image_size\)")):
        with pytest.raises(RequestError, match=message):
            engine.add_request(None, PROMPT, GREEDY, multi_modal_data={"image": [image]}, mm_processor_kwargs=settings)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("text, which", [(PROMPT, (0,)), (TWO, (0, 1))], ids=["one-image", "two-images"])
def test_logits_and_greedy_tokens_equal_transformers(vlm, text, which, request):
    """fp32 logits of every position within 1e-4, whole and in two chunks that cut through the first
    image's tokens; greedy tokens through LLM.generate with vLLM's prompt dict."""
    images = [_image(*IMAGES[i]) for i in which]
    # (TWO's reference is the two_images fixture's, computed once for the tests that share it)
    inputs, ref_logits, ref_tokens = request.getfixturevalue("two_images")[1:] if text == TWO else \
        _reference(vlm, text, images)
    engine = vlm[3].engine
    ids, logits = _hearth_logits(engine, text, images)
    assert ids == inputs["input_ids"][0].tolist()
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    image_token = engine.model_config.vision.image_token_id
    cut = ids.index(image_token) + 100  # inside the first image's first tile
    torch.testing.assert_close(_hearth_logits(engine, text, images, cut)[1], ref_logits, atol=1e-4, rtol=0)
    out = vlm[3].generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref_tokens


def test_encoder_and_prefix_caches_hit_on_the_same_image_only(vlm):
    """The same image again: no encoding, its blocks from the prefix cache; another image of the same
    size (the same placeholder tokens): encoded, and a prefix-cache miss from the image's first block
    on. The tokens are transformers' either way."""
    llm = vlm[3]
    engine = llm.engine
    cache, blocks, bs = engine.runner.encoder_cache, engine.block_manager, engine.config.cache.block_size
    first, other = _image(7, 260, 390), _image(8, 260, 390)
    expected = {id(image): _reference(vlm, PROMPT, [image])[2] for image in (first, other)}

    def run(image) -> tuple[int, int, int, Request]:
        misses, hits, prefix = cache.misses, cache.hits, blocks.prefix_cache_hits
        out = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": [image]}}, GREEDY, use_tqdm=False)
        assert out[0].outputs[0].token_ids == expected[id(image)]
        return cache.misses - misses, cache.hits - hits, blocks.prefix_cache_hits - prefix, out[0]

    misses, _, _, out = run(first)
    assert misses == 1
    misses, hits, prefix, _ = run(first)
    assert (misses, prefix) == (0, (len(out.prompt_token_ids) - 1) // bs * bs)
    misses, hits, prefix, _ = run(other)
    first_image_token = out.prompt_token_ids.index(engine.model_config.vision.image_token_id)
    assert (misses, prefix) == (1, first_image_token // bs * bs)


def test_chunks_through_images_and_a_small_encoder_budget(vlm):
    """Chunks of 48 tokens, an encoder budget below one image's embeddings: each image is encoded alone
    in the step its first chunk reaches it, and the tokens are transformers'; the same through the
    AsyncEngine (the server's way in)."""
    import asyncio

    from hearth import LLM
    from hearth.engine.async_engine import AsyncEngine

    images = [_image(*IMAGES[0]), _image(*IMAGES[1])]
    ref_tokens = _reference(vlm, TWO, images)[2]
    llm = LLM(str(vlm[0]), progress=False, max_num_batched_tokens=48)
    out = llm.generate({"prompt": TWO, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref_tokens
    assert llm.engine.runner.encoder_cache.misses == 2
    engine = AsyncEngine(llm.engine)

    async def generate():
        return [o async for o in engine.generate(TWO, GREEDY, multi_modal_data={"image": images})][-1]

    try:
        assert asyncio.run(generate()).outputs[0].token_ids == ref_tokens
    finally:
        engine.shutdown()


def test_scheduler_budgets_encoder_work():
    """An image is encoded whole in the step its first token is scheduled, against the step's encoder
    budget: a chunk that reaches an image past the budget ends before it, unless the image is the
    step's first encoder work or is cached."""
    def request(name: str, digest: bytes, embeds: int) -> Request:
        return Request(name, list(range(200)), images=[ImageSpan(10, 10 + embeds, digest, None, embeds)])

    scheduler = Scheduler(BlockManager(64, 16), max_num_seqs=4, max_num_batched_tokens=1000,
                          max_num_encoder_tokens=100)
    first, second, big = request("a", b"a" * 16, 80), request("b", b"b" * 16, 80), request("c", b"c" * 16, 150)
    for r in (first, second):
        scheduler.add_request(r)
    assert [(r.request_id, n) for r, n in scheduler.schedule().scheduled] == [("a", 200), ("b", 10)]
    cached = Scheduler(BlockManager(64, 16), max_num_seqs=4, max_num_batched_tokens=1000, max_num_encoder_tokens=100,
                       encoder_cache={b"b" * 16})
    for r in (request("a", b"a" * 16, 80), request("b", b"b" * 16, 80)):
        cached.add_request(r)
    assert [n for _, n in cached.schedule().scheduled] == [200, 200]
    alone = Scheduler(BlockManager(64, 16), max_num_seqs=4, max_num_batched_tokens=1000, max_num_encoder_tokens=100)
    alone.add_request(big)
    assert [n for _, n in alone.schedule().scheduled] == [200]


def test_bad_image_requests_are_refused(vlm, tmp_path):
    from hearth import LLM

    engine = vlm[3].engine
    image = _image(0, 30, 40)
    cases = [
        ("a <image> and <image>", {"image": [image]}, "names 2 image"),
        ("no marker", {"image": [image]}, "names 0 image"),
        ("a <image>", None, "names 1 image"),
        ("a <image>", {"image": ["not an image"]}, "PIL.Image"),
        ("a <image>", {"audio": [image]}, "multi_modal_data holds"),
        ("a <image>", {"video": [image]}, "takes no videos"),
    ]
    for prompt, data, message in cases:
        with pytest.raises(RequestError, match=message):
            engine.add_request(None, prompt, GREEDY, multi_modal_data=data)
    with pytest.raises(RequestError, match="not token ids"):
        engine.add_request(None, [1, 2, engine.model_config.vision.image_token_id], GREEDY)
    with pytest.raises(RequestError, match="beam search with images"):
        vlm[3].beam_search({"prompt": "a <image>", "multi_modal_data": {"image": [image]}},
                           BeamSearchParams(beam_width=2, max_tokens=2))
    text_only = LLM(str(make_hf_model(tmp_path / "llama", "llama")), progress=False).engine
    with pytest.raises(RequestError, match="this model takes no images"):
        text_only.add_request(None, "a <image>", GREEDY, multi_modal_data={"image": [image]})
    assert not engine.has_unfinished_requests() and engine.block_manager.check_all_free()


def test_vision_families_hearth_does_not_run_are_refused(vlm):
    import json

    from hearth.config import ModelConfig

    llava = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
             "vision_config": {"hidden_size": 32}, "text_config": {"model_type": "llama"}}
    with pytest.raises(ModelLoadError, match="image encoder"):
        ModelConfig.from_hf(llava)
    from hearth.model_info import model_info

    assert model_info(vlm[0])["vision"]["tokens_per_tile"] == 64  # hearth inspect's line
    config = json.loads((vlm[0] / "config.json").read_text())
    config["text_config"]["model_type"] = "mistral"
    with pytest.raises(ModelLoadError, match="llama text model"):
        ModelConfig.from_hf(config)


@pytest.mark.slow  # (~30 s: prefill under Triton's interpreter without a GPU)
def test_one_tile_images_on_the_gpu_backend(vlm, tmp_path):
    """The gpu backend (on the GPU, else its Triton kernels interpreted on the CPU) runs the encoder with
    torch operations on its device and takes the image rows through its prefill; a processor whose
    longest edge is one tile makes no grid (the global image alone): transformers' greedy tokens."""
    import json
    import shutil

    import transformers

    from hearth import LLM

    folder = tmp_path / "one-tile"
    shutil.copytree(vlm[0], folder)
    settings = json.loads((folder / "processor_config.json").read_text())
    settings["image_processor"]["size"]["longest_edge"] = 512
    (folder / "processor_config.json").write_text(json.dumps(settings))
    processor = transformers.AutoProcessor.from_pretrained(folder)
    image = _image(*IMAGES[0])
    inputs = processor(text=[PROMPT], images=[[image]], return_tensors="pt")
    assert inputs["pixel_values"].shape[1] == 1
    with torch.no_grad():
        expected = vlm[2].generate(**inputs, max_new_tokens=3, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(str(folder), device=device, dtype="float32", backend="gpu", kv_cache_memory=1 << 22, progress=False)
    out = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": [image]}},
                       SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out[0].prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out[0].outputs[0].token_ids == expected.tolist()


def test_generate_reads_image_files(tmp_path):
    """hearth generate --image: files read as PIL images (markers put first when the prompt has none);
    a file that is no image is a HearthError naming it."""
    from hearth.cli_generation import _generate_prompt
    from hearth.images import read_image_file
    from hearth.errors import HearthError
    from hearth.image_processor_qwen import QwenImageProcessor

    _image(0, 30, 40).save(tmp_path / "a.png")
    (tmp_path / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    images = [read_image_file(tmp_path / "a.png", "--image")] * 2
    prompt = _generate_prompt("Compare.", images)
    assert prompt["prompt"] == "<image><image>Compare." and prompt["multi_modal_data"]["image"][1].size == (40, 30)
    assert _generate_prompt("x <image> y", images[:1])["prompt"] == "x <image> y"
    qwen = _generate_prompt("Compare.", images[:1], QwenImageProcessor.__new__(QwenImageProcessor))
    assert qwen["prompt"] == "<|vision_start|><|image_pad|><|vision_end|>Compare."  # (Qwen3-VL's template's)
    with pytest.raises(HearthError, match="b.png"):
        read_image_file(tmp_path / "b.png", "--image")


# transformers' convention for image parts, as SmolVLM's template renders them: TWO is this template's
# rendering of [text "Compare ", image, text " with", image, text " please"]
IMAGE_PARTS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<image>{% else %}{{ p.text }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def gguf_vlm(vlm, tmp_path_factory):
    """The SmolVLM folder through `hearth convert --mmproj` (F32), and an LLM of the two files (its chat
    template renders image parts)."""
    from hearth import LLM
    from hearth.cli import main

    folder = tmp_path_factory.mktemp("gguf-vlm")
    text, mmproj = folder / "text.gguf", folder / "mmproj.gguf"
    assert main(["convert", str(vlm[0]), str(text), "--type", "f32", "--mmproj", str(mmproj)]) == 0
    return text, mmproj, LLM(str(text), mmproj=str(mmproj), chat_template=IMAGE_PARTS_TEMPLATE, progress=False)


# llama.cpp's mmproj tensor names for an idefics3 projector (tools/mtmd/clip-impl.h's TN_* formats)
def _llama_cpp_mmproj_names(layers: int) -> set[str]:
    per_layer = [f"v.blk.{i}.{part}.{kind}" for i in range(layers) for part in
                 ("attn_q", "attn_k", "attn_v", "attn_out", "ln1", "ln2", "ffn_up", "ffn_down")
                 for kind in ("weight", "bias")]
    return {"v.patch_embd.weight", "v.patch_embd.bias", "v.position_embd.weight", "v.post_ln.weight",
            "v.post_ln.bias", "mm.model.fc.weight", *per_layer}


def test_mmproj_gguf_equals_transformers(vlm, gguf_vlm, two_images, tmp_path, capsys):
    """`hearth convert --mmproj` writes a llama text GGUF and llama.cpp's mmproj file (read back by gguf-py's
    own reader: clip, idefics3, clip-impl.h's tensor names); the text GGUF with mmproj= gives transformers'
    fp32 logits within 1e-4 on a two-image prompt, and `hearth generate --mmproj --image` its greedy tokens."""
    import json

    import gguf

    from hearth.cli import main

    text, mmproj, llm = gguf_vlm
    reader = gguf.GGUFReader(mmproj)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert (field("general.architecture"), field("general.type"), field("clip.projector_type")) == \
        ("clip", "mmproj", "idefics3")
    assert (field("clip.vision.projector.scale_factor"), field("clip.vision.preproc_image_size")) == (4, 1024)
    assert {t.name for t in reader.tensors} == _llama_cpp_mmproj_names(2)
    assert gguf.GGUFReader(text).fields["general.architecture"].contents() == "llama"

    images, inputs, ref_logits, ref_tokens = two_images
    ids, logits = _hearth_logits(llm.engine, TWO, images)
    assert ids == inputs["input_ids"][0].tolist()
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    for name, image in zip("ab", images):
        image.save(tmp_path / f"{name}.png")
    capsys.readouterr()
    assert main(["generate", str(text), "--mmproj", str(mmproj), "--image", str(tmp_path / "a.png"), "--image",
                 str(tmp_path / "b.png"), "--prompt", TWO, "--max-tokens", "6", "--temperature", "0", "--json"]) == 0
    tokens = json.loads(capsys.readouterr().out)["token_ids"]  # (the CLI stops at an end of text)
    assert tokens and tokens == ref_tokens[:len(tokens)]


def test_quantized_and_bad_mmproj_files(vlm, gguf_vlm, tmp_path, capsys):
    """A Q8_0 mmproj file loads with gguf-py's dequantized values. Refused with a message that says so:
    another projector type, a missing tensor, a text model's GGUF as the mmproj, a text model without the
    image tokens, a folder with its own vision tower, one mmproj for several served models, `hearth
    quantize` of an image-text folder."""
    import gguf

    from hearth.cli import main
    from hearth.loading.loader import load_model
    from hearth.loading.mmproj import write_mmproj

    text, mmproj, _ = gguf_vlm
    q8 = write_mmproj(vlm[0], tmp_path / "q8.gguf", "q8_0", progress=False)
    fc = next(t for t in gguf.GGUFReader(q8).tensors if t.name == "mm.model.fc.weight")
    assert fc.tensor_type == gguf.GGMLQuantizationType.Q8_0
    tower = load_model(text, progress=False, mmproj=q8).model.vision
    torch.testing.assert_close(tower.connector.modality_projection.proj.weight,
                               torch.from_numpy(gguf.quants.dequantize(fc.data, fc.tensor_type)), atol=0, rtol=0)
    good = mmproj.read_bytes()
    (tmp_path / "internvl.gguf").write_bytes(good.replace(b"idefics3", b"internvl"))
    (tmp_path / "no-fc.gguf").write_bytes(good.replace(b"mm.model.fc.weight", b"mm.model.xx.weight"))
    cases = [(text, tmp_path / "internvl.gguf", "projector type 'internvl'"),
             (text, tmp_path / "no-fc.gguf", "missing tensor mm.model.fc.weight"),
             (text, text, "not an mmproj file"),
             ("builtin", mmproj, "no <image> token"),
             (vlm[0], mmproj, "has its own vision tower")]
    for model, file, message in cases:
        with pytest.raises(ModelLoadError, match=message):
            load_model(model, progress=False, mmproj=file)
    capsys.readouterr()
    assert main(["serve", "--model", f"a={text}", "--model", f"b={text}", "--mmproj", str(mmproj)]) == 1
    assert "not for several models" in capsys.readouterr().err
    assert main(["quantize", str(vlm[0]), str(tmp_path / "q.gguf"), "--type", "q8_0"]) == 1
    assert "`hearth convert` it first" in capsys.readouterr().err


def test_chat_with_image_parts(vlm, gguf_vlm, two_images, tmp_path, monkeypatch, capsys):
    """LLM.chat with OpenAI-style image parts (a data URL, a PIL image, a file path) between text parts:
    the processor's token ids (each image's placeholders as it lays them out) and transformers' greedy
    tokens; a part of another kind, a remote URL and an image processor setting SmolVLM's does not take
    (mm_processor_kwargs, with or without images) are refused. `hearth chat --mmproj` with /image: the
    processor's count of prompt tokens, and LLM.chat's reply."""
    import base64
    import io
    import json

    from hearth.cli import main

    images, inputs, _, ref_tokens = two_images
    llm = gguf_vlm[2]
    png = io.BytesIO()
    images[0].save(png, "PNG")
    images[1].save(tmp_path / "b.png")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    for second in ({"type": "image_pil", "image_pil": images[1]}, {"type": "image", "image": str(tmp_path / "b.png")}):
        content = [{"type": "text", "text": "Compare "}, {"type": "image_url", "image_url": {"url": url}},
                   {"type": "text", "text": " with"}, second, {"type": "text", "text": " please"}]
        out = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)[0]
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
        assert out.outputs[0].token_ids == ref_tokens
    for part, message in (({"type": "input_audio", "input_audio": {}}, "text, an image .* or a video"),
                          ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "fetches nothing"),
                          ({"type": "image", "image": str(tmp_path / "missing.png")}, "cannot read")):
        with pytest.raises(RequestError, match=message):
            llm.chat([{"role": "user", "content": [part, {"type": "image_pil", "image_pil": images[1]}]}], GREEDY)
    for content in ("Hello", [{"type": "image_pil", "image_pil": images[1]}]):  # (vLLM's LLM.chat keyword)
        with pytest.raises(RequestError, match=r"'max_crops' is not a setting of SmolVLM / Idefics3's image processor"):
            llm.chat([{"role": "user", "content": content}], GREEDY, mm_processor_kwargs={"max_crops": 2})
    assert not llm.engine.has_unfinished_requests()

    images[0].save(tmp_path / "a.png")
    (tmp_path / "parts.jinja").write_text(IMAGE_PARTS_TEMPLATE)
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"/image {tmp_path / 'a.png'}\n/image {tmp_path / 'b.png'}\nCompare\n"))
    capsys.readouterr()
    assert main(["chat", str(gguf_vlm[0]), "--mmproj", str(gguf_vlm[1]), "--chat-template", str(tmp_path / "parts.jinja"),
                 "--temperature", "0", "--max-tokens", "4", "--json"]) == 0
    reply = json.loads(capsys.readouterr().out)
    rendered = "<|im_start|>user\n<image><image>Compare<|im_end|>\n<|im_start|>assistant\n"
    assert reply["prompt_tokens"] == len(vlm[1](text=[rendered], images=[images])["input_ids"][0])
    history = [{"role": "user", "content": [{"type": "image_pil", "image_pil": images[0]},
                                            {"type": "image_pil", "image_pil": images[1]}, {"type": "text", "text": "Compare"}]}]
    assert reply["content"] == llm.chat(history, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].outputs[0].text


def test_the_server_counts_each_images_tokens(gguf_vlm, two_images):
    """Served (`hearth serve MODEL --mmproj`'s engine), a conversation with two images counts the tokens its
    processor makes of them: usage.prompt_tokens (OpenAI's SDK), /v1/messages/count_tokens (Anthropic's) and
    /tokenize equal the processor's input ids, and the reply is transformers' greedy tokens; a processor setting
    SmolVLM's does not take is a 400 that names it."""
    import base64
    import io

    import anthropic
    import httpx
    import openai

    from hearth.engine.async_engine import AsyncEngine
    from hearth.server.app import build_app
    from test_server import serving

    images, inputs, _, ref_tokens = two_images
    expected = len(inputs["input_ids"][0])
    data = []
    for image in images:
        png = io.BytesIO()
        image.save(png, "PNG")
        data.append(base64.b64encode(png.getvalue()).decode())
    engine = AsyncEngine(gguf_vlm[2].engine)
    try:
        with serving(build_app(engine, "smolvlm")) as url:
            chat = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0).chat.completions.create(
                model="smolvlm", max_tokens=len(ref_tokens), temperature=0, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": [
                    {"type": "text", "text": "Compare "},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data[0]}"}},
                    {"type": "text", "text": " with"},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data[1]}"}},
                    {"type": "text", "text": " please"}]}])
            tokenized = httpx.post(url + "/tokenize", json={"model": "smolvlm", "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": "Compare "},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data[0]}"}},
                    {"type": "text", "text": " with"},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data[1]}"}},
                    {"type": "text", "text": " please"}]}]}, timeout=60).json()
            counted = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0).messages.count_tokens(
                model="smolvlm", messages=[{"role": "user", "content": [
                    {"type": "text", "text": "Compare "},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data[0]}},
                    {"type": "text", "text": " with"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data[1]}},
                    {"type": "text", "text": " please"}]}])
            refused = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "model": "smolvlm", "mm_processor_kwargs": {"do_image_splitting": False, "max_crops": 2},
                "messages": [{"role": "user", "content": "Hello"}]})
    finally:
        engine.shutdown()
    assert chat.usage.prompt_tokens == counted.input_tokens == expected
    assert tokenized["tokens"] == inputs["input_ids"][0].tolist()
    assert refused.status_code == 400 and "'max_crops' is not a setting of SmolVLM" in refused.json()["error"]["message"]
    assert chat.choices[0].message.content == gguf_vlm[2].get_tokenizer().decode(ref_tokens)
