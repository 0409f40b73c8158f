"""Check a GGUF file's header against its size before gguf's reader parses it.

gguf.GGUFReader trusts the counts and lengths it reads: an array claiming 2^63 items reads past
the end of the file as empty values and loops for ever, and a count of tensors or keys far beyond
what the file holds builds Python objects until memory runs out. This walk reads only the counts,
lengths and type codes of the header (keys, values, tensor infos) and refuses any that cannot fit
in the bytes left, so that the reader then sees a header whose every part lies inside the file.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from gguf import GGUFValueType

from hearth.errors import ModelLoadError

_SCALAR_SIZES = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}
MAX_DIMS = 4  # ggml's tensors have at most 4 dimensions
SUPPORTED_VERSIONS = (2, 3)


class _Cursor:
    def __init__(self, data: mmap.mmap | bytes, where: str):
        self.data, self.offset, self.where = data, 0, where

    def take(self, size: int, what: str) -> int:
        """Advance over `size` bytes (refused if they run past the end); returns where they start."""
        start = self.offset
        if size < 0 or start + size > len(self.data):
            raise ModelLoadError(f"{self.where}: damaged or truncated GGUF file: {what} runs past the end of the file "
                                 f"(offset {start:,}, {size:,} bytes, file {len(self.data):,} bytes)")
        self.offset += size
        return start

    def unpack(self, fmt: str, what: str) -> int:
        return struct.unpack_from(fmt, self.data, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> None:
        self.take(self.unpack("<Q", f"{what}'s length"), what)

    def value_type(self, what: str) -> GGUFValueType:
        code = self.unpack("<I", f"{what}'s type")
        try:
            return GGUFValueType(code)
        except ValueError:
            raise ModelLoadError(f"{self.where}: damaged or truncated GGUF file: {what} has unknown type {code}") from None

    def value(self, kind: GGUFValueType, what: str) -> None:
        if kind in _SCALAR_SIZES:
            self.take(_SCALAR_SIZES[kind], what)
        elif kind == GGUFValueType.STRING:
            self.string(what)
        else:  # ARRAY: item type, count, items
            item = self.value_type(f"{what}'s items")
            count = self.unpack("<Q", f"{what}'s length")
            if item in _SCALAR_SIZES:
                self.take(count * _SCALAR_SIZES[item], what)
                return
            if item == GGUFValueType.ARRAY:  # no model file nests arrays, and unbounded nesting would recurse
                raise ModelLoadError(f"{self.where}: {what} is an array of arrays, which GGUF readers do not take")
            if count * 8 > len(self.data) - self.offset:  # a string takes 8 bytes at least
                raise ModelLoadError(f"{self.where}: damaged or truncated GGUF file: {what} claims {count:,} items, more "
                                     "than the file holds")
            self.strings(count, what)

    def strings(self, count: int, what: str) -> None:
        """`count` strings in a row: a vocabulary's 100,000 in a few tens of milliseconds."""
        data, offset, end, length = self.data, self.offset, len(self.data), struct.Struct("<Q")
        for _ in range(count):
            if offset + 8 > end:
                break
            offset += 8 + length.unpack_from(data, offset)[0]
        else:
            if offset <= end:
                self.offset = offset
                return
        raise ModelLoadError(f"{self.where}: damaged or truncated GGUF file: {what} runs past the end of the file")


def check_gguf_layout(path: Path, where: str) -> None:
    """Raise ModelLoadError unless every key, value and tensor info of the header fits in the file."""
    with open(path, "rb") as f:
        if path.stat().st_size == 0:
            raise ModelLoadError(f"{where}: empty file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(data, where)
            cursor.take(4, "the magic number")
            version = cursor.unpack("<I", "the version")
            if version not in SUPPORTED_VERSIONS:
                raise ModelLoadError(f"{where}: GGUF version {version} (hearth reads versions 2 and 3)")
            tensors = cursor.unpack("<Q", "the tensor count")
            keys = cursor.unpack("<Q", "the key count")
            if 12 * keys + 24 * tensors > len(data):  # the least a key and a tensor info take
                raise ModelLoadError(f"{where}: damaged or truncated GGUF file: {keys:,} keys and {tensors:,} tensors claimed, "
                                     "more than the file holds")
            for i in range(keys):
                cursor.string(f"key {i}")
                cursor.value(cursor.value_type(f"key {i}'s value"), f"key {i}'s value")
            for i in range(tensors):
                cursor.string(f"tensor {i}'s name")
                dims = cursor.unpack("<I", f"tensor {i}'s dimension count")
                if dims > MAX_DIMS:
                    raise ModelLoadError(f"{where}: damaged or truncated GGUF file: tensor {i} has {dims} dimensions "
                                         f"(at most {MAX_DIMS})")
                cursor.take(8 * dims + 4 + 8, f"tensor {i}'s shape, type and offset")
