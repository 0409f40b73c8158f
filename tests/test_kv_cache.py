"""hearth.engine.kv_cache: block allocation, ref counts, prefix cache, LRU eviction. No model."""

import sys

import pytest

from hearth.engine.kv_cache import BlockManager
from hearth.engine.request import Request, RequestStatus

BS = 4


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, arrival_time=0.0)


def admit(bm: BlockManager, r: Request, num_new: int | None = None) -> bool:
    """What the scheduler does for a waiting request: lookup, then allocate the rest."""
    computed, hit = bm.get_computed_blocks(r)
    return bm.allocate_slots(r, r.num_tokens - hit if num_new is None else num_new, computed)


def step_done(bm: BlockManager, r: Request, num_new: int | None = None) -> None:
    """What update_after_step does once the forward pass wrote the K/V."""
    r.num_computed_tokens += r.num_tokens - r.num_computed_tokens if num_new is None else num_new
    bm.cache_blocks(r, r.num_computed_tokens)


def test_request_bookkeeping():
    r = Request("a", [1, 2, 3], arrival_time=1.0)
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (3, 3, 0)
    r.append_output_token(9)
    assert r.all_token_ids == [1, 2, 3, 9] and r.output_token_ids == [9] and r.prompt_token_ids == [1, 2, 3]
    assert r.status is RequestStatus.WAITING and not r.is_finished and r.num_cached_tokens == -1
    r.status = RequestStatus.FINISHED_LENGTH
    assert r.is_finished and r.finish_reason == "length"
    assert RequestStatus.FINISHED_STOPPED.finish_reason == "stop"
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert RequestStatus.PREEMPTED.finish_reason is None and not RequestStatus.PREEMPTED.is_finished
    assert Request("a", [1]) != Request("a", [1])  # identity, so requests can be dict keys


def test_allocate_grow_free_and_refs():
    bm = BlockManager(num_blocks=4, block_size=BS)
    r = req("a", list(range(6)))
    assert bm.allocate_slots(r, 6)
    assert len(r.block_table) == 2 and bm.num_free_blocks == 2 and bm.usage == 0.5
    assert all(bm.blocks[b].ref_cnt == 1 for b in r.block_table)
    r.num_computed_tokens = 6
    assert bm.allocate_slots(r, 2) and len(r.block_table) == 2  # 8 tokens still fit in 2 blocks
    assert bm.allocate_slots(r, 3) and len(r.block_table) == 3
    bm.free(r)
    assert r.block_table == [] and bm.num_free_blocks == 4 and bm.usage == 0.0 and bm.check_all_free()


def test_failed_allocation_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a, b = req("a", list(range(8))), req("b", list(range(100, 108)))
    assert admit(bm, a)
    step_done(bm, a)
    bm.free(a)  # a's two blocks stay cached but free
    assert admit(bm, b)
    assert bm.num_free_blocks == 1
    c = req("c", list(range(8)) + [50, 51])  # hits a's first block (free), needs 2 more blocks
    free_before, cached_before = list(bm.free_blocks), dict(bm.cached)
    assert not admit(bm, c)
    assert c.block_table == [] and c.num_computed_tokens == 0
    assert list(bm.free_blocks) == free_before and bm.cached == cached_before
    assert bm.prefix_cache_queries == 16  # the failed admission counted nothing


def test_prefix_hit_shares_blocks_after_the_step():
    bm = BlockManager(num_blocks=10, block_size=BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    a = req("a", prompt)
    assert admit(bm, a)
    b = req("b", prompt)
    assert bm.get_computed_blocks(b) == ([], 0)  # a's K/V are not written yet
    step_done(bm, a)
    blocks, hit = bm.get_computed_blocks(b)
    assert blocks == a.block_table[:2] and hit == 8
    assert bm.allocate_slots(b, b.num_tokens - hit, blocks)
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]  # the partial block is private
    assert [bm.blocks[x].ref_cnt for x in b.block_table] == [2, 2, 1]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (20, 8)
    bm.free(a)
    assert [bm.blocks[x].ref_cnt for x in b.block_table] == [1, 1, 1]
    bm.free(b)
    assert bm.check_all_free()


def test_hit_on_free_cached_blocks_revives_them():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = req("a", list(range(9)))
    assert admit(bm, a)
    step_done(bm, a)
    first_two = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    b = req("b", list(range(8)) + [7, 7, 7])
    assert admit(bm, b)
    assert b.block_table[:2] == first_two and b.num_computed_tokens == 8
    assert bm.num_free_blocks == 1 and all(x not in bm.free_blocks for x in b.block_table)


