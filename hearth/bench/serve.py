"""`hearth bench serve`: a load generator for any OpenAI-compatible server.

Each request is a streamed `/v1/completions` call (`stream: true`, `max_tokens`, `ignore_eos`,
usage asked for in the last chunk). Per request it records

  TTFT      time to first token: from sending to the first chunk that carries text
  ITL       inter-token latency: the gaps between successive chunks that carry text
  TPOT      time per output token after the first: (latency - TTFT) / (output tokens - 1)
  latency   end to end, from sending to the end of the stream

and per run: the percentiles (p50, p90, p99) of each, request and token throughput, and the
goodput (requests per second that met every latency target given with --goodput).
Load is a fixed number of requests in flight (--concurrency) or Poisson arrivals at a rate
(--request-rate: exponential gaps of mean 1/rate). Several loads give several runs.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field

from hearth.errors import HearthError

METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    success: bool
    prompt_tokens: int | None
    output_tokens: int
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start: float = 0.0  # seconds since the run began
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def poisson_arrivals(count: int, rate: float, rng: random.Random) -> list[float]:
    """Send times (seconds from the start) of `count` requests arriving as a Poisson process."""
    if math.isinf(rate):
        return [0.0] * count
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 0.5, 'tpot': 0.05} (targets in ms, kept in seconds)."""
    targets = {}
    for spec in specs or []:
        for part in spec.replace(",", " ").split():
            name, _, value = part.partition(":")
            if name not in ("ttft", "tpot", "e2el") or not value:
                raise HearthError(f"bad --goodput target {part!r}; use ttft:MS, tpot:MS or e2el:MS")
            try:
                targets[name] = float(value) / 1000
            except ValueError:
                raise HearthError(f"bad --goodput target {part!r}: {value!r} is not a number of ms") from None
    return targets


def _is_good(r: RequestResult, targets: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot if r.tpot is not None else 0.0, "e2el": r.latency}
    return r.success and all(values[k] <= v for k, v in targets.items())


def summarize(results: list[RequestResult], duration: float, targets: dict[str, float] | None = None) -> dict:
    """Counts, throughput, goodput and the mean / median / percentiles of every latency (ms)."""
    done = [r for r in results if r.success]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in done)
    series = {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    summary = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration if duration > 0 else 0.0,
    }
    for name, values in series.items():
        ms = [v * 1000 for v in values]
        summary[f"mean_{name}_ms"] = sum(ms) / len(ms) if ms else math.nan
        for q in PERCENTILES:
            summary[f"p{q}_{name}_ms"] = percentile(ms, q)
    if targets:
        good = sum(_is_good(r, targets) for r in results)
        summary["goodput_targets_ms"] = {k: v * 1000 for k, v in targets.items()}
        summary["good_requests"] = good
        summary["goodput"] = good / duration if duration > 0 else 0.0
    errors = [r.error for r in results if r.error]
    if errors:
        summary["errors"] = sorted(set(errors))[:5]
    return summary


