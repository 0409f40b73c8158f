"""Build hearth's C++ kernels on first use.

`build(name, source)` JIT-compiles one C++ file with PyTorch's extension tooling (gcc with
-march=native and OpenMP) and returns the module, or None where it cannot be built (no compiler,
HEARTH_KERNELS=0, not x86-64/arm64): callers then take their pure-torch path. The sources include
no torch header, so a build takes seconds; the Python side checks and allocates tensors and passes
data pointers.

Each build has its own folder under ~/.cache/hearth/kernels (or $HEARTH_KERNELS_DIR), named by a
hash of the source, this CPU's instruction sets and torch's version: a machine never loads a build
made for another CPU or another source, and copies of the project with different sources (two
checkouts) do not rebuild over each other. A build already there is imported directly (a few
milliseconds); only a missing one pays for the extension tooling (setuptools, ninja) and gcc.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def build(name: str, source: Path, what: str):
    """The compiled module `name` from `source`, or None (logged once, naming `what` is slower)."""
    if os.environ.get("HEARTH_KERNELS", "1") == "0" or platform.machine().lower() not in (
        "x86_64", "amd64", "aarch64", "arm64"
    ):
        return None
    code = source.read_bytes()
    key = hashlib.sha256(f"{_cpu_flags()}\n{torch.__version__}\n".encode() + code).hexdigest()[:12]
    full_name = f"{name}_{key}"
    folder = _kernels_dir() / full_name
    built = _import_built(full_name, folder)
    if built is not None:
        return built
    from torch.utils import cpp_extension

    try:
        folder.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(
            name=full_name,
            sources=[str(source)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
    except Exception as e:  # no compiler, no headers, an unknown -march: the torch path still works
        message = str(e).strip().splitlines()
        log.warning("hearth: %s kernels could not be built (%s); using the slower torch path",
                    what, message[-1] if message else type(e).__name__)
        return None


def _kernels_dir() -> Path:
    if os.environ.get("HEARTH_KERNELS_DIR"):
        return Path(os.environ["HEARTH_KERNELS_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hearth" / "kernels"


def _import_built(full_name: str, folder: Path):
    """The module cpp_extension.load built in `folder` before, or None (not built, or unreadable:
    a build another process is still writing; then cpp_extension.load waits on its lock)."""
    library = folder / f"{full_name}.so"
    if not library.exists() or (folder / "lock").exists():
        return None
    spec = importlib.util.spec_from_file_location(full_name, library)
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError:
        return None
    return module
