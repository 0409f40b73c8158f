"""Images through every entry point of the server, as OpenAI's and Anthropic's SDKs send them.

A tiny random llama (no vision encoder) serves in-process: a well-formed image gets the 400 of a
model that takes no images, every hostile one its own 400 first (in under a second, /health still
OK), remote URLs only from allowed hosts (a local HTTP server stands for one). With the server told
that the model reads images, the engine itself gets them (its add_request watched): the rendered
prompt with one marker per image, and images equal pixel for pixel to those sent; the engine refuses
them. Real vision chat templates from ../shared render the image parts (skipped when absent).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.server
import io
import json
import shutil
import struct
import threading
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import httpx
import hypothesis
import numpy as np
import openai
import pytest
import transformers
from hypothesis import strategies as st
from PIL import Image

from hearth.engine_config import EngineConfig
from hearth.engine.async_engine import AsyncEngine
from hearth.engine.engine import LLMEngine
from hearth.errors import NO_IMAGES, RequestError
from hearth.images import ImageError, decode_image
from hearth.server.app import build_app
from hearth.server.chat import ChatPrompt, chat_prompt
from hearth.server.limits import ServerLimits
from hearth.server.protocol import ChatCompletionRequest
from hearth.tokenizer import Tokenizer
from models import make_hf_model
from test_server import serving

API_KEY, NAME = "sk-images", "tiny-llama"
TEMPLATES = Path(__file__).resolve().parents[2] / "shared" / "data" / "chat_templates"
# transformers' convention, as vision models' templates follow it: an image part renders the model's marker
VISION_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<image>{% else %}{{ p.text }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ---- images, good and hostile

def pixels(seed: int, width: int, height: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def encoded(array: np.ndarray, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def black_png(width: int, height: int) -> bytes:
    """A 1-bit PNG, all black: ~100 KB that decode to width x height pixels."""
    row, z = b"\0" * (1 + (width + 7) // 8), zlib.compressobj(1)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def wrong_crc(png: bytes) -> bytes:
    """The PNG with its IDAT chunk's CRC off by one bit (the pixels themselves intact)."""
    at = png.index(b"IDAT")
    crc = at + 4 + struct.unpack(">I", png[at - 4:at])[0]
    return png[:crc] + bytes([png[crc] ^ 1]) + png[crc + 1:]


SMALL = pixels(0, 37, 23)
JPEG = encoded(SMALL, "JPEG")
HOSTILE = {  # a case: (data URL, what its 400 says)
    "one byte": (data_url(b"\x89"), "1 bytes: too short"),
    "decompression bomb": (data_url(black_png(14_000, 14_000)), "decompression bomb"),
    "100 MP": (data_url(black_png(10_000, 10_000)), "100,000,000 pixels; this server's limit is 25,000,000"),
    "wrong CRC": (data_url(wrong_crc(encoded(SMALL))), "damaged or truncated (PNG)"),
    "truncated JPEG": (data_url(JPEG[:len(JPEG) // 2], "image/jpeg"), "damaged or truncated (JPEG)"),
    "not an image": (data_url(b"Once upon a time there was a fox.", "image/png"), "not an image"),
    "TIFF": (data_url(encoded(SMALL, "TIFF"), "image/tiff"), "TIFF, a format this server does not take"),
    "not base64": ("data:image/png;base64,!!not base64!!", "base64 is broken"),
    "not a data URL's shape": ("data:image/png,plain", "not base64"),
    "not an image's media type": (data_url(encoded(SMALL), "text/plain"), "not an image's"),
    "another scheme": ("file:///etc/passwd", "neither a data URL"),
    "remote, not allowed": ("https://example.com/cat.png", "does not fetch images from example.com"),
}


# ---- the server, and a host that serves images

class Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the standard library's name)
        if self.path == "/slow.png":
            time.sleep(2)
        if self.path == "/moved.png":
            self.send_response(302)
            self.send_header("Location", "/ok.png")
            self.end_headers()
            return
        body = {"/ok.png": encoded(SMALL), "/big.png": encoded(pixels(1, 300, 300)), "/slow.png": b""}.get(self.path)
        self.send_response(404 if body is None else 200)
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the server stops reading past its limit
            self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = AsyncEngine(LLMEngine(make_hf_model(tmp_path_factory.mktemp("images") / "llama", "llama"), EngineConfig(),
                                   progress=False))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    """Images from 127.0.0.1 allowed (up to 150 kB, fetched within 0.5 s); requests' own chat templates allowed."""
    limits = ServerLimits(max_image_bytes=150_000, image_fetch_timeout=0.5, max_images_per_request=3)
    app = build_app(engine, NAME, api_key=API_KEY, limits=limits, trust_request_chat_template=True,
                    allowed_media_domains=("127.0.0.1",))
    with serving(app, limits) as url:
        yield url


@pytest.fixture(scope="module")
def clients(server):
    import anthropic  # here, not at collection: its import (~2.5 s of CPU) is paid only where a test uses it

    return (openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0),
            anthropic.Anthropic(base_url=server, api_key=API_KEY, max_retries=0))


def chat_body(url: str) -> dict:
    return {"model": NAME, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]}]}


