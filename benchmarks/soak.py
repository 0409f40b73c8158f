"""Soak: drive a `hearth serve` for a given time with hostile and ordinary traffic; fail on any leak.

    python benchmarks/soak.py [--model MODEL] --duration 3600 [--json OUT.json]

Starts the server itself (the default model unless --model; a KV budget small enough to force
preemption; a small --max-queue and body limit), then runs --clients loops, each sending one
request after another, drawn from this mix:

  stream     streaming completion or chat, read to the end
  plain      non-streaming completion or chat
  cancel     streaming, closed after a random number of events
  stall      streaming, stops reading for a while after the first event, then closes
  oversized  a body past the server's --max-body-size (expects 413)
  malformed  bad JSON or wrong field types (expects 400)
  burst      many requests at once, beyond --max-queue (expects 200s and 503s)

(the first request of client i is of the i-th kind: every kind is sent at least once when --clients >= 7)

and every --sample seconds reads /metrics: resident memory, KV blocks in use, requests running
and waiting, preemptions. It reports requests served, answers by kind and status, latency
percentiles per time window, memory and KV blocks over time, and exits 1 on any failure:
a 5xx other than 503, an answer of the wrong kind (a 413 that came back 200...), KV blocks
still in use once the server is idle at the end, or resident memory more than --rss-growth
above its level at the end of warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
KINDS = {"stream": 30, "plain": 25, "cancel": 15, "stall": 5, "oversized": 5, "malformed": 10, "burst": 2}
EXPECTED = {"oversized": {413}, "malformed": {400}, "burst": {200, 503}}  # others: 200 (or 503 when busy)
WORDS = "the fox river cold stone small light tree old wind house bright far song".split()


@dataclass
class Answer:
    kind: str
    status: int | str  # an HTTP status, or the exception's class name
    start: float  # seconds since the run began
    latency: float
    message: str = ""  # the error's, for a wrong answer


@dataclass
class Sample:
    time: float
    rss_bytes: float
    kv_blocks_used: float
    kv_blocks: float
    running: float
    waiting: float
    preemptions: float


def start_server(args) -> tuple[subprocess.Popen, str]:
    """`hearth serve` on a free port; returns the process and its base URL once it listens."""
    command = [sys.executable, "-m", "hearth.cli", "serve", *([args.model] if args.model else []), "--port", "0",
               "--served-model-name", "soak", "--max-queue", str(args.max_queue), "--max-num-seqs",
               str(args.max_num_seqs), "--kv-cache-memory", args.kv_cache_memory, "--max-body-size",
               str(args.max_body_size), "--max-model-len", str(args.max_model_len), "--no-access-log",
               "--log-level", "warning", "--request-timeout", str(args.request_timeout)]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip())
        print("server |", line.rstrip(), file=sys.stderr)
        if m := re.search(r"listening\s+(http://\S+)/v1", line):
            # the rest of its output goes on to stderr (a pipe left unread would stop the server when full)
            threading.Thread(target=lambda: [print("server |", rest.rstrip(), file=sys.stderr) for rest in proc.stdout],
                             daemon=True).start()
            return proc, m.group(1)
    raise SystemExit("soak: the server did not start:\n" + "\n".join(lines[-20:]))


def read_metrics(text: str) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.labels or set(s.labels) == {"model_name"}:
                values[s.name] = s.value
    return values


async def sample(http: httpx.AsyncClient, start: float) -> Sample:
    m = read_metrics((await http.get("/metrics")).text)
    return Sample(time.monotonic() - start, m.get("process_resident_memory_bytes", float("nan")),
                  m["hearth:kv_cache_blocks_used"], m["hearth:kv_cache_blocks"], m["hearth:num_requests_running"],
                  m["hearth:num_requests_waiting"], m["hearth:num_preemptions_total"])


def request_body(rng: random.Random, stream: bool, max_tokens: int) -> tuple[str, dict]:
    prompt = " ".join(rng.choices(WORDS, k=rng.randint(3, 40)))
    common = {"model": "soak", "max_tokens": rng.randint(1, max_tokens), "temperature": rng.choice([0, 0.8]),
              "stream": stream, "seed": rng.randint(0, 2**31)}
    if rng.random() < 0.5:
        n = rng.choice([1, 1, 1, 2]) if common["temperature"] else 1  # (greedy samples would all be one)
        return "/v1/completions", {**common, "prompt": prompt, "n": n}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}


MALFORMED = [b'{"prompt": "hi", ', b"not json", b'{"prompt": {"text": 1}}', b'{"messages": "hello"}',
             b'{"prompt": "hi", "max_tokens": "many"}', b'{"prompt": "hi", "temperature": -1}',
             b'{"prompt": [1e30]}', b'{"messages": [{"role": "user", "content": [{"type": "image"}]}]}', b"[]"]


async def one(kind: str, http: httpx.AsyncClient, rng: random.Random, args, start: float) -> list[Answer]:
    began = time.monotonic()

    def answer(status, message: str = "") -> list[Answer]:
        return [Answer(kind, status, began - start, time.monotonic() - began, message[:200])]

    def of(r: httpx.Response) -> list[Answer]:
        return answer(r.status_code, "" if r.status_code == 200 else r.text)

    try:
        if kind == "oversized":
            body = b'{"prompt": "' + b"a" * (args.max_body_size + rng.randint(1, 65536)) + b'"}'
            return of(await http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"}))
        if kind == "malformed":
            path = rng.choice(["/v1/completions", "/v1/chat/completions"])
            return of(await http.post(path, content=rng.choice(MALFORMED), headers={"Content-Type": "application/json"}))
        if kind == "burst":  # more at once than the batch and the queue hold
            count = args.max_num_seqs + 2 * args.max_queue + 4
            bodies = [request_body(rng, False, 8) for _ in range(count)]
            answers = await asyncio.gather(*(http.post(p, json=b) for p, b in bodies), return_exceptions=True)
            return [Answer(kind, a.status_code, began - start, time.monotonic() - began,
                           "" if a.status_code == 200 else a.text[:200]) if isinstance(a, httpx.Response)
                    else Answer(kind, type(a).__name__, began - start, time.monotonic() - began, str(a)[:200])
                    for a in answers]
        path, body = request_body(rng, kind != "plain", args.max_tokens)
        if kind == "plain":
            return of(await http.post(path, json=body))
        async with http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return answer(r.status_code, (await r.aread()).decode(errors="replace"))
            events, stop_after = 0, rng.randint(1, 6)
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if '"error"' in line:  # an error event: its code is the answer
                    return answer(json.loads(line[6:])["error"]["code"], line)
                events += 1
                if kind == "cancel" and events >= stop_after:
                    break
                if kind == "stall" and events == 1:
                    await asyncio.sleep(rng.uniform(0.5, 3.0))  # stop reading; the server keeps writing
                    break
            return answer(r.status_code)
    except httpx.HTTPError as e:
        return answer(type(e).__name__, str(e))


def wrong(a: Answer) -> bool:
    """An answer a correct server never gives."""
    if isinstance(a.status, str):
        return True  # the connection failed
    return a.status not in EXPECTED.get(a.kind, {200, 503})


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"p50": q[49], "p99": q[98]}


async def run(args, base_url: str) -> dict:
    rng = random.Random(args.seed)
    kinds, weights = zip(*KINDS.items())
    answers: list[Answer] = []
    samples: list[Sample] = []
    # httpx keeps an idle connection 5 s by default, as long as uvicorn's keep-alive timeout: a
    # request sent on one just as the server closes it fails with ReadError (an hour
    # saw 3 in 42,478 answers); clients drop idle connections before the server does
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=args.request_timeout + 30, limits=limits) as http:
        start = time.monotonic()
        end = start + args.duration

        async def client(index: int, seed: int) -> None:
            # client i opens with kind i (in turn), then draws: a short run still sends every kind
            crng, kind = random.Random(seed), kinds[index % len(kinds)]
            while time.monotonic() < end:
                answers.extend(await one(kind, http, crng, args, start))
                kind = crng.choices(kinds, weights)[0]

        async def sampler() -> None:
            while time.monotonic() < end:
                samples.append(await sample(http, start))
                await asyncio.sleep(args.sample)

        await asyncio.gather(sampler(), *(client(i, rng.randrange(2**32)) for i in range(args.clients)))
        idle_deadline = time.monotonic() + 60  # the stalled and cancelled requests end; the server goes idle
        while True:
            last = await sample(http, start)
            if (last.running == 0 and last.waiting == 0) or time.monotonic() > idle_deadline:
                break
            await asyncio.sleep(0.2)
        samples.append(last)
    return report(args, answers, samples)


def report(args, answers: list[Answer], samples: list[Sample]) -> dict:
    window = max(args.duration / args.windows, 1e-9)
    windows = []
    for w in range(args.windows):
        ok = [a.latency for a in answers if a.status == 200 and a.kind in ("stream", "plain")
              and w * window <= a.start < (w + 1) * window]
        windows.append({"from_s": round(w * window, 1), "requests": len(ok), **percentiles(ok)})
    warm = [s for s in samples if s.time >= args.warmup] or samples
    rss_warm, rss_end = warm[0].rss_bytes, samples[-1].rss_bytes
    by_kind = {k: dict(Counter(str(a.status) for a in answers if a.kind == k)) for k in KINDS}
    failures = []
    server_errors = [a for a in answers if isinstance(a.status, int) and a.status >= 500 and a.status != 503]
    if server_errors:
        failures.append(f"{len(server_errors)} answers were 5xx other than 503: "
                        f"{dict(Counter((a.kind, a.status) for a in server_errors))}")
    odd = [a for a in answers if wrong(a) and a not in server_errors]
    if odd:
        failures.append(f"{len(odd)} wrong answers: {dict(Counter((a.kind, str(a.status)) for a in odd))}; "
                        f"for example: {sorted({a.message for a in odd})[:3]}")
    if samples[-1].running or samples[-1].waiting:
        failures.append(f"the server was not idle 60 s after the traffic stopped "
                        f"({samples[-1].running:g} running, {samples[-1].waiting:g} waiting)")
    if samples[-1].kv_blocks_used:
        failures.append(f"{samples[-1].kv_blocks_used:g} KV blocks still in use once idle")
    if rss_end > rss_warm * (1 + args.rss_growth):
        failures.append(f"resident memory grew {100 * (rss_end / rss_warm - 1):.1f}% after warm-up "
                        f"({rss_warm / 2**20:.1f} -> {rss_end / 2**20:.1f} MiB)")
    return {
        "duration_s": args.duration, "clients": args.clients, "model": args.model or "(default)",
        "served": sum(a.status == 200 for a in answers), "answers": len(answers), "answers_by_kind": by_kind,
        "preemptions": samples[-1].preemptions, "latency_windows": windows,
        "rss_mib_after_warmup": rss_warm / 2**20, "rss_mib_end": rss_end / 2**20,
        "kv_blocks": samples[-1].kv_blocks, "kv_blocks_used_end": samples[-1].kv_blocks_used,
        "kv_blocks_used_max": max(s.kv_blocks_used for s in samples),
        "samples": [vars(s) for s in samples], "failures": failures, "ok": not failures,
    }


def format_report(r: dict) -> str:
    lines = [f"soak: {r['duration_s']:g} s, {r['clients']} clients, model {r['model']}",
             f"served {r['served']} of {r['answers']} answers; {r['preemptions']:g} preemptions",
             "answers by kind (status: count):"]
    lines += [f"  {kind:<10} {counts}" for kind, counts in r["answers_by_kind"].items()]
    lines.append("latency of served stream/plain requests (s), by window:")
    for w in r["latency_windows"]:
        p50, p99 = (f"{w[k]:.3f}" if w[k] is not None else "-" for k in ("p50", "p99"))
        lines.append(f"  from {w['from_s']:>7.1f} s: {w['requests']:>5} requests, p50 {p50}, p99 {p99}")
    lines.append(f"resident memory: {r['rss_mib_after_warmup']:.1f} MiB after warm-up, {r['rss_mib_end']:.1f} MiB "
                 f"at the end; KV blocks in use: max {r['kv_blocks_used_max']:g} of {r['kv_blocks']:g}, "
                 f"{r['kv_blocks_used_end']:g} at the end")
    lines.append("verdict: " + ("ok" if r["ok"] else "FAILED\n  " + "\n  ".join(r["failures"])))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="what `hearth serve` loads (default: its default model)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    p.add_argument("--clients", type=int, default=12, help="client loops sending one request after another")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--kv-cache-memory", default="8MiB", help="small: forces preemption (8MiB: ~180 tokens of SmolLM2)")
    p.add_argument("--max-body-size", type=int, default=256 * 1024)
    p.add_argument("--max-tokens", type=int, default=48, help="largest max_tokens a request asks for")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--sample", type=float, default=2.0, help="seconds between reads of /metrics")
    p.add_argument("--warmup", type=float, default=None, help="seconds of warm-up (default: a tenth of the run)")
    p.add_argument("--rss-growth", type=float, default=0.10, help="resident memory growth allowed after warm-up")
    p.add_argument("--windows", type=int, default=6, help="latency windows in the report")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report (with every sample) here")
    args = p.parse_args(argv)
    args.warmup = args.duration / 10 if args.warmup is None else args.warmup
    proc, base_url = start_server(args)
    try:
        result = asyncio.run(run(args, base_url))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(format_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
