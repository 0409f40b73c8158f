#!/usr/bin/env python
"""Cascades (docs/cascade.md): quality against cost at several defer thresholds, beside each model alone.

The task has reference answers: continue held-out real text. The --text files are cut into windows of
--prompt-tokens tokens followed by the --answer-tokens tokens the text goes on with; each set-up (the small
model alone, the large model alone, the cascade at each of --thresholds) continues every window greedily,
all windows as one batch (max_num_seqs = their number). Quality: the tokens of each answer the output got
right, position by position (token accuracy), the windows whose whole answer it got (exact match), and the
outputs equal to the large model's own. Cost: the share of output tokens the large model drew, the
requests that moved, and the batch's time, in wall time and in CPU time (process_time: on a loaded machine
wall time measures the load); the set-ups run --runs times, interleaved, the median kept.

    python benchmarks/cascade.py smollm2-q2_k.gguf smollm2-q8_0.gguf \
        --text ../shared/data/models/smollm2-135m-instruct/text-*.txt --threads 2 --out benchmarks/results/cascade/smollm2
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from common import machine, machine_markdown, median, set_threads, table, write_results


def windows(ids: list[int], prompt: int, answer: int, count: int) -> list[tuple[list[int], list[int]]]:
    """Up to `count` (prompt, answer) pairs from consecutive, non-overlapping stretches of ids."""
    step = prompt + answer
    return [(ids[i:i + prompt], ids[i + prompt:i + step]) for i in range(0, len(ids) - step + 1, step)][:count]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("small")
    p.add_argument("large")
    p.add_argument("--text", nargs="+", required=True, help="held-out text files")
    p.add_argument("--thresholds", default="0.1,0.3,0.6")
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--windows", type=int, default=24)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    set_threads(args.threads)

    from hearth import LLM, SamplingParams

    thresholds = [float(t) for t in args.thresholds.split(",")]
    common = dict(max_num_seqs=args.windows, progress=False)
    setups = {"small alone": LLM(args.small, **common), "large alone": LLM(args.large, **common)}
    setups |= {f"cascade T={t:g}": LLM(cascade=(args.small, args.large), defer_threshold=t, **common)
               for t in thresholds}
    text = "\n".join(Path(t).read_text(encoding="utf-8") for t in args.text)
    ids = setups["small alone"].get_tokenizer().encode(text, add_special_tokens=False)
    tasks = windows(ids, args.prompt_tokens, args.answer_tokens, args.windows)
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True)
    for llm in setups.values():  # kernels built and caches touched before anything is timed
        llm.generate([tasks[0][0]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    outputs, wall, cpu = {}, {k: [] for k in setups}, {k: [] for k in setups}
    for run in range(args.runs):
        for name, llm in setups.items():
            started, started_cpu = time.perf_counter(), time.process_time()
            outputs[name] = llm.generate([prompt for prompt, _ in tasks], params, use_tqdm=False)
            wall[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - started_cpu)
            print(f"run {run + 1}: {name}: {wall[name][-1]:.2f} s wall, {cpu[name][-1]:.2f} s CPU", file=sys.stderr)
    large_tokens = [o.outputs[0].token_ids for o in outputs["large alone"]]
    rows, data = [], {}
    for name in setups:
        got = [o.outputs[0].token_ids for o in outputs[name]]
        right = sum(a == b for out, (_, answer) in zip(got, tasks) for a, b in zip(out, answer))
        exact = sum(out == answer for out, (_, answer) in zip(got, tasks))
        as_large = sum(out == ref for out, ref in zip(got, large_tokens))
        records = [o.cascade for o in outputs[name] if o.cascade is not None]
        moved = sum(r.deferred for r in records)
        by_large = sum(r.summary(args.answer_tokens)["large_model_tokens"] for r in records)
        share = {"small alone": 0.0, "large alone": 1.0}.get(name, by_large / (len(tasks) * args.answer_tokens))
        data[name] = {"token_accuracy": right / (len(tasks) * args.answer_tokens), "exact": exact,
                      "as_large": as_large, "moved": moved, "large_share": share,
                      "wall_s": median(wall[name]), "cpu_s": median(cpu[name])}
        rows.append([name, f"{right / (len(tasks) * args.answer_tokens):.1%}", f"{exact}/{len(tasks)}",
                     f"{as_large}/{len(tasks)}", "-" if not records else f"{moved}/{len(tasks)}", f"{share:.0%}",
                     f"{median(wall[name]):.2f}", f"{median(cpu[name]):.2f}"])
    info = machine()
    markdown = (f"{machine_markdown(info)}\n\n`python benchmarks/cascade.py {shlex.join(sys.argv[1:])}`\n\n"
                f"{len(tasks)} windows of {args.prompt_tokens} tokens, each continued by {args.answer_tokens} greedy "
                f"tokens, in one batch; the median of {args.runs} interleaved runs\n\n"
                + table(["set-up", "token accuracy", "exact answers", "= large alone", "requests moved",
                         "tokens by large", "batch s (wall)", "batch s (CPU)"], rows))
    write_results(args.out, markdown, {"args": vars(args), "machine": info, "setups": data})


if __name__ == "__main__":
    main()
