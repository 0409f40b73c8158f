#!/usr/bin/env python
"""Decode of a mixture-of-experts layer against a dense layer of the same active parameters.

Qwen3-30B-A3B's layer at full width (hidden 2048, 32 heads, 4 KV heads of 128, 128 experts of
768, 8 chosen per token) against a Qwen3 dense layer whose MLP is as wide as the 8 chosen experts
together (intermediate 8 x 768 = 6144): the same multiply-adds per token. Reduced depth (--layers),
weights random and quantized in memory (Q8_0 by default, gguf's quantizer), the layers only (no
embedding, no lm_head). Decode steps through hearth's ModelRunner on the CPU backend with a
context of --context tokens: milliseconds per step, medians of interleaved runs, and the GB/s of
the weights a step reads (the chosen experts' only, for the MoE).

    python benchmarks/moe_decode.py --threads 2 --layers 2 --out benchmarks/results/threads-2/moe-decode
    python benchmarks/moe_decode.py --threads 1 --cpu-time   # a shared machine: CPU seconds of the one thread
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from common import decode_step_ms, machine, machine_markdown, median, set_threads, table, threads, write_results

WIDTH = dict(vocab_size=256, hidden_size=2048, num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
             rope_theta=1e6, max_position_embeddings=4096, qk_norm="head")
EXPERTS, CHOSEN, EXPERT_WIDTH = 128, 8, 768


def build(config, qtype):
    """A model of `config` with random weights, its matrices quantized to `qtype` (one at a time)."""
    import torch

    from hearth.backend.cpu import CpuBackend
    from hearth.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(config, backend=CpuBackend())
    g = torch.Generator().manual_seed(0)
    weights = {}
    for name, shape in model.checkpoint_shapes():  # norms 1; routers stay float, as llama.cpp keeps them
        weights[name] = torch.ones(shape) if len(shape) == 1 else _random(
            shape, g, None if name.endswith("mlp.gate.weight") else qtype)
    model.load_weights(weights, torch.float32)
    model.backend.prepare(model, torch.float32)
    return model


def _random(shape, g, qtype):
    import torch

    from hearth.quant import QuantTensor, quantize

    values = torch.randn(shape, generator=g) * 0.02
    if qtype is None:
        return values
    return QuantTensor(quantize(values, qtype), qtype, shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--type", default="q8_0", help="q8_0, q4_0, ... or f32")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cpu-time", action="store_true",
                    help="time steps in CPU seconds of the one thread (a shared machine; needs --threads 1)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.cpu_time and args.threads != 1:
        sys.exit("--cpu-time counts one thread's seconds: add --threads 1")
    clock = time.process_time if args.cpu_time else time.perf_counter
    set_threads(args.threads)
    from gguf import GGMLQuantizationType

    from hearth.config import ModelConfig

    qtype = None if args.type == "f32" else GGMLQuantizationType[args.type.upper()]
    moe = ModelConfig("qwen3_moe", intermediate_size=EXPERTS * EXPERT_WIDTH, num_layers=args.layers,
                      num_experts=EXPERTS, num_experts_per_tok=CHOSEN, moe_intermediate_size=EXPERT_WIDTH,
                      norm_topk_prob=True, **WIDTH)
    dense = ModelConfig("qwen3", intermediate_size=CHOSEN * EXPERT_WIDTH, num_layers=args.layers, **WIDTH)
    models = {"dense (intermediate 6144)": build(dense, qtype), "MoE (128 x 768, 8 chosen)": build(moe, qtype)}
    bytes_per_weight = 4.0 if qtype is None else 34 / 32 if args.type == "q8_0" else 18 / 32
    h, q, kv = 2048, 32 * 128, 4 * 128
    active = args.layers * (h * q * 2 + 2 * h * kv + 3 * h * CHOSEN * EXPERT_WIDTH)  # weights a token reads
    rows, data = [], []
    for batch in map(int, args.batches.split(",")):
        samples = {name: [] for name in models}
        for _ in range(args.runs):  # interleaved: both models see the same machine load
            for name, model in models.items():
                samples[name].append(decode_step_ms(model, args.context, batch, args.steps, clock))
        dense_ms = median(samples["dense (intermediate 6144)"])
        for name in models:
            ms = median(samples[name])
            read = active * bytes_per_weight if name.startswith("dense") or batch == 1 else None
            rows.append([str(batch), name, f"{ms:.2f}", f"{ms / dense_ms:.2f}x",
                         f"{read / ms / 1e6:.1f}" if read else "-"])
            data.append({"batch": batch, "model": name, "ms_per_step": ms, "vs_dense": ms / dense_ms,
                         "samples_ms": samples[name]})
    header = ["batch", "model", "ms / step", "vs dense", "GB/s (active weights)"]
    command = "python benchmarks/moe_decode.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    info = machine()
    timing = "\n- steps timed in CPU seconds of the one thread" if args.cpu_time else ""
    write_results(args.out, f"# MoE decode vs dense, {args.layers} layers, {args.type}, context {args.context}\n\n"
                  f"{machine_markdown(info)}{timing}\n\n`{command}`\n\n{table(header, rows)}\n",
                  {"machine": info, "threads": threads(), "command": command, "rows": data})


if __name__ == "__main__":
    main()
