"""The optional references a test may skip without: llama-cpp-python (not a test extra), and llama.cpp's
source tree for its converter (LLAMA_CPP_SOURCE)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest


@functools.cache
def _runs_here(probe: str) -> bool:
    # A wheel built for instructions this CPU lacks (AVX-512, say) dies with SIGILL when llama.cpp
    # starts, taking the test process with it: probed once, in a child process.
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def import_llama_cpp():
    """llama-cpp-python, or a skip when it is not installed or cannot run on this CPU."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    if not _runs_here("import llama_cpp; llama_cpp.llama_backend_init()"):
        pytest.skip("llama-cpp-python is installed but its build does not run on this CPU")
    return llama_cpp


def import_llama_mtmd():
    """llama-cpp-python's bindings of llama.cpp's multimodal library (llama_cpp.mtmd_cpp, libmtmd: MTMD_CPP_LIB names
    its folder), or a skip as import_llama_cpp's or where the build has no libmtmd."""
    import_llama_cpp()
    if not _runs_here("from llama_cpp import mtmd_cpp; mtmd_cpp.mtmd_context_params_default()"):
        pytest.skip("llama-cpp-python's mtmd library does not load here (MTMD_CPP_LIB: the folder of a libmtmd "
                    "built with the libllama that LLAMA_CPP_LIB_PATH names)")
    from llama_cpp import mtmd_cpp

    return mtmd_cpp


def llama_cpp_quantizer():
    """llama.cpp's own block quantizer, `quantize(values [rows, cols] float32, qtype, imatrix [cols]
    or None) -> uint8 [rows, bytes]` (ggml_quantize_chunk in the library llama-cpp-python loads),
    or a skip as import_llama_cpp's. The 1- and 2-bit i-quants take an importance matrix."""
    import ctypes

    import numpy as np
    from gguf import GGML_QUANT_SIZES

    llama_cpp = import_llama_cpp()
    ggml = ctypes.CDLL(str(Path(llama_cpp.llama_cpp._lib._name).with_name("libggml-base.so")))
    ggml.ggml_quantize_chunk.restype = ctypes.c_size_t
    ggml.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    ggml.ggml_quantize_init.argtypes = [ctypes.c_int]

    def quantize(values, qtype, imatrix=None):
        values = np.ascontiguousarray(values, dtype=np.float32)
        rows, cols = values.shape
        block, size = GGML_QUANT_SIZES[qtype]
        out = np.zeros((rows, cols // block * size), np.uint8)
        weights = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=np.float32)
        ggml.ggml_quantize_init(int(qtype))
        written = ggml.ggml_quantize_chunk(int(qtype), values.ctypes.data, out.ctypes.data, 0, rows, cols,
                                           None if weights is None else weights.ctypes.data)
        assert written == out.nbytes
        return out

    return quantize


def llama_cpp_source() -> Path:
    """The llama.cpp source tree LLAMA_CPP_SOURCE names (its convert_hf_to_gguf.py and conversion/, gguf-py/),
    or a skip where it is not set or holds no converter."""
    source = os.environ.get("LLAMA_CPP_SOURCE")
    if not source or not (Path(source) / "convert_hf_to_gguf.py").exists():
        pytest.skip("llama.cpp's converter is not at hand (LLAMA_CPP_SOURCE: a llama.cpp source tree)")
    return Path(source)
