"""Build hearth's C++ kernels on first use.

`build(name, source)` JIT-compiles one C++ file with PyTorch's extension tooling (gcc with
-march=native and OpenMP, cached under ~/.cache/torch_extensions, keyed by this CPU's
instruction sets and torch's version so that a machine never loads a build made for another)
and returns the module, or None where it cannot be built (no compiler, HEARTH_KERNELS=0, not
x86-64/arm64): callers then take their pure-torch path. The sources include no torch header,
so a build takes seconds; the Python side checks and allocates tensors and passes data pointers.
"""

from __future__ import annotations

import hashlib
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
    from torch.utils import cpp_extension

    key = hashlib.sha256(f"{_cpu_flags()}\n{torch.__version__}".encode()).hexdigest()[:12]
    try:
        return cpp_extension.load(
            name=f"{name}_{key}",
            sources=[str(source)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no headers, an unknown -march: the torch path still works
        message = str(e).strip().splitlines()
        log.warning("hearth: %s kernels could not be built (%s); using the slower torch path",
                    what, message[-1] if message else type(e).__name__)
        return None
