#!/usr/bin/env python
"""Decode attention of one layer, three ways, on the same paged cache (blocks of 16 in shuffled order):

  sdpa       K/V gathered into a padded [D, kv_heads, L, head_dim] copy, one batched SDPA with a mask
             (hearth's path on CUDA and for dtypes other than float32)
  kernel     hearth/backend/cpu_kernels/attention.cpp reading K/V in place, whole contexts (no split)
  split-KV   the same kernel, contexts split at the multiples of DECODE_SPLIT_LEN (flash-decoding: hearth's)

Microseconds per call, medians of interleaved runs; float32.

    python benchmarks/decode_attention.py --threads 2 --out benchmarks/results/threads-2/decode-attention
"""

from __future__ import annotations

import argparse
import sys

from common import interleaved_medians, set_threads, write_interleaved_table

SHAPES = {  # name: (heads, kv_heads, head_dim)
    "smollm2-135m (9 heads, 3 KV heads)": (9, 3, 64),
    "tinyllama-1.1b (32 heads, 4 KV heads)": (32, 4, 64),
    "multi-query (16 heads, 1 KV head)": (16, 1, 128),
}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def time_cell(cpu, reference, heads: int, kv_heads: int, head_dim: int, batch: int, context: int,
              runs: int) -> dict[str, float]:
    """One shape, batch and context on a shuffled paged cache: microseconds per call of each way, medians."""
    import torch

    from hearth.backend.base import AttentionMetadata

    block = 16
    g = torch.Generator().manual_seed(0)
    blocks = batch * context // block
    k_cache = torch.randn(blocks * block, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(blocks * block, kv_heads, head_dim, generator=g)
    tables = torch.randperm(blocks, generator=g).to(torch.int32).reshape(batch, -1)
    q = torch.randn(batch, heads, head_dim, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), prefills=[],
        decode_token_index=torch.arange(batch),
        decode_query_start=torch.arange(batch + 1, dtype=torch.int32), decode_block_tables=tables,
        decode_context_lens=torch.full((batch,), context, dtype=torch.int32),
        decode_max_len=context, block_size=block,
    )
    ways = {
        "sdpa": lambda: reference.decode_attention(q, k_cache, v_cache, meta, 0.125),
        "kernel": lambda: cpu.decode_attention(q, k_cache, v_cache, meta, 0.125, split_len=context),
        "split": lambda: cpu.decode_attention(q, k_cache, v_cache, meta, 0.125),
    }
    # (the warm-up call also computes the SDPA path's slots, once per step)
    return {name: seconds * 1e6 for name, seconds in interleaved_medians(ways, runs).items()}


def main() -> None:
    args = parse_args()
    set_threads(args.threads)
    from hearth.backend.base import Backend
    from hearth.backend.cpu import DECODE_SPLIT_LEN, CpuBackend, cpu_kernels

    if cpu_kernels() is None:
        sys.exit("the C++ decode attention kernel cannot be built here")
    cpu, reference = CpuBackend(), Backend()
    rows, data = [], []
    for shape, (heads, kv_heads, head_dim) in SHAPES.items():
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                us = time_cell(cpu, reference, heads, kv_heads, head_dim, batch, context, args.runs)
                kv_bytes = 2 * batch * context * kv_heads * head_dim * 4
                rows.append([shape, batch, context, -(-context // DECODE_SPLIT_LEN), us["sdpa"], us["kernel"], us["split"],
                             us["sdpa"] / us["kernel"], us["kernel"] / us["split"],
                             kv_bytes / (us["split"] * 1e-6) / 1e9])
                data.append({"shape": shape, "batch": batch, "context": context, "split_len": DECODE_SPLIT_LEN, "us": us,
                             "kv_bytes": kv_bytes})
    write_interleaved_table(args.out, "Decode attention, one layer, float32", args.runs,
                            ["shape", "batch", "context", "splits", "sdpa us", "kernel us", "split-KV us",
                             "kernel vs sdpa", "split-KV vs kernel", "split-KV GB/s of K/V"], rows, data)


if __name__ == "__main__":
    main()
