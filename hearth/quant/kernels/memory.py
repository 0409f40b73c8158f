"""Give a memory-mapped weight's pages back once its contents live elsewhere (repacked).

A page of a file mapping that the process has read counts in its resident memory until the
mapping goes away, though the data is safe in the page cache. After the cpu backend's Int8Linear repacks a
weight, `release_pages` drops those pages from this process with madvise(MADV_DONTNEED): the
mapping stays valid (a later read faults the page back in from the cache), and resident memory
holds the packed copy alone. Only file-backed, read-only mappings are touched: on anonymous
memory MADV_DONTNEED would discard data.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

_MADV_DONTNEED = 4


def _file_mapping(address: int) -> tuple[int, int] | None:
    """(start, end) of the read-only file mapping holding `address`, or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                start, end = (int(v, 16) for v in fields[0].split("-"))
                if start <= address < end:
                    perms, inode = fields[1], fields[4]
                    return (start, end) if "w" not in perms and inode != "0" and len(fields) >= 6 else None
    except OSError:
        return None
    return None


def release_mappings(tensors) -> int:
    """Drop every resident page of the read-only file mappings that hold any of `tensors` (e.g. a
    GGUF file whose weights are about to be repacked, or were copied when reordered). Returns bytes
    advised away. The mappings stay valid: a later read faults its page back in."""
    seen: set[tuple[int, int]] = set()
    released = 0
    for tensor in tensors:
        if not sys.platform.startswith("linux") or tensor.device.type != "cpu" or tensor.numel() == 0:
            continue
        mapping = _file_mapping(tensor.data_ptr())
        if mapping is None or mapping in seen:
            continue
        seen.add(mapping)
        released += _madvise_dontneed(*mapping)
    return released


def _madvise_dontneed(start: int, end: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return end - start if libc.madvise(start, end - start, _MADV_DONTNEED) == 0 else 0


def release_pages(tensor: torch.Tensor) -> int:
    """Drop the whole pages of `tensor` (a view of a read-only file mapping) from this process's
    resident memory. Returns the bytes released (0 where the memory is not such a mapping)."""
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu" or tensor.numel() == 0:
        return 0
    first = tensor.data_ptr()
    last = first + tensor.numel() * tensor.element_size()
    mapping = _file_mapping(first)
    if mapping is None or last > mapping[1]:
        return 0
    page = mmap.PAGESIZE
    start, end = -(-first // page) * page, last // page * page
    if end <= start:
        return 0
    return _madvise_dontneed(start, end)
