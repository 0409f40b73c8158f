#!/usr/bin/env python
"""The KV transfer of disaggregated prefill and decode, per prompt token.

For each transport, starts `hearth serve MODEL --disaggregate --threads 1` (one prefill and one
decode worker, a thread each, behind the router; with `--ray` for the ray transport: the workers
as actors of a local Ray instance, the KV through its object store) and sends prompts of random
token ids one at a time (max_tokens 1, none sharing a prefix); after each, reads the decode
worker's transfer metrics through the router's /metrics. Per prompt length, medians over the
prompts: bytes and transfer time per prompt token (from the prefill worker's answer to the KV in
the decode worker's cache: the body read or the object fetched, decoded, written), and the rest
of the pull (the prefill worker computing the prompt, and the request to it; with Ray, also the
actor reading its replica's answer and putting it into the object store).

    python benchmarks/kv_transfer.py [MODEL] --transports http ray --lengths 128 512 1024 --repeats 3 \
        --out benchmarks/results/kv_transfer
"""

from __future__ import annotations

import argparse
import random
import sys

import httpx
from common import hearth_serve, machine, machine_markdown, median, table, tiny_model, write_results
from prometheus_client.parser import text_string_to_metric_families

DECODE_REPLICA = "1"  # --disaggregate starts the prefill worker first
NAMES = ("hearth:kv_transfer_bytes_total", "hearth:kv_transfer_tokens_total", "hearth:kv_transfer_seconds_sum",
         "hearth:kv_prefill_seconds_sum")


def decode_metrics(http: httpx.Client, transport: str) -> dict[str, float]:
    samples = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            labels = s.labels
            if s.name in NAMES and labels.get("replica") == DECODE_REPLICA and labels.get("transport") == transport:
                samples[s.name] = s.value
    return samples


def measure(model: str, transport: str, lengths: list[int], repeats: int, rng: random.Random) -> dict:
    """{prompt length: {"bytes", "transfer_us", "rest_us": per prompt token, one a prompt}} for one transport."""
    data = {}
    with hearth_serve(model, ["--disaggregate", "--threads", "1", "--kv-cache-memory", "512MiB",
                              *(["--ray"] if transport == "ray" else [])]) as url, \
            httpx.Client(base_url=url, timeout=600) as http:
        for length in lengths:
            per_token = {"bytes": [], "transfer_us": [], "rest_us": []}
            for _ in range(repeats):
                before = decode_metrics(http, transport)
                prompt = [rng.randrange(100, 1000) for _ in range(length)]
                r = http.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1})
                r.raise_for_status()
                after = decode_metrics(http, transport)
                delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in NAMES}
                tokens = delta["hearth:kv_transfer_tokens_total"]
                if not tokens:
                    raise RuntimeError(f"no KV went through the {transport} transport")
                transfer = delta["hearth:kv_transfer_seconds_sum"]
                per_token["bytes"].append(delta["hearth:kv_transfer_bytes_total"] / tokens)
                per_token["transfer_us"].append(1e6 * transfer / tokens)
                per_token["rest_us"].append(1e6 * (delta["hearth:kv_prefill_seconds_sum"] - transfer) / tokens)
            data[length] = per_token
            print(f"{transport} {length} tokens: {per_token}", file=sys.stderr)
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="default: the built-in model")
    parser.add_argument("--transports", nargs="+", choices=["http", "ray"], default=["http", "ray"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = args.model or tiny_model()[0]
    rng = random.Random(0)
    data = {transport: measure(model, transport, args.lengths, args.repeats, rng) for transport in args.transports}
    rows = []
    for length in args.lengths:
        for transport in args.transports:
            per_token = data[transport][length]
            transfer, rest = median(per_token["transfer_us"]), median(per_token["rest_us"])
            whole = median([t + r for t, r in zip(per_token["transfer_us"], per_token["rest_us"])])
            rows.append([length, transport, f"{median(per_token['bytes']):,.0f}", f"{transfer:.1f}", f"{rest:.1f}",
                         f"{transfer / rest:.2f}", f"{whole:.1f}"])
    info = {**machine(), "threads": 1}  # each worker's --threads
    markdown = (f"{machine_markdown(info)}\n\n{model}; prompts of random token ids, one at a time; "
                f"medians of {args.repeats} prompts a length\n\n"
                + table(["prompt tokens", "transport", "bytes / token", "transfer µs / token",
                         "prefill worker's compute (and request) µs / token", "transfer / compute",
                         "whole pull µs / token"], rows))
    write_results(args.out, markdown, {"model": model, "args": vars(args), "per_token": data})


if __name__ == "__main__":
    main()
