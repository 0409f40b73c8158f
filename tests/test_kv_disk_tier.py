"""The tiers under the prefix cache: the disk tier (--kv-cache-dir): blocks the KV cache evicts are written to
files and loaded back; the greedy tokens stay transformers' whether a prefix comes from the computation, the
cache, the disk or the disk after a restart; bad files are skipped; the size bound holds. The RAM tier
(--kv-cache-ram) ahead of it, on the cpu and gpu backends, and both tiers' q8_0 blocks (--kv-cache-tier-dtype)."""

from __future__ import annotations

import asyncio
import logging
import random
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from hearth import LLM, SamplingParams
from hearth.cli import build_parser
from hearth.engine_args import engine_argv, engine_options
from hearth.engine_config import CacheConfig, EngineConfig
from hearth.engine.async_engine import AsyncEngine
from hearth.engine.embedding import embed
from hearth.engine.kv_cache import BlockManager, chain_hash
from hearth.engine.kv_disk_tier import SUFFIX, DiskTier
from hearth.engine.kv_tiers import KVTiers
from hearth.engine.request import Request
from hearth.engine.startup import kv_tiers
from hearth.errors import HearthError
from hearth.kv_format import block_payloads
from hearth.server.metrics import ServerMetrics
from models import VOCAB_SIZE, load_hf_reference, make_hf_model
from test_gpu_backend import DEVICE

BLOCK = 16
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 kv heads x head_dim 16 x fp32
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("tier-model") / "llama", "llama")


def reference_greedy(folder, prompts: list[list[int]]) -> list[list[int]]:
    model = load_hf_reference(folder)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
                for p in prompts]


def tiered_llm(folder, directory, backend: str) -> LLM:
    # 8 blocks: each 70-token prompt takes 5, so the next one evicts the one before
    return LLM(folder, kv_cache_memory=8 * BLOCK * KV_BYTES_PER_TOKEN, kv_cache_dir=str(directory), backend=backend,
               progress=False)


def greedy_tokens(llm: LLM, prompt: list[int]) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate([prompt], params)[0].outputs[0].token_ids


def block_file(llm: LLM, prompt: list[int], index: int):
    """The file of the prompt's block `index` (the tier's name for it: its chain hash)."""
    tier = llm.engine.kv_disk_tier
    content_hash = tier.identity
    for i in range(index + 1):
        content_hash = chain_hash(content_hash, prompt[i * BLOCK:(i + 1) * BLOCK])
    return tier.directory / f"{content_hash.hex()}.kv"


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_evicted_blocks_come_back_from_disk_and_after_a_restart(llama, tmp_path, caplog, backend):
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(70)] for _ in range(3)]  # 4 full blocks each
    expected = reference_greedy(llama, prompts)
    directory = tmp_path / "tier"

    first = tiered_llm(llama, directory, backend)
    tier = first.engine.kv_disk_tier
    assert [greedy_tokens(first, p) for p in prompts] == expected  # each evicts the one before
    first.engine.kv_tiers.close()  # the writer thread's files written (it hashes and writes off the step)
    # prompt 1 evicts the last of prompt 0's 4 full blocks, prompt 2 the other 3 and one of prompt 1's
    assert tier.counts.blocks_written == 5 and tier.counts.hits == 0
    assert block_file(first, prompts[0], 3).exists()
    assert greedy_tokens(first, prompts[0]) == expected[0]  # its 4 blocks back from disk
    assert tier.counts.hits == 4 and tier.counts.bytes_read > 4 * first.engine.runner.tier_block_bytes()
    # an embedding borrows all 8 blocks: prompt 2's, still cached, reach the disk before it writes over them
    embed(first.engine, [[rng.randrange(VOCAB_SIZE) for _ in range(8 * BLOCK)]])
    assert greedy_tokens(first, prompts[2]) == expected[2] and tier.counts.hits == 8

    first.engine.close()
    second = tiered_llm(llama, directory, backend)  # a restart: the files are all it has
    assert greedy_tokens(second, prompts[1]) == expected[1]
    assert second.engine.kv_disk_tier.counts.hits == 4
    assert second.engine.block_manager.prefix_cache_hits == 4 * BLOCK

    # a corrupted block 1 of prompt 1 and a truncated block 0 of prompt 0: skipped, removed, recomputed
    second.engine.close()
    third = tiered_llm(llama, directory, backend)
    corrupted, truncated = block_file(third, prompts[1], 1), block_file(third, prompts[0], 0)
    data = bytearray(corrupted.read_bytes())
    data[-5] ^= 0xFF
    corrupted.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-7])
    with caplog.at_level(logging.WARNING, logger="hearth"):
        assert [greedy_tokens(third, prompts[1]), greedy_tokens(third, prompts[0])] == [expected[1], expected[0]]
    assert "checksum mismatch" in caplog.text and "truncated" in caplog.text
    counts = third.engine.kv_disk_tier.counts
    assert counts.skipped == 2 and counts.hits == 1  # prompt 1's block 0 only
    assert not truncated.exists()

    # the counts reach the engine's stats and /metrics (through the async engine, as the server reads them)
    engine = AsyncEngine(third.engine)
    try:
        asyncio.run(served(engine, prompts[2]))
        stats = engine.stats()
        assert stats.kv_disk_tier == third.engine.kv_disk_tier.counts and stats.kv_disk_tier.hits >= 1
        registry = ServerMetrics(engine, "m").registry
        assert registry.get_sample_value("hearth:kv_disk_tier_hits_total", {"model_name": "m"}) == stats.kv_disk_tier.hits
        assert registry.get_sample_value("hearth:kv_disk_tier_skipped_files_total", {"model_name": "m"}) == 2
        assert registry.get_sample_value("hearth:kv_disk_tier_dropped_blocks_total", {"model_name": "m"}) == 0
    finally:
        engine.shutdown()


