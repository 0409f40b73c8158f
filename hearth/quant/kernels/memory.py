"""Give a memory-mapped weight's pages back once its contents live elsewhere (repacked).
A page of a file mapping that the process has read counts in its resident memory until the
mapping goes away, though the data is safe in the file. After the cpu backend's Int8Linear repacks a
weight (or HalfLinear lays a BF16 one out in pairs), `release_pages` drops those pages from this process:
from a read-only mapping (a GGUF file) with madvise(MADV_DONTNEED), the mapping staying valid (a later read
faults the page back in from the cache); from a writable private one (safetensors maps its files so) with
MADV_PAGEOUT, which drops a page the process never wrote and would only swap out one it did (no data lost
either way). Resident memory then holds the new copy alone. Anonymous memory is never touched: MADV_DONTNEED
there would discard data.
The mappings are found in /proc/self/maps, a few hundred lines in a process that imported torch
(~1-2 ms a read): a model's load reads it once for all its weights (`file_mappings`), not once a tensor.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import mmap
import sys
import threading

import torch

_MADV_DONTNEED, _MADV_PAGEOUT = 4, 21


def _on_linux_cpu(tensor: torch.Tensor) -> bool:
    return sys.platform.startswith("linux") and tensor.device.type == "cpu" and tensor.numel() > 0


def _read_maps() -> list[tuple[int, int, int]]:
    """Every mapping of this process: (start, end, the advice that gives its pages back: MADV_DONTNEED for a
    read-only file mapping, MADV_PAGEOUT for a writable private one, 0 for any other), by address ([] where
    /proc/self/maps cannot be read)."""
    spans = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                start, end = (int(v, 16) for v in fields[0].split("-"))
                file, perms = fields[4] != "0" and len(fields) >= 6, fields[1]
                advice = 0 if not file else _MADV_DONTNEED if "w" not in perms else _MADV_PAGEOUT if perms[3] == "p" else 0
                spans.append((start, end, advice))
    except OSError:
        return []
    return spans


_snapshot = threading.local()  # .spans: _read_maps() while a mappings_snapshot() is open on this thread


@contextlib.contextmanager
def mappings_snapshot():
    """Within it, on this thread, file_mappings answers from one read of /proc/self/maps, read again only
    for an address outside every mapping listed (one made since): a model's preparation releases each
    weight's pages as it repacks them, ~1-2 ms a read (SmolLM2: 121 reads, 0.17 s of its start). Mappings
    are not unmapped during it: the weights being prepared hold them."""
    _snapshot.spans = _read_maps()
    try:
        yield
    finally:
        _snapshot.spans = None


def file_mappings(tensors) -> list[tuple[int, int, int]]:
    """(start, end, advice) of the file mappings that hold any of `tensors` and can give pages back
    (_read_maps), by address, from one read of /proc/self/maps (or the open mappings_snapshot's; [] where it
    cannot be read). They stay valid while those tensors live."""
    addresses = sorted(t.data_ptr() for t in tensors if _on_linux_cpu(t))
    if not addresses:
        return []
    spans = getattr(_snapshot, "spans", None)
    if spans is None:
        spans = _read_maps()
    elif not all(any(start <= a < end for start, end, _ in spans) for a in addresses):
        spans = _snapshot.spans = _read_maps()
    found = []
    for start, end, advice in spans:
        i = bisect.bisect_left(addresses, start)
        if advice and i < len(addresses) and addresses[i] < end:
            found.append((start, end, advice))
    return found


def release_mappings(tensors) -> int:
    """Drop every resident page of the read-only file mappings that hold any of `tensors` (e.g. a GGUF file
    whose weights are about to be repacked, or were copied when reordered). Returns bytes advised away.
    The mappings stay valid: a later read faults its page back in from the page cache. (Not the writable
    private ones: MADV_PAGEOUT may evict a page from the cache, and weights read in place would come back from
    the disk; release_pages gives those back tensor by tensor, once copied.)"""
    return sum(_madvise(start, end, advice) for start, end, advice in file_mappings(tensors)
               if advice == _MADV_DONTNEED)


def _madvise(start: int, end: int, advice: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return end - start if libc.madvise(start, end - start, advice) == 0 else 0


def release_pages(tensors: list[torch.Tensor], mappings: list[tuple[int, int, int]] | None = None) -> int:
    """Give back the whole pages of each of `tensors` that is a view of a file mapping (file_mappings) from
    this process's resident memory. mappings: file_mappings of these tensors, read earlier while they lived
    (None: read now). Returns the bytes released."""
    mappings = file_mappings(tensors) if mappings is None else mappings
    page, released = mmap.PAGESIZE, 0
    for tensor in tensors:
        if not _on_linux_cpu(tensor):
            continue
        first = tensor.data_ptr()
        last = first + tensor.numel() * tensor.element_size()
        advice = next((a for start, end, a in mappings if start <= first and last <= end), 0)
        start, end = -(-first // page) * page, last // page * page
        if advice and end > start:
            released += _madvise(start, end, advice)
    return released
