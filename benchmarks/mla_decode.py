#!/usr/bin/env python
"""Decode with multi-head latent attention: hearth against transformers on the same weights.

DeepSeek-V2-Lite's layers at full width (hidden 2048, 16 heads, latent 512 + rotated key 64,
q/k 128 + 64, v 128): a dense first layer and then MoE layers whose 8 experts of 1408 (6 chosen per
token, as Lite's 64) and 2 shared ones give a token Lite's multiply-adds, fewer layers (--layers),
random float32 weights written once by transformers (save_pretrained). Both engines hold the
compressed latent per token (transformers 5's deepseek_v2 caches it too); transformers expands
every cached token through kv_b_proj at every step, hearth attends on the latent with kv_b_proj
absorbed. Milliseconds per decode step after a --context token prompt, batch 1 and 8, medians of
interleaved runs; and the cache's bytes per token against per-head K and V.

    python benchmarks/mla_decode.py --threads 2 --layers 2 --contexts 256,1024 --out benchmarks/results/threads-2/mla-decode
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time

from common import machine, machine_markdown, median, set_threads, table, threads, write_results

LITE = dict(vocab_size=1024, hidden_size=2048, intermediate_size=10944, num_attention_heads=16, num_key_value_heads=16,
            q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            n_routed_experts=8, num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408,
            first_k_dense_replace=1, max_position_embeddings=4096, rms_norm_eps=1e-6, pad_token_id=None)


def write_model(folder: str, layers: int) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.DeepseekV2Config(num_hidden_layers=layers, **LITE)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.02)
    model.save_pretrained(folder)


def hearth_ms(model, context: int, batch: int, steps: int) -> float:
    """Median milliseconds of a decode step of `batch` sequences after `context` tokens each."""
    import torch

    from hearth.engine.runner import BatchEntry, ModelRunner

    block = 16
    per_seq = -(-(context + steps + 1) // block)
    runner = ModelRunner(model, per_seq * batch, block, torch.device("cpu"), torch.float32)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(batch)]
    g = torch.Generator().manual_seed(1)
    for s in range(batch):
        runner.forward([BatchEntry(torch.randint(0, 1024, (context,), generator=g).tolist(), 0, tables[s])])
    times = []
    for step in range(steps):
        entries = [BatchEntry([int(torch.randint(0, 1024, (1,), generator=g))], context + step, tables[s])
                   for s in range(batch)]
        start = time.perf_counter()
        runner.forward(entries)
        times.append(time.perf_counter() - start)
    return median(times[2:]) * 1e3


def transformers_ms(model, context: int, batch: int, steps: int) -> float:
    """The same with transformers: a prompt through the model, then one token at a time on its cache."""
    import torch
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(1)
    cache = DynamicCache(config=model.config)
    times = []
    with torch.no_grad():
        model.model(torch.randint(0, 1024, (batch, context), generator=g), past_key_values=cache, use_cache=True)
        for _ in range(steps):
            start = time.perf_counter()
            model.model(torch.randint(0, 1024, (batch, 1), generator=g), past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
    return median(times[2:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="256,1024")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    set_threads(args.threads)
    import torch
    import transformers

    from hearth.backend import choose_backend
    from hearth.loading.safetensors import load_hf_folder
    from hearth.model.transformer import Transformer

    folder = tempfile.TemporaryDirectory()
    write_model(folder.name, args.layers)
    config, weights = load_hf_folder(folder.name, progress=False)
    with torch.device("meta"):
        ours = Transformer(config, 4096, choose_backend(torch.device("cpu"), torch.float32))
    ours.load_weights(weights, torch.float32)
    ours.backend.prepare(ours, torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder.name, dtype=torch.float32).eval()
    per_head = config.num_layers * config.num_heads * (config.qk_nope_head_dim + config.head_dim + config.v_head_dim) * 4
    rows, data = [], []
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            samples = {"hearth": [], "transformers": []}
            for _ in range(args.runs):  # interleaved: both see the same machine load
                samples["hearth"].append(hearth_ms(ours, context, batch, args.steps))
                samples["transformers"].append(transformers_ms(theirs, context, batch, args.steps))
            ms = {name: median(values) for name, values in samples.items()}
            rows.append([str(context), str(batch), f"{ms['hearth']:.1f}", f"{ms['transformers']:.1f}",
                         f"{ms['transformers'] / ms['hearth']:.2f}x"])
            data.append({"context": context, "batch": batch, "ms_per_step": ms, "samples_ms": samples})
    header = ["context", "batch", "hearth ms / step", "transformers ms / step", "hearth speed-up"]
    command = "python benchmarks/mla_decode.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    info = machine()
    kv = (f"KV cache per token, {config.num_layers} layers, float32: hearth {config.kv_bytes_per_token(4):,} bytes "
          f"(latent {config.kv_lora_rank} + rotated key {config.head_dim} per layer); per-head K and V would "
          f"take {per_head:,} bytes")
    write_results(args.out, f"# MLA decode, DeepSeek-V2-Lite width, {args.layers} layers\n\n"
                  f"{machine_markdown(info)}\n\n`{command}`\n\n{table(header, rows)}\n\n{kv}\n",
                  {"machine": info, "threads": threads(), "command": command, "rows": data,
                   "kv_bytes_per_token": config.kv_bytes_per_token(4), "per_head_kv_bytes_per_token": per_head})


if __name__ == "__main__":
    main()
