#!/usr/bin/env python
"""hearth against transformers `generate` on the same Hugging Face folder, same dtype and threads.

Measured side by side, interleaved run by run:
  prefill P   one prompt of P tokens: hearth's first-token time; transformers `generate` with
              max_new_tokens=1
  decode B    B prompts of C tokens each generate D + 1 tokens; decode tokens/s is B x D over the
              time after the first token (transformers: generate(D + 1) minus generate(1))

    python benchmarks/hearth_vs_transformers.py --arch tinyllama-1.1b --out benchmarks/results/transformers
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
from pathlib import Path

from common import (bench_model, machine, machine_markdown, median, plural, set_threads, table, threads, timed,
                    write_results)


def torch_weight_bytes(model, config):
    """What a step of a transformers model reads: every parameter once, the embedding table only as a
    tied lm_head, plus one embedding row per token."""
    from hearth.bench.roofline import WeightBytes

    embed = model.get_input_embeddings().weight
    seen, per_step, matmul = set(), 0, 0
    for name, p in model.named_parameters(remove_duplicate=False):  # a tied lm_head is listed too
        key = (p.data_ptr(), p.numel())
        if key in seen or (p is embed and "lm_head" not in name):
            continue
        seen.add(key)
        per_step += p.numel() * p.element_size()
        if ".layers." in name and p.dim() == 2:
            matmul += p.numel()
    return WeightBytes(per_step, embed.shape[1] * embed.element_size(), matmul)


def folder_weight_bytes(folder, config):
    """Weight bytes of an HF folder as stored, from the safetensors headers (nothing loaded)."""
    import torch
    from safetensors import safe_open

    from hearth.bench.roofline import file_weight_bytes
    from hearth.loading.safetensors import weight_files

    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    meta = {}
    for file in weight_files(Path(folder)):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                meta[name] = torch.empty(piece.get_shape(), dtype=dtypes[piece.get_dtype()], device="meta")
    return file_weight_bytes(config, meta)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="tinyllama-1.1b")
    ap.add_argument("--hf", default=None, help="an HF folder instead of --arch")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None, help="threads for every engine (default: torch's)")
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def interleaved_runs(args: argparse.Namespace, engine, hf, vocab: int, batches: list[int]) -> dict:
    """A warm-up, then args.runs rounds of prefill and each batch's decode, hearth and transformers in
    turn: {(engine, test, batch): tokens/s of each run}."""
    import torch

    from hearth.bench.latency import one_run, random_prompts

    rng = random.Random(0)

    def hf_generate(prompts: list[list[int]], new: int) -> float:
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            return timed(lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                             min_new_tokens=new, do_sample=False))

    times: dict[tuple[str, str, int], list[float]] = {}

    def record(name: str, test: str, b: int, tok_s: float) -> None:
        times.setdefault((name, test, b), []).append(tok_s)

    one_run(engine, random_prompts(1, 32, vocab, rng), 4)  # warm-up
    hf_generate(random_prompts(1, 32, vocab, rng), 4)
    for _ in range(args.runs):
        prompt = random_prompts(1, args.prefill, vocab, rng)[0]
        record("hearth", "prefill", 1, one_run(engine, [prompt], 1)["prefill_tokens_per_s"])
        record("transformers", "prefill", 1, args.prefill / hf_generate([prompt], 1))
        for b in batches:
            prompts = random_prompts(b, args.context, vocab, rng)
            record("hearth", "decode", b, one_run(engine, prompts, args.decode + 1)["decode_tokens_per_s"])
            first = hf_generate(prompts, 1)
            whole = hf_generate(prompts, args.decode + 1)
            record("transformers", "decode", b, b * args.decode / max(whole - first, 1e-9))
    return times


def result_rows(args: argparse.Namespace, config, held: dict, stored, roof, times: dict,
                batches: list[int]) -> tuple[list[list], list[dict]]:
    """The table's rows and the JSON's results: medians, each engine's rate for the bytes it holds, the
    ceiling for the folder's weights as stored."""
    import torch

    from hearth.bench.roofline import step_cost

    itemsize = getattr(torch, args.dtype).itemsize
    peak = roof.flops_by_dtype[args.dtype]  # the matmuls run in this dtype
    rows, results = [], []
    for test, b in [("prefill", 1)] + [("decode", b) for b in batches]:
        context = args.prefill if test == "prefill" else args.context + args.decode // 2
        medians, rates = {}, {}
        for name, weights in held.items():
            cost = step_cost(config, weights, test, b, context, itemsize)
            medians[name] = v = median(times[(name, test, b)])
            # decode: bytes per step x steps per second; prefill: FLOPs per token x tokens per second
            rates[name] = (cost.bytes * v / b if test == "decode" else cost.flops / cost.tokens * v) / 1e9
        unit = "GB/s" if test == "decode" else "GFLOP/s"
        cost = step_cost(config, stored, test, b, context, itemsize)
        ceiling = cost.tokens / max(cost.flops / peak, cost.bytes / roof.bandwidth)
        h, t = medians["hearth"], medians["transformers"]
        label = f"prefill {args.prefill}" if test == "prefill" else f"decode B={b} (context {args.context})"
        rows.append([label, h, t, f"{h / t:.2f}x", f"{rates['hearth']:.1f} / {rates['transformers']:.1f} {unit}",
                     ceiling, f"{h / ceiling:.1%} / {t / ceiling:.1%}"])
        results.append({"test": test, "batch_size": b, "hearth_tokens_per_s": times[("hearth", test, b)],
                        "transformers_tokens_per_s": times[("transformers", test, b)], "hearth_median": h,
                        "transformers_median": t, "ratio": h / t, "ceiling_tokens_per_s": ceiling,
                        "rates": rates, "rate_unit": unit,
                        "weight_bytes_per_step": {k: w.per_step for k, w in held.items()}})
    return rows, results


