#!/usr/bin/env python
"""Two single-thread replicas behind the router against one two-thread engine, same load.

Each run starts the server (`hearth serve MODEL --threads 2`, or `hearth serve MODEL
--data-parallel-size 2`: each replica gets one of the two cores), drives it with `hearth bench
serve` (N requests, all in flight at once), and stops it; the two set-ups alternate run by run,
and the table gives medians and the ratio.

    python benchmarks/replicas.py [MODEL] --runs 3 --num-prompts 64 --out benchmarks/results/replicas
"""

from __future__ import annotations

from common import hearth_serve, report_interleaved, run_interleaved, tiny_model, workload_parser

from hearth.bench.serve import run_serve

SETUPS = {"one engine, 2 threads": ["--threads", "2"], "2 replicas, 1 thread each": ["--data-parallel-size", "2"]}


def serve_and_measure(model: str, options: list[str], args) -> dict:
    with hearth_serve(model, options) as url:
        report = run_serve(url, "m", args.num_prompts, args.input_len, args.output_len,
                           concurrency=[args.num_prompts], progress=False)
    return report["runs"][0]


def main() -> None:
    args = workload_parser(__doc__, 64).parse_args()
    model = args.model or tiny_model()[0]
    results = run_interleaved(SETUPS, lambda options: serve_and_measure(model, options, args), args.runs,
                              "output_throughput")
    report_interleaved(results, model, args, ("output tok/s", "output_throughput"), ("p50 e2e ms", "p50_e2el_ms"))


if __name__ == "__main__":
    main()
