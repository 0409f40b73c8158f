"""Readers of outside input against damaged and hostile input: each ends in a clear error
(ModelLoadError, RequestError) or a correct result; never another exception, a hang, or memory
beyond what the input's size warrants.

Mutation fuzzing of real files (bytes flipped, integers overwritten with extreme values,
truncation: seeded, so a failure names the case that reproduces it) and property-based fuzzing
(hypothesis) of parsed structures: GGUF files, safetensors headers, config.json, chat templates.
"""

from __future__ import annotations

import json
import random
import resource
import signal
import struct
from contextlib import contextmanager

import pytest
import torch
from gguf import GGUFReader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hearth.backend import Backend
from hearth.chat_template import render_chat_template
from hearth.config import ModelConfig
from hearth.errors import ModelLoadError, RequestError
from hearth.loading.convert import convert_hf_to_gguf
from hearth.loading.loader import load_model
from hearth.model.transformer import Transformer
from models import make_hf_model

GGUF_CASES = 250
EXTREME_INTEGERS = [0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 1 << 40, (1 << 63) - 1, (1 << 64) - 1]


@contextmanager
def deadline(seconds: int, case: str):
    """Fail the case that runs longer than `seconds` (a hang), naming it."""

    def expired(signum, frame):
        raise TimeoutError(f"{case}: still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    folder = make_hf_model(tmp_path_factory.mktemp("fuzz") / "llama", "llama")
    return convert_hf_to_gguf(folder, folder.parent / "model.gguf", "q8_0", progress=False)


def _mutations(data: bytes, header_end: int, rng: random.Random):
    """(description, damaged bytes) of the file `data` whose header ends at `header_end`."""
    while True:
        damaged = bytearray(data)
        kind = rng.choice(["flip", "bytes", "integer", "truncate"])
        if kind == "flip":
            at = rng.randrange(header_end)
            damaged[at] ^= 1 << rng.randrange(8)
            yield f"bit flipped at {at}", bytes(damaged)
        elif kind == "bytes":
            spots = [rng.randrange(header_end) for _ in range(rng.randint(2, 16))]
            for at in spots:
                damaged[at] = rng.randrange(256)
            yield f"bytes replaced at {spots}", bytes(damaged)
        elif kind == "integer":
            at, value = rng.randrange(4, header_end - 8), rng.choice(EXTREME_INTEGERS)
            damaged[at : at + 8] = struct.pack("<Q", value)
            yield f"{value} written at {at}", bytes(damaged)
        else:
            size = rng.randrange(len(data))
            yield f"truncated to {size} bytes", bytes(damaged[:size])


def test_damaged_gguf_files_are_refused_cleanly(gguf_file, tmp_path):
    """Metadata, tensor table and data of a real GGUF damaged GGUF_CASES ways: each loads (the damage
    hit something unused) or is refused with ModelLoadError, within seconds and bounded memory."""
    data = gguf_file.read_bytes()
    header_end = min(t.data_offset for t in GGUFReader(gguf_file).tensors)
    backend = Backend()  # the reference kernels: what is read is under test, not the matmuls
    load_model(gguf_file, progress=False, backend=backend)
    rss_before = _peak_rss_mib()
    damaged_path = tmp_path / "damaged.gguf"
    cases = _mutations(data, header_end, random.Random(0))
    for _ in range(GGUF_CASES):
        case, damaged = next(cases)
        damaged_path.write_bytes(damaged)
        with deadline(20, case):
            try:
                load_model(damaged_path, progress=False, backend=backend)
            except ModelLoadError:
                pass
            except Exception as e:  # noqa: BLE001 - the point: anything else is a finding
                pytest.fail(f"{case}: {type(e).__name__}: {e}")
    assert _peak_rss_mib() - rss_before < 256, "a damaged file made hearth allocate far beyond its size"


def _gguf_header(*, keys: list[bytes], tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, len(keys)) + b"".join(keys)


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize("header,message", [
    # a string array claiming 2^63 items (gguf.GGUFReader loops for ever on this one)
    (_gguf_header(keys=[_string(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 1 << 63)]), "claims"),
    (_gguf_header(keys=[_string(b"x") + struct.pack("<IIQ", 9, 4, 1 << 62)]), "damaged or truncated"),
    (_gguf_header(keys=[_string(b"x") + struct.pack("<IIQ", 9, 9, 1)]), "array of arrays"),
    (_gguf_header(keys=[_string(b"x") + struct.pack("<I", 99)]), "damaged or truncated"),
    (_gguf_header(keys=[], tensors=1) + _string(b"t") + struct.pack("<I", 1 << 31), "dimensions"),
    (_gguf_header(keys=[], tensors=1 << 40), "more than the file holds"),
    (_gguf_header(keys=[struct.pack("<Q", 1 << 50)]), "past the end"),
    (b"GGUF" + struct.pack("<IQQ", 7, 0, 0), "version 7"),
])
def test_hostile_gguf_headers_are_refused_before_parsing(tmp_path, header, message):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(header)
    with deadline(10, message):
        with pytest.raises(ModelLoadError, match=message):
            load_model(path, progress=False, backend=Backend())


def test_damaged_safetensors_headers_are_refused_cleanly(tmp_path):
    folder = make_hf_model(tmp_path / "llama", "llama")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + header_len])
    rng = random.Random(1)
    names = [name for name in header if name != "__metadata__"]
    for case in range(60):
        damaged_header = json.loads(json.dumps(header))
        entry = damaged_header[rng.choice(names)]
        field = rng.choice(["dtype", "shape", "data_offsets"])
        entry[field] = rng.choice([[1 << 62, 3], [-1, 2], [0, 1 << 62], "F64", "Q9", [], [1, 2, 3, 4, 5, 6], None, 7])
        body = json.dumps(damaged_header).encode()
        prefix = struct.pack("<Q", len(body) if case % 5 else rng.choice([0, 1 << 62, len(data)]))
        weights.write_bytes(prefix + body + data[8 + header_len :])
        with deadline(20, f"{field} = {entry[field]!r}"):
            try:
                load_model(folder, progress=False, backend=Backend())
            except ModelLoadError:
                pass


