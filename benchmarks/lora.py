"""Decode tokens/s of B requests each through its own LoRA adapter, against the same B requests on the
base model, on a real model (SmolLM2-135M Q4_1 by default).

    python benchmarks/lora.py [--model SmolLM2-135M-Instruct.Q4_1.gguf] [--batch 8] [--rank 16] [--steps 48]
                              [--threads 2] [--out benchmarks/results/lora]

Five setups, alternated `--repeats` times after a warm-up: the base model (no LoRA at all:
enable_lora off), the LoRA engine's plain requests (its projections wrapped, no adapter in the
step), the B requests all through one adapter, B requests each with its own adapter (B adapters in
one batch: rank --rank on all seven projections of every layer, random), and those again on an
engine with --lora-dtype bfloat16. A step is timed around LLMEngine.step() only while all B
requests decode; the median step gives tokens/s = B / step time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from common import machine, machine_markdown, set_threads, table, write_results
from hearth import LoRARequest, SamplingParams
from hearth.engine_config import EngineConfig
from hearth.engine.engine import LLMEngine

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "smollm2-135m-instruct"
PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(folder: Path, engine: LLMEngine, rank: int, seed: int) -> Path:
    """A random PEFT adapter (rank `rank`, every projection of every layer) for the engine's model."""
    import json

    config, generator, tensors = engine.model_config, torch.Generator().manual_seed(seed), {}
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"q_proj": (config.hidden_size, q), "k_proj": (config.hidden_size, kv), "v_proj": (config.hidden_size, kv),
              "o_proj": (q, config.hidden_size), "gate_proj": (config.hidden_size, config.intermediate_size),
              "up_proj": (config.hidden_size, config.intermediate_size),
              "down_proj": (config.intermediate_size, config.hidden_size)}
    for layer in range(config.num_layers):
        for block, names in PROJECTIONS.items():
            for name in names:
                fan_in, fan_out = shapes[name]
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                             "target_modules": [n for v in PROJECTIONS.values() for n in v]}))
    return folder


def step_times(engine: LLMEngine, loras: list[LoRARequest | None], steps: int, seed: int) -> list[float]:
    """Seconds of each step taken while all len(loras) requests decode."""
    batch = len(loras)
    for i, lora in enumerate(loras):
        engine.add_request(f"{seed}-{i}", list(range(10 + i, 42 + i)),
                           SamplingParams(temperature=0, ignore_eos=True, max_tokens=steps + 4), lora_request=lora)
    times = []
    while engine.has_unfinished_requests():
        decoding = engine.scheduler.num_running == batch and engine.last_step.num_tokens == batch
        start = time.perf_counter()
        engine.step()
        if decoding and engine.last_step.num_tokens == batch and len(times) < steps:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(SHARED / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    set_threads(args.threads)
    options = dict(max_num_seqs=args.batch, kv_cache_memory=256 << 20)
    base = LLMEngine(args.model, EngineConfig.from_options(**options), progress=False)
    lora, lora_bf16 = (LLMEngine(args.model, EngineConfig.from_options(
        **options, enable_lora=True, max_loras=args.batch, max_lora_rank=args.rank, lora_dtype=dtype), progress=False)
        for dtype in ("auto", "bfloat16"))
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"a{i}", 0, str(write_adapter(Path(tmp) / f"a{i}", lora, args.rank, i)))
                    for i in range(args.batch)]
        setups = {"base model (no LoRA)": (base, [None] * args.batch),
                  "LoRA engine, plain requests": (lora, [None] * args.batch),
                  f"1 adapter for all {args.batch} requests": (lora, adapters[:1] * args.batch),
                  f"{args.batch} adapters in one batch": (lora, adapters),
                  f"{args.batch} adapters in one batch, --lora-dtype bfloat16": (lora_bf16, adapters)}
        results = {name: [] for name in setups}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for name, (engine, loras) in setups.items():
                times = step_times(engine, loras, args.steps, repeat)
                if repeat:
                    results[name] += times
    info = machine()
    base_rate = args.batch / statistics.median(results["base model (no LoRA)"])
    rows = [[name, statistics.median(t) * 1e3, args.batch / statistics.median(t),
             args.batch / statistics.median(t) / base_rate] for name, t in results.items()]
    markdown = (f"LoRA: {args.batch} requests decoding, model {Path(args.model).name}, adapters of rank {args.rank} on "
                f"all 7 projections of every layer; median of {args.repeats} x {args.steps} decode steps each\n\n"
                + table(["setup", "step ms", "tokens/s", "vs base"], rows) + "\n\n" + machine_markdown(info))
    write_results(args.out, markdown, {"machine": info, "args": vars(args), "step_seconds": results})


if __name__ == "__main__":
    main()
