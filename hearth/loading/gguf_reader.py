"""Read a GGUF file's header (metadata and tensor table) in one pass over its bytes.

gguf.GGUFReader builds a numpy view of every value, which takes seconds on a real vocabulary
(SmolLM2's header holds ~100k strings): too slow for a command's start. This reads the same
header with `struct` and maps the tensor data once, read-only; tests/test_gguf_reader.py checks it
against GGUFReader. Layout (GGUF v2/v3, little-endian): magic, version u32, tensor count u64,
key-value count u64, the key-values, the tensor infos, padding to `general.alignment`, the data.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from hearth.errors import ModelLoadError

# GGUF value types -> struct formats (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
MAX_DIMS = 4  # ggml's tensors have at most 4 dimensions


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's order: ne0 (the columns) first
    offset: int  # from the start of the file
    nbytes: int


@dataclass
class GGUFFile:
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data: np.ndarray  # uint8, the whole file, memory-mapped read-only

    def tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        return self.data[info.offset:info.offset + info.nbytes]


class _Cursor:
    def __init__(self, buf) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row, in one loop with its lookups held in locals: a vocabulary's
        tokens and merges are ~100k strings, a visible share of a command's start."""
        buf, pos, size, unpack = self.buf, self.pos, len(self.buf), _U64.unpack_from
        out = []
        append = out.append
        for _ in range(count):
            (n,) = unpack(buf, pos)
            if pos + 8 + n > size:
                raise ValueError(f"a string of {n:,} bytes at offset {pos:,} runs past the end of the file")
            pos += 8
            append(str(buf[pos:pos + n], "utf-8"))
            pos += n
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, n = self.unpack("<IQ")
            if item == _ARRAY:  # no model file nests arrays, and unbounded nesting would recurse
                raise ValueError("an array of arrays")
            if item == _STRING:
                if 8 * n > len(self.buf) - self.pos:  # a string takes 8 bytes at least
                    raise ValueError(f"an array claims {n:,} strings, more than the file holds")
                return self.strings(n)
            dtype = np.dtype(_SCALARS[item])
            values = np.frombuffer(self.buf, dtype, n, self.pos).tolist()
            self.pos += n * dtype.itemsize
            return values
        return self.unpack(_SCALARS[kind])[0]


def read_gguf(path: str | Path) -> GGUFFile:
    """The header of the GGUF file at `path`; its bytes mapped, not read. ModelLoadError when it
    is not a GGUF file or is damaged."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                f.seek(0)
                raise ModelLoadError(f"{path}: not a GGUF file (starts with {f.read(4)!r}, expected b'GGUF')")
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return _parse(mapped)
    except (struct.error, KeyError, ValueError, IndexError, UnicodeDecodeError, OverflowError) as e:
        raise ModelLoadError(f"{path}: damaged or truncated GGUF file ({type(e).__name__}: {e})") from None


def _parse(mapped: mmap.mmap) -> GGUFFile:
    cursor = _Cursor(mapped)
    _, version, tensor_count, kv_count = cursor.unpack("<4sIQQ")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}, expected 2 or 3 (little-endian)")
    if 12 * kv_count + 24 * tensor_count > len(mapped):  # the least a key and a tensor info take
        raise ValueError(f"{kv_count:,} keys and {tensor_count:,} tensors claimed, more than the file holds")
    metadata = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I")[0])
    layout = []
    for _ in range(tensor_count):
        name = cursor.string()
        (n_dims,) = cursor.unpack("<I")
        if n_dims > MAX_DIMS:
            raise ValueError(f"tensor {name} has {n_dims} dimensions (ggml has at most {MAX_DIMS})")
        shape = cursor.unpack(f"<{n_dims}Q")
        qtype, offset = cursor.unpack("<IQ")
        layout.append((name, shape, GGMLQuantizationType(qtype), offset))
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    start = -(-cursor.pos // alignment) * alignment
    tensors = []
    for name, shape, qtype, offset in layout:
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        nbytes = math.prod(shape) // block * block_bytes  # Python ints: no overflow to a small size
        if start + offset + nbytes > len(mapped):
            raise ValueError(f"tensor {name} ends past the end of the file")
        tensors.append(TensorInfo(name, qtype, tuple(shape), start + offset, nbytes))
    return GGUFFile(metadata, tensors, np.frombuffer(mapped, dtype=np.uint8))