def messages_body(url: str) -> dict:
    source = {"type": "url", "url": url} if not url.startswith("data:") else {
        "type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]}
    return {"model": NAME, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": source}]}]}


def responses_body(url: str) -> dict:
    return {"model": NAME, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": url}]}]}


def chat_image(client: openai.OpenAI, url: str):
    return client.chat.completions.create(**chat_body(url))


def bad_request(call) -> str:
    """The message of the 400 that `call` (an SDK's) gets."""
    import anthropic

    with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as caught:
        call()
    body = caught.value.body
    assert isinstance(body, dict), body
    return body["message"] if "message" in body else body["error"]["message"]


def seconds_to_400(server: str, path: str, body: dict, tries: int = 3) -> float:
    """How long the server takes to answer `body` with its 400: the fastest of a few tries, the body
    encoded beforehand (the server's time, less the noise of a machine busy with other work)."""
    content, times = json.dumps(body).encode(), []
    for _ in range(tries):
        start = time.perf_counter()
        r = httpx.post(server + path, content=content, timeout=30,
                       headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        times.append(time.perf_counter() - start)
        assert r.status_code == 400, r.text
    return min(times)


# ---- tests

@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # Pillow's, for the 100 MP image
def test_every_hostile_image_gets_its_own_400_in_under_a_second_and_the_server_stays_healthy(server, clients):
    openai_client, anthropic_client = clients
    for case, (url, expected) in HOSTILE.items():
        message = bad_request(lambda: chat_image(openai_client, url))
        assert expected in message and NO_IMAGES not in message, (case, message)
        assert seconds_to_400(server, "/v1/chat/completions", chat_body(url)) < 1.0, case
        assert httpx.get(server + "/health").status_code == 200
    # the same images through the other two APIs, in their own error shapes
    for case in ("decompression bomb", "wrong CRC", "remote, not allowed"):
        url, expected = HOSTILE[case]
        assert expected in bad_request(lambda: anthropic_client.messages.create(**messages_body(url))), case
        assert expected in bad_request(lambda: openai_client.responses.create(**responses_body(url))), case
        assert seconds_to_400(server, "/v1/messages", messages_body(url)) < 1.0, case
        assert seconds_to_400(server, "/v1/responses", responses_body(url)) < 1.0, case
    too_many = [{"type": "image_url", "image_url": {"url": data_url(encoded(SMALL))}}] * 4
    message = bad_request(lambda: openai_client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": too_many}]))
    assert "4 images; this server's limit is 3" in message
    message = bad_request(lambda: chat_image(openai_client, data_url(encoded(pixels(2, 300, 300)))))
    assert "this server's limit is 150,000 (--max-image-size)" in message


def test_anthropics_error_shape_for_a_bad_image(server):
    r = httpx.post(server + "/v1/messages", headers={"x-api-key": API_KEY}, json={
        "model": NAME, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "the image is 3 bytes: too short to be an image"}}


def test_a_well_formed_image_through_each_api_gets_the_400_of_a_model_that_takes_no_images(clients):
    openai_client, anthropic_client = clients
    url = data_url(encoded(SMALL))
    expected = f"{NO_IMAGES}: `{NAME}` has no vision encoder"
    assert bad_request(lambda: chat_image(openai_client, url)) == expected
    assert bad_request(lambda: anthropic_client.messages.create(model=NAME, max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]}}]}])) == expected
    assert bad_request(lambda: openai_client.responses.create(model=NAME, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": url}]}])) == expected
    # text alone still answers
    assert openai_client.chat.completions.create(model=NAME, max_tokens=2, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Once upon a time"}]}]).choices[0].message.content


def test_remote_images_only_from_allowed_hosts_within_the_limits(server, clients, image_host):
    openai_client = clients[0]
    assert bad_request(lambda: chat_image(openai_client, image_host + "/ok.png")).startswith(NO_IMAGES)
    other = image_host.replace("127.0.0.1", "localhost")
    for url, expected in ((other + "/ok.png", "does not fetch images from localhost"),
                          (image_host + "/missing.png", "answered HTTP 404"),
                          (image_host + "/moved.png", "answered HTTP 302"),
                          (image_host + "/big.png", "larger than this server's limit of 150,000 bytes"),
                          (image_host + "/slow.png", "did not arrive within 0.5 s")):
        assert expected in bad_request(lambda: chat_image(openai_client, url)), url
        assert seconds_to_400(server, "/v1/chat/completions", chat_body(url)) < 1.0, url


def test_images_reach_the_engine_in_order_with_one_marker_each(engine, clients, monkeypatch):
    """Told that the model reads images, the server gives the engine the rendered text and the decoded
    images of every API's request; the engine (a text-only model's) refuses them with its own message."""
    openai_client, anthropic_client = clients
    seen = []
    expand = engine.engine.prompt_with_images  # where the engine takes a prompt's images (on a worker thread)
    monkeypatch.setattr(engine, "accepts_images", True)
    monkeypatch.setattr(engine.engine, "prompt_with_images",
                        lambda prompt, data, settings: (seen.append((prompt, data, settings)), expand(prompt, data))[1])
    first, second = pixels(3, 17, 29), pixels(4, 40, 8)
    urls = [data_url(encoded(first)), data_url(encoded(second, "BMP"), "image/bmp")]
    expected = f"{NO_IMAGES}: llama has no vision encoder (multi_modal_data with 2 images)"
    assert bad_request(lambda: openai_client.chat.completions.create(
        model=NAME, extra_body={"chat_template": VISION_TEMPLATE, "mm_processor_kwargs": {"do_pan_and_scan": True}},
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": urls[0]}}, {"type": "text", "text": "and"},
            {"type": "image_url", "image_url": {"url": urls[1]}}]}])) == expected
    assert bad_request(lambda: anthropic_client.messages.create(model=NAME, max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                   "data": urls[0].split(",", 1)[1]}},
                                     {"type": "text", "text": "and"},
                                     {"type": "image", "source": {"type": "base64", "media_type": "image/bmp",
                                                                   "data": urls[1].split(",", 1)[1]}}]}])) == expected
    assert bad_request(lambda: openai_client.responses.create(model=NAME, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": urls[0]}, {"type": "input_text", "text": "and"},
        {"type": "input_image", "image_url": urls[1]}]}])) == expected
    # the chat request's own template wrote a marker for each image part; the model's own (for the other two)
    # writes the content as it gets it: the parts in their order
    parts = "[{'type': 'image'}, {'type': 'text', 'text': 'and'}, {'type': 'image'}]"
    assert [settings for _, _, settings in seen] == [{"do_pan_and_scan": True}, None, None]
    assert [prompt for prompt, _, _ in seen] == ["<|im_start|>user\n<image>and<image><|im_end|>\n<|im_start|>assistant\n",
                                              f"<|im_start|>user\n{parts}<|im_end|>\n<|im_start|>assistant\n",
                                              f"<|im_start|>user\n{parts}<|im_end|>\n<|im_start|>assistant\n"]
    for _, data, _ in seen:
        images = data["image"]
        assert [np.asarray(im).tolist() for im in images] == [first.tolist(), second.tolist()]


