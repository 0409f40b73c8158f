"""hearth.tokenizer against real data: llama.cpp's vocab test cases, the stories260K prompts,
transformers (HF folders, chat templates), and the streaming decoder against decode()."""

from __future__ import annotations

import copy
import functools
import json
import random
from pathlib import Path

import pytest

from hearth.errors import ModelLoadError, RequestError
from hearth.loading.gguf_reader import read_gguf
from hearth.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
VOCAB = DATA / "vocab"
TEMPLATES = DATA / "chat_templates"
STORIES = DATA / "models" / "stories260K"

# every vocab that has .inp/.out cases (llama.cpp models/), and whether hearth supports it
REFERENCE_VOCABS = ["llama-spm", "phi-3", "gpt-2", "mpt", "falcon", "starcoder", "refact",
                    "deepseek-coder", "deepseek-llm", "bert-bge"]
UNSUPPORTED: dict[str, str] = {}  # name -> reason (xfail), e.g. "bert WordPiece not supported yet"


def need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"reference data not found: {path} (expected ../shared/data next to the repo)")
    return path


@functools.lru_cache(maxsize=None)
def gguf_metadata(name: str) -> dict:
    return read_gguf(need(VOCAB / f"ggml-vocab-{name}.gguf")).metadata


@functools.lru_cache(maxsize=None)
def gguf_tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gguf_metadata(name))


