#!/usr/bin/env python
"""CALM early exit (hearth/model/calm.py, docs/early-exit.md): quality against decode speed at several thresholds.

The model reads held-out text one token a step, as decoding does (batch 1, one new token a step
through the engine's runner: StepInputs, CalmExits.run, the logits the sampler would get), each
next token's log-probability taken from the logits of the layer it left at: perplexity under CALM
(teacher-forced), the share of tokens that left at each exit layer, and the step's time in CPU
time (process_time; the machine is shared) and wall time: the mean step of each run, as each kind
of step (its exit layer, or none) weighs, its median times its share (mixed_mean). Threshold "off" is the plain pass (no CALM);
"T" the softmax response's threshold, "MEASURE:T" another measure's (calm_measure: saturation,
saturation-softmax, the latter's loose bound --saturation-bound). The settings take turns within
each run (--runs runs; the median run).

    python benchmarks/calm.py --thresholds off,0.9,saturation:0.99,saturation-softmax:0.9 --exit-layers 15,22 \
        --tokens 384 --threads 2 --out benchmarks/results/threads-2/calm-smollm2
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

from common import machine, machine_markdown, median, set_threads, table, write_results

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "smollm2-135m-instruct"


def read_text(llm, setting, ids: list[int], prefix: int) -> dict:
    """One pass over ids: NLL per predicted token, exits per layer, step times (CPU, wall) in ms."""
    from hearth.engine.runner import BatchEntry

    runner = llm.engine.runner
    blocks = list(range(-(-len(ids) // runner.block_size)))
    runner.forward([BatchEntry(ids[:prefix], 0, blocks)])
    nll, exits, cpu, wall, kinds = 0.0, {}, [], [], []
    for i in range(prefix, len(ids) - 1):
        entries = [BatchEntry([ids[i]], i, blocks)]
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        step = runner.prepare(entries)
        if setting is None:
            logits = runner.model.compute_logits(runner.forward(entries, step)[0])
        else:
            hidden, exited = runner.calm.run(step, {0: setting})
            logits = runner.calm.logits(hidden, [0], exited)
            for layer in exited.layers:
                exits[layer] = exits.get(layer, 0) + 1
        kinds.append(exited.layers[0] if setting is not None and exited.layers else None)
        nll -= logits[0].log_softmax(-1)[ids[i + 1]].item()
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start_wall)
    return {"nll": nll, "tokens": len(ids) - 1 - prefix, "exits": exits, "cpu_ms": mixed_mean(cpu, kinds) * 1e3,
            "wall_ms": mixed_mean(wall, kinds) * 1e3}


def check(setting: str, bound: float):
    """A --thresholds entry's CalmCheck: "T" (softmax response) or "MEASURE:T"."""
    from hearth.model.calm import CalmCheck

    measure, _, threshold = setting.rpartition(":")
    return CalmCheck(float(threshold), measure or "softmax", bound)


def label(check) -> str:
    return "off" if check is None else f"{check.threshold}" if check.measure == "softmax" else (
        f"{check.measure} {check.threshold}" + (f" (bound {check.saturation_bound})"
                                               if check.measure == "saturation-softmax" else ""))


def mixed_mean(times: list[float], kinds: list) -> float:
    """The mean step as its kinds (the exit layer, or none) weigh: each kind's median step times its
    share. Tokens that exit and tokens that pay for every check mix, so throughput follows the mean; on
    a shared machine a few steps descheduled for long would swamp a plain mean."""
    by_kind: dict = {}
    for t, kind in zip(times, kinds):
        by_kind.setdefault(kind, []).append(t)
    return sum(len(ts) * median(ts) for ts in by_kind.values()) / len(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DATA / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--text", default=str(DATA / "text-apache-2.0.txt"), help="held-out text")
    p.add_argument("--thresholds", default="off,0.9,0.7,0.5", help="comma-separated; off: the plain pass")
    p.add_argument("--saturation-bound", type=float, default=0.9, help="saturation-softmax's calm_saturation_bound")
    p.add_argument("--exit-layers", default="15,22")
    p.add_argument("--tokens", type=int, default=384, help="tokens of the text read")
    p.add_argument("--prefix", type=int, default=16, help="its first tokens, prefilled")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    set_threads(args.threads)

    from hearth import LLM

    settings = [None if t == "off" else check(t, args.saturation_bound) for t in args.thresholds.split(",")]
    llm = LLM(args.model, progress=False, calm_exit_layers=args.exit_layers)
    ids = llm.get_tokenizer().encode(Path(args.text).read_text(encoding="utf-8"))[: args.tokens]
    runs: dict = {s: [] for s in settings}
    for run in range(args.runs):
        for s in settings:
            runs[s].append(read_text(llm, s, ids, args.prefix))
            print(f"run {run + 1}: {label(s)}: {runs[s][-1]}", file=sys.stderr)
    layers = [int(n) for n in args.exit_layers.split(",")]
    base = median([r["cpu_ms"] for r in runs[None]]) if None in runs else None
    rows = []
    for s, results in runs.items():
        first, cpu = results[0], median([r["cpu_ms"] for r in results])
        shares = [f"{100 * first['exits'].get(n, 0) / first['tokens']:.0f}%" for n in layers]
        rows.append([label(s), f"{math.exp(first['nll'] / first['tokens']):.3f}", *shares,
                     f"{1000 / cpu:.1f}", f"{cpu:.2f}", f"{median([r['wall_ms'] for r in results]):.2f}",
                     "–" if base is None else f"{base / cpu:.2f}x"])
    info = machine()
    markdown = (f"{machine_markdown(info)}\n\n`python benchmarks/calm.py {shlex.join(sys.argv[1:])}`\n\n"
                f"{Path(args.model).name}; {Path(args.text).name}, {len(ids):,} tokens, read one a step after "
                f"{args.prefix}; exit layers {args.exit_layers}; mean step (per-kind medians by share), median of {args.runs} interleaved runs\n\n"
                + table(["measure and threshold", "perplexity", *[f"left after {n}" for n in layers], "tok/s (CPU time)",
                         "step ms (CPU)", "step ms (wall)", "speed-up (CPU)"], rows))
    write_results(args.out, markdown, {"args": vars(args), "machine": info,
                                       "runs": {label(s): r for s, r in runs.items()}})


if __name__ == "__main__":
    main()
