#!/usr/bin/env python
"""Two pipeline stages (one thread each) against one process (one or two threads), same workload.

Each run builds the engine (`LLM(model)` on 1 or 2 threads, or `LLM(model, pipeline_parallel_size=2)`:
the two stages share the two cores, a thread each), warms it up, and generates N greedy requests
of random prompt tokens, all queued at once; the set-ups alternate run by run. On a shared
machine the wall clock favours whichever set-up runs more processes (each gets its share of the
cores), so the measure is output tokens per CPU-second of the generation, the worker's CPU time
included (from /proc), with wall-clock tokens/s beside it.

    python benchmarks/pipeline.py [MODEL] --runs 3 --num-prompts 32 --out benchmarks/results/pipeline
"""

from __future__ import annotations

import os
import random
import time

from common import report_interleaved, run_interleaved, set_threads, tiny_model, workload_parser

from hearth import LLM, SamplingParams

# (threads, LLM options): one process on 1 thread is the CPU cost of the work itself, without any
# thread or process waiting for another
SETUPS = {"one process, 1 thread": (1, {}), "one process, 2 threads": (2, {}),
          "2 stages, 1 thread each": (2, {"pipeline_parallel_size": 2})}


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of this process and of `pids` so far."""
    own = os.times()
    ticks = os.sysconf("SC_CLK_TCK")
    workers = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        workers += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return own.user + own.system + workers


def measure(model: str, setup: tuple[int, dict], args) -> dict:
    threads, options = setup
    set_threads(threads)  # the stages share them out
    llm = LLM(model, progress=False, **options)
    try:
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 1000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        workers = [] if llm.engine.workers is None else [p.pid for p in llm.engine.workers.processes]
        cpu, wall = cpu_seconds(workers), time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - wall, cpu_seconds(workers) - cpu
    finally:
        llm.engine.close()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"output_tokens": tokens, "wall_s": wall, "cpu_s": cpu, "output_tokens_per_s": tokens / wall,
            "output_tokens_per_cpu_s": tokens / cpu}


def main() -> None:
    args = workload_parser(__doc__, 32).parse_args()
    model = args.model or tiny_model()[0]
    results = run_interleaved(SETUPS, lambda options: measure(model, options, args), args.runs,
                              "output_tokens_per_cpu_s")
    report_interleaved(results, model, args, ("output tokens / CPU-s", "output_tokens_per_cpu_s"),
                       ("output tok/s (wall)", "output_tokens_per_s"))


if __name__ == "__main__":
    main()
