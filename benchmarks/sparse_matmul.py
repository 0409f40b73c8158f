#!/usr/bin/env python
"""Activation sparsity's kernels per matrix (docs/sparsity.md): `sparse_matmul` at several sparsities
against the dense kernel of the same weight (int8_matmul for block formats, half_matmul for F16), at
batch 1, on the TinyLlama shape's matrices (hidden 2,048, intermediate 5,632).

Weights: random codes (Q4_K, Q6_K: hearth's quantizer on Gaussian values; Q4_1, Q8_0: gguf's), cycled
through --copies copies so that each call reads them from DRAM as a model's decode step does; the
activations Gaussian, masked at each sparsity's quantile of |x|. Median CPU time (process_time) of
--runs interleaved runs.

    python benchmarks/sparse_matmul.py --threads 2 --out benchmarks/results/activation-sparsity/matrices
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from common import machine, machine_markdown, median, set_threads, table, write_results

SHAPES = {"gate/up 2,048 -> 5,632": (5632, 2048), "down 5,632 -> 2,048": (2048, 5632)}


def weights(qtype, n: int, k: int, copies: int):
    import torch
    from gguf.quants import quantize

    from hearth.quant.quantizer import K_QUANTS, quantize_rows

    generator = torch.Generator().manual_seed(n + k)
    out = []
    for _ in range(copies):
        values = torch.randn(n, k, generator=generator) * 0.02
        if qtype.name == "F16":
            out.append(values.half().view(torch.uint8))
        else:
            blocks = quantize_rows(values, qtype) if qtype in K_QUANTS else quantize(values.numpy(), qtype)
            out.append(torch.from_numpy(blocks))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="Q4_K,Q6_K,Q4_1,Q8_0,F16")
    p.add_argument("--sparsities", default="0,0.25,0.4,0.5")
    p.add_argument("--copies", type=int, default=6)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    set_threads(args.threads)

    import torch
    from gguf import GGMLQuantizationType

    from hearth.quant import kernels

    ext = kernels.extension()
    sparsities = [float(s) for s in args.sparsities.split(",")]
    rows, data = [], {}
    for name in args.types.split(","):
        qtype = GGMLQuantizationType[name]
        for shape, (n, k) in SHAPES.items():
            dense = weights(qtype, n, k, args.copies)
            half = qtype.name == "F16"
            sparse = [w.view(torch.float16).t().contiguous() if half else ext.sparse_repack(w, qtype, n, k) for w in dense]
            x = torch.randn(1, k, generator=torch.Generator().manual_seed(1))
            y = torch.empty(1, n)
            thresholds = [0.0 if s == 0 else x.abs().flatten().kthvalue(int(s * k)).values.item() for s in sparsities]

            def dense_call(w):
                if half:
                    return ext.module.half_matmul(x.data_ptr(), w.data_ptr(), y.data_ptr(), 1, n, k, 2 * k, 1, False,
                                                  False, torch.get_num_threads())
                return ext.module.int8_matmul(x.data_ptr(), w.data_ptr(), 0, y.data_ptr(), 1, n, k, int(qtype), 0,
                                              torch.get_num_threads())

            calls = {"dense": (dense_call, dense)}
            for s, t in zip(sparsities, thresholds):
                calls[s] = (lambda w, t=t: ext.module.sparse_matmul(
                    x.data_ptr(), w.data_ptr(), y.data_ptr(), 1, n, k, int(qtype), t, torch.get_num_threads()), sparse)
            times: dict = {key: [] for key in calls}
            for _ in range(args.runs):
                for key, (call, ws) in calls.items():
                    start = time.process_time()
                    for i in range(3 * args.copies):
                        call(ws[i % args.copies])
                    times[key].append((time.process_time() - start) / (3 * args.copies) * 1e6)
            us = {key: median(v) for key, v in times.items()}
            data[f"{name} {shape}"] = us
            rows.append([name, shape, f"{us['dense']:.0f}"] +
                        [f"{us[s]:.0f} ({us['dense'] / us[s]:.2f}x)" for s in sparsities])
            print(rows[-1], file=sys.stderr)
    info = machine()
    markdown = (f"{machine_markdown(info)}\n\n`python benchmarks/sparse_matmul.py {shlex.join(sys.argv[1:])}`\n\n"
                f"batch 1, microseconds per call (CPU time), median of {args.runs} interleaved runs; in brackets the "
                "speed-up over the dense kernel\n\n"
                + table(["weight", "matrix", "dense kernel us"] + [f"sparse {s}" for s in sparsities], rows))
    write_results(args.out, markdown, {"args": vars(args), "machine": info, "us": data})


if __name__ == "__main__":
    main()
