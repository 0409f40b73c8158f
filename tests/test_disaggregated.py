"""Prefill and decode on separate workers (hearth/fleet/disaggregated.py): one engine's outputs."""

from __future__ import annotations

import contextlib
import os
import signal

import httpx
import pytest

from hearth import LLM, SamplingParams
from hearth.engine_config import EngineConfig
from hearth.engine.async_engine import AsyncEngine
from hearth.engine.engine import LLMEngine
from hearth.engine.kv_cache import BlockManager
from hearth.engine.request import Request
from hearth.fleet.disaggregated import add_role
from hearth.fleet.router import Router, build_router_app
from hearth.server.app import build_app
from hearth.server.protocol import PREFILL_HEADER
from models import make_hf_model
from test_distributed import NAME, FixedReplicas, complete_all, hearth_serve, metric_samples
from test_server import serving

# prompts of 3 to 6 blocks of 16 tokens, a few sharing their first blocks
PROMPTS = [f"Once upon a time there were {i} foxes and a hen. " * (2 + i % 3) + "The quick brown fox" for i in range(16)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("pd-model") / "llama", "llama")


@pytest.fixture(scope="module")
def expected(folder) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].text for o in LLM(folder, progress=False).generate(PROMPTS, params, use_tqdm=False)]


@contextlib.contextmanager
def prefill_and_decode(folder):
    """A prefill and a decode worker (in-process servers) and the router in front; yields the
    router's URL and the two engines."""
    engines = [AsyncEngine(LLMEngine(folder, EngineConfig(), progress=False)) for _ in range(2)]
    try:
        with serving(add_role(build_app(engines[0], NAME), "prefill")) as prefill, \
                serving(add_role(build_app(engines[1], NAME), "decode")) as decode:
            router = Router(FixedReplicas([prefill, decode]), prefill_replicas=frozenset({0}))
            with serving(build_router_app(router)) as url:
                yield url, decode, engines
    finally:
        for engine in engines:
            engine.shutdown()