def reference_cases(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's .inp/.out pairs (format: vocab/README.md)."""
    texts = need(VOCAB / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8").split("\n__ggml_vocab_test__\n")
    if texts[-1] == "":
        texts.pop()
    lines = (VOCAB / f"ggml-vocab-{name}.gguf.out").read_bytes().decode("utf-8").split("\n")
    if lines[-1] == "":
        lines.pop()
    assert len(texts) == len(lines)
    return [(text, [int(t) for t in line.split()]) for text, line in zip(texts, lines)]


# ---------------------------------------------------------------- llama.cpp's tokenizer tests

@pytest.mark.parametrize("name", REFERENCE_VOCABS)
def test_reference_tokenization(name):
    md = gguf_metadata(name)
    if name in UNSUPPORTED:
        with pytest.raises(ModelLoadError, match=md["tokenizer.ggml.model"]):
            Tokenizer.from_gguf_metadata(md)
        pytest.xfail(UNSUPPORTED[name])
    tok = gguf_tokenizer(name)
    cases = reference_cases(name)
    wrong = [(text, ids, got) for text, ids in cases
             if (got := tok.encode(text, add_special_tokens=False, parse_special=False)) != ids]
    print(f"{name}: {len(cases) - len(wrong)}/{len(cases)} cases match")
    assert not wrong, f"{name}: {len(cases) - len(wrong)}/{len(cases)} cases match; first misses: {wrong[:3]}"


@pytest.mark.parametrize("name", [n for n in REFERENCE_VOCABS if n not in UNSUPPORTED and n != "bert-bge"])
def test_reference_round_trip(name):
    """decode(encode(text)) gives the text back, and streaming gives the same as decode."""
    tok = gguf_tokenizer(name)
    for text, ids in reference_cases(name):
        assert tok.decode(ids) == text
        stream = tok.incremental_decoder()
        assert "".join(stream.step(i) for i in ids) + stream.flush() == text


def test_unknown_tokenizer_models_are_refused():
    md = {"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(ModelLoadError, match="rwkv"):
        Tokenizer.from_gguf_metadata(md)
    with pytest.raises(ModelLoadError, match="None"):
        Tokenizer.from_gguf_metadata({})


def test_unknown_pre_tokenizer_falls_back_to_gpt2(caplog):
    md = dict(gguf_metadata("gpt-2"), **{"tokenizer.ggml.pre": "no-such-model"})
    with caplog.at_level("WARNING"):
        tok = Tokenizer.from_gguf_metadata(md)
    assert "no-such-model" in caplog.text
    ref = gguf_tokenizer("gpt-2")
    for text, ids in reference_cases("gpt-2")[:20]:
        assert tok.encode(text, add_special_tokens=False) == ids == ref.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------- special tokens, BOS/EOS

def test_llama_spm_specials_and_bos():
    tok = gguf_tokenizer("llama-spm")
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (32000, 1, [2], True)
    assert tok.encode("Hello world") == [1, 15043, 3186]
    assert tok.encode("Hello world", add_special_tokens=False) == [15043, 3186]
    assert tok.encode("") == [1] and tok.encode("", add_special_tokens=False) == []
    # "</s>" is a control token: matched with parse_special, plain text without
    assert tok.encode("Hi</s>", add_special_tokens=False) == [6324, 2]
    assert 2 not in tok.encode("Hi</s>", add_special_tokens=False, parse_special=False)
    assert tok.is_special(1) and tok.is_special(2) and tok.is_special(0) and not tok.is_special(15043)
    assert tok.id_to_piece(15043) == "▁Hello" and tok.id_to_piece(13) == "<0x0A>"
    assert tok.decode([1, 15043, 3186, 2]) == "Hello world"
    assert tok.decode([1, 15043, 3186, 2], skip_special_tokens=False) == "<s> Hello world</s>"


def test_phi3_chat_tokens():
    """Control tokens of a chat format are single tokens, swallow the newline after them (as HF's
    Phi-3 tokenizer and llama.cpp do), and turn-end tokens end generation."""
    tok = gguf_tokenizer("phi-3")
    ids = tok.encode("<|user|>\nHi<|end|>\n<|assistant|>\n", add_special_tokens=False)
    assert ids == [32010, 6324, 32007, 32001]
    assert 32010 not in tok.encode("<|user|>", parse_special=False)
    assert 32000 in tok.eos_token_ids and 32007 in tok.eos_token_ids  # <|endoftext|>, <|end|>
    assert tok.decode(ids) == "Hi" and tok.decode(ids, skip_special_tokens=False) == "<|user|> Hi<|end|><|assistant|>"


def test_user_defined_tokens_always_match_and_are_not_special():
    tok = gguf_tokenizer("mpt")  # gpt-neox: runs of spaces are user-defined tokens
    assert tok.encode("a    b", parse_special=False) == tok.encode("a    b") and 50274 in tok.encode("a    b")
    assert not tok.is_special(50274) and tok.is_special(0)
    assert tok.decode(tok.encode("x  \n    y")) == "x  \n    y"
    assert not tok.add_bos and tok.encode("hello") == tok.encode("hello", add_special_tokens=False)


def test_bert_wordpiece():
    tok = gguf_tokenizer("bert-bge")
    ids = tok.encode("Hello, World!")
    assert ids == [101, 7592, 1010, 2088, 999, 102]  # [CLS] hello , world ! [SEP]
    assert tok.decode(ids) == "hello , world !" and tok.is_special(101) and tok.bos_token_id == 101
    assert tok.decode(tok.encode("tokenization")) == "tokenization"  # ##-pieces glue


def test_byte_level_specials():
    tok = gguf_tokenizer("deepseek-coder")
    bos = tok.bos_token_id
    assert tok.add_bos and tok.encode("x")[0] == bos
    assert tok.encode("<｜end▁of▁sentence｜>", add_special_tokens=False) == [32014]
    assert 32014 not in tok.encode("<｜end▁of▁sentence｜>", add_special_tokens=False, parse_special=False)
    assert tok.decode([bos, *tok.encode("def f():", add_special_tokens=False), 32014]) == "def f():"


# ---------------------------------------------------------------- stories260K

def test_stories260k_prompts():
    path = need(STORIES / "stories260K.gguf")
    tok = Tokenizer.from_gguf_metadata(read_gguf(path).metadata)
    expected = json.loads((STORIES / "expected_greedy.json").read_text())
    assert tok.vocab_size == 512 and tok.bos_token_id == 1 and tok.eos_token_ids == [2]
    for case in expected["cases"]:
        ids = tok.encode(case["prompt"])
        assert ids == case["tokens"][:len(ids)], case["prompt"]
        assert tok.decode(case["tokens"][1:]) == case["text"]
    prompts = {c["prompt"]: c["tokens"] for c in expected["cases"]}
    assert tok.encode("Zoo") == prompts["Zoo"][:4] == [1, 410, 469, 347]
    assert tok.encode("Once upon a time") == prompts["Once upon a time"][:5]


# ---------------------------------------------------------------- incremental decoding

STREAM_TEXTS = [
    "Hello world", " leading space", "  two leading spaces\n\tand a tab", "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅",
    "ប្រសិនបើ Khmer", "中文：你好，世界！ 日本語 한국어", "Привет, мир", "3333333 and 🦙🦙", "a\u00e9\u0301 e\u0301 ﬁ",
]


@pytest.mark.parametrize("name", ["llama-spm", "gpt-2", "falcon", "deepseek-llm"])
def test_streaming_equals_decode(name):
    tok = gguf_tokenizer(name)
    for text in STREAM_TEXTS:
        ids = tok.encode(text)
        stream = tok.incremental_decoder()
        steps = [stream.step(i) for i in ids]
        assert "".join(steps) + stream.flush() == tok.decode(ids)
        assert all("\ufffd" not in s for s in steps)  # nothing printed before its character is whole


def test_streaming_holds_split_characters():
    tok = gguf_tokenizer("llama-spm")
    ids = tok.encode("🦙", add_special_tokens=False)  # ▁ then 4 byte tokens
    assert [tok.id_to_piece(i) for i in ids] == ["▁", "<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    stream = tok.incremental_decoder()
    assert [stream.step(i) for i in ids] == ["", "", "", "", "🦙"]  # the dummy-prefix space is dropped
    assert stream.flush() == ""


def test_streaming_random_ids_including_invalid_utf8():
    for name in ("llama-spm", "gpt-2"):
        tok = gguf_tokenizer(name)
        rng = random.Random(0)
        byte_ids = [i for i in range(tok.vocab_size) if tok.id_to_piece(i).startswith("<0x")] or list(range(256))
        for _ in range(200):
            ids = [rng.choice(byte_ids) if rng.random() < 0.6 else rng.randrange(tok.vocab_size)
                   for _ in range(rng.randrange(1, 12))]
            for skip in (True, False):
                stream = tok.incremental_decoder(skip_special_tokens=skip)
                assert "".join(stream.step(i) for i in ids) + stream.flush() == tok.decode(ids, skip), ids


def test_streaming_after_a_prompt_keeps_the_leading_space():
    tok = gguf_tokenizer("llama-spm")
    prompt, new = tok.encode("Hello"), tok.encode(" world, 🦙!", add_special_tokens=False)[1:]
    stream = tok.incremental_decoder(prompt_ids=prompt)
    text = "".join(stream.step(i) for i in new) + stream.flush()
    assert text == tok.decode(prompt + new)[len(tok.decode(prompt)):] == " world, 🦙!"
    assert tok.decode(new) == "world, 🦙!"  # on its own the first space is the dummy prefix


def test_ids_past_the_vocabulary():
    """A model's embedding may have more rows than the tokenizer has tokens: such ids decode to nothing."""
    tok = gguf_tokenizer("gpt-2")
    assert tok.decode([1, 50257, 2]) == tok.decode([1, 2]) == '"#'
    stream = tok.incremental_decoder()
    assert [stream.step(i) for i in (1, 50257, 2)] == ['"', "", "#"]
    with pytest.raises(ValueError, match="50257"):
        tok.id_to_piece(50257)


# ---------------------------------------------------------------- Hugging Face folders

@pytest.fixture(scope="module")
def transformers():
    import transformers  # imported when first needed: it takes seconds

    return transformers


HF_TEXTS = ["Hello world", " Hello  world ", "\n\n  code:\tx = 1\n", "🚀 ✅ ប្រសិនបើ 中文 Привет",
            "<s>Hi</s> there", "3.14159 and 1,000,000", ""]


def test_hf_dir_spm_matches_transformers(tmp_path, transformers):
    need(VOCAB / "ggml-vocab-llama-spm.gguf")
    ref = transformers.AutoTokenizer.from_pretrained(str(VOCAB), gguf_file="ggml-vocab-llama-spm.gguf")
    ref.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 13]}))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.vocab_size == len(ref) and tok.bos_token_id == ref.bos_token_id == 1
    assert tok.eos_token_ids == [2, 13]  # generation_config's list
    assert tok.add_bos
    for text in HF_TEXTS:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert tok.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), (text, skip)
                stream = tok.incremental_decoder(skip)
                assert "".join(stream.step(i) for i in ids) + stream.flush() == tok.decode(ids, skip)