async def send_request(client, url: str, body: dict, start_of_run: float) -> RequestResult:
    """One streamed completion; parses the SSE `data:` lines as they arrive."""
    sent = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    chunks_with_text = 0
    usage = None
    prompt_len = len(body["prompt"]) if isinstance(body["prompt"], list) else None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                return RequestResult(False, prompt_len, 0, start=sent - start_of_run,
                                     error=f"HTTP {response.status_code}: {text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or []
                if choices and (choices[0].get("text") or (choices[0].get("delta") or {}).get("content")):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                    chunks_with_text += 1
    except Exception as e:  # connection refused, reset, bad JSON: a failed request, not a crash
        return RequestResult(False, prompt_len, 0, start=sent - start_of_run, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if first is None:
        return RequestResult(False, prompt_len, 0, start=sent - start_of_run, error="no tokens in the stream")
    tokens = chunks_with_text
    if usage:
        tokens = int(usage.get("completion_tokens") or tokens)
        prompt_len = usage.get("prompt_tokens", prompt_len)
    return RequestResult(True, prompt_len, tokens, ttft=first - sent, itl=gaps, latency=end - sent,
                         start=sent - start_of_run)


def make_prompts(num_prompts: int, input_len: int, vocab_size: int, dataset: str | None, seed: int) -> list:
    """Token-id prompts of input_len ids drawn from [0, vocab_size), or the dataset's texts."""
    if dataset is not None:
        from hearth.bench.throughput import read_dataset

        return [text for text, _ in read_dataset(dataset, num_prompts)]
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


async def run_load(base_url: str, model: str, prompts: list, output_len: int, concurrency: int | None,
                   request_rate: float | None, seed: int = 0, progress: bool = True, timeout: float = 600.0,
                   extra_body: dict | None = None, transport=None) -> tuple[list[RequestResult], float]:
    """Send every prompt under one load; results in prompt order and the run's duration."""
    import httpx
    from tqdm import tqdm

    url = base_url.rstrip("/") + "/v1/completions"
    arrivals = poisson_arrivals(len(prompts), request_rate if request_rate else math.inf, random.Random(seed))
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    connections = concurrency or len(prompts)
    label = f"concurrency {concurrency}" if concurrency and not request_rate else f"rate {request_rate}/s"
    bar = tqdm(total=len(prompts), desc=label, unit="req", disable=not progress, leave=False)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:
        start = time.perf_counter()

        async def one(prompt, arrival: float) -> RequestResult:
            delay = start + arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = {"model": model, "prompt": prompt, "max_tokens": output_len, "stream": True,
                    "ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True},
                    **(extra_body or {})}
            if limit is None:
                result = await send_request(client, url, body, start)
            else:
                async with limit:
                    result = await send_request(client, url, body, start)
            bar.update()
            return result

        results = await asyncio.gather(*(one(p, a) for p, a in zip(prompts, arrivals)))
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def run_serve(base_url: str, model: str, num_prompts: int, input_len: int, output_len: int,
              concurrency: list[int] | None = None, request_rate: list[float] | None = None,
              dataset: str | None = None, vocab_size: int = 256, goodput: list[str] | None = None,
              seed: int = 0, progress: bool = True, timeout: float = 600.0, transport=None) -> dict:
    """One run per load level; the report `hearth bench serve --json` prints."""
    if not concurrency and not request_rate:
        raise HearthError("give --concurrency or --request-rate")
    if num_prompts < 1 or output_len < 1 or (dataset is None and input_len < 1):
        raise HearthError("number of prompts, input length and output length must be at least 1")
    if any(c < 1 for c in concurrency or []) or any(r <= 0 for r in request_rate or []):
        raise HearthError("concurrency must be at least 1 and request rate above 0")
    targets = parse_goodput(goodput)
    prompts = make_prompts(num_prompts, input_len, vocab_size, dataset, seed)
    loads = [("concurrency", c) for c in concurrency or []] + [("request_rate", r) for r in request_rate or []]
    runs = []
    for kind, value in loads:
        results, duration = asyncio.run(run_load(
            base_url, model, prompts, output_len,
            concurrency=value if kind == "concurrency" else None,
            request_rate=value if kind == "request_rate" else None,
            seed=seed, progress=progress, timeout=timeout, transport=transport,
        ))
        if not any(r.success for r in results):
            errors = sorted({r.error for r in results if r.error})
            raise HearthError(f"every request to {base_url} failed: {'; '.join(errors[:3])}")
        runs.append({"load": kind, kind: value, **summarize(results, duration, targets),
                     "requests": [_request_row(r) for r in results]})
    return {"base_url": base_url, "model": model, "num_prompts": num_prompts,
            "input_len": None if dataset else input_len, "output_len": output_len, "dataset": dataset,
            "runs": runs}


def _request_row(r: RequestResult) -> dict:
    row = asdict(r)
    row["tpot"] = r.tpot
    return row


def format_serve(report: dict) -> str:
    lines = [f"{report['base_url']}  model {report['model']}  {report['num_prompts']} requests, "
             f"{report['input_len'] or 'dataset'} prompt / {report['output_len']} output tokens"]
    header = (f"{'load':>14} {'ok':>5} {'req/s':>7} {'out tok/s':>10} {'goodput':>8} "
              + " ".join(f"{m + ' p' + str(q):>11}" for m in ("ttft", "tpot", "itl", "e2el") for q in PERCENTILES))
    lines.append(header)
    for run in report["runs"]:
        load = f"{run['load'].replace('request_rate', 'rate')} {run[run['load']]:g}"
        cells = [f"{load:>14}", f"{run['completed']:>5}", f"{run['request_throughput']:>7.2f}",
                 f"{run['output_throughput']:>10.1f}", f"{run.get('goodput', float('nan')):>8.2f}"]
        cells += [f"{run[f'p{q}_{m}_ms']:>9.1f}ms" for m in ("ttft", "tpot", "itl", "e2el") for q in PERCENTILES]
        lines.append(" ".join(cells))
    return "\n".join(lines)
