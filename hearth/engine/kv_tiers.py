"""The tiers under the prefix cache: host RAM (--kv-cache-ram), then disk (--kv-cache-dir). No tensors.

A block the KV cache evicts goes to every tier (write-through: the disk keeps it over a restart, RAM
answers fast while it lasts); a prefix lookup that runs past the cached blocks asks RAM first, then
disk, block by block along the content-hash chain (kv_cache.py). Each tier holds payloads: a block's
K/V as bytes, as the runner lays them out (ModelRunner.block_bytes: the cache's own bytes, or q8_0 with
kv_cache_tier_dtype q8_0; bytes or a memoryview over a buffer of the block's own, never written again, so
that both tiers keep the one copy). The RAM tier keeps them in an LRU dict bounded in bytes; a hit counts as
a use. The disk tier writes them on a thread of its own (kv_disk_tier.py).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (it imports TierCounts from here)
    from hearth.engine.kv_disk_tier import DiskTier
    from hearth.kv_format import Payload


@dataclass(slots=True)
class TierCounts:
    """One tier's totals since the engine started (engine stats, /metrics)."""

    hits: int = 0  # blocks loaded back from the tier
    blocks_written: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    skipped: int = 0  # the disk tier's truncated, corrupted or foreign files
    dropped: int = 0  # blocks the disk tier's writer did not keep up with, not written (its queue's bound)

    def copy(self) -> TierCounts:
        return replace(self)


class RamTier:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.counts = TierCounts()
        self.total_bytes = 0
        self._blocks: OrderedDict[bytes, Payload] = OrderedDict()  # block hash -> payload, least recently used first

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def read(self, block_hash: bytes) -> Payload | None:
        start = time.perf_counter()
        payload = self._blocks.get(block_hash)
        if payload is not None:
            self._blocks.move_to_end(block_hash)
            self.counts.hits += 1
            self.counts.bytes_read += len(payload)
            self.counts.read_seconds += time.perf_counter() - start
        return payload

    def touch(self, block_hash: bytes) -> bool:
        """Mark a block used; whether the tier holds it."""
        if block_hash not in self._blocks:
            return False
        self._blocks.move_to_end(block_hash)
        return True

    def write(self, block_hash: bytes, payload: Payload) -> None:
        """Keep a block (one already kept is only marked used), then drop the least recently used past the bound."""
        if self.touch(block_hash) or len(payload) > self.max_bytes:
            return
        start = time.perf_counter()
        self._blocks[block_hash] = payload
        self.total_bytes += len(payload)
        while self.total_bytes > self.max_bytes:
            self.total_bytes -= len(self._blocks.popitem(last=False)[1])
        self.counts.blocks_written += 1
        self.counts.bytes_written += len(payload)
        self.counts.write_seconds += time.perf_counter() - start


class KVTiers:
    """RAM, then disk (either may be absent): the store the BlockManager looks evicted prefixes up in."""

    def __init__(self, identity: bytes, ram: RamTier | None, disk: DiskTier | None, q8_0: bool):
        """identity: 32 bytes naming the model and cache layout (the chain's seed); q8_0: payloads are
        compressed (ModelRunner.block_bytes(compress=True))."""
        self.identity, self.ram, self.disk, self.q8_0 = identity, ram, disk, q8_0
        self._tiers = [t for t in (ram, disk) if t is not None]

    def __contains__(self, block_hash: bytes) -> bool:
        return any(block_hash in t for t in self._tiers)

    def read(self, block_hash: bytes) -> Payload | None:
        """The block's payload from the first tier that holds it; None where none holds it usably."""
        for tier in self._tiers:
            if block_hash in tier:
                return tier.read(block_hash)
        return None

    def held_by_all(self, block_hash: bytes) -> bool:
        """Whether every tier holds the block already (then marked used in each: no copy to make)."""
        return all(block_hash in t for t in self._tiers) and all([t.touch(block_hash) for t in self._tiers])

    def write(self, block_hash: bytes, payload: Payload, wait: bool = False) -> None:
        """Keep a block in every tier; wait: for room in the disk tier's queue (DiskTier.write)."""
        if self.ram is not None:
            self.ram.write(block_hash, payload)
        if self.disk is not None:
            self.disk.write(block_hash, payload, wait)

    def close(self) -> None:
        """The disk tier's queued blocks written, its writer thread ended (the tiers stay usable)."""
        if self.disk is not None:
            self.disk.close()