def report(args: argparse.Namespace, folder: str, info: dict, roof, held: dict, stored, rows: list[list]) -> str:
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    peak = roof.flops_by_dtype[args.dtype]
    return "\n".join([
        f"### hearth vs transformers `generate` ({folder.rstrip('/').rsplit('/', 2)[-2]}, {args.dtype}, {plural(threads(), 'thread')})",
        "",
        f"`{command}` — medians of {args.runs} interleaved runs.",
        "",
        machine_markdown(info),
        f"- roofline of this machine: {roof.bandwidth / 1e9:.1f} GB/s, {peak / 1e9:.0f} GFLOP/s {args.dtype} matmul; "
        f"ceiling = its tokens/s for the folder's weights as stored ({stored.per_step / 1e9:.2f} GB per step); "
        f"rates use the bytes each engine holds (hearth {held['hearth'].per_step / 1e9:.2f} GB, "
        f"transformers {held['transformers'].per_step / 1e9:.2f} GB)",
        "",
        table(["test", "hearth tok/s", "transformers tok/s", "hearth / transformers", "rate (hearth / transformers)",
               "ceiling tok/s", "share of ceiling"], rows),
    ])


def main() -> None:
    args = parse_args()
    set_threads(args.threads)

    import torch
    import transformers

    from hearth.bench.roofline import measure_machine, model_weight_bytes
    from hearth.config import ModelConfig
    from hearth.llm import LLM
    from hearth.loading.safetensors import read_json

    folder = args.hf or bench_model(args.arch, ())["hf"]
    batches = [int(b) for b in args.batches.split(",")]
    dtype = getattr(torch, args.dtype)
    info = machine()
    roof = measure_machine("cpu", dtype)
    longest = max(args.prefill, max(batches) * (args.context + args.decode + 2)) + 64
    config = ModelConfig.from_hf(read_json(Path(folder) / "config.json"))
    llm = LLM(folder, dtype=args.dtype, max_num_seqs=max(batches), max_num_batched_tokens=max(2048, args.prefill),
              kv_cache_memory=config.kv_bytes_per_token(dtype.itemsize) * longest, progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    hf.generation_config.eos_token_id = None  # fixed lengths, as ignore_eos
    hf.generation_config.pad_token_id = 0
    times = interleaved_runs(args, llm.engine, hf, config.vocab_size, batches)
    # bytes per step: each engine's weights as it holds them (hearth may keep the folder's bf16,
    # transformers converts to --dtype); the ceiling is the roofline for the folder's weights as stored
    held = {"hearth": model_weight_bytes(llm.engine.model), "transformers": torch_weight_bytes(hf, config)}
    stored = folder_weight_bytes(folder, config)
    rows, results = result_rows(args, config, held, stored, roof, times, batches)
    write_results(args.out, report(args, folder, info, roof, held, stored, rows),
                  {"machine": info, "roofline_machine": vars(roof), "results": results})


if __name__ == "__main__":
    main()
