"""The optional reference a test may skip without: llama-cpp-python (not a test extra)."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest


@functools.cache
def _llama_cpp_runs_here() -> bool:
    # A wheel built for instructions this CPU lacks (AVX-512, say) dies with SIGILL when llama.cpp
    # starts, taking the test process with it: probed once, in a child process.
    probe = "import llama_cpp; llama_cpp.llama_backend_init()"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def import_llama_cpp():
    """llama-cpp-python, or a skip when it is not installed or cannot run on this CPU."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    if not _llama_cpp_runs_here():
        pytest.skip("llama-cpp-python is installed but its build does not run on this CPU")
    return llama_cpp
