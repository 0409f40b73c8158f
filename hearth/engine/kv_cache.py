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

Sliding windows: when every layer of the model attends only to its last `window` positions,
a running request's blocks whose tokens are all older than that are never read again;
`free_outside_window` gives them back as decoding proceeds and leaves NO_BLOCK in their
place in the block table, so that positions keep indexing it (the runner sends block 0 for
it, and no kernel reads a position outside the window). They were entered into the prefix
cache when computed, so they stay findable until evicted; the chain of content ids goes on
from the request's last entered block, which is remembered rather than read from the table.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from hearth.engine.request import Request

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


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
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
        # content id of the last of them (the parent of the next).
        self._cached_chain: dict[Request, tuple[int, int]] = {}
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

        Never all of its tokens: at most (num_tokens - 1) // block_size blocks. Pure
        lookup: it changes nothing, so a failed admission can simply ask again later.
        A request with skip_prefix_cache gets no hit.
        """
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return [], 0
        hits = self.lookup(request.all_token_ids, -request.lora_id)
        return hits, len(hits) * self.block_size

    def lookup(self, tokens: list[int], root: int = 0) -> list[int]:
        """Block ids of the longest cached prefix of full blocks of `tokens`, short of its last token.
        root: the chain's first parent (-lora_id of a LoRA adapter's requests; 0: the base model's)."""
        bs, hits, parent = self.block_size, [], root
        for i in range((len(tokens) - 1) // bs):
            block_id = self.cached.get((parent, tuple(tokens[i * bs:(i + 1) * bs])))
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
        bs, parent, entered, chain = self.block_size, 0, [], set()
        for i in range((len(tokens) - 1) // bs):
            key = (parent, tuple(tokens[i * bs:(i + 1) * bs]))
            block_id = self.cached.get(key)
            if block_id is None:
                block_id = next((b for b in self.free_blocks if b not in chain), None)  # least recently used
                if block_id is None:
                    break
                block = self.blocks[block_id]
                if block.key is not None:
                    del self.cached[block.key]
                block.key, block.content_id = key, self._next_content_id
                self._next_content_id += 1
                self.cached[key] = block_id
                entered.append((i, block_id))
            if self.blocks[block_id].ref_cnt == 0:
                self.free_blocks.move_to_end(block_id)
            chain.add(block_id)
            parent = self.blocks[block_id].content_id
        return entered

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Enter the request's blocks that are full within num_computed_tokens into the cache.

        Call once their K/V are written (after the step). A block whose content is
        already cached (another request computed it in the same step) is a duplicate: it
        takes that content id, so blocks after it can still be entered, but it is not
        entered itself and is simply freed with its request.
        """
        if not self.enable_prefix_caching:
            return
        start, parent = self._cached_chain.get(request, (0, -request.lora_id))
        end = min(num_computed_tokens // self.block_size, len(request.block_table))
        if end <= start:
            return
        tokens, bs, table = request.all_token_ids, self.block_size, request.block_table
        for i in range(start, end):
            block = self.blocks[table[i]]
            key = (parent, tuple(tokens[i * bs:(i + 1) * bs]))
            existing = self.cached.get(key)
            if existing is None:
                block.content_id = self._next_content_id
                self._next_content_id += 1
                block.key = key
                self.cached[key] = block.block_id
            else:
                block.content_id = self.blocks[existing].content_id
            parent = block.content_id
        self._cached_chain[request] = (end, parent)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False) while any request holds a block."""
        if len(self.free_blocks) != self.num_blocks:
            return False
        self.cached.clear()
        for block in self.blocks:
            block.key, block.content_id = None, 0
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
            self._cached_chain[request] = (len(computed), self.blocks[computed[-1]].content_id)
        for _ in range(num_new_blocks):
            block_id, _ = self.free_blocks.popitem(last=False)
            block = self.blocks[block_id]
            if block.key is not None:  # evict its cached content
                del self.cached[block.key]
                block.key = None
            block.content_id = 0
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
