"""The disk tier under the prefix cache: full KV blocks the cache evicts, one file each. No tensors.

A file is named by its block's content hash (BlockManager's chain over token ids, seeded with the
model's identity, so one prefix's blocks have one name across restarts) and holds the block's K/V
as bytes (the runner's layout, hearth/engine/runner.py). Its header carries a magic, the identity
of the model and cache it was written for (a hash of the model's path, size and config, the KV
dtype, the block size and the layer count), the payload's length and its SHA-256: a truncated,
corrupted or foreign file is skipped with a warning and removed, never loaded. Files past the size
bound are removed least recently used first (a hit counts as a use; after a restart, by mtime).

The engine's step only hands a block's bytes over: a writer thread hashes and writes each file (under a
temporary name, then renamed, so that no reader sees half of one), oldest first. Until its file is
complete a block is found in the queue (lookups, reads and uses see it there); the queue is bounded in
bytes (past it the oldest queued block is dropped, counted, never waited for: a disk slower than the
evictions loses blocks, not time). The thread ends when the queue stays empty WRITER_IDLE_SECONDS, at
once on close() (which writes the queue out first), and is not a daemon: the interpreter's exit waits
for the queue to be written.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import struct
import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

from hearth.engine.kv_tiers import TierCounts

if TYPE_CHECKING:
    from hearth.kv_format import Payload

logger = logging.getLogger("hearth")

MAGIC = b"HEARTHKV"
_HEADER = struct.Struct("<8s32sQ32s")  # magic, identity, payload bytes, SHA-256 of the payload
SUFFIX = ".kv"
QUEUE_BYTES = 256 << 20  # the most the writer's queue holds (at most the tier's bound)
WRITER_IDLE_SECONDS = 0.5  # how long the writer thread waits for another block before it ends


class DiskTier:
    def __init__(self, directory: str | Path, max_bytes: int, identity: bytes, payload_bytes: int,
                 queue_bytes: int = QUEUE_BYTES):
        """identity: 32 bytes naming the model and cache layout; payload_bytes: one block's K/V; queue_bytes:
        the bound of the blocks waiting for the writer thread."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.identity, self.payload_bytes = max_bytes, identity, payload_bytes
        self.queue_bytes = min(queue_bytes, max_bytes)
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
        # the writer's: every field below and the ones above are read and changed under the lock
        self._lock = threading.Condition()
        self._queued: OrderedDict[bytes, Payload] = OrderedDict()  # blocks to write, oldest first
        self._queued_bytes = 0
        self._writing: tuple[bytes, Payload] | None = None  # the block the writer is hashing and writing
        self._writer: threading.Thread | None = None  # the last one started
        self._writer_running = self._closing = False
        # queued blocks are written before the process ends, also where it ends without the interpreter's
        # teardown (hearth generate / chat: cli._exit_at_once runs the exit handlers, not thread joins)
        atexit.register(_close_if_alive, weakref.ref(self))

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._files or self._pending(block_hash) is not None

    def totals(self) -> TierCounts:
        """The counts as of now (the writer thread adds to them)."""
        with self._lock:
            return self.counts.copy()

    def read(self, block_hash: bytes) -> Payload | None:
        """The block's payload, from the queue or its file, checked; None (a warning, the file removed) when it
        is unusable."""
        start = time.perf_counter()
        with self._lock:
            payload = self._pending(block_hash)
            if payload is not None:
                size = len(payload)
            elif block_hash in self._files and (found := self._read_file(block_hash)) is not None:
                size, payload = found
            else:  # (unusable; or removed since the caller found it, past the bound)
                return None
            self.counts.hits += 1
            self.counts.bytes_read += size
            self.counts.read_seconds += time.perf_counter() - start
            return payload

    def _read_file(self, block_hash: bytes) -> tuple[int, memoryview] | None:
        """(lock held) The file's bytes and its checked payload; None where it is unusable (skipped)."""
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
        except OSError as e:
            return self._skip(block_hash, f"unreadable ({e})")
        if len(data) < _HEADER.size:
            return self._skip(block_hash, "truncated header")
        magic, identity, size, digest = _HEADER.unpack_from(data)
        payload = memoryview(data)[_HEADER.size:]
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
        return len(data), payload

    def touch(self, block_hash: bytes) -> bool:
        """Mark a block used; whether the tier holds it (written or queued)."""
        with self._lock:
            return self._touch(block_hash)

    def _touch(self, block_hash: bytes) -> bool:
        if block_hash in self._files:
            self._files.move_to_end(block_hash)
            return True
        return self._pending(block_hash) is not None

    def _pending(self, block_hash: bytes) -> Payload | None:
        """(lock held) The payload of a block queued or being written."""
        if self._writing is not None and self._writing[0] == block_hash:
            return self._writing[1]
        return self._queued.get(block_hash)

    def write(self, block_hash: bytes, payload: Payload, wait: bool = False) -> None:
        """Queue a block for the writer thread (one already stored or queued is only marked used). Past the
        queue's bound the oldest queued blocks are dropped (counts.dropped); with wait (a shutdown's save, not a
        step) this waits for room instead."""
        with self._lock:
            if self._touch(block_hash):
                return
            if not self._writer_running:
                self._writer_running = True
                self._writer = threading.Thread(target=self._write_queued, name="hearth-kv-disk-writer")
                self._writer.start()  # (it waits for the lock, then finds this block)
            if wait:
                self._lock.wait_for(lambda: not self._queued or self._queued_bytes + len(payload) <= self.queue_bytes)
            self._queued[block_hash] = payload
            self._queued_bytes += len(payload)
            while self._queued_bytes > self.queue_bytes and len(self._queued) > 1:
                self._queued_bytes -= len(self._queued.popitem(last=False)[1])
                self.counts.dropped += 1
            self._lock.notify_all()

    def close(self) -> None:
        """Write every queued block, then end the writer thread (a later write starts another)."""
        with self._lock:
            writer, self._closing = self._writer, True
            self._lock.notify_all()
        if writer is not None:
            writer.join()
        with self._lock:
            self._closing = False

    def _write_queued(self) -> None:
        """The writer thread: the queued blocks written, oldest first, until the queue stays empty."""
        try:
            while (block := self._next_queued()) is not None:
                written = self._write_file(*block)
                with self._lock:
                    self._writing = None
                    if written is not None:
                        self._add_file(block[0], *written)
                    self._lock.notify_all()  # (a write waiting for room)
        except BaseException:  # (not expected: OSError is handled) the next write starts another writer
            with self._lock:
                self._writer_running, self._writing = False, None
                self._lock.notify_all()
            raise

    def _next_queued(self) -> tuple[bytes, Payload] | None:
        """The oldest queued block, now the one being written; None: the writer ends."""
        with self._lock:
            if not self._queued and not self._closing:
                self._lock.wait(WRITER_IDLE_SECONDS)  # (woken by a write or close)
            if not self._queued:
                self._writer_running = False
                return None
            self._writing = self._queued.popitem(last=False)
            self._queued_bytes -= len(self._writing[1])
            return self._writing

    def _write_file(self, block_hash: bytes, payload: Payload) -> tuple[int, float] | None:
        """(the writer thread, no lock) The block's file, complete under its name: (its bytes, the seconds
        taken); None where it could not be written."""
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
            return None
        return len(header) + len(payload), time.perf_counter() - start

    def _add_file(self, block_hash: bytes, size: int, seconds: float) -> None:
        """(lock held) A file written: counted, then the tier kept under its bound."""
        self._files[block_hash] = size
        self.total_bytes += size
        self.counts.blocks_written += 1
        self.counts.bytes_written += size
        self.counts.write_seconds += seconds
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


def _close_if_alive(tier_ref: weakref.ref) -> None:
    """The exit handler: a tier still alive writes its queue and ends its writer."""
    tier = tier_ref()
    if tier is not None:
        tier.close()
