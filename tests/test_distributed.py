"""Replicas behind one endpoint (hearth/fleet): outputs, prefix routing, a replica that dies."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from hearth import LLM, SamplingParams
from hearth.engine_config import EngineConfig
from hearth.engine.async_engine import AsyncEngine
from hearth.engine.engine import LLMEngine
from hearth.fleet.router import Router, build_router_app, prompt_key
from hearth.fleet.routing import PrefixRouter, prefix_hashes
from hearth.server.app import build_app
from models import make_hf_model
from test_server import serving

REPO = Path(__file__).resolve().parents[1]
BUILTIN = REPO / "hearth" / "assets" / "default.gguf"
NAME = "tiny"
PROMPTS = [f"Once upon a time there were {i} foxes" + " and a hen" * (i % 5) for i in range(16)]


class FixedReplicas:
    """Replicas the test started itself (in-process servers): the router only needs their URLs."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls

    def __len__(self) -> int:
        return len(self.urls)

    def url(self, index: int) -> str:
        return self.urls[index]

    def kv_source(self, index: int) -> str:
        return self.urls[index]

    async def recover(self, index: int) -> str:
        return self.urls[index]

    def pid(self, index: int) -> int:
        return os.getpid()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("dp-model") / "llama", "llama")


@contextlib.contextmanager
def replica_servers(folder: Path, count: int, **config):
    """`count` engines of the model, each behind its own in-process server."""
    engines = [AsyncEngine(LLMEngine(folder, EngineConfig.from_options(**config), progress=False)) for _ in range(count)]
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(serving(build_app(e, NAME))) for e in engines]
        try:
            yield urls, engines
        finally:
            for engine in engines:
                engine.shutdown()


def test_prefix_hashes_name_whole_chunks_by_everything_before_them():
    a = prefix_hashes("x" * 10 + "y" * 10 + "z" * 3, 10)
    b = prefix_hashes("w" * 10 + "y" * 10, 10)
    assert len(a) == 2 and len(b) == 2
    assert a[1] != b[1]  # the same second chunk after another first chunk is another prefix
    assert prefix_hashes("x" * 10 + "y" * 10, 10) == a


def test_router_policy_prefers_the_holder_unless_it_is_much_busier():
    router = PrefixRouter(3, chunk_bytes=8, balance_slack=2)
    shared = "s" * 64
    first = router.choose(shared + "one")
    assert first.matched_chunks == 0 and first.total_chunks == 8
    router.replicas[first.replica].in_flight = 2
    again = router.choose(shared + "two")
    assert again.replica == first.replica and again.matched_chunks == 8
    router.replicas[first.replica].in_flight = 3  # beyond the slack over idle replicas: balance instead
    assert router.choose(shared + "three").replica != first.replica
    router.replicas[first.replica].in_flight = 0
    router.replicas[first.replica].healthy = False
    assert router.choose(shared).replica != first.replica
    for load in router.replicas:
        load.healthy = False
    with pytest.raises(LookupError):
        router.choose(shared)
    with pytest.raises(ValueError, match="routing policy"):
        PrefixRouter(2, policy="fastest")


