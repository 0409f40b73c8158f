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


def test_release_pages_gives_back_a_file_mappings_pages_and_nothing_else():
    """hearth/quant/kernels/memory.py: a mapped GGUF's pages are dropped (the data reads back from the file),
    memory that is no file mapping is left alone, the mappings found in one read of /proc/self/maps."""
    import warnings

    import torch

    from hearth.quant.kernels.memory import file_mappings, mappings_snapshot, release_pages

    path = REAL_FILES[0] if REAL_FILES[0].exists() else REAL_FILES[1]
    if not path.exists() or not Path("/proc/self/maps").exists():
        pytest.skip("needs ../shared/data and Linux")
    data = read_gguf(path).data[:1 << 20]  # the file's first MiB, mapped (the mapping starts on a page)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a read-only buffer: never written)
        mapped = torch.from_numpy(data)
    copy = mapped.clone()  # anonymous memory: MADV_DONTNEED there would zero it
    mappings = file_mappings([mapped, copy])
    assert len(mappings) == 1 and mappings[0][0] <= mapped.data_ptr() < mappings[0][1]
    assert release_pages([mapped, copy], mappings) == 1 << 20
    assert torch.equal(mapped, copy) and int(copy.sum()) > 0
    with mappings_snapshot():  # one read of the maps for a model's preparation; anonymous memory made since
        assert file_mappings([mapped]) == mappings and file_mappings([copy]) == []  # is read again: never a file's
        later = torch.ones(1 << 22, dtype=torch.uint8)
        assert file_mappings([later]) == [] and release_pages([later, copy]) == 0
    assert int(later.sum()) == 1 << 22 and torch.equal(mapped, copy)


def test_release_pages_of_a_private_writable_mapping_loses_nothing(tmp_path):
    """A writable private file mapping (safetensors maps its files so): its pages are given back by
    MADV_PAGEOUT, which drops a page never written (it reads back from the file) and keeps one written (no swap
    here: it stays, its new contents intact)."""
    import numpy as np
    import torch

    from hearth.quant.kernels.memory import file_mappings, release_pages

    import os

    release = tuple(int(part) for part in os.uname().release.split("-")[0].split(".")[:2] if part.isdigit())
    if not Path("/proc/self/maps").exists() or release < (5, 4):
        pytest.skip("needs Linux 5.4 or newer (MADV_PAGEOUT)")
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    mapped = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c"))  # MAP_PRIVATE, writable
    expected = mapped.clone()
    mapped[:4096] = 7  # one page written (copied on write: now anonymous memory of the mapping)
    expected[:4096] = 7
    assert len(file_mappings([mapped])) == 1 and file_mappings([expected]) == []
    assert release_pages([mapped]) == 1 << 20 and release_pages([expected]) == 0
    assert torch.equal(mapped, expected)
