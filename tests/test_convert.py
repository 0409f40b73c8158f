"""hearth convert (HF folder -> GGUF): checked against transformers, gguf's own constants, and
llama.cpp itself (llama-cpp-python) where it is installed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from hearth.errors import ModelLoadError
from hearth.loading.convert import OUT_TYPES, convert_hf_to_gguf
from hearth.loading.gguf import load_gguf
from models import ARCHITECTURES, hearth_logits, load_hf_reference, make_hf_model, make_spm_tokenizer
from optional import import_llama_cpp

TOKENS = [0, 5, 77, 123, 200, 9, 250, 31, 64, 100, 7, 299, 150, 42, 3, 11, 90, 91, 92, 17]
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # Llama 3's Split pre-tokenizer
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
VARIANTS = {  # name -> (architecture, make_hf_model overrides)
    **{arch: (arch, {}) for arch in ARCHITECTURES},
    "llama3-tied": ("llama", {"seed": 1, "rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": True}),
    "llama-linear": ("llama", {"seed": 2, "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "rope_theta": 500.0}),
}

# Max |logits(gguf) - logits(transformers)| / max |logits(transformers)| measured on the tiny random
# models (llama, mistral, qwen2, qwen3, gemma, llama3-tied; 20 tokens), and the bound asserted: about
# 1.5-2x the worst measured. Random weights are harder on block quantization than trained ones.
# type: (worst measured, asserted)
QUANT_TOLERANCES = {
    "f16": (9.0e-4, 2e-3),
    "bf16": (7.2e-3, 1.5e-2),
    "q8_0": (2.8e-2, 5e-2),
    "q5_1": (1.3e-1, 0.25),
    "q5_0": (1.9e-1, 0.35),
    "q4_1": (2.6e-1, 0.45),
    "q4_0": (3.2e-1, 0.55),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {name: make_hf_model(root / name, arch, **overrides) for name, (arch, overrides) in VARIANTS.items()}


@pytest.fixture(scope="module")
def reference_logits(hf_dirs) -> dict[str, torch.Tensor]:
    out = {}
    for name, folder in hf_dirs.items():
        with torch.no_grad():
            out[name] = load_hf_reference(folder)(torch.tensor([TOKENS])).logits[0]
    return out


def _convert(hf_dirs, name: str, out_type: str, tmp_path_factory) -> Path:
    out = tmp_path_factory.getbasetemp() / "gguf" / f"{name}-{out_type}.gguf"
    if not out.exists():
        convert_hf_to_gguf(hf_dirs[name], out, out_type, progress=False)
    return out


def _metadata(source: Path | gguf.GGUFReader) -> dict:
    reader = source if isinstance(source, gguf.GGUFReader) else gguf.GGUFReader(source)
    return {key: field.contents() for key, field in reader.fields.items()}


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_f32_round_trip_matches_transformers(name, hf_dirs, reference_logits, tmp_path_factory):
    path = _convert(hf_dirs, name, "f32", tmp_path_factory)
    config, weights, _ = load_gguf(path, progress=False)
    assert config.architecture == ("llama" if VARIANTS[name][0] == "mistral" else VARIANTS[name][0])
    logits = hearth_logits(config, weights, TOKENS)
    assert _relative_error(logits, reference_logits[name]) <= 1e-4


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma", "llama3-tied"])
def test_quantized_error_within_measured_tolerance(name, hf_dirs, reference_logits, tmp_path_factory):
    errors = {}
    for out_type, (_, bound) in QUANT_TOLERANCES.items():
        config, weights, _ = load_gguf(_convert(hf_dirs, name, out_type, tmp_path_factory), progress=False)
        errors[out_type] = _relative_error(hearth_logits(config, weights, TOKENS), reference_logits[name])
        assert errors[out_type] <= bound, f"{out_type}: relative logit error {errors[out_type]:.3g} > {bound}"
    # more bits, less error
    assert errors["f16"] < errors["bf16"] < errors["q8_0"] < min(errors["q5_0"], errors["q5_1"])
    assert max(errors["q5_0"], errors["q5_1"]) < max(errors["q4_0"], errors["q4_1"])


def _expected_tensor_names(arch: gguf.MODEL_ARCH, blocks: int) -> set[str]:
    names = set()
    for tensor in gguf.MODEL_TENSORS[arch]:
        pattern = gguf.TENSOR_NAMES[tensor]
        for suffix in (".weight", ".bias"):
            names |= {pattern.format(bid=b) + suffix for b in range(blocks)}
    return names


@pytest.mark.parametrize("name, arch", [("llama", gguf.MODEL_ARCH.LLAMA), ("mistral", gguf.MODEL_ARCH.LLAMA),
                                        ("qwen2", gguf.MODEL_ARCH.QWEN2), ("qwen3", gguf.MODEL_ARCH.QWEN3),
                                        ("gemma", gguf.MODEL_ARCH.GEMMA), ("gemma2", gguf.MODEL_ARCH.GEMMA2),
                                        ("llama3-tied", gguf.MODEL_ARCH.LLAMA)])
def test_metadata_and_tensors_as_llama_cpp_expects(name, arch, hf_dirs, tmp_path_factory):
    reader = gguf.GGUFReader(_convert(hf_dirs, name, "q8_0", tmp_path_factory))
    md = _metadata(reader)
    a = gguf.MODEL_ARCH_NAMES[arch]
    assert md["general.architecture"] == a
    assert md["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert md["general.name"] == name
    hidden, ff, heads, kv_heads, head_dim, vocab = 64, 112, 4, 2, 16, 320
    assert (md[f"{a}.embedding_length"], md[f"{a}.feed_forward_length"], md[f"{a}.block_count"]) == (hidden, ff, 2)
    assert (md[f"{a}.attention.head_count"], md[f"{a}.attention.head_count_kv"]) == (heads, kv_heads)
    assert (md[f"{a}.context_length"], md[f"{a}.vocab_size"], md[f"{a}.rope.dimension_count"]) == (512, vocab, head_dim)
    assert md[f"{a}.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert md[f"{a}.rope.freq_base"] == pytest.approx(10000.0)
    assert f"{a}.attention.key_length" not in md  # 64 / 4 == 16: llama.cpp derives it

    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) <= _expected_tensor_names(arch, 2)
    tied = name in ("gemma", "gemma2", "llama3-tied")
    assert ("output.weight" in tensors) == (not tied)
    assert ("rope_freqs.weight" in tensors) == (name == "llama3-tied")
    assert ("blk.0.attn_q.bias" in tensors) == (name == "qwen2")
    assert ("blk.1.attn_k_norm.weight" in tensors) == (name == "qwen3")
    shapes = {  # ggml order: row length first
        "token_embd.weight": [hidden, vocab], "blk.1.attn_q.weight": [hidden, heads * head_dim],
        "blk.1.attn_k.weight": [hidden, kv_heads * head_dim], "blk.1.attn_output.weight": [heads * head_dim, hidden],
        "blk.1.ffn_gate.weight": [hidden, ff], "blk.1.ffn_down.weight": [ff, hidden], "output_norm.weight": [hidden],
    }
    for tensor_name, shape in shapes.items():
        assert tensors[tensor_name].shape.tolist() == shape, tensor_name
    Q = gguf.GGMLQuantizationType
    for t in tensors.values():
        if len(t.shape) == 1:
            assert t.tensor_type == Q.F32, t.name  # norms, biases, rope factors
        elif t.name.endswith("ffn_down.weight"):
            assert t.tensor_type == Q.F16, t.name  # rows of 112 are not whole Q8_0 blocks of 32
        else:
            assert t.tensor_type == Q.Q8_0, t.name  # token_embd and output too, as llama.cpp's q8_0
    if name == "llama3-tied":
        assert tensors["rope_freqs.weight"].shape.tolist() == [head_dim // 2]
    if name == "gemma2":  # soft-caps, the window; the query scale llama.cpp would not derive (24, not head_dim)
        assert (md[f"{a}.attn_logit_softcapping"], md[f"{a}.final_logit_softcapping"]) == (5.0, 10.0)
        assert md[f"{a}.attention.sliding_window"] == 128
        assert f"{a}.attention.scale" not in md  # llama.cpp reads no such key: folded into the queries instead
        assert {"blk.1.post_attention_norm.weight", "blk.1.ffn_norm.weight", "blk.1.post_ffw_norm.weight"} <= set(tensors)


def _hf_tokenizer(folder: Path):
    # tokenizer.json itself: transformers' per-model classes may add tokens of their own
    # (transformers 5's Qwen2Tokenizer adds <|endoftext|> when the file has none)
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def test_tokenizer_round_trip_byte_level(hf_dirs, tmp_path_factory):
    folder = hf_dirs["qwen2"]
    md = _metadata(_convert(hf_dirs, "qwen2", "q8_0", tmp_path_factory))
    vocab = _hf_tokenizer(folder).get_vocab(with_added_tokens=True)
    by_id = {i: t for t, i in vocab.items()}
    tokens = md["tokenizer.ggml.tokens"]
    assert len(tokens) == 320 and md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "gpt-2"
    assert [tokens[i] for i in sorted(by_id)] == [by_id[i] for i in sorted(by_id)]
    assert tokens[len(vocab):] == [f"[PAD{i}]" for i in range(len(vocab), 320)]
    types = md["tokenizer.ggml.token_type"]
    assert types[:4] == [3, 3, 3, 3] and set(types[4:len(vocab)]) == {1} and set(types[len(vocab):]) == {5}
    merges = json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]
    assert md["tokenizer.ggml.merges"] == [m if isinstance(m, str) else " ".join(m) for m in merges]
    assert (md["tokenizer.ggml.bos_token_id"], md["tokenizer.ggml.eos_token_id"]) == (0, 1)
    assert md["tokenizer.ggml.add_bos_token"] is False
    assert "<|im_start|>" in md["tokenizer.chat_template"]


def test_pre_tokenizer_recognised_by_regex(hf_dirs, tmp_path):
    qwen2 = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")  # digits one by one
    for regex, expected in ((LLAMA3_REGEX, "llama-bpe"), (qwen2, "qwen2"), (r"\s+", "default")):
        folder = tmp_path / expected
        shutil.copytree(hf_dirs["llama"], folder, dirs_exist_ok=True)
        _set_split_regex(folder, regex)
        out = convert_hf_to_gguf(folder, tmp_path / f"{expected}.gguf", "f16", progress=False)
        assert gguf.GGUFReader(out).fields["tokenizer.ggml.pre"].contents() == expected


def _set_split_regex(folder: Path, regex: str) -> None:
    path = folder / "tokenizer.json"
    tok = json.loads(path.read_text())
    tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    path.write_text(json.dumps(tok))


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> tuple[Path, Path]:
    folder = make_hf_model(tmp_path_factory.mktemp("spm") / "spm-llama", "llama", vocab_size=448)
    assert make_spm_tokenizer(folder) <= 448
    return folder, convert_hf_to_gguf(folder, folder.parent / "spm-f32.gguf", "f32", progress=False)


def test_tokenizer_round_trip_sentencepiece_style(spm_model):
    folder, path = spm_model
    md = _metadata(path)
    assert (md["tokenizer.ggml.model"], md["tokenizer.ggml.pre"]) == ("llama", "default")
    vocab = _hf_tokenizer(folder).get_vocab(with_added_tokens=True)
    tokens, types, scores = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"], md["tokenizer.ggml.scores"]
    assert all(tokens[i] == t for t, i in vocab.items())
    assert types[:3] == [3, 3, 3] and types[3:259] == [6] * 256 and tokens[3 + 0x41] == "<0x41>"
    assert types[259:len(vocab)] == [1] * (len(vocab) - 259)
    # no scores in tokenizer.json: a token scores minus the rank of the merge that makes it
    merges = json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]
    rank: dict[str, int] = {}
    for r, merge in enumerate(merges):
        rank.setdefault("".join(merge.split(" ") if isinstance(merge, str) else merge), r)
    assert len(rank) > 100
    assert all(scores[vocab[token]] == -r for token, r in rank.items())
    assert md["tokenizer.ggml.add_space_prefix"] is True
    special = ("bos_token_id", "eos_token_id", "unknown_token_id")
    assert [md[f"tokenizer.ggml.{key}"] for key in special] == [1, 2, 0]


def test_errors(hf_dirs, tmp_path):
    with pytest.raises(ModelLoadError, match="unknown output type"):
        convert_hf_to_gguf(hf_dirs["llama"], tmp_path / "x.gguf", "q3_k")
    with pytest.raises(ModelLoadError, match="no such model folder"):
        convert_hf_to_gguf(tmp_path / "missing", tmp_path / "x.gguf")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        convert_hf_to_gguf(tmp_path / "empty", tmp_path / "x.gguf")
    odd = tmp_path / "odd"
    shutil.copytree(hf_dirs["llama"], odd)
    config = json.loads((odd / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        convert_hf_to_gguf(odd, tmp_path / "x.gguf")
    wordpiece = tmp_path / "wordpiece"
    shutil.copytree(hf_dirs["llama"], wordpiece)
    tok = json.loads((wordpiece / "tokenizer.json").read_text())
    tok["model"]["type"] = "WordPiece"
    (wordpiece / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ModelLoadError, match="not supported"):
        convert_hf_to_gguf(wordpiece, tmp_path / "x.gguf")
    assert not list(tmp_path.glob("*.gguf*"))  # nothing half-written left behind


# ---------------------------------------------------------------- llama.cpp itself

@pytest.mark.parametrize("name", list(VARIANTS))
def test_llama_cpp_loads_and_agrees(name, hf_dirs, reference_logits, tmp_path_factory):
    llama_cpp = import_llama_cpp()
    llm = llama_cpp.Llama(model_path=str(_convert(hf_dirs, name, "f32", tmp_path_factory)), logits_all=True,
                          n_ctx=256, verbose=False)
    llm.eval(TOKENS)
    logits = torch.from_numpy(np.array(llm.scores[: len(TOKENS)]))
    # llama.cpp keeps its KV cache in f16: ~5e-4 measured
    assert _relative_error(logits, reference_logits[name]) <= 1e-3


def test_llama_cpp_tokenizes_as_hf(hf_dirs, spm_model, tmp_path, tmp_path_factory):
    llama_cpp = import_llama_cpp()
    texts = ["Once upon a time there was a little fox", "def fibonacci(n):\n    return 3333 + 12345\n\n\n  x",
             " leading space  and   runs\t\ttabs", "I've been 'told he's there, 'RE you? 🦙 héllo wörld ñ 日本"]
    folder = tmp_path / "llama-bpe"
    shutil.copytree(hf_dirs["llama"], folder)
    _set_split_regex(folder, LLAMA3_REGEX)
    cases = [(hf_dirs["llama"], _convert(hf_dirs, "llama", "f32", tmp_path_factory)), spm_model,
             (folder, convert_hf_to_gguf(folder, tmp_path / "llama-bpe.gguf", "f16", progress=False))]
    for hf_folder, path in cases:
        hf = _hf_tokenizer(hf_folder)
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        for text in texts:
            want = hf.encode(text, add_special_tokens=False).ids
            assert llm.tokenize(text.encode(), add_bos=False) == want, (path.name, text)


@pytest.mark.parametrize("out_type", ["tq1_0", "tq2_0"])
def test_ternary_model_converts_exactly_and_decodes_as_its_float_copy(out_type, tmp_path):
    """A BitNet-shaped model (every projection d * {-1, 0, 1}, per tensor) written as TQ1_0 / TQ2_0:
    each ternary tensor dequantizes (gguf's dequantizer) to exactly the float file's tensor, the
    embeddings and output stay F16, and the model on the ternary kernel scores a text as the float
    copy does."""
    from hearth import LLM, SamplingParams

    folder = make_hf_model(tmp_path / "bitnet", "llama", hidden_size=256, intermediate_size=512)
    model = load_hf_reference(folder)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "proj" in name:
                scale = (0.02 + 0.05 * torch.rand(1, generator=g)).half().float()  # what a float16 d holds
                p.copy_(torch.randint(-1, 2, p.shape, generator=g).float() * scale)
    model.save_pretrained(folder, safe_serialization=True)
    ternary = convert_hf_to_gguf(folder, tmp_path / f"bitnet-{out_type}.gguf", out_type, progress=False)
    dense = convert_hf_to_gguf(folder, tmp_path / "bitnet-f32.gguf", "f32", progress=False)
    dense_tensors = {t.name: t for t in gguf.GGUFReader(dense).tensors}
    qtype = OUT_TYPES[out_type][1]
    kinds = {}
    for t in gguf.GGUFReader(ternary).tensors:
        kinds[t.name] = t.tensor_type
        if t.tensor_type == qtype:
            values = gguf.dequantize(t.data, qtype).reshape(dense_tensors[t.name].data.shape)
            np.testing.assert_array_equal(values, dense_tensors[t.name].data)
    assert kinds["blk.0.ffn_down.weight"] == kinds["blk.1.attn_q.weight"] == qtype
    assert kinds["token_embd.weight"] == kinds["output.weight"] == gguf.GGMLQuantizationType.F16
    # the int8 kernel rounds activations (as llama.cpp does), so the float copy is met within that
    # rounding: the log-probability of every token of a text, and the most likely next token
    text = "Once upon a time there was a fox who lived in the woods and liked to read books at night."
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    scored = [LLM(path, progress=False).generate([text], params, use_tqdm=False)[0].prompt_logprobs[1:]
              for path in (ternary, dense)]
    ids = LLM(dense, progress=False).get_tokenizer().encode(text)[1:]
    chosen = [[position[token] for position, token in zip(run, ids)] for run in scored]
    differences = [abs(a - b) for a, b in zip(*chosen)]  # measured: mean 0.027, max 0.086 nats
    assert sum(differences) / len(differences) < 0.05 and max(differences) < 0.15
    top = [[max(position, key=position.get) for position in run] for run in scored]
    assert sum(a == b for a, b in zip(*top)) >= 0.9 * len(ids)
