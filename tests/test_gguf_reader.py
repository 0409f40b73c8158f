"""hearth's GGUF header reader against gguf.GGUFReader (the llama.cpp project's own): metadata,
tensor table and tensor bytes, on converted tiny models and on the real files in ../shared/data."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from hearth.errors import ModelLoadError
from hearth.loading.convert import convert_hf_to_gguf
from hearth.loading.gguf_reader import read_gguf
from models import make_hf_model

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
REAL_FILES = [DATA / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf",
              DATA / "vocab" / "ggml-vocab-llama-spm.gguf"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("gguf")
    folder = make_hf_model(root / "llama", "llama")
    return [convert_hf_to_gguf(folder, root / f"{kind}.gguf", kind) for kind in ("f32", "f16", "q8_0", "q4_1")]


def assert_same_as_gguf(path: Path) -> None:
    reference = gguf.GGUFReader(path)
    file = read_gguf(path)
    expected = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert file.metadata == expected
    assert [t.name for t in file.tensors] == [t.name for t in reference.tensors]
    for ours, theirs in zip(file.tensors, reference.tensors):
        assert ours.qtype == theirs.tensor_type
        assert ours.shape == tuple(int(d) for d in theirs.shape)
        assert ours.nbytes == theirs.n_bytes
        assert np.array_equal(file.tensor_bytes(ours), theirs.data.reshape(-1).view(np.uint8))


def test_converted_files_read_as_gguf_reads_them(converted):
    for path in converted:
        assert_same_as_gguf(path)


@pytest.mark.parametrize("path", REAL_FILES, ids=lambda p: p.name)
def test_real_files_read_as_gguf_reads_them(path):
    if not path.exists():
        pytest.skip(f"reference data not found: {path} (expected ../shared/data next to the repo)")
    assert_same_as_gguf(path)


def test_damaged_files_raise_clear_errors(converted, tmp_path):
    data = converted[0].read_bytes()
    for name, content, message in [
        ("truncated.gguf", data[: len(data) // 2], "truncated"),
        ("header-only.gguf", data[:30], "truncated"),
        ("text.gguf", b"hello world", "not a GGUF file"),
        ("version.gguf", data[:4] + (7).to_bytes(4, "little") + data[8:], "version 7"),
    ]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ModelLoadError, match=message):
            read_gguf(tmp_path / name)
    with pytest.raises(ModelLoadError, match="cannot read"):
        read_gguf(tmp_path / "missing.gguf")
