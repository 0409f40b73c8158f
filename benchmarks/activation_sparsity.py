#!/usr/bin/env python
"""Activation sparsity (docs/sparsity.md): perplexity against decode speed at several sparsities.

For each model file given (an F16 GGUF, where the cpu backend skips the masked columns; a GGUF of
block formats, where it only masks) and each sparsity in --sparsities (0: the dense model, as it
runs without the option), on the cpu backend with --threads threads:
  * perplexity over the --text files (hearth/perplexity.py, windows of --context tokens);
  * decode speed at batch 1: one sequence of --decode-context random tokens prefilled through the
    ModelRunner, then --steps decode steps timed in CPU time (process_time: on a machine shared by
    many processes, 2 OpenMP threads wait at every barrier for a descheduled partner, and wall time
    measures the load); the median step over --runs runs, the set-ups (model, sparsity) interleaved.

    python benchmarks/activation_sparsity.py smollm2-f16.gguf smollm2-q4_1.gguf --thresholds t.json \
        --text ../shared/data/models/smollm2-135m-instruct/text-apache-2.0.txt --threads 2 --out benchmarks/results/sparsity
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from common import decode_step_ms, machine, machine_markdown, median, set_threads, table, write_results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", help="GGUF files of one model (same shape: the thresholds serve all)")
    p.add_argument("--thresholds", required=True, help="hearth sparsify's file for the model")
    p.add_argument("--text", nargs="+", required=True, help="held-out text files for perplexity")
    p.add_argument("--sparsities", default="0,0.25,0.4,0.5")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--decode-context", type=int, default=64)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-perplexity", action="store_true", help="decode speed only")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    set_threads(args.threads)

    import torch

    from hearth.engine_config import SparsityConfig
    from hearth.loading.loader import load_model
    from hearth.perplexity import perplexity

    sparsities = [float(s) for s in args.sparsities.split(",")]
    text = "\n".join(Path(t).read_text(encoding="utf-8") for t in args.text)
    loaded = {(Path(m).name, s): load_model(m, progress=False, sparsity=SparsityConfig(s, args.thresholds))
              for m in args.models for s in sparsities}
    ids = next(iter(loaded.values())).tokenizer.encode(text)
    quality = {key: float("nan") for key in loaded}
    for key, m in ([] if args.skip_perplexity else loaded.items()):
        quality[key] = perplexity(m.model, ids, args.context, torch.device("cpu"))["perplexity"]
        print(f"{key}: perplexity {quality[key]:.4f}", file=sys.stderr)
    cpu: dict = {key: [] for key in loaded}
    for run in range(args.runs):
        for key, m in loaded.items():
            cpu[key].append(decode_step_ms(m.model, args.decode_context, 1, args.steps, clock=time.process_time))
            print(f"run {run + 1}: {key}: {cpu[key][-1]:.2f} ms", file=sys.stderr)
    rows = []
    for (model, s) in loaded:
        base = median(cpu[(model, 0.0)]) if (model, 0.0) in cpu else None
        step = median(cpu[(model, s)])
        rows.append([model, s, f"{quality[(model, s)]:.3f}", f"{1000 / step:.1f}", f"{step:.2f}",
                     "–" if base is None else f"{base / step:.2f}x"])
    info = machine()
    markdown = (f"{machine_markdown(info)}\n\n`python benchmarks/activation_sparsity.py {shlex.join(sys.argv[1:])}`\n\n"
                f"perplexity over {len(ids):,} tokens (windows of {args.context}); decode at batch 1 after "
                f"{args.decode_context} tokens, median step of {args.steps} over {args.runs} interleaved runs\n\n"
                + table(["model", "sparsity", "perplexity", "decode tok/s (CPU time)", "step ms (CPU time)",
                         "speed-up"], rows))
    write_results(args.out, markdown, {"args": vars(args), "machine": info,
                                       "perplexity": {f"{m} {s}": v for (m, s), v in quality.items()},
                                       "step_ms_cpu": {f"{m} {s}": v for (m, s), v in cpu.items()}})


if __name__ == "__main__":
    main()