def test_a_server_shutdown_saves_the_blocks_still_cached_for_the_next_start(llama, tmp_path):
    """Blocks the cache never evicted reach the disk tier when the async engine (a server) shuts down, or the
    engine closes (offline), so the next start finds the prompt's prefix there: transformers' greedy tokens, every full block a disk hit."""
    prompt = [random.Random(9).randrange(VOCAB_SIZE) for _ in range(70)]  # 4 full blocks
    directory = tmp_path / "tier"
    first = tiered_llm(llama, directory, "cpu")
    engine = AsyncEngine(first.engine)
    asyncio.run(served(engine, prompt))
    assert first.engine.kv_disk_tier.counts.blocks_written == 0  # nothing evicted
    engine.shutdown()
    assert first.engine.kv_disk_tier.counts.blocks_written == 4

    second = tiered_llm(llama, directory, "cpu")
    assert greedy_tokens(second, prompt) == reference_greedy(llama, [prompt])[0]
    assert second.engine.kv_disk_tier.counts.hits == 4
    # offline (LLM, hearth generate / chat): the engine's close saves them too
    other = [random.Random(10).randrange(VOCAB_SIZE) for _ in range(70)]
    greedy_tokens(second, other)
    second.engine.close()
    third = tiered_llm(llama, directory, "cpu")
    assert greedy_tokens(third, other) == reference_greedy(llama, [other])[0]
    assert third.engine.kv_disk_tier.counts.hits == 4


@pytest.mark.parametrize("tier", ["disk", "ram"])
def test_a_sleep_saves_the_blocks_still_cached_and_the_next_turn_hits(llama, tmp_path, tier):
    """A level-1 sleep (the KV cache given back, AsyncEngine.sleep) first saves the blocks the prefix
    cache holds to the tiers, so that after it the same prompt finds its 4 full blocks there: transformers'
    greedy tokens, 4 tier hits, 64 cached tokens."""
    prompt = [random.Random(10).randrange(VOCAB_SIZE) for _ in range(70)]  # 4 full blocks
    if tier == "disk":
        llm = tiered_llm(llama, tmp_path / "tier", "cpu")
    else:
        llm = ram_tiered_llm(llama, 8 * BLOCK * KV_BYTES_PER_TOKEN)
    engine = AsyncEngine(llm.engine)
    try:
        asyncio.run(served(engine, prompt))
        asyncio.run(engine.sleep())
        counts = llm.engine.kv_tiers.disk.counts if tier == "disk" else llm.engine.kv_tiers.ram.counts
        assert counts.blocks_written == 4 and counts.hits == 0
        assert all(not t.any() for t, _ in llm.engine.runner._cache_tensors())  # its pages given back
    finally:
        engine.shutdown()
    before = llm.engine.block_manager.prefix_cache_hits
    assert greedy_tokens(llm, prompt) == reference_greedy(llama, [prompt])[0]
    assert counts.hits == 4 and llm.engine.block_manager.prefix_cache_hits - before == 4 * BLOCK