def test_the_engine_refuses_images_for_a_model_without_vision(engine, clients):
    with pytest.raises(RequestError, match=f"{NO_IMAGES}: llama has no vision encoder"):
        engine.engine.add_request("x", "Once upon a time", multi_modal_data={"image": [Image.fromarray(SMALL)]})
    assert not engine.engine.has_unfinished_requests()
    # image processor settings (vLLM's mm_processor_kwargs) for a model without one: a 400 that says so
    assert bad_request(lambda: clients[0].chat.completions.create(
        model=NAME, max_tokens=2, messages=[{"role": "user", "content": "Once upon a time"}],
        extra_body={"mm_processor_kwargs": {"do_pan_and_scan": True}})) == \
        "mm_processor_kwargs: this model has no image processor (no vision encoder)"


def test_decoded_images_equal_what_was_encoded():
    for fmt in ("PNG", "BMP", "WEBP", "GIF"):
        array = pixels(5, 31, 19)
        if fmt == "GIF":  # a palette of 256 colours: an image that has no more
            array = np.repeat(np.arange(0, 256, 16, dtype=np.uint8), 3).reshape(1, 16, 3).repeat(19, 0)
        image = decode_image(encoded(array, fmt), 10_000)
        assert image.format == fmt and (np.asarray(image.convert("RGB")) == array).all(), fmt
    with pytest.raises(ImageError, match="is 31 x 19 = 589 pixels; this server's limit is 588"):
        decode_image(encoded(pixels(5, 31, 19)), 588)


