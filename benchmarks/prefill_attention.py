#!/usr/bin/env python
"""A prompt's attention in one layer, two ways, on the same paged cache (slots shuffled):

  sdpa     K/V gathered, torch's SDPA with the causal mask (the reference backend's path, and the cpu
           backend's before prefill_attention.cpp)
  kernel   hearth/backend/cpu_kernels/prefill_attention.cpp over the same gathered K/V (the cpu backend's)

The shapes: decode_attention.py's three, and gpt-oss's (64 heads, 8 KV heads, 64) with its sinks, whole and in its
128-token sliding window (the reference path writes that softmax out: repeated K/V, the whole score matrix).
Milliseconds per call, medians of interleaved runs, and GFLOP/s of what has to be computed (the causal half, the window:
2 x 2 x heads x head_dim x the keys each row sees); float32; the whole prompt new (no cached prefix).

    python benchmarks/prefill_attention.py --threads 2 --out benchmarks/results/threads-2/prefill-attention
"""

from __future__ import annotations

import argparse
import sys

from common import interleaved_medians, set_threads, write_interleaved_table
from decode_attention import SHAPES


GPT_OSS = {"gpt-oss (64 heads, 8 KV heads, sinks)": None, "gpt-oss, sliding layers (window 128)": 128}


def time_cell(cpu, reference, heads: int, kv_heads: int, head_dim: int, prompt: int, runs: int, sinks: bool = False,
              window: int | None = None) -> dict[str, float]:
    import torch

    from hearth.backend.base import PrefillSequence

    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(prompt, generator=g)
    k_cache = torch.randn(prompt, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(prompt, kv_heads, head_dim, generator=g)
    q = torch.randn(prompt, heads, head_dim, generator=g)
    seq = PrefillSequence(0, prompt, slots, torch.ones(prompt, prompt, dtype=torch.bool).tril())
    options = {"window": window, "sinks": torch.randn(heads, generator=g) if sinks else None}
    ways = {"sdpa": lambda: reference.prefill_attention(q, k_cache, v_cache, seq, head_dim ** -0.5, **options),
            "kernel": lambda: cpu.prefill_attention(q, k_cache, v_cache, seq, head_dim ** -0.5, **options)}
    return {name: seconds * 1e3 for name, seconds in interleaved_medians(ways, runs).items()}


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
    shapes = {name: (*shape, False, None) for name, shape in SHAPES.items()}
    shapes.update({name: (64, 8, 64, True, window) for name, window in GPT_OSS.items()})
    for shape, (heads, kv_heads, head_dim, sinks, window) in shapes.items():
        for prompt in map(int, args.prompts.split(",")):
            ms = time_cell(cpu, reference, heads, kv_heads, head_dim, prompt, args.runs, sinks, window)
            seen = [min(p + 1, window or p + 1) for p in range(prompt)]  # keys each row sees
            flops = 4 * heads * head_dim * sum(seen)
            rows.append([shape, prompt, ms["sdpa"], ms["kernel"], ms["sdpa"] / ms["kernel"],
                         flops / (ms["kernel"] * 1e-3) / 1e9])
            data.append({"shape": shape, "prompt": prompt, "ms": ms, "causal_flops": flops})
    write_interleaved_table(args.out, "Prefill attention, one layer, float32", args.runs,
                            ["shape", "prompt", "sdpa ms", "kernel ms", "kernel vs sdpa", "kernel GFLOP/s (keys seen)"],
                            rows, data)


if __name__ == "__main__":
    main()