async def served(engine: AsyncEngine, prompt: list[int]) -> None:
    async for _ in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=2)):
        pass


def test_size_bound_and_foreign_files(tmp_path, caplog):
    payload = bytes(range(200))
    tier = DiskTier(tmp_path, max_bytes=3 * (len(payload) + 80), identity=b"a" * 32, payload_bytes=len(payload))
    hashes = [bytes([i]) * 16 for i in range(5)]
    for h in hashes[:3]:
        tier.write(h, payload)
        tier.close()  # (written now: its writer thread ended)
        time.sleep(0.02)  # (mtimes a file-system clock tick apart: a restart orders the files by them)
    assert tier.read(hashes[0]) == payload  # now the most recently used
    time.sleep(0.02)
    tier.write(hashes[3], payload)  # one too many: the least recently used (1) goes
    tier.close()
    assert [h in tier for h in hashes] == [True, False, True, True, False]
    assert sorted(p.stem for p in tmp_path.glob("*.kv")) == sorted(h.hex() for h in (hashes[0], hashes[2], hashes[3]))
    reopened = DiskTier(tmp_path, tier.max_bytes, b"a" * 32, len(payload))  # a restart keeps the order
    reopened.write(hashes[4], payload)
    reopened.close()
    assert [h in reopened for h in hashes] == [True, False, False, True, True]
    foreign = DiskTier(tmp_path, tier.max_bytes, b"b" * 32, len(payload))  # another model's files
    with caplog.at_level(logging.WARNING, logger="hearth"):
        assert foreign.read(hashes[0]) is None
    assert "another model" in caplog.text and hashes[0] not in foreign


@pytest.fixture
def held_writer(monkeypatch):
    """The disk tier's writer thread held before each file it writes until `go` is set; `holding` is set once
    it holds a block (taken from the queue, not yet written)."""
    go, holding = threading.Event(), threading.Event()
    write_file = DiskTier._write_file

    def held(tier, block_hash, payload):
        holding.set()
        go.wait(10)
        return write_file(tier, block_hash, payload)

    monkeypatch.setattr(DiskTier, "_write_file", held)
    yield SimpleNamespace(go=go, holding=holding)
    go.set()


def new_writers(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.name == "hearth-kv-disk-writer"]


def test_the_writer_queue_is_bounded_and_close_writes_it_out(tmp_path, held_writer):
    """A queue of 2 blocks behind the block being written: a third drops the oldest queued (counted), unless
    the write waits for room (a shutdown's save); queued blocks are read from memory before any file exists;
    close() writes the rest and ends the thread; the files read back checked after a restart."""
    payload, threads = bytes(range(200)), set(threading.enumerate())
    tier = DiskTier(tmp_path, 2**20, b"a" * 32, len(payload), queue_bytes=2 * len(payload))
    hashes = [bytes([i]) * 16 for i in range(5)]
    tier.write(hashes[0], payload)
    assert held_writer.holding.wait(10)  # block 0 taken from the queue
    for h in hashes[1:4]:
        tier.write(h, payload)
    assert [h in tier for h in hashes] == [True, False, True, True, False] and tier.counts.dropped == 1
    assert tier.read(hashes[0]) == payload and tier.read(hashes[3]) == payload and not list(tmp_path.iterdir())
    threading.Timer(0.2, held_writer.go.set).start()
    tier.write(hashes[4], payload, wait=True)  # waits until the writer took block 2
    tier.close()
    assert not new_writers(threads) and tier.counts.dropped == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(h.hex() + SUFFIX for h in hashes if h != hashes[1])
    assert tier.counts.blocks_written == 4 and tier.counts.hits == 2
    assert DiskTier(tmp_path, 2**20, b"a" * 32, len(payload)).read(hashes[4]) == payload


