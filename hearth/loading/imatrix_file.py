"""llama.cpp's importance-matrix files: what `llama-imatrix` writes and `llama-quantize --imatrix` reads.

The GGUF format (llama-imatrix's default since 2025, the one written here): general.type "imatrix",
imatrix.datasets (the text files), imatrix.chunk_count and imatrix.chunk_size, and per weight W two
F32 tensors: "W.in_sum2" [matrices, columns] (the sum over tokens of each input column's squared
activation; an expert stack has one row per expert) and "W.counts" [matrices, 1] (the tokens each
row summed). The legacy .dat format (read only): int32 entries, then per entry int32 name length,
the name, int32 ncall, int32 nval and nval float32 (the mean times ncall); then optionally int32
chunks and a dataset name. Readers divide: the importance of a column is its mean squared
activation (a matrix no token reached gets ones), as llama-quantize does.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter

from hearth.errors import ModelLoadError


@dataclass
class ImportanceSums:
    """Per weight name: float64 sums [matrices, columns] and token counts [matrices]."""

    sums: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, np.ndarray] = field(default_factory=dict)
    chunks: int = 0
    chunk_size: int = 0
    datasets: list[str] = field(default_factory=list)


def write_imatrix(path: str | Path, data: ImportanceSums) -> Path:
    """The GGUF imatrix file at `path` (returned), tensors in name order as llama-imatrix writes them."""
    path = Path(path)
    writer = GGUFWriter(None, "")
    writer.kv_data[0].pop("general.architecture", None)  # an imatrix file names no architecture
    writer.add_type("imatrix")
    writer.add_array("imatrix.datasets", data.datasets)
    writer.add_uint32("imatrix.chunk_count", data.chunks)
    writer.add_uint32("imatrix.chunk_size", data.chunk_size)
    for name in sorted(data.sums):
        sums = np.asarray(data.sums[name], dtype=np.float32)
        writer.add_tensor(f"{name}.in_sum2", sums.reshape(-1, sums.shape[-1]))
        writer.add_tensor(f"{name}.counts", np.asarray(data.counts[name], dtype=np.float32).reshape(-1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_imatrix(path: str | Path) -> dict[str, np.ndarray]:
    """Each weight's importance, float32 [matrices * columns], from a GGUF or legacy .dat imatrix."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return _read_gguf(path) if magic == b"GGUF" else _read_legacy(path.read_bytes())
    except (ValueError, struct.error, UnicodeDecodeError, KeyError) as e:
        raise ModelLoadError(f"{path}: not an importance matrix llama.cpp writes ({e})") from None


def _read_gguf(path: Path) -> dict[str, np.ndarray]:
    reader = GGUFReader(path)
    tensors = {t.name: np.asarray(t.data, dtype=np.float32) for t in reader.tensors}
    out = {}
    for key, sums in tensors.items():
        if not key.endswith(".in_sum2"):
            continue
        name = key.removesuffix(".in_sum2")
        if f"{name}.counts" not in tensors:
            raise ValueError(f"{name} has sums but no counts")
        counts = tensors[f"{name}.counts"].reshape(-1)
        sums = sums.reshape(len(counts), -1)
        means = np.ones_like(sums)
        reached = counts > 0
        means[reached] = sums[reached] / counts[reached, None].astype(np.float32)
        out[name] = means.reshape(-1)
    if not out:
        raise ValueError("no .in_sum2 tensors")
    return out


def _read_legacy(data: bytes) -> dict[str, np.ndarray]:
    (entries,), pos = struct.unpack_from("<i", data), 4
    if entries < 1:
        raise ValueError("no entries")
    out = {}
    for _ in range(entries):
        (length,) = struct.unpack_from("<i", data, pos)
        name = data[pos + 4:pos + 4 + length].decode()
        ncall, nval = struct.unpack_from("<ii", data, pos + 4 + length)
        pos += 12 + length
        values = np.frombuffer(data, np.float32, nval, pos).copy()
        pos += 4 * nval
        out[name] = values / ncall if ncall > 0 else values
    return out
