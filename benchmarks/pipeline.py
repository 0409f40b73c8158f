#!/usr/bin/env python
"""Two pipeline stages (one thread each) against one process (two threads), same workload.

Each run is `hearth bench throughput MODEL --threads 2 --json`, with and without
`--pipeline-parallel-size 2` (the stages share the two cores: one thread each); the set-ups
alternate run by run, and the table gives medians and the ratio.

    python benchmarks/pipeline.py [MODEL] --runs 3 --num-prompts 32 --out benchmarks/results/pipeline
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from common import REPO, report_interleaved, run_interleaved, tiny_model, workload_parser

SETUPS = {"one process, 2 threads": [], "2 stages, 1 thread each": ["--pipeline-parallel-size", "2"]}


def measure(model: str, options: list[str], args) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "hearth.cli", "bench", "throughput", model, "--threads", "2", "--json",
         "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len), "--output-len",
         str(args.output_len), *options],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    args = workload_parser(__doc__, 32).parse_args()
    model = args.model or tiny_model()[0]
    results = run_interleaved(SETUPS, lambda options: measure(model, options, args), args.runs, "output_tokens_per_s")
    report_interleaved(results, model, args, "output_tokens_per_s", ("total tok/s", "total_tokens_per_s"))


if __name__ == "__main__":
    main()