def test_blocks_still_queued_for_the_disk_are_found_there(llama, tmp_path, held_writer):
    """While the writer thread holds the first evicted block, a prompt whose 4 blocks were all evicted finds them
    in memory (the one being written, the others queued; no file yet) and gets transformers' tokens and the
    logprobs of a prefix-cache hit never evicted, bit for bit; the engine's close writes every block and ends
    the writer thread."""
    rng = random.Random(11)
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(70)] for _ in range(3)]
    llm, threads = tiered_llm(llama, tmp_path, "cpu"), set(threading.enumerate())
    tier = llm.engine.kv_disk_tier
    assert greedy_tokens(llm, prompts[0]) == reference_greedy(llama, prompts[:1])[0]
    never_evicted = greedy_logprobs(llm, prompts[0])  # its 4 full blocks from the cache
    for prompt in prompts[1:]:
        greedy_tokens(llm, prompt)  # evict prompt 0's 4 blocks and one of prompt 1's
    assert held_writer.holding.is_set() and tier.counts.blocks_written == 0
    assert greedy_logprobs(llm, prompts[0]) == never_evicted
    assert tier.counts.hits == 4 and not list(tmp_path.glob("*" + SUFFIX))
    held_writer.go.set()
    llm.engine.close()
    assert not new_writers(threads) and tier.counts.dropped == 0
    assert tier.counts.blocks_written == len(list(tmp_path.glob("*" + SUFFIX))) >= 5


def test_off_for_hybrids_and_without_prefix_caching(tmp_path, caplog):
    hybrid = SimpleNamespace(is_hybrid=True, architecture="lfm2")
    dense = SimpleNamespace(is_hybrid=False, architecture="llama")
    asked = CacheConfig(kv_cache_dir=str(tmp_path))
    cases = [(EngineConfig(cache=asked), hybrid, "a hybrid model (lfm2)"),
             (EngineConfig(cache=CacheConfig(kv_cache_dir=str(tmp_path), enable_prefix_caching=False)), dense,
              "prefix caching is off")]
    for config, model_config, why in cases:
        with caplog.at_level(logging.INFO, logger="hearth"):
            assert kv_tiers(config, model_config, tmp_path, "float32", 2, 1024, split=False) is None
        assert why in caplog.text
    assert kv_tiers(EngineConfig(), dense, tmp_path, "float32", 2, 1024, split=False) is None  # not asked for
    (tmp_path / "a-file").write_text("")
    with pytest.raises(HearthError, match="not a folder"):
        kv_tiers(EngineConfig(cache=CacheConfig(kv_cache_dir=str(tmp_path / "a-file"))), dense, tmp_path,
                     "float32", 2, 1024, split=False)


def test_block_manager_lists_evictions_by_hash_and_drops_a_load_evicted_before_it_ran(tmp_path):
    disk = DiskTier(tmp_path, 2**20, identity=b"i" * 32, payload_bytes=4)
    bm = BlockManager(3, block_size=2, tiers=KVTiers(b"i" * 32, None, disk, q8_0=False))
    first = Request("a", [1, 2, 3, 4, 5])
    assert bm.allocate_slots(first, 5, bm.get_computed_blocks(first)[0])
    bm.cache_blocks(first, 5)  # blocks of (1, 2) and (3, 4)
    bm.free(first)
    other = Request("b", [9] * 5)
    assert bm.allocate_slots(other, 5, [])  # takes every block: both cached ones are evicted
    hashes = [chain_hash(b"i" * 32, (1, 2))]
    hashes.append(chain_hash(hashes[0], (3, 4)))
    evicted, loads = bm.take_tier_moves()
    assert sorted(h for h, _ in evicted) == sorted(hashes) and not loads
    for h in hashes:
        disk.write(h, h[:4])
    bm.free(other)
    again = Request("c", [1, 2, 3, 4, 7])
    blocks, hit = bm.get_computed_blocks(again)  # both from disk: entered, to be loaded
    assert hit == 4 and [bm.loads[b] for b in blocks] == [h[:4] for h in hashes]
    assert bm.allocate_slots(Request("d", [8] * 6), 6, [])  # evicts them before any step loaded them
    assert bm.take_tier_moves() == ([], {})  # nothing to load, nothing to save (the disk has them)