def small_byte_level_dir(tmp_path: Path, transformers, template: str | None = None) -> Path:
    """A real (tiny) byte-level BPE, trained here, saved by transformers."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = [text * 3 for text in STREAM_TEXTS + HF_TEXTS] + ["the quick brown fox jumps over the lazy dog"] * 5
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus, trainer)
    backend.add_tokens(["<think>"])  # a non-special added token
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                               pad_token="<|endoftext|>", chat_template=template)
    ref.save_pretrained(tmp_path)
    return tmp_path


def test_hf_dir_byte_level_matches_transformers(tmp_path, transformers):
    folder = small_byte_level_dir(tmp_path, transformers, "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    tok = Tokenizer.from_hf_dir(folder)
    assert tok.eos_token_ids == [ref.eos_token_id] and tok.bos_token_id is None and not tok.add_bos
    assert tok.is_special(ref.eos_token_id) and not tok.is_special(ref.convert_tokens_to_ids("<think>"))
    texts = HF_TEXTS + STREAM_TEXTS + ["<|im_start|>user\nhi<|im_end|><think>x</think>"]
    for text in texts:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        for skip in (True, False):
            assert tok.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ref.convert_tokens_to_ids("<|im_start|>") not in tok.encode("<|im_start|>", parse_special=False)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert Tokenizer.from_hf_dir(folder).eos_token_ids == [0, ref.eos_token_id]


def test_hf_dir_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# ---------------------------------------------------------------- chat templates

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello! <b>Bold</b> & \"quoted\""},
    {"role": "assistant", "content": "Hi there, how can I help?"},
    {"role": "user", "content": "Who are you?"},
]
NO_SYSTEM = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi there."},
             {"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "An assistant."}]

COMPARED_TEMPLATES = {
    "Qwen-Qwen2.5-7B-Instruct": CONVERSATION,
    "meta-llama-Llama-3.1-8B-Instruct": CONVERSATION,
    "google-gemma-2-2b-it": NO_SYSTEM,
    "microsoft-Phi-3.5-mini-instruct": CONVERSATION,
    "mistralai-Mistral-Nemo-Instruct-2407": CONVERSATION,
    "Qwen-Qwen3-0.6B": CONVERSATION,
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": CONVERSATION,
}


def template_tokenizer(template: str) -> Tokenizer:
    """The llama-spm tokenizer (bos "<s>", eos "</s>") carrying this template."""
    tok = copy.copy(gguf_tokenizer("llama-spm"))
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def hf_template_tokenizer(transformers):
    import tokenizers

    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<s>": 0, "</s>": 1, "<unk>": 2}, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("name", sorted(COMPARED_TEMPLATES))
def test_chat_template_matches_transformers(name, hf_template_tokenizer):
    template = need(TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    tok = template_tokenizer(template)
    messages = COMPARED_TEMPLATES[name]
    for add_generation_prompt in (True, False):
        expected = hf_template_tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    extra = {"enable_thinking": False, "date_string": "01 Jan 2025"}
    expected = hf_template_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                         add_generation_prompt=True, **extra)
    assert tok.apply_chat_template(messages, **extra) == expected


def test_template_errors_become_request_errors(hf_template_tokenizer):
    gemma = template_tokenizer(need(TEMPLATES / "google-gemma-2-2b-it.jinja").read_text(encoding="utf-8"))
    with pytest.raises(RequestError, match="System role not supported"):
        gemma.apply_chat_template(CONVERSATION)
    with pytest.raises(RequestError, match="no chat template"):
        gguf_tokenizer("gpt-2").apply_chat_template(CONVERSATION)
    with pytest.raises(RequestError, match="compile"):
        template_tokenizer("{% for m in messages %}").apply_chat_template(CONVERSATION)
    with pytest.raises(RequestError, match="chat template error"):
        template_tokenizer("{{ messages[0].content + 1 }}").apply_chat_template(CONVERSATION)
    with pytest.raises(RequestError):  # the sandbox holds
        template_tokenizer("{{ messages.__class__.__mro__ }}").apply_chat_template(CONVERSATION)


def test_template_helpers():
    tok = template_tokenizer(
        "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% endfor %}|{{ strftime_now('%Y') | length }}"
        "|{{ tools is none }}|{{ custom }}{% generation %}|g{% endgeneration %}"
    )
    out = tok.apply_chat_template([{"role": "user", "content": "<é>"}], custom="x")
    assert out == '<s>{"role": "user", "content": "<é>"}|4|True|x|g'


def test_all_templates_render_or_raise_request_error():
    """Each real template renders a system/user/assistant conversation or refuses it with a
    RequestError, never another exception."""
    paths = sorted(need(TEMPLATES).glob("*.jinja"))
    assert len(paths) == 57
    messages = CONVERSATION[:3]
    rendered, refused = [], []
    for path in paths:
        tok = template_tokenizer(path.read_text(encoding="utf-8"))
        try:
            text = tok.apply_chat_template(messages)
        except RequestError as e:
            refused.append(f"{path.stem}: {e}")
            continue
        assert "Hi there, how can I help?" in text, path.stem
        rendered.append(path.stem)
    print(f"\nchat templates: {len(rendered)} rendered, {len(refused)} refused:", *refused, sep="\n  ")
    assert len(rendered) >= 50, refused


def test_hf_dir_other_decoders_stream_through_the_library(tmp_path, transformers):
    """A decoder hearth does not reproduce byte by byte (WordPiece): decode is the library's, and
    streaming still adds up to it."""
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    backend = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.train_from_iterator([t * 3 for t in STREAM_TEXTS], trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]"]))
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[SEP]").save_pretrained(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.eos_token_ids == [ref.eos_token_id]
    for text in STREAM_TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text)
        assert tok.decode(ids) == ref.decode(ids)
        stream = tok.incremental_decoder()
        assert "".join(stream.step(i) for i in ids) + stream.flush() == tok.decode(ids), text