_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 112,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 1 << 62), st.floats(allow_nan=True),
                    st.text(max_size=8), st.lists(st.integers(-2, 5), max_size=3),
                    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
                    st.sampled_from(["LlamaForCausalLM", "GemmaForCausalLM", "qwen2", "linear", "llama3", "yarn"]))
_KEYS = st.sampled_from(sorted(_CONFIG) + ["head_dim", "rope_scaling", "rope_parameters", "hidden_act",
                                           "model_type", "attention_bias", "mlp_bias", "sliding_window",
                                           "use_sliding_window", "tie_word_embeddings", "partial_rotary_factor"])


@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(changes=st.dictionaries(_KEYS, _VALUES, max_size=3), dropped=st.sets(st.sampled_from(sorted(_CONFIG)), max_size=2))
def test_config_json_fields_of_any_type_and_size(changes, dropped):
    """Any value in any field: a ModelConfig whose model builds, or ModelLoadError; no size
    without bound (the model is built on the meta device: shapes only)."""
    hf = {key: value for key, value in _CONFIG.items() if key not in dropped} | changes
    try:
        config = ModelConfig.from_hf(hf)
        with torch.device("meta"):
            Transformer(config, 64)
    except ModelLoadError:
        pass


@pytest.mark.parametrize("template,refusal", [
    ("{{ 'a' * 10 ** 10 }}", "repetition"),
    ("{{ ('a' * 1000) * 1000 * 1000 }}", "repetition"),
    ("{{ 10 ** 100000 ** 2 }}", "power"),
    ("{% for i in range(10 ** 9) %}{% endfor %}", "Range too big"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    ("{{ cycler.__init__.__globals__ }}", "unsafe"),
    ("{% include '/etc/passwd' %}", "loader"),
    ("{% import 'os' as os %}", "loader"),
])
def test_chat_templates_cannot_escape_or_exhaust(template, refusal):
    """A template comes from the model file: it cannot reach Python's internals or files, nor
    spend unbounded memory or time."""
    with deadline(10, template):
        with pytest.raises(RequestError, match=refusal):
            render_chat_template(template, [{"role": "user", "content": "hi"}])
    assert render_chat_template("{{ 'ab' * 3 }}{{ 2 ** 10 }}{{ [1] * 2 }}", []) == "ababab1024[1, 1]"


@pytest.mark.parametrize("weight_map,message", [
    ({"model.embed_tokens.weight": "../../outside.safetensors"}, "inside the folder"),
    ({"model.embed_tokens.weight": ["a"]}, "inside the folder"),
    ({"model.embed_tokens.weight": "/etc/passwd"}, "inside the folder"),
    ("not an object", "weight_map"),
])
def test_shard_index_names_only_files_inside_the_folder(tmp_path, weight_map, message):
    folder = make_hf_model(tmp_path / "llama", "llama")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match=message):
        load_model(folder, progress=False, backend=Backend())


def test_config_json_that_is_not_utf8_is_refused(tmp_path):
    folder = make_hf_model(tmp_path / "llama", "llama")
    (folder / "config.json").write_bytes(b'{"architectures": ["\xff\xfe"]}')
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(folder, progress=False, backend=Backend())