def greedy_logprobs(llm: LLM, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and each one's logprob (the log-softmax of its logits) with the 3 next best."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    out = llm.generate([prompt], params)[0].outputs[0]
    return out.token_ids, [lp for step in out.logprobs for lp in step.values()]


def ram_tiered_llm(folder, ram_bytes: int, **options) -> LLM:
    # as tiered_llm: 8 blocks, a 70-token prompt takes 5
    return LLM(folder, kv_cache_memory=8 * BLOCK * KV_BYTES_PER_TOKEN, kv_cache_ram=ram_bytes, progress=False,
               **options)


def test_ram_tier_returns_the_logits_of_blocks_never_evicted(llama):
    """Evicted blocks come back from RAM with the logprobs of a prefix-cache hit never evicted, bit for bit;
    the RAM tier's bound holds (least recently used out) and its counts reach the engine's stats."""
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(70)] for _ in range(3)]
    expected = reference_greedy(llama, prompts[:1])[0]
    llm = ram_tiered_llm(llama, 5 * BLOCK * KV_BYTES_PER_TOKEN)  # 5 blocks
    ram, block_bytes = llm.engine.kv_tiers.ram, llm.engine.runner.tier_block_bytes()
    assert llm.engine.kv_disk_tier is None and greedy_tokens(llm, prompts[0]) == expected  # cold
    never_evicted = greedy_logprobs(llm, prompts[0])  # its 4 full blocks from the cache
    assert llm.engine.block_manager.prefix_cache_hits == 4 * BLOCK and ram.counts.blocks_written == 0
    for prompt in prompts[1:]:
        greedy_tokens(llm, prompt)  # evict prompt 0's 4 blocks and one of prompt 1's
    assert ram.counts.blocks_written == 5 and ram.total_bytes == 5 * block_bytes
    assert greedy_logprobs(llm, prompts[0]) == never_evicted  # its 4 blocks from RAM: the same floats
    runner = llm.engine.runner  # its K/V in one allocation: one gather, the bytes of a gather per tensor (copies)
    copies = [(t.clone(), packable) for t, packable in runner._cache_tensors()]
    assert runner.block_bytes([2, 5]) == block_payloads(copies, runner._slots([2, 5]), 2, False)
    assert ram.counts.hits == 4 and ram.counts.bytes_read == 4 * block_bytes and ram.counts.read_seconds > 0
    # loading them evicted prompt 2's blocks: into RAM, whose least recently used went (it holds 5 at most)
    assert ram.counts.blocks_written > 5 and ram.total_bytes == 5 * block_bytes
    engine = AsyncEngine(llm.engine)  # the counts reach /metrics, as the server reads them
    try:
        asyncio.run(served(engine, prompts[1]))
        registry = ServerMetrics(engine, "m").registry
        assert engine.stats().kv_ram_tier == ram.counts
        for name, value in (("hits", ram.counts.hits), ("written_bytes", ram.counts.bytes_written)):
            assert registry.get_sample_value(f"hearth:kv_ram_tier_{name}_total", {"model_name": "m"}) == value
    finally:
        engine.shutdown()


