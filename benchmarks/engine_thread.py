#!/usr/bin/env python
"""Decode at batch 1 stepped on a thread of its own (as the server's engine thread), with the model loaded on
the main thread or on a thread that exits (hearth.engine.async_engine.build_on_passing_thread): each way in a
process of its own, alternating, medians of the runs (tokens/s as `hearth bench latency` counts them).

    python benchmarks/engine_thread.py --gguf ../shared/data/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys


def measure(gguf: str, load_on: str, runs: int, threads: int) -> list[float]:
    """In this process: the model loaded on `load_on` ("main" or "passing"), decoded on another thread."""
    import random
    import threading

    import torch

    torch.set_num_threads(threads)
    from hearth.bench.latency import one_run, random_prompts
    from hearth.engine.async_engine import build_on_passing_thread
    from hearth.llm import LLM

    build = lambda: LLM(gguf, progress=False, max_num_seqs=1, max_model_len=256)  # noqa: E731
    llm = build() if load_on == "main" else build_on_passing_thread(build)
    rng, rates = random.Random(0), []

    def decode() -> None:
        one_run(llm.engine, random_prompts(1, 32, llm.engine.model_config.vocab_size, rng), 9)  # warm-up
        for _ in range(runs):
            rates.append(one_run(llm.engine, random_prompts(1, 32, llm.engine.model_config.vocab_size, rng), 33)
                         ["decode_tokens_per_s"])

    thread = threading.Thread(target=decode)
    thread.start()
    thread.join()
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--rounds", type=int, default=2, help="processes per way, alternating")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per process")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--load-on", choices=["main", "passing"], help=argparse.SUPPRESS)  # (one process's)
    args = ap.parse_args()
    if args.load_on:
        print(json.dumps(measure(args.gguf, args.load_on, args.runs, args.threads)))
        return
    rates: dict[str, list[float]] = {"main": [], "passing": []}
    for _ in range(args.rounds):
        for way in rates:
            out = subprocess.run([sys.executable, __file__, "--gguf", args.gguf, "--runs", str(args.runs), "--threads",
                                  str(args.threads), "--load-on", way], capture_output=True, text=True, check=True)
            rates[way] += json.loads(out.stdout.strip().splitlines()[-1])
    for way, values in rates.items():
        print(f"loaded on the {way} thread: decode {statistics.median(values):.1f} tok/s (runs: "
              f"{', '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    main()