def test_prompt_key_reads_the_prompt_or_the_messages():
    assert prompt_key("/v1/completions", b'{"prompt": "abc", "max_tokens": 3}') == "abc"
    messages = prompt_key("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}')
    assert messages.startswith('[{"role":"user"')
    assert prompt_key("/v1/completions", b"not json") == ""
    assert prompt_key("/v1/models", b"") == ""


def test_two_replicas_give_one_engines_greedy_outputs(folder):
    expected = [o.outputs[0].text for o in LLM(folder, progress=False).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
    with replica_servers(folder, 2) as (urls, engines):
        router = Router(FixedReplicas(urls), policy="least_loaded")
        with serving(build_router_app(router)) as url:
            assert complete_all(url, PROMPTS, 12) == expected
            sent = metric_samples(url, "hearth:router_requests_total")
            assert sorted(sent) == ["0", "1"] and all(v > 0 for v in sent.values())  # both replicas served
            assert all(e.engine.block_manager.check_all_free() for e in engines)


def test_requests_naming_a_stored_response_find_the_replica_that_holds_it(folder):
    """A stored response lives on the replica that made it: follow-ups by previous_response_id, GET and
    DELETE (through the openai SDK) reach it behind a router that sends them anywhere (random), and
    each gets the answer one engine gives; a response no replica holds is a 404."""
    with replica_servers(folder, 2) as (urls, engines):
        router = Router(FixedReplicas(urls), policy="random")
        router.routing._random.seed(1)
        with serving(build_router_app(router)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            first = client.responses.create(model=NAME, input="Once upon a time", max_output_tokens=4,
                                            temperature=0)
            held = [httpx.get(f"{u}/v1/responses/{first.id}", timeout=30).status_code == 200 for u in urls]
            assert sorted(held) == [False, True]  # stored by the replica that made it, only there
            direct = openai.OpenAI(base_url=urls[held.index(True)] + "/v1", api_key="none", max_retries=0)
            expected = direct.responses.create(model=NAME, input="and then", previous_response_id=first.id,
                                               max_output_tokens=4, temperature=0).output_text
            replies = {client.responses.create(model=NAME, input="and then", previous_response_id=first.id,
                                               max_output_tokens=4, temperature=0).output_text for _ in range(6)}
            assert replies == {expected}  # the holder's own reply, whichever replica each was sent to first
            assert client.responses.retrieve(first.id).id == first.id
            client.responses.delete(first.id)
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(first.id)
            assert metric_samples(url, "hearth:router_retries_total")[""] > 0  # some went elsewhere first


def complete_all(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy completions of the prompts through the openai client, all sent at once, every other one streamed."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

    async def one(prompt: str, stream: bool) -> str:
        kwargs = dict(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
        if not stream:
            return (await client.completions.create(**kwargs)).choices[0].text
        chunks = await client.completions.create(**kwargs, stream=True)
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    async def everything():
        return await asyncio.gather(*(one(p, i % 2 == 1) for i, p in enumerate(prompts)))

    return asyncio.run(everything())


def run_shared_prefix_traffic(folder: Path, policy: str) -> float:
    """16 long prefixes sent round after round to two replicas whose KV caches hold 8 of them each:
    the prefix-cache hit rate (in tokens) over both replicas. Routed by prefix, each replica keeps
    its half cached; routed at random, a replica sent more than 8 evicts prefixes before they come
    back, and a prefix comes back to the replica holding it only half of the time."""
    prefixes = [f"Document {i}: " + " ".join(f"w{i}x{j}" for j in range(12)) for i in range(16)]
    probe = LLMEngine(folder, EngineConfig(), progress=False)
    block = probe.config.cache.block_size
    blocks = max(-(-(len(probe.tokenizer.encode(p + " q0")) + 1) // block) for p in prefixes)
    kv_bytes = 8 * blocks * block * probe.model_config.kv_bytes_per_token(4)
    with replica_servers(folder, 2, kv_cache_memory=kv_bytes) as (urls, engines):
        router = Router(FixedReplicas(urls), policy=policy, chunk_bytes=32)
        router.routing._random.seed(0)
        with serving(build_router_app(router)) as url, httpx.Client(base_url=url, timeout=60) as http:
            for round_ in range(3):
                for prefix in prefixes:
                    r = http.post("/v1/completions", json={"prompt": f"{prefix} q{round_}", "max_tokens": 1})
                    assert r.status_code == 200, r.text
        stats = [e.stats() for e in engines]
        return sum(s.prefix_cache_hits for s in stats) / sum(s.prefix_cache_queries for s in stats)


def test_prefix_routing_hits_the_cache_at_least_twice_as_often_as_random(folder):
    prefix_rate = run_shared_prefix_traffic(folder, "prefix")
    random_rate = run_shared_prefix_traffic(folder, "random")
    assert prefix_rate >= 2 * random_rate and prefix_rate > 0.4, (prefix_rate, random_rate)


def metric_samples(url: str, name: str, **labels: str) -> dict[str, float]:
    """The values of one metric by replica label, from the router's /metrics (only the samples
    with `labels`, when given)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.labels.get("replica", ""): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name and labels.items() <= s.labels.items()}


@contextlib.contextmanager
def hearth_serve(*options: str):
    """`hearth serve builtin OPTIONS` as a child process; yields the router's URL, then SIGTERMs it
    and checks that it exits cleanly."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    stderr = tempfile.TemporaryFile("w+")  # read back only when the router does not start
    proc = subprocess.Popen(
        [sys.executable, "-m", "hearth.cli", "serve", "builtin", "--port", "0", "--no-access-log",
         "--kv-cache-memory", "8MiB", "--log-level", "warning", *options],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
    )
    try:
        url = None
        for line in proc.stdout:
            if line.startswith("listening"):
                url = line.split()[1].removesuffix("/v1")
                break
        if url is None:
            proc.wait(timeout=60)
            stderr.seek(0)
            raise AssertionError(f"the router did not start (exit {proc.returncode}):\n{stderr.read()[-3000:]}")
        yield url
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stderr.close()


def run_while_killing(url: str, prompts: list[str], pid: int) -> list[str]:
    """Greedy completions of `prompts`, sent at once; process `pid` is killed while they run."""
    async def run_all() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async def one(prompt: str) -> str:
                r = await client.post("/v1/completions", json={
                    "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            tasks = [asyncio.create_task(one(p)) for p in prompts]
            while not (await client.get("/replicas")).json()["replicas"][0]["in_flight"]:
                await asyncio.sleep(0.01)  # until replica 0 holds some of them
            os.kill(pid, signal.SIGKILL)
            return await asyncio.gather(*tasks)

    return asyncio.run(run_all())


def wait_restarted(http: httpx.Client, index: int, old_pid: int, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        replica = http.get("/replicas").json()["replicas"][index]
        if replica["healthy"] and replica["pid"] != old_pid:
            return replica
        time.sleep(0.5)
    pytest.fail(f"replica {index} was not started again: {replica}")


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


PROMPTS_GGUF = [f"def function_{i}(x):" for i in range(8)]
MAX_TOKENS = 64  # long enough that the requests still run when a replica is killed


@pytest.fixture(scope="module")
def builtin_greedy() -> list[str]:
    """One engine's greedy outputs on the built-in GGUF, at the thread count the replicas get below."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].text for o in LLM("builtin", progress=False).generate(PROMPTS_GGUF, params)]


@pytest.mark.slow
def test_hearth_serve_data_parallel_survives_a_replica_killed_mid_run(builtin_greedy):
    """The real command on the built-in GGUF: outputs equal one engine's; a replica killed while
    requests run: those not yet streaming complete on the other; the endpoint stays healthy; the
    survivor's KV cache is empty afterwards; the dead replica is started again."""
    # the threads LLM runs on here, so that the replicas' sums are the same
    with hearth_serve("--data-parallel-size", "2", "--threads", str(torch.get_num_threads())) as url, \
            httpx.Client(base_url=url, timeout=120) as http:
        pids = [r["pid"] for r in http.get("/replicas").json()["replicas"]]
        assert run_while_killing(url, PROMPTS_GGUF, pids[0]) == builtin_greedy
        assert http.get("/health").status_code == 200
        assert metric_samples(url, "hearth:router_retries_total")[""] >= 1
        assert metric_samples(url, "hearth:kv_cache_usage_perc")["1"] == 0.0
        restarted = wait_restarted(http, 0, pids[0])
    assert_gone([pids[1], restarted["pid"]])  # no replica outlives the router


@pytest.mark.slow
def test_hearth_serve_ray_restarts_a_killed_actor(builtin_greedy):
    """--ray on a local Ray instance: the same outputs; the actor process of a replica killed
    mid-run: Ray restarts it, its replica process goes with it, the requests complete elsewhere."""
    with hearth_serve("--ray", "--data-parallel-size", "2", "--threads", str(torch.get_num_threads())) as url, \
            httpx.Client(base_url=url, timeout=120) as http:
        pids = [r["pid"] for r in http.get("/replicas").json()["replicas"]]
        actor_pid = int(Path(f"/proc/{pids[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its parent
        assert run_while_killing(url, PROMPTS_GGUF, actor_pid) == builtin_greedy
        assert http.get("/health").status_code == 200
        restarted = wait_restarted(http, 0, pids[0])
        assert_gone([pids[0]])  # the dead actor's replica went with it
        r = http.post("/v1/completions", json={"prompt": PROMPTS_GGUF[0], "max_tokens": MAX_TOKENS, "temperature": 0,
                                               "ignore_eos": True})
        assert r.json()["choices"][0]["text"] == builtin_greedy[0]
    assert_gone([pids[1], restarted["pid"]])
