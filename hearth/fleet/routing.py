"""Which replica a request goes to: the one most likely to hold its prompt's prefix in its KV cache.

The router never sees token ids (it forwards JSON), so prefixes are tracked in characters: a
prompt's UTF-8 bytes are cut into chunks of `chunk_bytes` and each chunk is named by a hash chained through all
chunks before it, the way the engine names KV blocks by their tokens and everything before them.
Each replica keeps a bounded, least-recently-used set of the chunk hashes it was sent. A request
goes to the replica holding the longest run of its leading chunks, unless that replica is busier
than the least busy one by more than `balance_slack` requests; with no prefix held anywhere, it
goes to the least busy replica (among equals, the one holding the fewest prefixes, so that distinct
prefixes spread over the replicas; then the one its first chunk hashes to).
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from dataclasses import dataclass, field


def prefix_hashes(text: str, chunk_bytes: int) -> list[bytes]:
    """The chained hashes of text's whole chunks (a trailing partial chunk is not a shareable prefix)."""
    hashes, previous = [], b""
    data = text.encode("utf-8", "surrogatepass")
    for start in range(0, len(data) - chunk_bytes + 1, chunk_bytes):
        previous = hashlib.blake2b(previous + data[start : start + chunk_bytes], digest_size=16).digest()
        hashes.append(previous)
    return hashes


@dataclass
class ReplicaLoad:
    in_flight: int = 0
    healthy: bool = True
    held: OrderedDict = field(default_factory=OrderedDict)  # chunk hash -> None, least recent first


@dataclass
class Route:
    replica: int
    matched_chunks: int  # leading chunks the chosen replica was already sent
    total_chunks: int


class PrefixRouter:
    def __init__(self, num_replicas: int, policy: str = "prefix", chunk_bytes: int = 256,
                 max_chunks_per_replica: int = 65536, balance_slack: int = 4, seed: int | None = None) -> None:
        if policy not in ("prefix", "least_loaded", "random"):
            raise ValueError(f"unknown routing policy {policy!r} (prefix, least_loaded or random)")
        self.policy = policy
        self.chunk_bytes = chunk_bytes
        self.max_chunks = max_chunks_per_replica
        self.balance_slack = balance_slack
        self.replicas = [ReplicaLoad() for _ in range(num_replicas)]
        self._random = random.Random(seed)

    def choose(self, prompt: str, exclude: frozenset[int] = frozenset()) -> Route:
        """Pick a healthy replica not in `exclude` for a prompt; raises LookupError when there is none."""
        candidates = [i for i, r in enumerate(self.replicas) if r.healthy and i not in exclude]
        if not candidates:
            raise LookupError("no healthy replica")
        hashes = prefix_hashes(prompt, self.chunk_bytes)
        if self.policy == "random":
            chosen = self._random.choice(candidates)
        else:
            least = min(self.replicas[i].in_flight for i in candidates)
            # among equally busy replicas, the one holding the fewest prefixes (distinct prefixes
            # spread out, each replica's share of the working set stays small); then the prompt's hash
            fewest = min(len(self.replicas[i].held) for i in candidates if self.replicas[i].in_flight == least)
            idle = [i for i in candidates if self.replicas[i].in_flight == least and len(self.replicas[i].held) == fewest]
            name = hashes[0] if hashes else hashlib.blake2b(prompt.encode("utf-8", "surrogatepass")).digest()
            chosen = idle[int.from_bytes(name[:8], "little") % len(idle)]
            if self.policy == "prefix" and hashes:
                best = max(candidates, key=lambda i: (self._matched(i, hashes), -self.replicas[i].in_flight))
                if self._matched(best, hashes) and self.replicas[best].in_flight <= least + self.balance_slack:
                    chosen = best
        route = Route(chosen, self._matched(chosen, hashes), len(hashes))
        held = self.replicas[chosen].held
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_chunks:
            held.popitem(last=False)
        return route

    def _matched(self, replica: int, hashes: list[bytes]) -> int:
        held = self.replicas[replica].held
        count = 0
        for h in hashes:
            if h not in held:
                break
            count += 1
        return count
