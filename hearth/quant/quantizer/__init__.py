"""llama.cpp's quantizer searches in C++ (kquants.cpp, searches.h, iq4.h, grids.h, grid_quants.h, iq1.h):
float rows -> K-quant blocks (Q2_K .. Q6_K), IQ4_NL, IQ4_XS, the grid i-quants (IQ3_S, IQ3_XXS, IQ2_S,
IQ2_XS, IQ2_XXS, IQ1_S, IQ1_M; IQ2_XS, IQ2_XXS and IQ1_S only with an importance matrix, as
ggml_quantize_chunk demands), and the 32-value
formats Q4_0 .. Q5_1 when an importance matrix weighs the columns. The grids' points are gguf-py's.
The blocks equal llama.cpp's byte for byte (kquants.cpp says how). Built on first use (hearth.native)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from hearth.errors import ModelLoadError
from hearth.native import build

Q = GGMLQuantizationType
K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
GRID_QUANTS = (Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_S, Q.IQ2_XS, Q.IQ2_XXS, Q.IQ1_S, Q.IQ1_M)
# of those, the ones llama.cpp's quantizer refuses to write without an importance matrix (ggml_quantize_requires_imatrix)
NEEDS_IMATRIX = (Q.IQ2_XS, Q.IQ2_XXS, Q.IQ1_S)
SEARCHED = (*K_QUANTS, Q.IQ4_NL, Q.IQ4_XS, *GRID_QUANTS)  # the formats hearth's quantizer writes (see NEEDS_IMATRIX)
# the formats whose search an importance matrix changes (Q8_0's has no weighted search)
WEIGHTED = (*SEARCHED, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)


@functools.cache
def _module():
    module = build("hearth_quantizer", sorted(Path(__file__).parent.glob("*.cpp")), "the quantizer", seconds=20,
                   without="hearth cannot write K-quants", flags=("-ffp-contract=off",))
    if module is None:
        raise ModelLoadError("K-quants and importance-weighted quantization need hearth's C++ quantizer, "
                             "which could not be built here (a C++ compiler is needed)")
    return module


@functools.cache
def _module_for(qtype: GGMLQuantizationType):
    """The module, with `qtype`'s grid set up if it has one (its neighbour lists: once, well under a second)."""
    module = _module()
    if qtype in GRID_QUANTS:
        cls = getattr(gguf_quants, qtype.name)
        cls.init_grid()
        points = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
        levels = np.searchsorted(np.asarray(cls.grid_map, dtype=np.float32), points).astype(np.int8)
        module.set_grid(int(qtype), np.ascontiguousarray(levels).ctypes.data, levels.shape[0])
    return module


def quantize_rows(values: torch.Tensor, qtype: GGMLQuantizationType, importance: np.ndarray | None = None) -> np.ndarray:
    """float values [..., cols] -> uint8 [rows, bytes_per_row] of `qtype` blocks, as llama.cpp writes
    them. importance: float32 [cols] (or [experts, cols] for a 3-D expert stack) or None."""
    array = np.ascontiguousarray(values.detach().to("cpu", torch.float32).numpy())
    cols = array.shape[-1]
    rows = array.reshape(-1, cols)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if qtype not in WEIGHTED or (qtype not in SEARCHED and importance is None):
        raise ModelLoadError(f"hearth's quantizer has no {qtype.name} search{'' if importance is None else ' with an importance matrix'}")
    if qtype in NEEDS_IMATRIX and importance is None:
        raise ModelLoadError(f"{qtype.name} needs an importance matrix (as llama.cpp's quantizer does): "
                             "make one with `hearth imatrix` and pass it with --imatrix")
    if cols % block_size:
        raise ModelLoadError(f"cannot quantize to {qtype.name}: row length {cols} is not a multiple of {block_size}")
    out = np.empty((rows.shape[0], cols // block_size * type_size), dtype=np.uint8)
    if importance is None:
        _module_for(qtype).quantize_rows(rows.ctypes.data, out.ctypes.data, rows.shape[0], cols, int(qtype), 0,
                                torch.get_num_threads())
        return out
    weights = np.ascontiguousarray(importance, dtype=np.float32).reshape(-1, cols)
    per_matrix = rows.shape[0] // weights.shape[0]  # an expert stack: one row of weights per expert
    if per_matrix * weights.shape[0] != rows.shape[0]:
        raise ModelLoadError(f"importance matrix of shape {importance.shape} does not fit a tensor of shape {values.shape}")
    for m, w in enumerate(weights):
        part = slice(m * per_matrix, (m + 1) * per_matrix)
        _module_for(qtype).quantize_rows(rows[part].ctypes.data, out[part].ctypes.data, per_matrix, cols, int(qtype),
                                w.ctypes.data, torch.get_num_threads())
    return out
