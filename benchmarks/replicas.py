#!/usr/bin/env python
"""Two single-thread replicas behind the router against one two-thread engine, same load.

Each run starts the server (`hearth serve MODEL --threads 2`, or `hearth serve MODEL
--data-parallel-size 2`: each replica gets one of the two cores), drives it with `hearth bench
serve` (N requests, all in flight at once), and stops it; the two set-ups alternate run by run,
and the table gives medians and the ratio.

    python benchmarks/replicas.py [MODEL] --runs 3 --num-prompts 64 --out benchmarks/results/replicas
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from common import REPO, machine, machine_markdown, median, table, tiny_model, write_results

from hearth.bench.serve import run_serve

SETUPS = {"one engine, 2 threads": ["--threads", "2"], "2 replicas, 1 thread each": ["--data-parallel-size", "2"]}


def serve_and_measure(model: str, options: list[str], args) -> dict:
    proc = subprocess.Popen(
        [sys.executable, "-m", "hearth.cli", "serve", model, "--port", "0", "--no-access-log", "--log-level",
         "warning", "--served-model-name", "m", *options],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True)
    try:
        url = next((line.split()[1].removesuffix("/v1") for line in proc.stdout if line.startswith("listening")), None)
        if url is None:
            raise RuntimeError(f"the server did not start: hearth serve {model} {' '.join(options)}")
        report = run_serve(url, "m", args.num_prompts, args.input_len, args.output_len,
                           concurrency=[args.num_prompts], progress=False)
        return report["runs"][0]
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="default: the built-in model")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = args.model or tiny_model()[0]
    results = {name: [] for name in SETUPS}
    for run in range(args.runs):
        for name, options in SETUPS.items():
            results[name].append(serve_and_measure(model, options, args))
            print(f"run {run + 1}: {name}: {results[name][-1]['output_throughput']:.1f} output tok/s", file=sys.stderr)
    rows, base = [], None
    for name, runs in results.items():
        throughput = median([r["output_throughput"] for r in runs])
        base = base or throughput
        rows.append([name, f"{throughput:.1f}", f"{median([r['p50_e2el_ms'] for r in runs]):.0f}",
                     f"{throughput / base:.2f}x"])
    markdown = (f"{machine_markdown(machine())}\n\n{args.num_prompts} requests at once, {args.input_len} prompt / "
                f"{args.output_len} output tokens, {model}; medians of {args.runs} runs, interleaved\n\n"
                + table(["set-up", "output tok/s", "p50 e2e ms", "ratio"], rows))
    write_results(args.out, markdown, {"model": model, "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