def test_chain_a_different_earlier_block_means_no_hit():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = req("a", [1, 1, 1, 1, 5, 6, 7, 8, 0])
    assert admit(bm, a)
    step_done(bm, a)
    b = req("b", [2, 2, 2, 2, 5, 6, 7, 8, 0])  # same second block, different first
    assert bm.get_computed_blocks(b) == ([], 0)
    c = req("c", [1, 1, 1, 1, 5, 6, 7, 9, 0])  # same first block only
    assert bm.get_computed_blocks(c) == (a.block_table[:1], 4)


def test_hash_collisions_give_no_false_hit():
    # CPython hashes ints modulo 2**61 - 1: these two blocks' keys hash equal.
    m = sys.hash_info.modulus
    block_a, block_b = (0, 1, 2, 3), (m, 1, 2, 3)
    assert hash((0, block_a)) == hash((0, block_b))
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = req("a", [*block_a, *block_a, 9])
    assert admit(bm, a)
    step_done(bm, a)
    assert bm.get_computed_blocks(req("b", [*block_b, *block_a, 9])) == ([], 0)
    # the parent is an exact content id, so a colliding parent cannot leak into its child
    assert bm.get_computed_blocks(req("c", [*block_a, *block_b, 9])) == (a.block_table[:1], 4)


def test_never_hands_out_every_token():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = req("a", list(range(8)))
    assert admit(bm, a)
    step_done(bm, a)
    b = req("b", list(range(8)))  # exactly two full blocks, both cached
    blocks, hit = bm.get_computed_blocks(b)
    assert hit == 4 and blocks == a.block_table[:1]
    assert bm.allocate_slots(b, 4, blocks) and b.num_computed_tokens == 4
    assert b.block_table[1] != a.block_table[1]


def test_lru_evicts_oldest_freed_and_tail_blocks_first():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = req("a", list(range(0, 12)) + [99])  # 3 full blocks + 1 partial
    assert admit(bm, a)
    step_done(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)  # free list, head first: a's partial, the 2 never used, a2, a1, a0
    b = req("b", list(range(50, 62)) + [99])  # 4 blocks: evicts a's tail block a2 only
    assert admit(bm, b)
    assert b.block_table[-1] == a_blocks[2]
    assert bm.get_computed_blocks(req("x", list(range(0, 12)) + [1])) == (a_blocks[:2], 8)
    step_done(bm, b)
    b_partial = b.block_table[3]
    bm.free(b)  # head first: b's partial, a1, a0, b2, b1, b0
    c = req("c", list(range(200, 208)) + [1])  # 3 blocks: a's go before b's
    assert admit(bm, c)
    assert c.block_table == [b_partial, a_blocks[1], a_blocks[0]]
    assert bm.get_computed_blocks(req("x", list(range(0, 12)) + [1]))[1] == 0
    assert bm.get_computed_blocks(req("y", list(range(50, 62)) + [1]))[1] == 12


def test_lru_order_is_by_free_time():
    bm = BlockManager(num_blocks=4, block_size=BS)
    reqs = [req(str(i), [i] * 4 + [0]) for i in range(2)]  # one full block each (+1 partial)
    for r in reqs:
        assert admit(bm, r)
        step_done(bm, r)
    bm.free(reqs[1])
    bm.free(reqs[0])  # freed last: the most recently used
    d = req("d", [7] * 7)  # two new blocks: both partial blocks, then the LRU cached one: reqs[1]'s
    assert bm.allocate_slots(d, 7)
    d.num_computed_tokens = 7
    assert bm.allocate_slots(d, 2)  # a third block: evicts reqs[1]'s cached block
    assert bm.get_computed_blocks(req("p", [1] * 4 + [0]))[1] == 0
    assert bm.get_computed_blocks(req("q", [0] * 4 + [0]))[1] == 4


def test_same_step_duplicates_are_not_shared_but_keep_the_chain():
    bm = BlockManager(num_blocks=12, block_size=BS)
    a = req("a", list(range(9)))
    b = req("b", list(range(13)))  # a's prompt plus one more full block
    assert admit(bm, a) and admit(bm, b)  # same step: no hits
    assert set(a.block_table).isdisjoint(b.block_table)
    step_done(bm, a)
    step_done(bm, b)
    # b's first two blocks duplicate a's (not entered); its third block is entered
    c = req("c", list(range(13)) + [0])
    blocks, hit = bm.get_computed_blocks(c)
    assert hit == 12 and blocks == a.block_table[:2] + b.block_table[2:3]
    bm.free(a)
    bm.free(b)
    assert bm.check_all_free()