def rendered(engine, messages: list[dict], template: str, **fields):
    """The (text, images) the server makes of `messages` through `template`."""
    served = build_app(engine, NAME, trust_request_chat_template=True).state.served
    body = ChatCompletionRequest.model_validate({"messages": messages, "chat_template": template, **fields})
    prompt = asyncio.run(chat_prompt(served, body))
    return prompt.text, prompt.images


@pytest.mark.parametrize("name, marker", [
    ("Qwen3.5-4B", "<|vision_start|><|image_pad|><|vision_end|>"), ("google-gemma-4-31B-it", "<|image|>"),
    ("Mistral-Small-3.2-24B-Instruct-2506", "[IMG]"), ("LFM2.5-8B-A1B", "<image>")])
def test_real_vision_templates_render_one_marker_per_image_where_the_parts_were(engine, monkeypatch, name, marker):
    path = TEMPLATES / f"{name}.jinja"
    if not path.exists():
        pytest.skip(f"reference data not found: {path}")
    monkeypatch.setattr(engine, "accepts_images", True)
    first, second = pixels(6, 9, 13), pixels(7, 21, 5)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "XYLO"}, {"type": "image_url", "image_url": {"url": data_url(encoded(first))}},
        {"type": "text", "text": "ZEPP"}, {"type": "image_url", "image_url": {"url": data_url(encoded(second))}}]}]
    text, images = rendered(engine, messages, path.read_text())
    hf_messages = [{"role": "user", "content": [{"type": "text", "text": "XYLO"}, {"type": "image"},
                                                {"type": "text", "text": "ZEPP"}, {"type": "image"}]}]
    reference = transformers.AutoTokenizer.from_pretrained(engine.model_path).apply_chat_template(
        hf_messages, chat_template=path.read_text(), tokenize=False, add_generation_prompt=True)
    assert text == reference and text.count(marker) == 2
    assert text.index("XYLO") < text.index(marker) < text.index("ZEPP") < text.rindex(marker)
    assert [np.asarray(im).tolist() for im in images] == [first.tolist(), second.tolist()]


