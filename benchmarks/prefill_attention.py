#!/usr/bin/env python
"""A prompt's attention in one layer, two ways, on the same paged cache (slots shuffled):

  sdpa     K/V gathered, torch's SDPA with the causal mask (the reference backend's path, and the cpu
           backend's before prefill_attention.cpp)
  kernel   hearth/backend/cpu_kernels/prefill_attention.cpp over the same gathered K/V (the cpu backend's)

Milliseconds per call, medians of interleaved runs, and GFLOP/s of the causal half (what has to be computed:
2 x 2 x heads x head_dim x sum of each row's context); float32; the whole prompt new (no cached prefix).

    python benchmarks/prefill_attention.py --threads 2 --out benchmarks/results/threads-2/prefill-attention
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from common import machine, machine_markdown, median, set_threads, table, threads, write_results
from decode_attention import SHAPES


def time_cell(cpu, reference, heads: int, kv_heads: int, head_dim: int, prompt: int, runs: int) -> dict[str, float]:
    import torch

    from hearth.backend.base import PrefillSequence

    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(prompt, generator=g)
    k_cache = torch.randn(prompt, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(prompt, kv_heads, head_dim, generator=g)
    q = torch.randn(prompt, heads, head_dim, generator=g)
    seq = PrefillSequence(0, prompt, slots, torch.ones(prompt, prompt, dtype=torch.bool).tril())
    ways = {"sdpa": lambda: reference.prefill_attention(q, k_cache, v_cache, seq, head_dim ** -0.5),
            "kernel": lambda: cpu.prefill_attention(q, k_cache, v_cache, seq, head_dim ** -0.5)}
    times = {name: [] for name in ways}
    for fn in ways.values():
        fn()
    for _ in range(runs):
        for name, fn in ways.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="128,512,2048")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    set_threads(args.threads)
    from hearth.backend.base import Backend
    from hearth.backend.cpu import CpuBackend, cpu_kernels

    if cpu_kernels() is None:
        sys.exit("the C++ attention kernels cannot be built here")
    cpu, reference = CpuBackend(), Backend()
    rows, data = [], []
    for shape, (heads, kv_heads, head_dim) in SHAPES.items():
        for prompt in map(int, args.prompts.split(",")):
            ms = time_cell(cpu, reference, heads, kv_heads, head_dim, prompt, args.runs)
            flops = 4 * heads * head_dim * prompt * (prompt + 1) / 2
            rows.append([shape, prompt, ms["sdpa"], ms["kernel"], ms["sdpa"] / ms["kernel"],
                         flops / (ms["kernel"] * 1e-3) / 1e9])
            data.append({"shape": shape, "prompt": prompt, "ms": ms, "causal_flops": flops})
    info = machine()
    command = "python benchmarks/prefill_attention.py " + shlex.join(sys.argv[1:])
    markdown = "\n".join([
        f"### Prefill attention, one layer, float32 ({threads()} threads)", "",
        f"`{command}` — medians of {args.runs} interleaved runs.", "",
        machine_markdown(info), "",
        table(["shape", "prompt", "sdpa ms", "kernel ms", "kernel vs sdpa", "kernel GFLOP/s (causal)"], rows),
    ])
    write_results(args.out, markdown, {"machine": info, "command": command, "rows": data})


if __name__ == "__main__":
    main()