def test_prefill_and_decode_workers_give_one_engines_greedy_outputs(folder, expected):
    """One request alone, then 16 at once: the same text as one engine; the decode worker received
    the KV of every prompt's full blocks (and found them in its prefix cache instead of computing
    them); every KV block free on both workers after."""
    with prefill_and_decode(folder) as (url, decode_url, (prefill, decode)):
        assert complete_all(url, PROMPTS[:1], MAX_TOKENS) == expected[:1]
        assert complete_all(url, PROMPTS, MAX_TOKENS) == expected
        tokenizer, block = decode.tokenizer, decode.engine.config.cache.block_size
        full_blocks = [(len(tokenizer.encode(p)) - 1) // block * block for p in PROMPTS]
        received = metric_samples(decode_url, "hearth:kv_transfer_tokens_total", transport="http")[""]
        # the first prompt twice; prompts sharing leading blocks received them whole
        assert received == full_blocks[0] + sum(full_blocks)
        sent = metric_samples(decode_url, "hearth:kv_transfer_bytes_total", transport="http")[""]
        assert sent >= received * 2 * 2 * 2 * 16 * 4
        assert metric_samples(decode_url, "hearth:kv_transfer_failures_total", transport="http")[""] == 0
        assert decode.stats().prefix_cache_hits >= sum(full_blocks)  # computed there, not here
        assert prefill.stats().prefix_cache_queries >= sum(len(tokenizer.encode(p)) for p in PROMPTS)
        assert prefill.engine.block_manager.check_all_free() and decode.engine.block_manager.check_all_free()


def test_a_failed_pull_leaves_the_decode_worker_to_compute_the_prompt(folder, expected):
    with prefill_and_decode(folder) as (_, decode_url, (_, decode)):
        r = httpx.post(decode_url + "/v1/completions", headers={PREFILL_HEADER: "http://127.0.0.1:9"}, json={
            "prompt": PROMPTS[3], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.json()["choices"][0]["text"] == expected[3]
        assert metric_samples(decode_url, "hearth:kv_transfer_failures_total", transport="http")[""] == 1
        assert decode.engine.block_manager.check_all_free()


def test_imported_blocks_are_found_by_their_tokens():
    """import_prefix enters the missing full blocks (not the one holding the last token), after the
    ones already cached; a lookup then finds the whole chain; another prompt's does not match."""
    manager = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(14))  # blocks 0..2 full (the last token's block 3 is partial)
    held = Request("a", tokens[:9], None)
    assert manager.allocate_slots(held, 9, computed_blocks=[])
    manager.cache_blocks(held, 9)  # blocks 0 and 1 cached by a request that holds them
    entered = manager.import_prefix(tokens)
    assert [index for index, _ in entered] == [2]
    assert manager.lookup(tokens) == held.block_table[:2] + [entered[0][1]]
    assert manager.lookup(list(range(1, 15))) == []
    manager.free(held)
    assert manager.check_all_free()


@pytest.mark.slow
def test_hearth_serve_disaggregate_starts_a_prefill_and_a_decode_worker():
    """The real command on the built-in GGUF: one prefill and one decode worker behind the router;
    a greedy completion equals one engine's, its prompt's KV went through the transfer."""
    prompt = "def fibonacci(n):\n    " * 4
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with hearth_serve("--disaggregate", "--threads", "1") as url, httpx.Client(base_url=url, timeout=120) as http:
        replicas = http.get("/replicas").json()["replicas"]
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                               "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert metric_samples(url, "hearth:kv_transfer_tokens_total", transport="http")["1"] >= 16  # replica 1 decodes
        assert metric_samples(url, "hearth:router_requests_total") == {"1": 1.0}
    expected = LLM("builtin", progress=False).generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    assert r.json()["choices"][0]["text"] == expected
    assert len(replicas) == 2


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance with this process as a driver, as `ray start --head` would start one
    (`hearth serve --ray-address` joins it); yields its address."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


# prompts of 2 to 4 full blocks of the built-in model's tokens, a few sharing their first blocks
PROMPTS_RAY = [f"# step {i}\n" + "def fibonacci(n):\n    " * (2 + i % 3) for i in range(16)]


@pytest.mark.slow
def test_hearth_serve_ray_disaggregate_moves_the_kv_through_the_object_store(ray_cluster):
    """--ray --disaggregate, joining a local Ray cluster: one request alone, then 16 at once, give
    one engine's greedy text; the decode worker received every prompt's full blocks' KV through
    Ray's object store (none over HTTP, no pull failed); every KV block free on both workers after.
    A decode worker of this process pulls from the prefill worker's actor too; once the actor's
    replica has died, its pull fails and it computes the prompt itself."""
    llm = LLM("builtin", progress=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS_RAY, params, use_tqdm=False)]
    block = llm.engine.config.cache.block_size
    full_blocks = [(len(llm.get_tokenizer().encode(p)) - 1) // block * block for p in PROMPTS_RAY]
    engine = AsyncEngine(LLM("builtin", progress=False).engine)  # a cache of its own, empty
    try:
        with hearth_serve("--ray", "--ray-address", ray_cluster, "--disaggregate", "--threads", "1",
                          "--served-model-name", NAME) as url, \
                serving(add_role(build_app(engine, NAME), "decode")) as decode_url:
            assert complete_all(url, PROMPTS_RAY[:1], MAX_TOKENS) == expected[:1]
            assert complete_all(url, PROMPTS_RAY, MAX_TOKENS) == expected
            ray_tokens = metric_samples(url, "hearth:kv_transfer_tokens_total", transport="ray")
            assert ray_tokens == {"1": full_blocks[0] + sum(full_blocks)}  # replica 1 decodes, and pulled them all
            assert metric_samples(url, "hearth:kv_transfer_bytes_total", transport="ray")["1"] >= ray_tokens["1"] * 64
            assert metric_samples(url, "hearth:kv_transfer_tokens_total", transport="http") == {"1": 0.0}
            for transport in ("ray", "http"):
                assert metric_samples(url, "hearth:kv_transfer_failures_total", transport=transport) == {"1": 0.0}
            assert metric_samples(url, "hearth:router_requests_total") == {"1": 17.0}  # none to the prefill worker
            assert metric_samples(url, "hearth:kv_cache_usage_perc") == {"0": 0.0, "1": 0.0}

            prefill = httpx.get(url + "/replicas").json()["replicas"][0]
            assert prefill["kv_source"].startswith("ray://")
            for prompt, killed in ((PROMPTS_RAY[2], False), (PROMPTS_RAY[3], True)):
                if killed:
                    os.kill(prefill["pid"], signal.SIGKILL)  # the replica, under its living actor
                r = httpx.post(decode_url + "/v1/completions", headers={PREFILL_HEADER: prefill["kv_source"]},
                               json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
                               timeout=60)
                assert r.json()["choices"][0]["text"] == expected[PROMPTS_RAY.index(prompt)]
                pulled = metric_samples(decode_url, "hearth:kv_transfer_tokens_total", transport="ray")[""]
                failed = metric_samples(decode_url, "hearth:kv_transfer_failures_total", transport="ray")[""]
                assert (pulled, failed) == (full_blocks[2], killed)
            assert engine.engine.block_manager.check_all_free()
    finally:
        engine.shutdown()
