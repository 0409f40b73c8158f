#!/usr/bin/env python
"""One request through chat completions, OpenAI's Responses API and Anthropic's Messages API,
streamed and not: time to the first token and output tokens/s of each, the six set-ups
interleaved run by run, medians.

    python benchmarks/agent_apis.py [MODEL.gguf] --runs 5 --max-tokens 128 --threads 2 --out benchmarks/results/agent-apis

The server is `hearth serve MODEL --no-prefix-caching` (every request prefills its whole prompt) in
a child process; the client reads the raw responses and server-sent events with httpx. The same
conversation at temperature 0 gives the same tokens through every API (tests/test_*_api.py check
it), so the APIs are compared on the same work. Streamed: TTFT from sending the request to the
first text delta, tokens/s the output tokens after the first over the time after it. Not
streamed: the whole response's latency, and the output tokens over it.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from common import REPO, hearth_serve, machine, machine_markdown, median, run_interleaved, table, write_results

SYSTEM = "You are a storyteller."
USER = "Tell me a long story about a fox who learns to fly."


@dataclass
class API:
    path: str
    body: Callable[[int, bool], dict]
    is_delta: Callable[[dict], bool]  # a streamed event that carries text
    tokens: Callable[[dict], int | None]  # output tokens, from a response or a stream's last events


APIS = {
    "chat completions": API(
        "/v1/chat/completions",
        lambda n, stream: {"model": "m", "max_tokens": n, "temperature": 0, "stream": stream,
                           "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
                           **({"stream_options": {"include_usage": True}} if stream else {})},
        lambda d: bool(d.get("choices") and d["choices"][0]["delta"].get("content")),
        lambda d: (d.get("usage") or {}).get("completion_tokens")),
    "responses": API(
        "/v1/responses",
        lambda n, stream: {"model": "m", "max_output_tokens": n, "temperature": 0, "stream": stream, "store": False,
                           "instructions": SYSTEM, "input": USER},
        lambda d: d.get("type") == "response.output_text.delta",
        lambda d: ((d.get("response", d).get("usage")) or {}).get("output_tokens")),
    "messages": API(
        "/v1/messages",
        lambda n, stream: {"model": "m", "max_tokens": n, "temperature": 0, "stream": stream, "system": SYSTEM,
                           "messages": [{"role": "user", "content": USER}]},
        lambda d: d.get("type") == "content_block_delta",
        lambda d: (d.get("usage") or {}).get("output_tokens")),  # the message's, or message_delta's
}


def label(name: str, stream: bool) -> str:
    return f"{name}, {'streamed' if stream else 'whole'}"


def measure(client: httpx.Client, url: str, api: API, max_tokens: int, stream: bool) -> dict:
    start = time.perf_counter()
    if not stream:
        body = client.post(url + api.path, json=api.body(max_tokens, False)).raise_for_status().json()
        elapsed = time.perf_counter() - start
        tokens = api.tokens(body)
        return {"ttft_ms": elapsed * 1e3, "tokens_per_s": tokens / elapsed, "output_tokens": tokens}
    first = last = tokens = None
    with client.stream("POST", url + api.path, json=api.body(max_tokens, True)) as res:
        for line in res.raise_for_status().iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data, now = json.loads(line.removeprefix("data: ")), time.perf_counter()
            if api.is_delta(data):
                first, last = first or now, now
            tokens = api.tokens(data) or tokens
    return {"ttft_ms": (first - start) * 1e3, "tokens_per_s": (tokens - 1) / (last - first), "output_tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?",
                        default=str(REPO.parent / "shared/data/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    options = ["--no-prefix-caching"] + (["--threads", str(args.threads)] if args.threads else [])
    with hearth_serve(args.model, options) as url, httpx.Client(timeout=600) as client:
        setups = {label(name, stream): (api, stream) for stream in (True, False) for name, api in APIS.items()}
        measure(client, url, APIS["chat completions"], args.max_tokens, True)  # warm-up
        results = run_interleaved(setups, lambda s: measure(client, url, s[0], args.max_tokens, s[1]), args.runs,
                                  "tokens_per_s")
    medians = {key: (median([r["ttft_ms"] for r in runs]), median([r["tokens_per_s"] for r in runs]))
               for key, runs in results.items()}
    rows = []
    for stream in (True, False):
        base_ttft, base_rate = medians[label("chat completions", stream)]
        for name in APIS:
            ttft, rate = medians[label(name, stream)]
            rows.append([label(name, stream), f"{ttft:.1f}", f"{rate:.1f}", f"{ttft / base_ttft:.3f}",
                         f"{rate / base_rate:.3f}", sorted({r["output_tokens"] for r in results[label(name, stream)]})])
    info = machine()
    info["threads"] = args.threads or info["threads"]
    markdown = (f"{machine_markdown(info)}\n\none request ({args.max_tokens} output tokens at most, temperature 0), "
                f"{args.model}; medians of {args.runs} runs, the set-ups interleaved\n\n"
                + table(["API", "TTFT (streamed) or latency, ms", "output tok/s", "TTFT / chat's", "tok/s / chat's",
                         "output tokens"], rows))
    write_results(args.out, markdown, {"model": args.model, "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
