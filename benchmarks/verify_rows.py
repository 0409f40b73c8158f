#!/usr/bin/env python
"""What a verification step costs by its rows: one sequence of C cached tokens and R new rows (its
last token and R - 1 guesses), 1 thread, CPU milliseconds (medians): the layers' pass (the one-call
decode path on a CPU), the output layer on R rows, and the layers' matmuls alone (every
projection of every layer once on R activation rows, the weights streamed as in a step).

    python benchmarks/verify_rows.py --context 400 --rows 1-9
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from common import machine, machine_markdown, median, set_threads, table, write_results
from speculative import DATA


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DATA / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--context", type=int, default=400, help="tokens in the cache before the rows")
    ap.add_argument("--rows", default="1-9", help="FIRST-LAST rows of the sequence in the step")
    ap.add_argument("--repeats", type=int, default=15, help="timed calls per cell (median)")
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = ap.parse_args()
    set_threads(1)  # CPU time: one thread's
    import torch

    from hearth import LLM
    from hearth.engine.runner import BatchEntry

    runner = LLM(args.model, progress=False, max_num_seqs=1, kv_cache_memory=1 << 30).engine.runner
    model = runner.model
    first, last = (int(n) for n in args.rows.split("-"))
    blocks = list(range((args.context + last) // runner.block_size + 1))
    runner.forward([BatchEntry(list(range(100, 100 + args.context)), 0, blocks)])  # the context's K/V
    projections = [m for layer in model.layers for m in (*layer.self_attn.qkv_proj.parts, layer.self_attn.o_proj,
                                                         *layer.mlp.gate_up_proj.parts, layer.mlp.down_proj)]

    calls = {}  # rows -> (the layers' pass, the output layer, the matmuls alone)
    for r in range(first, last + 1):
        step = [BatchEntry(list(range(200, 200 + r)), args.context, blocks)]  # the same slots each call
        hidden = torch.randn(r, model.config.hidden_size)
        inputs = {m.in_features: torch.randn(r, m.in_features) for m in projections}
        calls[r] = (lambda step=step: runner.forward(step), lambda hidden=hidden: model.compute_logits(hidden),
                    lambda inputs=inputs: [m(inputs[m.in_features]) for m in projections])
    times = {r: [[], [], []] for r in calls}
    for repeat in range(args.repeats + 2):  # every cell in turn, each round (the first two untimed)
        for r, cells in calls.items():
            for call, cell_times in zip(cells, times[r]):
                start = time.process_time()
                call()
                if repeat >= 2:
                    cell_times.append(1000 * (time.process_time() - start))
    rows, data = [], {}
    for r, cells in times.items():
        data[r] = [median(cell) for cell in cells]
        step_ms = sum(data[r][:2])
        rows.append([r, *data[r], step_ms, None if r == first else (step_ms - sum(data[first][:2])) / (r - first)])
    write_results(args.out, "\n".join([
        f"`python benchmarks/verify_rows.py {shlex.join(sys.argv[1:])}`", "", machine_markdown(machine()),
        f"- {args.model.split('/')[-1]}, context {args.context}, 1 thread, CPU ms, medians of {args.repeats}", "",
        table(["rows", "layers", "output layer", "layers' matmuls alone", "step", "per row past the first"], rows)]),
        {"args": vars(args), "ms": data})


if __name__ == "__main__":
    main()
