#!/usr/bin/env python
"""The router's prefix-cache hit rate by routing policy: two replicas, shared-prefix traffic.

Each run starts `hearth serve MODEL --data-parallel-size 2 --routing POLICY` with KV caches that
hold --cache-fraction of the distinct prefixes each (so where a prefix goes decides whether it is
still cached when it comes back), then sends --rounds rounds of requests: every one of --prefixes
long documents with a new question after it, --concurrency at once, in a shuffled order each
round. The hit rate is what the replicas' own prefix caches report through the router's
/metrics: prompt tokens found cached over prompt tokens looked up, both replicas together.
Policies alternate run by run; medians of --runs.

    python benchmarks/routing.py [MODEL] --runs 3 --out benchmarks/results/routing
"""

from __future__ import annotations

import argparse
import asyncio
import random

import httpx
from common import hearth_serve, machine, machine_markdown, median, table, tiny_model, write_results
from prometheus_client.parser import text_string_to_metric_families

POLICIES = ("prefix", "least_loaded", "random")


def documents(count: int, words: int) -> list[str]:
    rng = random.Random(0)
    vocabulary = "the a of and to in is was for on with as by at from that this it be are".split()
    return [f"Document {i}: " + " ".join(rng.choice(vocabulary) + str(rng.randrange(100)) for _ in range(words))
            for i in range(count)]


def cache_bytes(model: str, prefixes: list[str], fraction: float) -> int:
    """KV cache bytes that hold `fraction` of the prefixes (whole blocks each)."""
    from hearth.engine_config import EngineConfig
    from hearth.engine.engine import LLMEngine

    probe = LLMEngine(model, EngineConfig(), progress=False)
    block = probe.config.cache.block_size
    blocks = sum(-(-(len(probe.tokenizer.encode(p)) + 16) // block) for p in prefixes) / len(prefixes)
    per_token = probe.model_config.kv_bytes_per_token(probe.dtype.itemsize)
    return int(fraction * len(prefixes) * (blocks + 1) * block * per_token)


def hit_rate(url: str) -> tuple[float, float]:
    """(prompt tokens found in the replicas' prefix caches, prompt tokens looked up), both replicas."""
    totals = {"hearth:prefix_cache_hits_total": 0.0, "hearth:prefix_cache_queries_total": 0.0}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in family.samples:
            if s.name in totals and "replica" in s.labels:
                totals[s.name] += s.value
    return totals["hearth:prefix_cache_hits_total"], totals["hearth:prefix_cache_queries_total"]


async def send_rounds(url: str, prefixes: list[str], rounds: int, concurrency: int) -> None:
    rng = random.Random(1)
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(prompt: str) -> None:
            async with limit:
                r = await client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 4})
                r.raise_for_status()

        for round_ in range(rounds):
            order = rng.sample(prefixes, len(prefixes))
            await asyncio.gather(*(one(f"{p}\nQuestion {round_}: what is it about?") for p in order))


def measure(model: str, policy: str, prefixes: list[str], kv_bytes: int, args) -> float:
    with hearth_serve(model, ["--data-parallel-size", "2", "--routing", policy,
                              "--kv-cache-memory", str(kv_bytes)]) as url:
        asyncio.run(send_rounds(url, prefixes, args.rounds, args.concurrency))
        hits, queries = hit_rate(url)
    return hits / queries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="default: the built-in model")
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--words", type=int, default=60, help="words of each document")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--cache-fraction", type=float, default=0.5,
                        help="the share of the prefixes one replica's KV cache holds")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = args.model or tiny_model()[0]
    prefixes = documents(args.prefixes, args.words)
    kv_bytes = cache_bytes(model, prefixes, args.cache_fraction)
    rates: dict[str, list[float]] = {policy: [] for policy in POLICIES}
    for _ in range(args.runs):
        for policy in POLICIES:
            rates[policy].append(measure(model, policy, prefixes, kv_bytes, args))
    info = machine()
    rows = [[policy, median(values), median(values) / median(rates["random"]), ", ".join(f"{v:.3f}" for v in values)]
            for policy, values in rates.items()]
    markdown = "\n".join([
        f"### Prefix-cache hit rate by routing policy: {model}, 2 replicas",
        "",
        machine_markdown(info),
        f"- {args.prefixes} documents of {args.words} words, {args.rounds} rounds with a new question each, "
        f"{args.concurrency} at once; each replica's KV cache holds {args.cache_fraction:.0%} of the documents "
        f"({kv_bytes:,} bytes); medians of {args.runs} runs, policies alternating",
        "",
        table(["routing", "hit rate (tokens)", "vs random", "runs"], rows),
    ])
    write_results(args.out, markdown, {"info": info, "args": vars(args), "kv_cache_bytes": kv_bytes, "rates": rates})


if __name__ == "__main__":
    main()
