#!/usr/bin/env python
"""Two pipeline stages (one thread each) against one process (two threads), same workload.

Each run is `hearth bench throughput MODEL --threads 2 --json`, with and without
`--pipeline-parallel-size 2` (the stages share the two cores: one thread each); the set-ups
alternate run by run, and the table gives medians and the ratio.

    python benchmarks/pipeline.py [MODEL] --runs 3 --num-prompts 32 --out benchmarks/results/pipeline
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from common import REPO, machine, machine_markdown, median, table, tiny_model, write_results

SETUPS = {"one process, 2 threads": [], "2 stages, 1 thread each": ["--pipeline-parallel-size", "2"]}


def measure(model: str, options: list[str], args) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "hearth.cli", "bench", "throughput", model, "--threads", "2", "--json",
         "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len), "--output-len",
         str(args.output_len), *options],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="default: the built-in model")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = args.model or tiny_model()[0]
    results = {name: [] for name in SETUPS}
    for run in range(args.runs):
        for name, options in SETUPS.items():
            results[name].append(measure(model, options, args))
            print(f"run {run + 1}: {name}: {results[name][-1]['output_throughput']:.1f} output tok/s", file=sys.stderr)
    rows, base = [], None
    for name, runs in results.items():
        throughput = median([r["output_tokens_per_s"] for r in runs])
        total = median([r["total_tokens_per_s"] for r in runs])
        base = base or throughput
        rows.append([name, f"{throughput:.1f}", f"{total:.1f}", f"{throughput / base:.2f}x"])
    markdown = (f"{machine_markdown(machine())}\n\n{args.num_prompts} requests at once, {args.input_len} prompt / "
                f"{args.output_len} output tokens, {model}; medians of {args.runs} runs, interleaved\n\n"
                + table(["set-up", "output tok/s", "total tok/s", "ratio"], rows))
    write_results(args.out, markdown, {"model": model, "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