def test_hearth_serve_takes_the_image_limits_and_allowed_hosts_as_options():
    from hearth.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-image-size", "2MiB", "--max-image-pixels", "1000000",
                                      "--max-images-per-request", "2", "--image-fetch-timeout", "3",
                                      "--allowed-media-domains", "images.example.com", "cdn.example.org"])
    limits = ServerLimits.from_args(args)
    assert (limits.max_image_bytes, limits.max_image_pixels, limits.max_images_per_request,
            limits.image_fetch_timeout) == (2 * 2**20, 1_000_000, 2, 3.0)
    assert args.allowed_media_domains == ["images.example.com", "cdn.example.org"]
    assert build_parser().parse_args(["serve"]).allowed_media_domains is None


def test_a_final_message_with_an_image_is_continued_after_its_text(engine, monkeypatch):
    monkeypatch.setattr(engine, "accepts_images", True)
    messages = [{"role": "user", "content": "Describe it."}, {"role": "assistant", "content": [
        {"type": "image_url", "image_url": {"url": data_url(encoded(SMALL))}}, {"type": "text", "text": "It shows"}]}]
    text, images = rendered(engine, messages, VISION_TEMPLATE, add_generation_prompt=False,
                            continue_final_message=True)
    assert text == "<|im_start|>user\nDescribe it.<|im_end|>\n<|im_start|>assistant\n<image>It shows"
    assert len(images) == 1


def test_the_text_the_engine_gets_encodes_to_the_ids_the_server_counted(engine, tmp_path):
    """The engine encodes a text prompt with the tokenizer's special tokens (LLMEngine._encode): where the
    tokenizer adds a BOS, the one a template wrote is left out of the text, so that it comes once."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    image = Image.fromarray(SMALL)
    for add_bos in (False, True):
        folder = tmp_path / f"bos-{add_bos}"
        folder.mkdir()
        shutil.copy(engine.model_path / "tokenizer.json", folder)
        config = json.loads((engine.model_path / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": add_bos}))
        tok = Tokenizer.from_hf_dir(folder)
        assert tok.add_bos == add_bos
        for template in (VISION_TEMPLATE, "{{ bos_token }}" + VISION_TEMPLATE):
            text = tok.chat_text(messages, True, False, template)
            prompt = ChatPrompt(tok.encode_chat_text(text), text, [image], None)
            engine_text, data, _ = prompt.with_images(SimpleNamespace(tokenizer=tok))
            assert tok.encode(engine_text) == prompt.ids and prompt.ids.count(tok.bos_token_id) == (
                add_bos or template.startswith("{{")) and data == {"image": [image]}


SAMPLES = [encoded(pixels(8, 13, 11), fmt) for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP")]


@hypothesis.settings(max_examples=300, deadline=None, derandomize=True)
@hypothesis.given(sample=st.sampled_from(SAMPLES), cut=st.integers(0, 2000),
                  flips=st.lists(st.tuples(st.integers(0, 2000), st.integers(1, 255)), max_size=4))
def test_damaged_images_decode_or_fail_with_an_image_error_only(sample, cut, flips):
    """Any file cut short or with bytes changed is read whole or refused with an ImageError (the 400),
    never another exception (a 500)."""
    data = bytearray(sample[:max(1, len(sample) - cut)])
    for at, xor in flips:
        data[at % len(data)] ^= xor
    try:
        image = decode_image(bytes(data), 10_000)
    except ImageError:
        return
    assert image.size[0] * image.size[1] <= 10_000
