#!/usr/bin/env python
"""Waking a sleeping model against loading it cold, in a server of several models (docs/several-models.md).

    python benchmarks/sleep_wake.py [MODEL.gguf] --runs 5 --threads 2 --out benchmarks/results/sleep-wake

The server is `hearth serve --model m=MODEL` in a child process. Each run, in turn: a level-2 sleep
(the engine dropped, as unloaded) then POST /wake_up, which loads it (cold load); a level-1 sleep (the
KV cache's pages given back, the weights kept) then POST /wake_up; and after each of those sleeps the
first request (one greedy token of a short prompt: the wake or load it causes, then the prefill). The
server's resident memory (its /metrics) is read awake (with a 2k-token prompt's KV cached before the
level-1 sleep) and asleep. Medians over the runs.
"""

from __future__ import annotations

import argparse
import time

import httpx

from common import REPO, hearth_serve, machine, machine_markdown, median, table, write_results

SMOLLM2 = REPO.parent / "shared" / "data" / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 200  # ~2,000 tokens
REQUEST = {"model": "m", "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}


def rss_mib(http: httpx.Client) -> float:
    line = next(line for line in http.get("/metrics").text.splitlines() if line.startswith("process_resident_memory"))
    return float(line.split()[-1]) / 2**20


def seconds(http: httpx.Client, method: str, path: str, **kwargs) -> float:
    start = time.perf_counter()
    http.request(method, path, **kwargs).raise_for_status()
    return time.perf_counter() - start


def one_run(http: httpx.Client) -> dict[str, float]:
    run = {}
    for level in (2, 1):
        if level == 1:  # a long prompt's KV in the cache first, so that giving it back shows
            http.post("/v1/completions", json=REQUEST | {"prompt": LONG_PROMPT}).raise_for_status()
            run["awake, 2k tokens cached MiB"] = rss_mib(http)
        http.post("/sleep", params={"level": level}).raise_for_status()
        run[f"asleep {level} MiB"] = rss_mib(http)
        run[f"wake_up after level {level} s"] = seconds(http, "POST", "/wake_up")
        http.post("/sleep", params={"level": level}).raise_for_status()
        run[f"first request after level {level} s"] = seconds(http, "POST", "/v1/completions", json=REQUEST)
        run["awake request s"] = seconds(http, "POST", "/v1/completions", json=REQUEST)
        run["awake MiB"] = rss_mib(http)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=str(SMOLLM2))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    info = machine()
    with hearth_serve(None, ["--model", f"m={args.model}", "--threads", str(args.threads)]) as url, \
            httpx.Client(base_url=url, timeout=600) as http:
        http.post("/v1/completions", json=REQUEST).raise_for_status()  # the first load: kernels, page cache
        runs = [one_run(http) for _ in range(args.runs)]
    keys = list(runs[0])
    rows = [[key, median([r[key] for r in runs]), min(r[key] for r in runs), max(r[key] for r in runs)] for key in keys]
    markdown = (f"Sleep and wake: {args.model}, {args.runs} runs\n\n{machine_markdown(info)}\n\n"
                + table(["measure", "median", "min", "max"], rows))
    write_results(args.out, markdown, {"machine": info, "model": args.model, "runs": runs})


if __name__ == "__main__":
    main()
