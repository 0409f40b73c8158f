"""Compiled CPU kernels for quantized matmul, built on first use (hearth.native).

`extension()` returns `Kernels`, or None where the C++ sources beside this file (qmatmul.h says
which does what) cannot be built: callers then take the pure-torch path. This module checks and
allocates the tensors and hands the kernels their data pointers.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from hearth.native import build, cpu_has

_SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
Q = GGMLQuantizationType
# the grid i-quants: the int8 kernels read them as nibble blocks of 4- or 3-bit codes (`grid_nibbles`)
GRID_FORMATS = (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M)
# the 32-value formats, IQ4_XS, Q4_K and Q5_K: on AVX2 builds repacked at load into groups of 8 rows (`rows8_repack`),
# int8_matmul's type for them ROWS8 + the format's (formats.h)
ROWS8_QTYPES = (Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q8_0)
ROWS8 = 1000
# half_matmul's type for BF16 weights laid out as pairs of 16 rows (formats.h, bf16_pairs.py)
BF16_PAIRS = 900


class Kernels:
    """Checked entry points into the compiled module. Weights: uint8 [N, bytes_per_row], contiguous,
    GGUF blocks of `qtype` (a GGMLQuantizationType value, F16 and BF16 included)."""

    def __init__(self, module):
        self.module = module
        self.avx512 = module.has_avx512()
        self.vnni = module.has_vnni()
        # int8_matmul's code paths in this build, fastest first (e.g. avx512-vnni, avx2, portable)
        self.int8_paths: dict[str, int] = dict(module.int8_paths())
        for qtype in GRID_FORMATS[:-1]:  # their grids, from gguf-py (formats.h: GridTables; IQ1_M's is IQ1_S's)
            cls = getattr(gguf_quants, qtype.name)
            cls.init_grid()
            values = np.ascontiguousarray(np.asarray(cls.grid).reshape(-1), dtype=np.int8)
            module.set_grid(int(qtype), values.ctypes.data, values.nbytes)

    def _check(self, x: torch.Tensor, w: torch.Tensor, qtype: int, n: int,
               dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> tuple[torch.Tensor, int]:
        if x.dtype not in dtypes or x.dim() != 2 or x.device.type != "cpu":
            raise ValueError(f"x: {' or '.join(str(d).removeprefix('torch.') for d in dtypes)} CPU tensor [M, K] expected")
        if w.dtype != torch.uint8 or w.dim() != 2 or w.shape[0] != n or not w.is_contiguous() or w.device.type != "cpu":
            raise ValueError(f"weight: contiguous uint8 CPU tensor [{n}, bytes_per_row] expected")
        k = x.shape[1]
        if k % self.module.block_values(qtype):
            raise ValueError(f"K={k} is not a multiple of the block size")
        return x.contiguous(), k

    def half_matmul(self, x: torch.Tensor, w: torch.Tensor, qtype: int, n: int, portable: bool = False) -> torch.Tensor:
        """x [M, K] W^T -> float32 [M, n] for F16 / BF16 W (rows) or BF16_PAIRS W (bf16_pairs.py's layout),
        any M. x float32: exact up to summation order, but against BF16_PAIRS from `half_bf16_min_rows()`
        rows (where not 0; not `portable`) rounded to bf16 first. x bfloat16 (bf16 compute): the same fp32
        products (exact for bf16 x bf16)."""
        rows = -(-n // 16) if qtype == BF16_PAIRS else n  # BF16_PAIRS: groups of 16 rows (bf16_pairs.py)
        x, k = self._check(x, w, qtype, rows, (torch.float32, torch.bfloat16))
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        self.module.half_matmul(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], n, k, w.shape[1], int(qtype),
                                x.dtype == torch.bfloat16, portable, torch.get_num_threads())
        return y

    def sparse_matmul(self, x: torch.Tensor, wt: torch.Tensor, threshold: float) -> torch.Tensor:
        """mask(x) [M, K] @ wt [K, N] -> float32 [M, N], mask(x) = x where |x| >= threshold else 0;
        wt: W transposed, float32, float16 or bfloat16, contiguous. Reads only wt's rows (W's
        columns) that some row of mask(x) needs."""
        qtypes = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}
        if x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu":
            raise ValueError("x: float32 CPU tensor [M, K] expected")
        if (wt.dtype not in qtypes or wt.dim() != 2 or wt.shape[0] != x.shape[1] or not wt.is_contiguous()
                or wt.device.type != "cpu"):
            raise ValueError(f"wt: contiguous float32/float16/bfloat16 CPU tensor [{x.shape[1]}, N] expected")
        x = x.contiguous()
        y = torch.empty(x.shape[0], wt.shape[1], dtype=torch.float32)
        self.module.sparse_matmul(x.data_ptr(), wt.data_ptr(), y.data_ptr(), x.shape[0], wt.shape[1], x.shape[1],
                                  qtypes[wt.dtype], float(threshold), torch.get_num_threads())
        return y

    def sparse_repack(self, w: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor | None:
        """Blocks [n, bytes_per_row] -> uint8 [bytes]: sparse_blocks.cpp's column-major layout, which
        `sparse_matmul` with this qtype reads; None for a format it has no layout for or an n that is
        no multiple of 64."""
        self._check(torch.empty(0, k), w, qtype, n)
        try:
            size = self.module.sparse_blocks_bytes(int(qtype), n, k)
        except ValueError:
            return None
        out = torch.empty(size, dtype=torch.uint8)
        self.module.sparse_repack(w.data_ptr(), out.data_ptr(), n, k, w.shape[1], int(qtype), torch.get_num_threads())
        return out

    def int8_matmul(self, x: torch.Tensor, w: torch.Tensor, qtype: int, n: int, path: str | None = None) -> torch.Tensor:
        """x [M, K] W^T with W's blocks read in place and x rounded to int8 per block of the format
        (llama.cpp's q8_K for K-quants, q8_0 for the 32-value formats); block formats only, the grid
        formats as `grid_nibbles` writes them (with its type). `path`: one of `int8_paths` (default: the fastest)."""
        x, k = self._check(x, w, qtype, n)
        if path is not None and path not in self.int8_paths:
            raise ValueError(f"path {path!r}: this build has {', '.join(self.int8_paths)}")
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        self.module.int8_matmul(x.data_ptr(), w.data_ptr(), 0, y.data_ptr(), x.shape[0], n, k, int(qtype),
                                self.int8_paths[path] if path else 0, torch.get_num_threads())
        return y

    def grid_nibbles(self, w: torch.Tensor, qtype: int, n: int, k: int) -> tuple[torch.Tensor, int]:
        """Blocks [n, bytes_per_row] of a grid format (GRID_FORMATS) -> (nibble blocks uint8
        [n, k / 256 * 148] with 4-bit codes (IQ3_*), [n, k / 256 * 116] with 3-bit ones (IQ2_*, IQ1_*),
        their type for `int8_matmul` / `dequantize_rows`): the same weights (formats.h's Nibbles),
        read about as fast as Q4_K."""
        self._check(torch.empty(0, k), w, qtype, n)
        nibble_type = self.module.nibble_type(int(qtype))
        out = torch.empty(n, k // 256 * self.module.block_bytes(nibble_type), dtype=torch.uint8)
        self.module.grid_nibbles(w.data_ptr(), out.data_ptr(), n, k, w.shape[1], int(qtype), torch.get_num_threads())
        return out, nibble_type

    def rows8_repack(self, w: torch.Tensor, qtype: int, n: int, k: int) -> tuple[torch.Tensor, int]:
        """Blocks [n, bytes_per_row] of a ROWS8_QTYPES format (AVX2 builds) -> (groups of 8 rows uint8
        [ceil(n / 8), rows8_bytes(qtype, k)], their type for `int8_matmul`): rows8.cpp's layout."""
        self._check(torch.empty(0, k), w, qtype, n)
        out = torch.empty(-(-n // 8), self.module.rows8_bytes(int(qtype), k), dtype=torch.uint8)
        self.module.rows8_repack(w.data_ptr(), out.data_ptr(), n, k, int(qtype), torch.get_num_threads())
        return out, ROWS8 + int(qtype)

    def rows8_blocks(self, groups: torch.Tensor, kernel_qtype: int, n: int, k: int) -> torch.Tensor:
        """Groups of 8 rows (rows8_repack's, of a weight [n, k]) -> the GGUF blocks uint8 [n, bytes_per_row]
        they were repacked from, byte for byte."""
        qtype = kernel_qtype - ROWS8
        if groups.dtype != torch.uint8 or not groups.is_contiguous() or groups.shape != (-(-n // 8), self.module.rows8_bytes(qtype, k)):
            raise ValueError(f"groups: contiguous uint8 [{-(-n // 8)}, {self.module.rows8_bytes(qtype, k)}] expected")
        out = torch.empty(n, k // self.module.block_values(qtype) * self.module.block_bytes(qtype), dtype=torch.uint8)
        self.module.rows8_blocks(groups.data_ptr(), out.data_ptr(), n, k, qtype, torch.get_num_threads())
        return out

    def repack(self, w: torch.Tensor, qtype: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks [n, bytes_per_row] of any block format but TQ2_0 -> the packed tiles `packed_matmul`
        reads (32 rows each; packed.h): (codes, terms), uint8 [tiles, bytes per tile]."""
        self._check(torch.empty(0, k), w, qtype, n)
        code_bytes, term_bytes = self.module.packed_bytes(int(qtype), k)
        tiles = -(-n // 32)
        codes = torch.empty(tiles, code_bytes, dtype=torch.uint8)
        terms = torch.empty(tiles, term_bytes, dtype=torch.uint8)
        self.module.repack(w.data_ptr(), codes.data_ptr(), terms.data_ptr(), n, k, w.shape[1], int(qtype),
                           torch.get_num_threads())
        return codes, terms

    def _check_packed(self, codes: torch.Tensor, terms: torch.Tensor, qtype: int, k: int) -> None:
        sizes = self.module.packed_bytes(int(qtype), k)
        for array, size in zip((codes, terms), sizes):
            if (array.dtype != torch.uint8 or array.dim() != 2 or array.shape != (codes.shape[0], size)
                    or not array.is_contiguous() or array.device.type != "cpu"):
                raise ValueError(f"packed weight: contiguous uint8 CPU tensors [tiles, {sizes}] expected")

    def packed_matmul(self, x: torch.Tensor, codes: torch.Tensor, terms: torch.Tensor, qtype: int, n: int,
                      portable: bool = False) -> torch.Tensor:
        """x [M, K] W^T, W packed; x rounded to int8 per block of the format (q8_K / q8_0)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu":
            raise ValueError("x: float32 CPU tensor [M, K] expected")
        x = x.contiguous()
        k = x.shape[1]
        if k % self.module.block_values(int(qtype)) or codes.shape[0] != -(-n // 32):
            raise ValueError("packed weight does not match x")
        self._check_packed(codes, terms, qtype, k)
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        self.module.packed_matmul(x.data_ptr(), codes.data_ptr(), terms.data_ptr(), y.data_ptr(), x.shape[0], n, k,
                                  int(qtype), portable, torch.get_num_threads())
        return y

    def dequantize_packed(self, codes: torch.Tensor, terms: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
        """Packed tiles -> float32 [32 x tiles, k] (bit-exact as `dequantize_rows`; padding rows zero)."""
        self._check_packed(codes, terms, qtype, k)
        out = torch.empty(32 * codes.shape[0], k, dtype=torch.float32)
        self.module.dequantize_packed(codes.data_ptr(), terms.data_ptr(), out.data_ptr(), codes.shape[0], k,
                                      int(qtype), torch.get_num_threads())
        return out

    def dequantize_rows(self, w: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
        """W as fp32 [N, k] (the kernels' own decoding, to test against hearth.quant.formats)."""
        self._check(torch.empty(0, k), w, qtype, w.shape[0])
        out = torch.empty(w.shape[0], k, dtype=torch.float32)
        self.module.dequantize_rows(w.data_ptr(), out.data_ptr(), w.shape[0], k, w.shape[1], int(qtype),
                                    torch.get_num_threads())
        return out


@functools.cache
def extension() -> Kernels | None:
    """The compiled kernels, or None (then callers take the pure-torch path)."""
    # (-march=native: with AVX-512 VNNI the packed tiles' paths compile too, packed_matmul.cpp alone 136 s on
    # an Intel Xeon, 2026-11-27; 30 s in all on a 2-core AMD EPYC with AVX2)
    module = build("hearth_qmatmul", _SOURCES, "quantized matmul", seconds=150 if cpu_has("avx512_vnni") else 30,
                   without="quantized layers dequantize their weights in torch instead (slower)")
    return Kernels(module) if module is not None else None
