"""Paged KV cache bookkeeping: which block holds which tokens of which request. No tensors.

The cache is `num_blocks` blocks of `block_size` token slots; the runner owns the tensors,
this module owns the ids. A request's `block_table` lists its blocks in token order.

Prefix caching (a chain over full blocks, as in vLLM v1):
  * A full block is known by its link key `(parent content id, its tokens)`. The content
    id names one exact token prefix (every token from position 0 to the end of the block);
    ids come from a counter and are never reused. The dict `key -> block id` is a Python
    dict, so every hit compares the whole key (parent id and all the block's tokens), not
    only a hash: a hash collision can cost a hit, never give a wrong one. Because the
    parent is an exact id rather than a parent hash, a collision anywhere up the chain
    cannot leak into a later block either.
  * Blocks enter the cache only after their K/V are written: the scheduler calls
    `cache_blocks` from `update_after_step`, after the forward pass. Two requests in the
    same step never share a block that one of them is still writing (the attention kernel
    may read a request's context before another request in the batch has written it).
    So n requests with one prompt admitted in the same step each compute it once; from the
    next step on, later requests share the first one's blocks. (hearth's runner writes a
    layer's new K/V for the whole batch before attending, which would make entering blocks
    at allocation safe too, as vLLM v1 does; this rule does not depend on the kernel.)
  * A block whose ref count drops to 0 stays cached and reusable until evicted. The free
    list is an OrderedDict used as an O(1) LRU: allocation takes from the head; a freed
    block holding cached content goes to the tail, one holding nothing reusable (a partial
    block, a duplicate) goes to the head, so it is reused before any cached content is
    evicted. A request frees its blocks in reverse order, so its tail blocks are evicted
    before its head blocks (which more requests are likely to share).
  * K/V depend on the LoRA adapter a request runs with: a request's chain starts from the parent
    -lora_id (0: the base model), so that requests of different adapters never share a block.
  * A lookup never returns every token of a request: the last token is always computed
    so the model yields logits for it.
  * A block that holds tokens of a prompt's image (Request.images) has the content hash of each
    such image after its token ids in its key (two int64s an image: block_content): the same image
    hits, another image of the same size (the same placeholder tokens) misses.

Sliding windows: when every layer of the model attends only to its last `window` positions,
a running request's blocks whose tokens are all older than that are never read again;
`free_outside_window` gives them back as decoding proceeds and leaves NO_BLOCK in their
place in the block table, so that positions keep indexing it (the runner sends block 0 for
it, and no kernel reads a position outside the window). They were entered into the prefix
cache when computed, so they stay findable until evicted; the chain of content ids goes on
from the request's last entered block, which is remembered rather than read from the table.

Tiers under the cache (kv_tiers.py: host RAM, then the disk tier of kv_disk_tier.py; optional): every
full cached block also carries a content hash, a chain over its prefix's token ids (hash(parent's
hash, its tokens)) seeded with the tiers' model identity, stable across processes. A cached block
that is evicted is listed in `evicted` (hash, block id); a prefix lookup that runs out of cached
blocks goes on through the hashes the tiers hold, and enters each one found (its payload read, from
RAM or checked from disk) into a free block, listed in `loads`. The
engine hands both to the runner (take_tier_moves) before the step's forward pass: evicted blocks'
K/V are copied out before anything overwrites them, then loaded blocks' K/V are written in.

A hybrid model's state checkpoints (state_slots.StateCheckpoints, optional): a prefix is found only up
to the last of its cached blocks whose content id has a checkpoint (the states there), and a cached
block's checkpoint goes with it when it is evicted or the cache is reset.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from hearth.engine.kv_tiers import KVTiers
from hearth.engine.request import ImageSpan, Request
from hearth.engine.state_slots import StateCheckpoints

BlockKey = tuple[int, tuple[int, ...]]  # (parent content id, token ids of the block)
NO_BLOCK = -1  # a block_table entry whose block was freed behind the sliding window


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while this block is the prefix cache's entry for its content (cached[key] == id).
    key: BlockKey | None = None
    # Id of the exact prefix this full, computed block ends; 0 while not (yet) known.
    # Duplicates of a cached block (computed in the same step by another request) share it.
    content_id: int = 0
    content_hash: bytes = b""  # the chain hash of the same prefix, set with content_id (the disk tier's name)


def block_content(tokens: list[int], index: int, block_size: int, images: list[ImageSpan]) -> tuple[int, ...]:
    """Block `index`'s part of a block key: its token ids, then the content hash of every image whose
    tokens it holds (ImageSpan.key). A block of text alone: its token ids."""
    start, end = index * block_size, (index + 1) * block_size
    block = tuple(tokens[start:end])
    for image in images:
        if image.start < end and image.end > start:
            block += image.key
    return block


def chain_hash(parent: bytes, tokens: tuple[int, ...] | list[int]) -> bytes:
    """The content hash of a block: its parent's hash and its token ids."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 tiers: KVTiers | None = None, checkpoints: StateCheckpoints | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU: head first
        self.cached: dict[BlockKey, int] = {}  # full computed block content -> block id
        self._next_content_id = 1
        # Per request, how many of its leading blocks have passed through cache_blocks, and the
        # content id and hash of the last of them (the parent of the next).
        self._cached_chain: dict[Request, tuple[int, int, bytes]] = {}
        self.tiers = tiers
        self.checkpoints = checkpoints  # a hybrid model's state checkpoints (with prefix caching)
        self._root_hash = tiers.identity if tiers is not None else b""
        self.evicted: list[tuple[bytes, int]] = []  # (content hash, block id): K/V to copy to the tiers
        self.loads: dict[int, bytes] = {}  # block id -> payload read from a tier: K/V to write in
        # Per request, how many of its leading blocks free_outside_window has given back.
        self._num_window_freed: dict[Request, int] = {}
        # Metrics, in tokens, counted once per successful admission (see allocate_slots).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- sizes ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached-but-free blocks count: they can be evicted)."""
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1 (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self.free_blocks) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content a prefix lookup can find (held or free)."""
        return len(self.cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check_all_free(self) -> bool:
        """True when no request holds any block (what the engine expects once idle)."""
        return len(self.free_blocks) == self.num_blocks and all(b.ref_cnt == 0 for b in self.blocks)

    # ---- prefix cache --------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks of request.all_token_ids: (block ids, tokens).

        Never all of its tokens: at most (num_tokens - 1) // block_size blocks. Without tiers
        a pure lookup; with them, the blocks found in RAM or on disk past the cached ones are entered
        into free blocks (cached, free, most recently used; see `loads`), so that a failed
        admission asking again later finds them cached. A request with skip_prefix_cache gets no hit.
        """
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return [], 0
        hits = self.lookup(request.all_token_ids, -request.lora_id, request.images)
        if self.tiers is not None:  # (never with LoRA adapters: startup.kv_tiers; nor hybrids)
            hits += self._enter_from_tiers(request.all_token_ids, hits, request.images)
        if self.checkpoints is not None:
            hits = self._up_to_checkpoint(request, hits)
        return hits, len(hits) * self.block_size

    def _up_to_checkpoint(self, request: Request, hits: list[int]) -> list[int]:
        """The hits up to the last whose prefix has a state checkpoint; where the K/V hits reach further,
        request.checkpoint_junction names the end of them (a checkpoint is taken there: state_slots.py)."""
        found = self.checkpoints.prefix_end([self.blocks[b].content_id for b in hits])
        request.checkpoint_junction = len(hits) * self.block_size if len(hits) > found else 0
        return hits[:found]

    def save_state(self, request: Request) -> None:
        """Checkpoint the state of a hybrid request whose computed tokens end a full cached block (its
        state slot holds the states there until the next pass: the runner copies it before)."""
        end = request.num_computed_tokens // self.block_size
        content_id = self.blocks[request.block_table[end - 1]].content_id if end else 0
        if content_id:  # (0: not entered, prefix caching off)
            self.checkpoints.save(content_id, request.state_slot)

    def restore_state(self, request: Request) -> None:
        """Copy into an admitted hybrid request's state slot the checkpoint its prefix hits end at."""
        if request.num_computed_tokens:
            last = request.block_table[request.num_computed_tokens // self.block_size - 1]
            self.checkpoints.restore(self.blocks[last].content_id, request.state_slot)

    def _enter_from_tiers(self, tokens: list[int], hits: list[int], images: list[ImageSpan]) -> list[int]:
        """Block ids of the blocks of `tokens` after the cached `hits` that a tier holds, each
        entered into a free block (not one of hits) whose K/V the runner loads before the step."""
        bs, entered = self.block_size, []
        parent = self.blocks[hits[-1]] if hits else None
        parent_id, parent_hash = (0, self._root_hash) if parent is None else (parent.content_id, parent.content_hash)
        for i in range(len(hits), (len(tokens) - 1) // bs):
            block_tokens = block_content(tokens, i, bs, images)
            content_hash = chain_hash(parent_hash, block_tokens)
            if content_hash not in self.tiers:
                break
            block_id = self._least_recently_used_free(set(hits) | set(entered))
            if block_id is None:
                break
            payload = self.tiers.read(content_hash)
            if payload is None:  # an unusable file (skipped with a warning)
                break
            block = self.blocks[block_id]
            self._enter(block, (parent_id, block_tokens), content_hash)
            self.loads[block_id] = payload
            self.free_blocks.move_to_end(block_id)
            entered.append(block_id)
            parent_id, parent_hash = block.content_id, content_hash
        return entered

    def _least_recently_used_free(self, taken: set[int]) -> int | None:
        return next((b for b in self.free_blocks if b not in taken), None)

    def take_tier_moves(self) -> tuple[list[tuple[bytes, int]], dict[int, bytes]]:
        """The blocks to copy to the tiers (content hash, block id) and to load from them (block id ->
        payload) since the last call; the runner does both, in that order, before the next step."""
        evicted, loads = self.evicted, self.loads
        self.evicted, self.loads = [], {}
        return evicted, loads

    def lookup(self, tokens: list[int], root: int = 0, images: list[ImageSpan] = ()) -> list[int]:
        """Block ids of the longest cached prefix of full blocks of `tokens`, short of its last token.
        root: the chain's first parent (-lora_id of a LoRA adapter's requests; 0: the base model's).
        images: the prompt's (their hashes are in their blocks' keys)."""
        bs, hits, parent = self.block_size, [], root
        for i in range((len(tokens) - 1) // bs):
            block_id = self.cached.get((parent, block_content(tokens, i, bs, images)))
            if block_id is None:
                break
            hits.append(block_id)
            parent = self.blocks[block_id].content_id
        return hits

    def import_prefix(self, tokens: list[int]) -> list[tuple[int, int]]:
        """Enter the full blocks of `tokens` (short of its last token, as a lookup finds them) that
        the cache lacks, for K/V computed elsewhere (a prefill worker's). Each takes a free block
        (evicting what it held) and stays free and cached, most recently used; the cached blocks of
        the prefix are touched likewise. Returns (block's index in tokens, block id) of each block
        entered: the caller writes its K/V now, before any step. Stops early with no room."""
        if not self.enable_prefix_caching:
            return []
        bs, parent, parent_hash, entered, chain = self.block_size, 0, self._root_hash, [], set()
        for i in range((len(tokens) - 1) // bs):
            key = (parent, tuple(tokens[i * bs:(i + 1) * bs]))
            block_id = self.cached.get(key)
            if block_id is None:
                block_id = self._least_recently_used_free(chain)
                if block_id is None:
                    break
                self._enter(self.blocks[block_id], key, chain_hash(parent_hash, key[1]))
                entered.append((i, block_id))
            if self.blocks[block_id].ref_cnt == 0:
                self.free_blocks.move_to_end(block_id)
            chain.add(block_id)
            parent, parent_hash = self.blocks[block_id].content_id, self.blocks[block_id].content_hash
        return entered

    def _enter(self, block: KVBlock, key: BlockKey, content_hash: bytes) -> None:
        """Make a free block the cache's entry for new content (evicting what it held)."""
        self._evict(block)
        block.key, block.content_id, block.content_hash = key, self._next_content_id, content_hash
        self._next_content_id += 1
        self.cached[key] = block.block_id

    def _evict(self, block: KVBlock) -> None:
        """Forget the block's cached content; with tiers it is listed to be copied there
        (unless its K/V were never loaded in: then a tier has them already)."""
        if block.key is not None:
            del self.cached[block.key]
            if self.checkpoints is not None:
                self.checkpoints.drop(block.content_id)
            if self.tiers is not None and self.loads.pop(block.block_id, None) is None:
                self.evicted.append((block.content_hash, block.block_id))
            block.key = None
        block.content_id, block.content_hash = 0, b""

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Enter the request's blocks that are full within num_computed_tokens into the cache.

        Call once their K/V are written (after the step). A block whose content is
        already cached (another request computed it in the same step) is a duplicate: it
        takes that content id, so blocks after it can still be entered, but it is not
        entered itself and is simply freed with its request.
        """
        if not self.enable_prefix_caching:
            return
        start, parent, parent_hash = self._cached_chain.get(request, (0, -request.lora_id, self._root_hash))
        end = min(num_computed_tokens // self.block_size, len(request.block_table))
        if end <= start:
            return
        tokens, bs, table = request.all_token_ids, self.block_size, request.block_table
        for i in range(start, end):
            block = self.blocks[table[i]]
            key = (parent, block_content(tokens, i, bs, request.images))
            existing = self.cached.get(key)
            block.content_hash = chain_hash(parent_hash, key[1])
            if existing is None:
                block.content_id = self._next_content_id
                self._next_content_id += 1
                block.key = key
                self.cached[key] = block.block_id
            else:
                block.content_id = self.blocks[existing].content_id
            parent, parent_hash = block.content_id, block.content_hash
        self._cached_chain[request] = (end, parent, parent_hash)

    def cached_blocks(self) -> list[tuple[bytes, int]]:
        """(content hash, block id) of every block the prefix cache holds (to save in the tiers at shutdown)."""
        return [(block.content_hash, block.block_id) for block in self.blocks if block.key is not None]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False) while any request holds a block."""
        if len(self.free_blocks) != self.num_blocks:
            return False
        self.cached.clear()
        if self.checkpoints is not None:
            self.checkpoints.clear()
        for block in self.blocks:
            block.key, block.content_id, block.content_hash = None, 0, b""
        self._cached_chain.clear()
        return True

    # ---- allocation ----------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> bool:
        """Make request.block_table cover num_computed_tokens + num_new_tokens tokens.

        computed_blocks (from get_computed_blocks, admission only: the request holds no
        blocks yet) come first and set request.num_computed_tokens to the tokens they
        hold. Returns False, changing nothing, when there are not enough free blocks.
        Passing computed_blocks (even []) marks an admission: on success it counts one
        prefix-cache query (request.num_tokens) and its hits, in tokens.
        """
        computed = computed_blocks or []
        if computed and request.block_table:
            raise ValueError(f"request {request.request_id}: computed blocks given but it already holds blocks")
        num_computed = len(computed) * self.block_size if computed else request.num_computed_tokens
        num_required = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = num_required - len(request.block_table) - len(computed)
        num_revived = sum(1 for b in computed if self.blocks[b].ref_cnt == 0)  # leave the free list
        if max(num_new_blocks, 0) + num_revived > len(self.free_blocks):
            return False

        for block_id in computed:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_blocks[block_id]
            block.ref_cnt += 1
            request.block_table.append(block_id)
        if computed:
            request.num_computed_tokens = num_computed
            last = self.blocks[computed[-1]]
            self._cached_chain[request] = (len(computed), last.content_id, last.content_hash)
        for _ in range(num_new_blocks):
            block_id, _ = self.free_blocks.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            request.block_table.append(block_id)
        if computed_blocks is not None:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_computed
        return True

    def free_excess(self, request: Request, num_tokens: int) -> None:
        """Give back the request's blocks past the first blocks_needed(num_tokens): the slots of
        speculative tokens that were rejected. Those blocks hold no full computed block, so no
        prefix-cache content; they go to the head of the free list."""
        keep = self.blocks_needed(num_tokens)
        while len(request.block_table) > keep:
            self._release(request.block_table.pop())

    def free_outside_window(self, request: Request, first_needed_position: int) -> None:
        """Give back the request's blocks whose tokens all lie before first_needed_position (no
        later query of it reads them: they are outside every layer's window); NO_BLOCK stays in
        their place in the block table."""
        table = request.block_table
        end = min(max(first_needed_position, 0) // self.block_size, len(table))
        for i in range(self._num_window_freed.get(request, 0), end):
            self._release(table[i])
            table[i] = NO_BLOCK
        self._num_window_freed[request] = max(end, self._num_window_freed.get(request, 0))

    def free(self, request: Request) -> None:
        """Drop the request's refs (tail blocks first) and clear its block_table."""
        for block_id in reversed(request.block_table):
            if block_id != NO_BLOCK:
                self._release(block_id)
        request.block_table.clear()
        self._cached_chain.pop(request, None)
        self._num_window_freed.pop(request, None)

    def _release(self, block_id: int) -> None:
        """One ref fewer; at none the block is free: at the LRU tail (evicted last) when it holds cached
        content, at the head (reused first) when it holds nothing reusable."""
        block = self.blocks[block_id]
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free_blocks[block_id] = None
            if block.key is None:
                self.free_blocks.move_to_end(block_id, last=False)
