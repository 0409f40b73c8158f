"""Tokenizer files against damage: Hugging Face tokenizer.json (and tokenizer_config.json) and
GGUF vocabularies (tokens, merges, token types, scores, special ids). Each ends in ModelLoadError
or a tokenizer that encodes and decodes without any other exception, within seconds.

Mutation fuzzing of the real files (bytes flipped or replaced, truncation; seeded) and property-based
fuzzing (hypothesis) of their parsed fields. The GGUF vocabularies are the tiny test model's
(byte-level BPE, 'gpt2') and real ones from ../shared/data where present: stories260K
(SentencePiece, 'llama'; fuzzed) and SmolLM2 (byte-level BPE; 2 s to build, so only damaged whole).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hearth.errors import ModelLoadError
from hearth.loading.convert import convert_hf_to_gguf
from hearth.loading.gguf_reader import read_gguf
from hearth.tokenizer import Tokenizer
from models import make_hf_model
from test_fuzz import deadline

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "models"
REAL_GGUF = {"llama": DATA / "stories260K" / "stories260K.gguf",
             "gpt2": DATA / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"}
SAMPLE = "Once upon a time, héllo wörld 123 <s></s> \n\t  def f(x): return x"
JSON_CASES = 150


def exercise(tok: Tokenizer) -> None:
    """What a server does with a tokenizer: encode, decode (whole and incremental), pieces."""
    ids = tok.encode(SAMPLE)
    tok.decode(ids)
    decoder = tok.incremental_decoder(True, ids[:2])
    for i in ids[2:]:
        decoder.step(i)
    decoder.flush()
    for i in ids[:5]:
        tok.id_to_piece(i)


def loads_cleanly(load, case: str) -> None:
    with deadline(20, case):
        try:
            tok = load()
        except ModelLoadError:
            return
        except Exception as e:  # noqa: BLE001 - the point: anything else is a finding
            pytest.fail(f"{case}: loading raised {type(e).__name__}: {e}")
        try:
            exercise(tok)
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"{case}: a tokenizer that loaded then raised {type(e).__name__}: {e}")


# ---------------------------------------------------------------- tokenizer.json


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("fuzz-tok") / "llama", "llama")


def _copy_folder(src: Path, dst: Path, replace: dict[str, bytes]) -> Path:
    dst.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (dst / name).write_bytes(replace.get(name, (src / name).read_bytes()))
    return dst


def test_damaged_tokenizer_json_bytes(hf_folder, tmp_path):
    rng = random.Random(0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        data = (hf_folder / name).read_bytes()
        for n in range(JSON_CASES):
            damaged = bytearray(data)
            kind = rng.choice(["flip", "bytes", "truncate"])
            if kind == "truncate":
                damaged = damaged[: rng.randrange(len(data))]
            else:
                for _ in range(1 if kind == "flip" else rng.randint(2, 12)):
                    at = rng.randrange(len(damaged))
                    damaged[at] = damaged[at] ^ (1 << rng.randrange(8)) if kind == "flip" else rng.randrange(256)
            folder = _copy_folder(hf_folder, tmp_path / "t", {name: bytes(damaged)})
            loads_cleanly(lambda: Tokenizer.from_hf_dir(folder), f"{name} case {n} ({kind})")


def _leaf_paths(node, path=()):
    """Every path to a value in a JSON tree (containers included)."""
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaf_paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node[:50]):  # the first entries of the long vocab and merges lists
            yield from _leaf_paths(v, path + (i,))


_JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64), st.floats(allow_nan=False),
              st.text(max_size=20), st.sampled_from(["<s>", "</s>", "Ġ", "▁", "", "a b", "BPE", "ByteLevel"])),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_tokenizer_json_fields_of_any_type(hf_folder, tmp_path_factory, data):
    name = data.draw(st.sampled_from(["tokenizer.json", "tokenizer_config.json"]))
    spec = json.loads((hf_folder / name).read_text())
    paths = list(_leaf_paths(spec))[1:]
    path = data.draw(st.sampled_from(paths))
    action = data.draw(st.sampled_from(["set", "delete"]))
    parent = spec
    for key in path[:-1]:
        parent = parent[key]
    if action == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(_JSON_VALUES)
    folder = _copy_folder(hf_folder, tmp_path_factory.mktemp("t"), {name: json.dumps(spec).encode()})
    loads_cleanly(lambda: Tokenizer.from_hf_dir(folder), f"{name}: {action} {list(path)}")


# ---------------------------------------------------------------- GGUF vocabularies


@pytest.fixture(scope="module")
def vocabularies(hf_folder) -> dict[str, dict]:
    """The metadata of each real GGUF vocabulary at hand (the tiny model's always)."""
    tiny = convert_hf_to_gguf(hf_folder, hf_folder.parent / "tok.gguf", "f16", progress=False)
    files = {"tiny": tiny, **{k: p for k, p in REAL_GGUF.items() if p.is_file()}}
    return {k: dict(read_gguf(p).metadata) for k, p in files.items()}


_VOCAB_KEYS = ["tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores",
               "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
               "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token",
               "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template"]
_ELEMENTS = st.one_of(st.none(), st.integers(-(2**63), 2**64), st.floats(), st.text(max_size=12),
                      st.sampled_from(["", " ", "a b", "a  b", "<0xZZ>", "<0x41>", "▁", "Ġ", "\x00"]), st.booleans())


def _damage(rng: random.Random, value, draw_element):
    """One kind of damage to a list field: an entry replaced, removed, duplicated, the list cut or emptied."""
    if not isinstance(value, list) or not value:
        return draw_element()
    value = list(value)
    kind = rng.choice(["replace", "remove", "duplicate", "cut", "empty", "swap"])
    at = rng.randrange(len(value))
    if kind == "replace":
        value[at] = draw_element()
    elif kind == "remove":
        del value[at]
    elif kind == "duplicate":
        value.insert(at, value[rng.randrange(len(value))])
    elif kind == "cut":
        value = value[: rng.randrange(len(value))]
    elif kind == "empty":
        value = []
    else:
        other = rng.randrange(len(value))
        value[at], value[other] = value[other], value[at]
    return value


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_gguf_vocabularies_damaged_in_any_field(vocabularies, data):
    which = data.draw(st.sampled_from(sorted(set(vocabularies) - {"gpt2"})))  # (SmolLM2's takes ~2 s to build)
    md = dict(vocabularies[which])
    changes = []
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(_VOCAB_KEYS))
        seed = data.draw(st.integers(0, 2**32))
        if data.draw(st.booleans()) and key in md:
            del md[key]
            changes.append(f"{key} removed")
        else:
            md[key] = _damage(random.Random(seed), md.get(key), lambda: data.draw(_ELEMENTS))
            changes.append(f"{key} damaged (seed {seed})")
    loads_cleanly(lambda: Tokenizer.from_gguf_metadata(md), f"{which}: {', '.join(changes)}")


def test_a_gguf_vocabulary_with_nan_scores_and_absurd_ids(vocabularies):
    for which, md in vocabularies.items():
        n = len(md["tokenizer.ggml.tokens"])
        bad = {**md, "tokenizer.ggml.scores": [math.nan] * n, "tokenizer.ggml.bos_token_id": 2**63,
               "tokenizer.ggml.eos_token_id": -1, "tokenizer.ggml.token_type": [99] * n}
        loads_cleanly(lambda: Tokenizer.from_gguf_metadata(bad), f"{which}: nan scores, absurd ids and types")