def test_decode_blocks_enter_the_cache():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req("a", [1, 2, 3])
    assert admit(bm, a)
    step_done(bm, a)
    for t in (4, 5, 6):  # decode: sampled token, then a 1-token step
        a.append_output_token(t)
        assert bm.allocate_slots(a, 1)
        step_done(bm, a, 1)
    assert a.num_computed_tokens == 6
    blocks, hit = bm.get_computed_blocks(req("b", [1, 2, 3, 4, 5, 6, 7]))
    assert hit == 4 and blocks == a.block_table[:1]


def test_counters_usage_and_reset():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = req("a", list(range(6)))
    assert admit(bm, a)
    step_done(bm, a)
    assert bm.usage == 0.5 and (bm.prefix_cache_queries, bm.prefix_cache_hits) == (6, 0)
    assert not bm.reset_prefix_cache()  # a still holds blocks
    b = req("b", list(range(6)))
    assert admit(bm, b)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (12, 4) and bm.usage == 0.75
    bm.free(a)
    bm.free(b)
    assert bm.usage == 0.0 and bm.num_cached_blocks == 1
    assert bm.reset_prefix_cache() and bm.num_cached_blocks == 0
    assert bm.get_computed_blocks(req("c", list(range(6)))) == ([], 0)


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = req("a", list(range(9)))
    assert admit(bm, a)
    step_done(bm, a)
    assert bm.get_computed_blocks(req("b", list(range(9)))) == ([], 0) and bm.num_cached_blocks == 0


def test_blocks_needed_and_bad_args():
    bm = BlockManager(num_blocks=2, block_size=16)
    assert [bm.blocks_needed(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    a = req("a", list(range(40)))
    assert bm.allocate_slots(a, 20)
    with pytest.raises(ValueError):
        bm.allocate_slots(a, 1, [0])


def test_skip_prefix_cache_computes_everything_but_still_fills_the_cache():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req("a", list(range(9)))
    assert admit(bm, a)
    step_done(bm, a)
    b = req("b", list(range(9)) + [5, 5, 5, 5])
    b.skip_prefix_cache = True  # e.g. it wants prompt logprobs: every position's logits
    assert bm.get_computed_blocks(b) == ([], 0)
    assert admit(bm, b) and b.num_computed_tokens == 0
    step_done(bm, b)
    blocks, hit = bm.get_computed_blocks(req("c", list(range(9)) + [5, 5, 5, 5, 1]))
    assert hit == 12 and blocks == a.block_table[:2] + b.block_table[2:3]


def test_blocks_outside_the_window_are_freed_and_stay_findable():
    """A request decoding past a window: its old blocks go back to the free list (as cached content,
    found by a later request with the same prefix), NO_BLOCK marks their place, the content-id chain
    goes on from the last entered block (window shorter than a block), and free() skips the marks."""
    from hearth.engine.kv_cache import NO_BLOCK

    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req("a", list(range(10)))
    assert admit(bm, a)
    step_done(bm, a)
    first_blocks = list(a.block_table)
    bm.free_outside_window(a, a.num_computed_tokens - 3 + 1)  # window 3: positions 8, 9 and 10 seen next
    assert a.block_table == [NO_BLOCK, NO_BLOCK, first_blocks[2]] and bm.num_free_blocks == 7
    bm.free_outside_window(a, a.num_computed_tokens - 3 + 1)  # again: nothing more
    assert bm.num_free_blocks == 7
    for token in range(10, 17):  # decode on: blocks 2 and 3 fill and enter the cache
        a.append_output_token(token)
        assert bm.allocate_slots(a, 1)
        step_done(bm, a, 1)
        bm.free_outside_window(a, a.num_computed_tokens - 3 + 1)
    assert a.block_table[:3] == [NO_BLOCK] * 3 and NO_BLOCK not in a.block_table[3:]
    b = req("b", list(range(17)) + [99])  # the same 17 tokens, then its own
    computed, hit = bm.get_computed_blocks(b)
    assert hit == 16 and computed[:2] == first_blocks[:2]  # blocks 0..3, freed ones revived
    assert bm.allocate_slots(b, b.num_tokens - hit, computed)
    bm.free(a)
    bm.free(b)
    assert bm.check_all_free()