def test_ram_tier_on_the_gpu_backend(llama):
    """The same on the gpu backend (its Triton kernels on CPU tensors, interpreted here: a step costs about
    a second, so blocks of 4 tokens and 4 steps): a cache of 4 blocks, a 9-token prompt's 2 full blocks
    evicted by a 13-token one come back from RAM, and the next token's logprobs are bit for bit those of
    a hit never evicted."""
    rng = random.Random(8)
    first, second = [rng.randrange(VOCAB_SIZE) for _ in range(9)], [rng.randrange(VOCAB_SIZE) for _ in range(13)]
    kv_bytes = 4 * 4 * KV_BYTES_PER_TOKEN  # 4 blocks of 4 tokens
    llm = LLM(llama, kv_cache_memory=kv_bytes, kv_cache_ram=kv_bytes, block_size=4, backend="gpu", device=DEVICE,
              dtype="float32", progress=False)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=3)
    run = lambda prompt: llm.generate([prompt], params)[0].outputs[0]  # noqa: E731
    run(first)
    never_evicted = run(first)  # its 2 full blocks from the cache
    run(second)  # takes all 4 blocks
    through_ram = run(first)
    assert llm.engine.kv_ram_totals.hits == 2 and llm.engine.kv_ram_totals.blocks_written == 4
    assert (through_ram.token_ids, through_ram.logprobs) == (never_evicted.token_ids, never_evicted.logprobs)


def test_q8_0_tiers_move_logits_by_a_bounded_amount(llama, tmp_path):
    """kv_cache_tier_dtype q8_0: a float32 cache's blocks stored as q8_0 (3.8x fewer bytes) in RAM and on disk;
    through either, the greedy tokens stay transformers' and the logprobs within 0.02 of a hit never evicted."""
    rng = random.Random(9)
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(70)] for _ in range(3)]
    expected = reference_greedy(llama, prompts)
    q8_0_block = BLOCK * KV_BYTES_PER_TOKEN // 4 // 32 * 34  # float32 values: 34 bytes per 32 as q8_0
    llm = ram_tiered_llm(llama, 3 * q8_0_block, kv_cache_dir=str(tmp_path), kv_cache_tier_dtype="q8_0")
    runner, tiers = llm.engine.runner, llm.engine.kv_tiers
    assert tiers.q8_0 and runner.tier_block_bytes(True) == q8_0_block and runner.tier_block_bytes() == 4 * 32 / 34 * q8_0_block
    never_evicted = [greedy_logprobs(llm, p) for p in prompts[:1]][0]
    for prompt, tokens in zip(prompts[1:], expected[1:]):
        assert greedy_tokens(llm, prompt) == tokens
    # prompt 0's blocks went 3, 2, 1, 0, then prompt 1's block 3: RAM kept the last 3, the disk all
    tokens, logprobs = greedy_logprobs(llm, prompts[0])  # blocks 0-1 from RAM, 2-3 from disk
    assert tiers.ram.counts.hits == 2 and tiers.disk.counts.hits == 2
    assert tokens == never_evicted[0] == expected[0]
    assert max(abs(a - b) for a, b in zip(logprobs, never_evicted[1])) < 0.02
    assert logprobs != never_evicted[1]  # (they did go through q8_0)


def test_ram_tier_flags():
    """--kv-cache-ram and llama.cpp's --cache-ram (a bare number: MiB, as llama.cpp reads it)."""
    parser = build_parser()
    assert engine_options(parser.parse_args(["serve", "--cache-ram", "8192"]))["kv_cache_ram"] == 8 << 30
    assert engine_options(parser.parse_args(["serve", "--kv-cache-ram", "512MiB"]))["kv_cache_ram"] == 512 << 20
    assert engine_options(parser.parse_args(["serve", *engine_argv(kv_cache_ram=3 << 20)]))["kv_cache_ram"] == 3 << 20
    with pytest.raises(ValueError, match="kv_cache_ram"):
        CacheConfig(kv_cache_ram=-1)


def test_queued_blocks_are_written_when_generate_ends_without_teardown(tmp_path):
    """`hearth generate` and `chat` end with cli._exit_at_once (no thread joins): the exit handlers still write
    every queued block (a process without torch: no model needed)."""
    code = ("import sys; from hearth.cli import _exit_at_once; from hearth.engine.kv_disk_tier import DiskTier\n"
            "tier = DiskTier(sys.argv[1], 2**20, b'a' * 32, 4096)\n"
            "for i in range(8): tier.write(bytes([i]) * 16, bytes([i]) * 4096)\n"
            "_exit_at_once(0)\n")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60)
    tier = DiskTier(tmp_path, 2**20, b"a" * 32, 4096)
    assert [tier.read(bytes([i]) * 16) for i in range(8)] == [bytes([i]) * 4096 for i in range(8)]
