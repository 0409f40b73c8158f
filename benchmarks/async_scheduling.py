#!/usr/bin/env python
"""Asynchronous scheduling on the CPU: decode tokens/s with the overlap on and off, and the share of a
step's wall time that is not the model pass (the host's Python: scheduling, laying out, output
processing), which the overlap hides behind the pass.

    python benchmarks/async_scheduling.py --gguf ../shared/data/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --batch 1 32 --threads 2 --runs 5

B prompts of C random tokens, then D decode steps, timed by the wall clock (the overlap is about
wall time: two threads of one process). The engines with the overlap on and off alternate run by
run; figures are medians. "pass" is ModelRunner.launch (forward, logits, draws: what the worker
thread runs with the overlap on), timed where it runs; "host share" = 1 - pass time / wall time of
the decode steps: the time no pass runs, per step in ms beside it.
"""

from __future__ import annotations

import argparse
import random
import time

from common import median, set_threads


def timed_launches(runner) -> list[float]:
    """Wrap runner.launch so that each call's duration is appended to the returned list."""
    spans: list[float] = []
    launch = runner.launch

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return launch(*args, **kwargs)
        finally:
            spans.append(time.perf_counter() - start)

    runner.launch = timed
    return spans


def one_run(engine, spans: list[float], batch: int, context: int, decode: int, rng: random.Random
            ) -> tuple[float, float, float, float]:
    """(decode tokens/s, host share, ms a step, host ms a step) of one run of `batch` sequences."""
    from hearth.bench.latency import random_prompts
    from hearth.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=decode + 1, ignore_eos=True)
    for prompt in random_prompts(batch, context, engine.model_config.vocab_size, rng):
        engine.add_request(None, prompt, params)
    while not any(r.num_output_tokens for r in engine.scheduler.running):  # the prefill (and, ahead, one step)
        engine.step()
    spans.clear()
    start, tokens, steps = time.perf_counter(), 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        tokens += engine.last_step.num_generated
        steps += 1
    wall = time.perf_counter() - start
    return tokens / wall, 1 - sum(spans) / wall, 1e3 * wall / steps, 1e3 * (wall - sum(spans)) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=32, help="prompt tokens of each sequence")
    ap.add_argument("--decode", type=int, default=64, help="decode steps per run")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per engine, after one untimed")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    set_threads(args.threads)

    from hearth.llm import LLM

    engines = {on: LLM(args.gguf, progress=False, backend="cpu", async_scheduling=on,
                       max_num_seqs=max(args.batch)).engine for on in (False, True)}
    spans = {on: timed_launches(engine.runner) for on, engine in engines.items()}
    rng = random.Random(0)
    print(f"| batch | overlap | decode tok/s (median of {args.runs}) | ms a step | host share (ms a step) | runs (tok/s) |")
    print("|---|---|---|---|---|---|")
    for batch in args.batch:
        results: dict[bool, list[tuple[float, ...]]] = {False: [], True: []}
        for run in range(args.runs + 1):
            for on, engine in engines.items():  # interleaved: the machine's load falls on both alike
                figures = one_run(engine, spans[on], batch, args.context, args.decode, rng)
                if run:
                    results[on].append(figures)
        for on in (False, True):
            rates, shares, step_ms, host_ms = zip(*results[on])
            print(f"| {batch} | {'on' if on else 'off'} | {median(rates):.1f} | {median(step_ms):.1f} | "
                  f"{median(shares):.1%} ({median(host_ms):.2f}) | {', '.join(f'{r:.1f}' for r in rates)} |")


if __name__ == "__main__":
    main()
