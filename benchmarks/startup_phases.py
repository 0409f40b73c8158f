#!/usr/bin/env python
"""`hearth generate` to its first token, checkouts side by side (run by run alternated): the whole
command's wall and CPU seconds (user + system, from launch to exit), and in a second process the CPU
seconds of each phase (`process_time`): import torch, the CLI's parser, import hearth.llm, LLM() (the
model's load), the first token. On a shared machine read the CPU seconds: the wall clock measures the
other jobs too.

    python benchmarks/startup_phases.py MODEL.gguf --checkouts OLD_TREE . --runs 5 --threads 2
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

PROMPT = "What is the capital of France?"
PHASES = ["import torch", "parser", "import hearth.llm", "LLM()", "first token"]
PHASE_SCRIPT = """
import sys, time
marks = [time.process_time()]
import torch
marks.append(time.process_time())
from hearth.cli import build_parser
args = build_parser().parse_args(sys.argv[1:])
marks.append(time.process_time())
import hearth.llm
from hearth.cli_generation import _sampling
from hearth.engine_args import build_llm
marks.append(time.process_time())
llm = build_llm(args)
marks.append(time.process_time())
for _ in llm.stream(args.prompt, _sampling(args)):
    pass
marks.append(time.process_time())
print(" ".join(f"{b - a:.4f}" for a, b in zip(marks, marks[1:])))
"""


def one_run(tree: str, argv: list[str], threads: int) -> tuple[float, float, list[float]]:
    """(the command's wall s, its CPU s, the phases' CPU s) in checkout `tree`."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "OMP_NUM_THREADS": str(threads)}
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "hearth.cli", *argv], env=env, cwd=tree, capture_output=True, text=True)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: hearth generate failed:\n{done.stderr[-2000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    phases = subprocess.run([sys.executable, "-c", PHASE_SCRIPT, *argv], env=env, cwd=tree, capture_output=True,
                            text=True, check=True).stdout.split()
    return wall, cpu, [float(p) for p in phases]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--checkouts", nargs="+", default=["."], help="folders holding a hearth package")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    argv = ["generate", os.path.abspath(args.model), "--prompt", PROMPT, "--max-tokens", "1", "--temperature", "0",
            "--threads", str(args.threads)]
    results = {tree: [] for tree in args.checkouts}
    loads = []
    for run in range(args.runs):
        for tree in args.checkouts:
            results[tree].append(one_run(tree, argv, args.threads))
            loads.append(os.getloadavg()[0])
            print(f"run {run} {tree}: wall {results[tree][-1][0]:.2f} s, CPU {results[tree][-1][1]:.2f} s", file=sys.stderr)
    print(f"load average (1 min) during the runs: {min(loads):.1f}-{max(loads):.1f}; medians (ranges) of {args.runs} runs\n")
    print("| checkout | command wall s | command CPU s | " + " | ".join(f"{p} CPU s" for p in PHASES) + " |")
    print("|---" * (3 + len(PHASES)) + "|")
    for tree, rows in results.items():
        phases = [spread([row[2][i] for row in rows]) for i in range(len(PHASES))]
        print(f"| {tree} | {spread([r[0] for r in rows])} | {spread([r[1] for r in rows])} | " + " | ".join(phases) + " |")


if __name__ == "__main__":
    main()
