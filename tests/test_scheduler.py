"""hearth.engine.scheduler: token budget, chunked prefill, FCFS, preemption, abort. No model.

A fake engine loop stands in for the runner and sampler: it checks that every K/V slot a
step reads holds the right prefix (as written by an earlier step), writes the new slots,
appends a dummy token to each request that reached its end and finishes it at max_tokens.
"""

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from hearth.engine.kv_cache import BlockManager
from hearth.engine.request import Request, RequestStatus
from hearth.engine.scheduler import Scheduler, SchedulerOutput
from hearth.errors import RequestError

RUNNING, PREEMPTED = RequestStatus.RUNNING, RequestStatus.PREEMPTED


@dataclass
class Params:
    max_tokens: int


def req(rid: str, n_prompt: int, max_tokens: int = 1, base: int = 0) -> Request:
    return Request(rid, [base + i for i in range(n_prompt)], Params(max_tokens), arrival_time=0.0)


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, prefix=True, **kw) -> Scheduler:
    s = Scheduler(BlockManager(num_blocks, block_size, prefix), max_num_seqs, budget, **kw)
    s.fake_kv = FakeKV(s.block_manager)  # what step() checks reads against
    return s


class FakeKV:
    """The cache's content: slot -> the exact prefix whose last token's K/V it holds."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.slots: dict[int, tuple[int, ...]] = {}

    def slot(self, r: Request, pos: int) -> int:
        return r.block_table[pos // self.bm.block_size] * self.bm.block_size + pos % self.bm.block_size

    def run(self, out: SchedulerOutput) -> None:
        # reads first: everything attention reads must have been written in an earlier step
        for r, n in out.scheduled:
            for pos in range(r.num_computed_tokens):
                assert self.slots.get(self.slot(r, pos)) == tuple(r.all_token_ids[: pos + 1]), (r.request_id, pos)
        written = set()
        for r, n in out.scheduled:
            tokens = r.all_token_ids + r.spec_token_ids  # a guess's K/V: the prefix it guesses
            for pos in range(r.num_computed_tokens, r.num_computed_tokens + n):
                block = self.bm.blocks[r.block_table[pos // self.bm.block_size]]
                assert block.ref_cnt == 1 and block.key is None  # never write a shared/cached block
                s = self.slot(r, pos)
                assert s not in written
                written.add(s)
                self.slots[s] = tuple(tokens[: pos + 1])


def step(sched: Scheduler, token=lambda r: 7) -> SchedulerOutput:
    """One engine iteration: schedule, 'run', update, append a token, finish at max_tokens."""
    out = sched.schedule()
    sched.fake_kv.run(out)
    sched.update_after_step(out)
    for r, _ in out.scheduled:
        if r.status is RUNNING and r.num_computed_tokens == r.num_tokens:
            r.append_output_token(token(r))
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
    return out


def run_all(sched: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished_requests():
        assert len(outs) < max_steps, "a request starved"
        outs.append(step(sched))
    assert sched.block_manager.check_all_free()
    return outs


def test_token_budget_and_running_first():
    s = make(budget=10)
    a, b = req("a", 6, 5), req("b", 6, 5)
    s.add_request(a)
    s.add_request(b)
    out = step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 6), ("b", 4)]
    assert out.num_batched_tokens == 10 and out.num_scheduled_requests == 2
    out = step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 2)]
    assert a.num_output_tokens == 2 and b.num_output_tokens == 1  # b's chunk ended its prompt
    assert 0 < out.kv_cache_usage <= 1 and out.num_running == 2 and out.num_waiting == 0
    assert all(o.num_batched_tokens <= 10 for o in run_all(s))


def test_chunked_prefill_spreads_a_long_prompt_over_steps_with_decodes():
    s = make(budget=8)
    a = req("a", 3, 10)
    s.add_request(a)
    step(s)
    b = req("b", 20, 2, base=100)
    s.add_request(b)
    progress = []
    for _ in range(3):
        out = step(s)
        assert out.scheduled[0] == (a, 1)  # a decodes every step
        assert out.num_batched_tokens <= 8
        progress.append(b.num_computed_tokens)
    assert progress == [7, 14, 20] and b.num_output_tokens == 1
    run_all(s)


def test_guesses_take_only_the_budget_the_steps_tokens_leave():
    """A decoding request's guesses are scheduled after every running request's next tokens and the
    prompts admitted: a prompt's chunks end where they would without guesses (so greedy outputs in a
    batch do not change with speculation), and the guesses get what is left, or nothing."""
    s = make(budget=12)
    a = req("a", 3, 10)
    s.add_request(a)
    step(s)  # a decodes from here on
    b, c = req("b", 5, 2, base=100), req("c", 20, 2, base=200)
    s.add_request(b)
    s.add_request(c)
    a.spec_token_ids[:] = [7] * 6
    out = s.schedule()
    assert out.scheduled == [(a, 1), (b, 5), (c, 6)] and a.spec_token_ids == []  # no budget left for them
    s.fake_kv.run(out)
    s.update_after_step(out)
    for r in (a, b):
        r.append_output_token(7)
    s.accept_spec_tokens(a, 0)
    a.spec_token_ids[:] = [7] * 10
    out = s.schedule()
    # a's token and b's, c's next chunk (12 - 2 = 10 of its 14 left), then a's guesses: none left again
    assert out.scheduled == [(a, 1), (b, 1), (c, 10)] and a.spec_token_ids == []
    s.fake_kv.run(out)
    s.update_after_step(out)
    for r in (a, b):
        r.append_output_token(7)
    a.spec_token_ids[:] = [7] * 10
    out = s.schedule()
    assert out.scheduled == [(a, 1 + 6), (b, 1), (c, 4)] and a.spec_token_ids == [7] * 6  # trimmed to the 6 left
    s.fake_kv.run(out)
    s.update_after_step(out)
    for r in (a, a, a, b, c):  # a: 2 guesses accepted and the token after them
        r.append_output_token(7)
    s.accept_spec_tokens(a, 2)
    assert a.num_computed_tokens == a.num_tokens - 1  # their K/V kept, the rest's slots given back
    run_all(s)


def test_long_prefill_token_threshold_caps_each_chunk():
    s = make(budget=32, long_prefill_token_threshold=5)
    b = req("b", 12, 1)
    s.add_request(b)
    assert [step(s).scheduled[0][1] for _ in range(3)] == [5, 5, 2]


def test_without_chunking_a_long_prompt_runs_whole():
    s = make(budget=8, enable_chunked_prefill=False)
    a = req("a", 3, 4)
    s.add_request(a)
    step(s)
    short, long = req("short", 5, 1, base=50), req("long", 20, 1, base=100)
    s.add_request(short)
    s.add_request(long)
    out = step(s)  # a's decode + short (5) fit; long waits, it is not chunked
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("short", 5)]
    while a.status is RUNNING:
        out = step(s)
        assert all(r is not long for r, _ in out.scheduled)
    out = step(s)  # nothing else runs now: long goes whole, over the budget rather than never
    assert out.scheduled == [(long, 20)]
    run_all(s)


def test_max_num_seqs_and_fcfs():
    s = make(max_num_seqs=2, budget=100)
    reqs = [req(str(i), 3, 3 - i % 2, base=10 * i) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    admitted = []
    while s.has_unfinished_requests():
        out = step(s)
        assert out.num_scheduled_requests <= 2 and s.num_running <= 2
        admitted += [r.request_id for r, n in out.scheduled if r.num_output_tokens == 1 and n == 3]
    assert admitted == ["0", "1", "2", "3", "4"]


def test_fcfs_head_of_line_blocks_on_kv_space():
    s = make(num_blocks=4, block_size=4, budget=100)
    s.add_request(req("a", 8, 20))
    step(s)
    big, small = req("big", 10, 1, base=50), req("small", 2, 1, base=90)
    s.add_request(big)
    s.add_request(small)
    out = step(s)  # big needs 3 blocks, 2 are free: it waits and small may not overtake it
    assert [r.request_id for r, _ in out.scheduled] == ["a"] and s.num_waiting == 2
    outs = run_all(s)
    firsts = [r.request_id for o in outs for r, n in o.scheduled if n > 1]
    assert firsts == ["big", "small"]


def test_preemption_takes_the_most_recent_and_requeues_it_at_the_front():
    s = make(num_blocks=6, block_size=2, budget=100, prefix=False)
    a, b, c = req("a", 3, 6), req("b", 3, 6, base=10), req("c", 3, 6, base=20)
    for r in (a, b, c):
        s.add_request(r)
    step(s)  # 2 blocks each: the cache is full
    d = req("d", 2, 1, base=30)
    s.add_request(d)
    out = step(s)  # 4 tokens each, still 2 blocks
    assert not out.preempted
    out = step(s)  # a needs a 3rd block: c (admitted last) goes; b then fits in c's other block
    assert out.preempted == [c] and [r for r, _ in out.scheduled] == [a, b]
    assert c.status is PREEMPTED and c.num_computed_tokens == 0 and c.block_table == []
    assert c.num_preemptions == 1 and list(s.waiting) == [c, d]
    assert c.num_output_tokens == 2
    outs = run_all(s)
    c_back = next((n for o in outs for r, n in o.scheduled if r is c))
    assert c_back == 5  # recomputes prompt + its 2 outputs, then samples the 3rd
    for r in (a, b, c):
        assert r.num_output_tokens == 6 and r.status is RequestStatus.FINISHED_LENGTH


def test_priority_orders_admission_and_preemption_takes_the_lowest_priority_first():
    """vLLM's priority semantics: a lower value is admitted first; under a full cache the running request
    of the highest value (the latest among equals) is preempted, and it keeps its place when requeued."""
    s = make(num_blocks=6, block_size=2, budget=100, max_num_seqs=3, prefix=False)
    low, mid, high = req("low", 3, 6), req("mid", 3, 6, base=10), req("high", 3, 6, base=20)
    low.priority, mid.priority, high.priority = 5, 1, 0
    for r in (low, mid, high):  # arrival order: low first
        s.add_request(r)
    assert list(s.waiting) == [high, mid, low]
    out = step(s)
    assert [r for r, _ in out.scheduled] == [high, mid, low]  # running: in priority order too
    step(s)
    out = step(s)  # high needs a 3rd block: low goes (not mid, admitted after it, nor high itself)
    assert out.preempted == [low] and [r for r, _ in out.scheduled] == [high, mid]
    later_but_better = req("later", 2, 1, base=30)
    later_but_better.priority = 3
    s.add_request(later_but_better)
    assert list(s.waiting) == [later_but_better, low]
    outs = run_all(s)
    firsts = [r.request_id for o in outs for r, n in o.scheduled if n > 1]
    assert firsts.index("later") < firsts.index("low")
    assert not high.num_preemptions  # the best priority is never the victim while another runs


def test_preemption_of_itself_when_it_is_the_last():
    s = make(num_blocks=3, block_size=2, budget=100)
    a, b = req("a", 1, 4), req("b", 4, 4, base=10)
    s.add_request(a)
    s.add_request(b)
    step(s)
    out = step(s)  # a (2 tokens) fits its block; b needs a 3rd block, only a's are left
    assert out.scheduled == [(a, 1)] and out.preempted == [b] and out.num_preemptions == 1
    assert b.status is PREEMPTED and list(s.waiting) == [b]
    outs = run_all(s)
    assert a.num_output_tokens == 4
    # b comes back and grows to 7 tokens: 4 blocks, more than the cache has
    assert b.status is RequestStatus.FINISHED_LENGTH and b.num_output_tokens == 3
    assert [r for o in outs for r in o.finished] == [b]


def test_a_sequence_that_outgrows_the_whole_cache_finishes_with_length():
    s = make(num_blocks=2, block_size=2, budget=100)
    a = req("a", 3, 10)
    s.add_request(a)
    step(s)
    step(s)
    assert a.num_tokens == 5
    out = s.schedule()
    assert out.finished == [a] and out.scheduled == []
    assert a.status is RequestStatus.FINISHED_LENGTH and a.finish_reason == "length"
    assert not s.has_unfinished_requests() and s.block_manager.check_all_free()


def test_scratch_slots_come_with_a_sampling_step_and_go_after_it():
    """Contrastive search's candidates: a request that samples in a step holds num_scratch_slots
    slots past its tokens during it, given back after; one that cannot have them ends with length."""
    s = make(num_blocks=8, block_size=4, budget=6)
    a = req("a", 9, 3)
    a.num_scratch_slots = 4
    s.add_request(a)
    out = s.schedule()  # a chunk of 6: no sampling, no scratch
    assert out.scheduled == [(a, 6)] and len(a.block_table) == 2
    s.update_after_step(out)
    out = s.schedule()  # the last 3 prompt tokens and the draw: 9 + 4 slots
    assert out.scheduled == [(a, 3)] and len(a.block_table) == 4
    s.update_after_step(out)
    assert len(a.block_table) == 3  # back to the 9 computed tokens' blocks
    tight = make(num_blocks=3, block_size=4, budget=100)
    b = req("b", 9, 3)
    b.num_scratch_slots = 4
    tight.add_request(b)
    out = tight.schedule()
    assert out.finished == [b] and b.finish_reason == "length" and tight.block_manager.check_all_free()


def test_add_request_rejects_what_can_never_run():
    s = make(num_blocks=2, block_size=4)
    with pytest.raises(RequestError):
        s.add_request(req("a", 9))
    with pytest.raises(RequestError):
        s.add_request(req("e", 0))
    s.add_request(req("b", 8))
    with pytest.raises(RequestError):
        s.add_request(req("b", 1))


def test_abort_anywhere_frees_everything():
    s = make(num_blocks=8, block_size=2, budget=6)
    a, b, c = req("a", 10, 9), req("b", 3, 9, base=50), req("c", 2, 9, base=80)
    for r in (a, b, c):
        s.add_request(r)
    step(s)  # a mid-prefill (6 of 10), b and c waiting
    assert s.abort_request("c") is c and c.status is RequestStatus.FINISHED_ABORTED
    assert s.abort_request("a") is a and a.block_table == [] and c.finish_reason == "abort"
    assert s.abort_request("a") is None and s.abort_request("nope") is None
    out = s.schedule()
    assert out.scheduled == [(b, 3)]
    s.abort_request("b")  # between schedule and update: update skips it
    s.update_after_step(out)
    assert b.num_computed_tokens == 0 and not s.has_unfinished_requests()
    assert s.block_manager.check_all_free()


def test_same_prompt_shares_blocks_from_the_next_step():
    s = make(num_blocks=32, block_size=4, budget=100)
    prompt_reqs = [req(x, 10, 3) for x in "abc"]
    s.add_request(prompt_reqs[0])
    s.add_request(prompt_reqs[1])
    out = step(s)  # same step: a's blocks are not written yet, b computes its own copy
    a, b, c = prompt_reqs
    assert set(a.block_table).isdisjoint(b.block_table) and out.prefix_cache_hits == 0
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    s.add_request(c)
    out = step(s)
    assert (c, 2) in out.scheduled and c.num_cached_tokens == 8
    assert c.block_table[:2] == a.block_table[:2]
    assert [s.block_manager.blocks[x].ref_cnt for x in a.block_table[:2]] == [2, 2]
    assert (out.prefix_cache_queries, out.prefix_cache_hits) == (10, 8)
    run_all(s)


def test_timing_from_the_clock_and_subclassed_requests():
    from dataclasses import dataclass as dc

    @dc(slots=True, eq=False)
    class EngineRequest(Request):
        text: str = ""

    now = [100.0]
    s = make(clock=lambda: now[0])
    r = EngineRequest("a", [1, 2, 3], Params(2), arrival_time=99.0)
    s.add_request(r)
    out = step(s)
    assert out.scheduled[0][0] is r and r.first_scheduled_time == 100.0
    now[0] = 101.5
    step(s)
    assert r.finish_time == 101.5 and r.is_finished


def check_invariants(s: Scheduler, out: SchedulerOutput) -> None:
    bm = s.block_manager
    assert not (set(map(id, s.running)) & set(map(id, s.waiting)))
    assert len(s.running) <= s.max_num_seqs
    assert all(n >= 1 for _, n in out.scheduled)
    assert len({id(r) for r, _ in out.scheduled}) == len(out.scheduled)
    if s.enable_chunked_prefill:
        assert out.num_batched_tokens <= s.max_num_batched_tokens
    elif len(out.scheduled) > 1:
        assert out.num_batched_tokens <= s.max_num_batched_tokens
    refs = Counter(b for r in s.running for b in r.block_table)
    for block in bm.blocks:
        assert block.ref_cnt == refs.get(block.block_id, 0)
        assert (block.ref_cnt == 0) == (block.block_id in bm.free_blocks)
    assert len(bm.free_blocks) + len(refs) == bm.num_blocks
    for r in s.running:
        assert len(set(r.block_table)) == len(r.block_table)
        assert len(r.block_table) == bm.blocks_needed(r.num_computed_tokens)
        for i, b in enumerate(r.block_table):
            if refs[b] > 1:  # shared only through the prefix cache, only full computed blocks
                assert bm.blocks[b].content_id and (i + 1) * bm.block_size <= r.num_computed_tokens
    for r in s.waiting:
        assert r.block_table == [] and r.num_computed_tokens == 0
    for key, b in bm.cached.items():
        assert bm.blocks[b].key == key


@pytest.mark.parametrize("seed,chunked,prefix,threshold", [
    (0, True, True, 0), (1, True, True, 6), (2, False, True, 0), (3, True, False, 0), (4, False, False, 0),
])
def test_randomized_simulation(seed, chunked, prefix, threshold):
    rng = random.Random(seed)
    s = make(num_blocks=14, block_size=4, max_num_seqs=6, budget=16, prefix=prefix,
             enable_chunked_prefill=chunked, long_prefill_token_threshold=threshold)
    prefixes = [[rng.randrange(4) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    pending = []
    for i in range(60):
        prompt = rng.choice(prefixes) + [rng.randrange(4) for _ in range(rng.randrange(1, 16))]
        pending.append(Request(str(i), prompt, Params(60 if i % 10 == 9 else rng.randrange(1, 24)), arrival_time=0.0))
    everyone = list(pending)
    steps = preemptions = hits = 0
    aborted, cut = set(), set()
    first_admitted = []
    while pending or s.has_unfinished_requests():
        for _ in range(rng.randrange(3)):
            if pending:
                s.add_request(pending.pop(0))
        if rng.random() < 0.03 and s.requests:
            aborted.add(s.abort_request(rng.choice(sorted(s.requests))).request_id)
        was_running = set(map(id, s.running))
        out = step(s, token=lambda r: rng.randrange(4))
        check_invariants(s, out)
        if out.preempted:  # a step that preempted admits nobody
            assert all(id(r) in was_running for r, _ in out.scheduled)
        for r, _ in out.scheduled:
            if r.num_cached_tokens >= 0 and r.request_id not in first_admitted:
                first_admitted.append(r.request_id)
        for r in out.finished:  # cut by the scheduler: the sequence outgrew the whole cache
            assert r.status is RequestStatus.FINISHED_LENGTH and s.block_manager.blocks_needed(r.num_tokens) > 14
            cut.add(r.request_id)
        preemptions += out.num_preemptions
        hits += out.prefix_cache_hits
        steps += 1
        assert steps < 3000, "a request starved"
    assert all(r.is_finished for r in everyone)
    assert s.block_manager.check_all_free() and not s.requests
    assert preemptions > 0 and cut  # the cache is small enough to force both
    assert (hits > 0) == prefix
    assert first_admitted == sorted(first_admitted, key=int)  # first come, first served
    for r in everyone:
        if r.request_id in aborted:
            assert r.status is RequestStatus.FINISHED_ABORTED
        elif r.request_id not in cut:
            assert r.num_output_tokens == r.sampling_params.max_tokens
