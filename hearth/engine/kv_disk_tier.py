"""The disk tier under the prefix cache: full KV blocks the cache evicts, one file each. No tensors.

A file is named by its block's content hash (BlockManager's chain over token ids, seeded with the
model's identity, so one prefix's blocks have one name across restarts) and holds the block's K/V
as bytes (the runner's layout, hearth/engine/runner.py). Its header carries a magic, the identity
of the model and cache it was written for (a hash of the model's path, size and config, the KV
dtype, the block size and the layer count), the payload's length and its SHA-256: a truncated,
corrupted or foreign file is skipped with a warning and removed, never loaded. Files past the size
bound are removed least recently used first (a hit counts as a use; after a restart, by mtime).
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import time
from collections import OrderedDict
from pathlib import Path

from hearth.engine.kv_tiers import TierCounts

logger = logging.getLogger("hearth")

MAGIC = b"HEARTHKV"
_HEADER = struct.Struct("<8s32sQ32s")  # magic, identity, payload bytes, SHA-256 of the payload
SUFFIX = ".kv"


class DiskTier:
    def __init__(self, directory: str | Path, max_bytes: int, identity: bytes, payload_bytes: int):
        """identity: 32 bytes naming the model and cache layout; payload_bytes: one block's K/V."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.identity, self.payload_bytes = max_bytes, identity, payload_bytes
        self.counts = TierCounts()
        self._files: OrderedDict[bytes, int] = OrderedDict()  # block hash -> file bytes, least recently used first
        found = []
        for path in self.directory.glob("*" + SUFFIX):
            try:
                found.append((path.stat().st_mtime, bytes.fromhex(path.stem), path.stat().st_size))
            except (ValueError, OSError):  # not one of ours, or gone meanwhile
                continue
        for _, block_hash, size in sorted(found):
            self._files[block_hash] = size
        self.total_bytes = sum(self._files.values())
        self._trim()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._files

    def read(self, block_hash: bytes) -> bytes | None:
        """The block's payload, checked; None (a warning, the file removed) when it is unusable."""
        start = time.perf_counter()
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
        except OSError as e:
            return self._skip(block_hash, f"unreadable ({e})")
        if len(data) < _HEADER.size:
            return self._skip(block_hash, "truncated header")
        magic, identity, size, digest = _HEADER.unpack_from(data)
        payload = data[_HEADER.size:]
        if magic != MAGIC:
            return self._skip(block_hash, "not a hearth KV block")
        if identity != self.identity or size != self.payload_bytes:
            return self._skip(block_hash, "written for another model or cache layout")
        if len(payload) != size:
            return self._skip(block_hash, f"truncated ({len(payload)} of {size} bytes)")
        if hashlib.sha256(payload).digest() != digest:
            return self._skip(block_hash, "checksum mismatch")
        self._files.move_to_end(block_hash)
        os.utime(path)  # its place in the LRU order after a restart
        self.counts.hits += 1
        self.counts.bytes_read += len(data)
        self.counts.read_seconds += time.perf_counter() - start
        return payload

    def touch(self, block_hash: bytes) -> bool:
        """Mark a block used; whether the tier holds it."""
        if block_hash not in self._files:
            return False
        self._files.move_to_end(block_hash)
        return True

    def write(self, block_hash: bytes, payload: bytes) -> None:
        """Store a block (a block already stored is only marked used), then keep under the bound."""
        if self.touch(block_hash):
            return
        start = time.perf_counter()
        header = _HEADER.pack(MAGIC, self.identity, len(payload), hashlib.sha256(payload).digest())
        path = self._path(block_hash)
        partial = path.with_suffix(".partial")
        try:
            with open(partial, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(partial, path)  # a reader never sees half a file under the real name
        except OSError as e:
            logger.warning("kv disk tier: block %s not written: %s", block_hash.hex(), e)
            return
        size = len(header) + len(payload)
        self._files[block_hash] = size
        self.total_bytes += size
        self.counts.blocks_written += 1
        self.counts.bytes_written += size
        self.counts.write_seconds += time.perf_counter() - start
        self._trim()

    def _trim(self) -> None:
        while self.total_bytes > self.max_bytes and self._files:
            self._remove(next(iter(self._files)))

    def _skip(self, block_hash: bytes, why: str) -> None:
        logger.warning("kv disk tier: %s skipped: %s", self._path(block_hash), why)
        self.counts.skipped += 1
        self._remove(block_hash)
        return None

    def _remove(self, block_hash: bytes) -> None:
        self.total_bytes -= self._files.pop(block_hash, 0)
        self._path(block_hash).unlink(missing_ok=True)

    def _path(self, block_hash: bytes) -> Path:
        return self.directory / (block_hash.hex() + SUFFIX)
