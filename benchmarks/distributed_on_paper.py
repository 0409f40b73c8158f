#!/usr/bin/env python
"""On paper: a 70B model (Llama-3-70B's shape, bf16) on 8 H100s, by hearth's roofline (hearth/bench/roofline.py).

Not a measurement: datasheet rates put into the roofline's step costs. For each split of the 8
GPUs (tensor parallelism of t GPUs, 8 / t replicas): the KV cache each replica holds, the decode
step at the batch that cache allows (at most 256 sequences of `--context` tokens), and the
prefill of one prompt of `--context` tokens. A rank reads 1/t of the weights and of the KV
cache and does 1/t of the FLOPs; tensor parallelism adds 2 all-reduces a layer of the step's
hidden states (ring: 2 (t - 1) / t of them over each GPU's link, plus a fixed latency each).
Then the transfer of one prompt token's KV for disaggregated prefill, over several links,
against the prefill compute of that token.

    python benchmarks/distributed_on_paper.py [--context 2048] [--measured-bytes-per-s 1.5e9]
"""

from __future__ import annotations

import argparse

from common import table  # noqa: F401 - puts the repository on sys.path

from hearth.bench.roofline import WeightBytes, step_cost
from hearth.config import ModelConfig

# H100 SXM datasheet: HBM3 3.35 TB/s, 989 TFLOP/s dense bf16, 80 GB; NVLink 4 450 GB/s each way
HBM, FLOPS, MEMORY, NVLINK = 3.35e12, 989e12, 80e9, 450e9
ALL_REDUCE_LATENCY = 10e-6  # seconds per small all-reduce (NCCL on NVLink, order of magnitude)
USABLE = 0.9  # of each GPU's memory for weights and KV (the rest: activations, CUDA graphs, NCCL)
LINKS = {"NVLink (same node)": 450e9, "InfiniBand NDR 400 Gb/s": 50e9, "Ethernet 100 Gb/s": 12.5e9}

LLAMA_70B = ModelConfig(architecture="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                        num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=8192)


def weights(config: ModelConfig, bytes_per_param: int) -> WeightBytes:
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_layers
    attention = h * config.num_heads * config.head_dim * 2 + h * config.num_kv_heads * config.head_dim * 2
    matmul = layers * (attention + 3 * h * i)
    embedding = config.vocab_size * h
    return WeightBytes((matmul + embedding) * bytes_per_param, h * bytes_per_param, matmul)


def all_reduce_s(config: ModelConfig, tokens: int, ranks: int) -> float:
    if ranks == 1:
        return 0.0
    size = tokens * config.hidden_size * 2  # bf16 hidden states
    return 2 * config.num_layers * (ALL_REDUCE_LATENCY + 2 * (ranks - 1) / ranks * size / NVLINK)


def step_s(config: ModelConfig, w: WeightBytes, phase: str, batch: int, context: int, ranks: int) -> float:
    cost = step_cost(config, w, phase, batch, context, 2)
    return max(cost.flops / FLOPS, cost.bytes / HBM) / ranks + all_reduce_s(config, cost.tokens, ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2048, help="prompt and context length")
    parser.add_argument("--measured-bytes-per-s", type=float, default=None,
                        help="hearth's measured KV transfer rate (benchmarks/kv_transfer.py), for the last table")
    args = parser.parse_args()
    config, w, context = LLAMA_70B, weights(LLAMA_70B, 2), args.context
    kv_token = config.kv_bytes_per_token(2)
    print(f"Llama-3-70B shape, bf16: {w.per_step / 1e9:.0f} GB of weights, {kv_token / 1024:.0f} KiB of KV a token; "
          f"context {context}\n")
    rows = []
    for ranks in (2, 4, 8):  # 70B in bf16 does not fit one 80 GB GPU
        replicas = 8 // ranks
        kv_tokens = int((ranks * MEMORY * USABLE - w.per_step) // kv_token)
        batch = min(256, kv_tokens // context)
        decode = step_s(config, w, "decode", batch, context, ranks)
        single = step_s(config, w, "decode", 1, context, ranks)
        prefill = step_s(config, w, "prefill", 1, context, ranks)
        rows.append([f"TP={ranks} x {replicas}", f"{kv_tokens:,}", batch, f"{1e3 * single:.1f}",
                     f"{1e3 * decode:.1f}", f"{replicas * batch / decode:,.0f}", f"{1e3 * prefill:.0f}",
                     f"{prefill / decode:.1f}"])
    print(table(["split of 8 GPUs", "KV tokens a replica", "decode batch a replica",
                 "ms a token at batch 1", "ms a decode step at that batch", "output tok/s, all replicas",
                 f"ms to prefill {context} tokens", "prefill / decode step"], rows))
    prefill_token = step_s(config, w, "prefill", 1, context, 8) / context
    print(f"\nDisaggregation: one prompt token's KV ({kv_token:,} bytes) against its prefill on TP=8 "
          f"({1e6 * prefill_token:.1f} µs a token at the roofline):\n")
    links = dict(LINKS)
    if args.measured_bytes_per_s:
        links["hearth's HTTP transfer as measured on CPU"] = args.measured_bytes_per_s
    rows = [[name, f"{rate / 1e9:.3g}", f"{1e6 * kv_token / rate:.1f}", f"{kv_token / rate / prefill_token:.2f}"]
            for name, rate in links.items()]
    print(table(["link", "GB/s", "µs a token", "transfer / prefill compute"], rows))


if __name__ == "__main__":
    main()
