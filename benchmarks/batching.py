#!/usr/bin/env python
"""Output tokens/s of N concurrent requests (continuous batching) against the same requests run one
at a time, and against transformers `generate` with static batches; same model, dtype and threads.

Every request has the same shape (P prompt tokens of random ids, exactly O output tokens), so a
rate measured on a sample of the one-at-a-time requests or of the static batches holds for all N:
--sequential-sample and --static-sample say how many were timed (0: all).

    python benchmarks/batching.py --model tiny --out benchmarks/results/batching-tiny
    python benchmarks/batching.py --model tinyllama-1.1b --dtype bfloat16 --sequential-sample 1 \\
        --static-sample 1 --out benchmarks/results/batching-tinyllama
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import time
from pathlib import Path

from common import (bench_model, machine, machine_markdown, plural, set_threads, table, threads, tiny_model,
                    write_results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="'tiny' or an architecture of hearth bench make-model")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--static-batch", type=int, default=16, help="transformers' batch size")
    ap.add_argument("--sequential-sample", type=int, default=0, help="one-at-a-time requests timed (0: all)")
    ap.add_argument("--static-sample", type=int, default=0, help="static batches timed (0: all)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--also-gguf", default=None, metavar="TYPE",
                    help="also run hearth on the model's GGUF of this type (q8_0...), its quantized path")
    ap.add_argument("--threads", type=int, default=None, help="threads for every engine (default: torch's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    set_threads(args.threads)

    import torch
    import transformers

    from hearth.bench.latency import random_prompts
    from hearth.config import ModelConfig
    from hearth.llm import LLM
    from hearth.loading.safetensors import read_json
    from hearth.sampling_params import SamplingParams

    if args.model == "tiny":
        if args.also_gguf:
            sys.exit("--also-gguf needs an architecture of hearth bench make-model as --model")
        source, folder, description = tiny_model()
    else:
        folder = bench_model(args.model, ())["hf"]
        source, description = folder, f"{args.model} (random weights), HF folder"
    dtype = getattr(torch, args.dtype)
    n, p_len, o_len = args.num_prompts, args.input_len, args.output_len
    info = machine()

    config = ModelConfig.from_hf(read_json(Path(folder) / "config.json"))
    prompts = random_prompts(n, p_len, config.vocab_size, random.Random(0))
    params = SamplingParams(temperature=0, max_tokens=o_len, ignore_eos=True)
    rows, results = [], {}

    def add(name: str, requests: int, seconds: float, note: str) -> None:
        tok_s = requests * o_len / seconds
        results[name] = {"requests_timed": requests, "seconds": seconds, "output_tokens_per_s": tok_s, "note": note}

    def run_hearth(path: str, dtype_name: str, label: str) -> None:
        """N requests at once (continuous batching), then a sample of them one at a time."""
        element = getattr(torch, dtype_name).itemsize if dtype_name != "auto" else 4
        llm = LLM(path, dtype=dtype_name, max_num_seqs=n, max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_cache_memory=config.kv_bytes_per_token(element) * (n * (p_len + o_len) + 32 * n), progress=False)
        llm.generate(random_prompts(2, 16, config.vocab_size, random.Random(1)),
                     SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == n * o_len
        add(f"hearth{label}, {n} concurrent (continuous batching)", n, elapsed, "all requests")
        sample = args.sequential_sample or n
        start = time.perf_counter()
        for prompt in prompts[:sample]:  # one request in the engine at a time
            llm.generate([prompt], params, use_tqdm=False)
        add(f"hearth{label}, one at a time", sample, time.perf_counter() - start, f"{sample} of {n} requests timed")

    run_hearth(source, args.dtype, "")
    if args.also_gguf:  # the same weights as a quantized GGUF, in hearth's own compute dtype
        gguf = bench_model(args.model, (args.also_gguf,))[args.also_gguf]
        run_hearth(gguf, "auto", f" on the {args.also_gguf} GGUF (float32 activations)")

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    batch = args.static_batch
    batches = [prompts[i : i + batch] for i in range(0, n, batch)]
    timed_batches = batches[: args.static_sample or len(batches)]
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0][:16]]), max_new_tokens=4, do_sample=False)  # warm-up
        start = time.perf_counter()
        for group in timed_batches:
            ids = torch.tensor(group)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=o_len, min_new_tokens=o_len,
                              do_sample=False)
            assert out.shape[1] == p_len + o_len
        seconds = time.perf_counter() - start
    count = sum(len(g) for g in timed_batches)
    add(f"transformers generate, static batches of {batch}", count, seconds,
        f"{len(timed_batches)} of {len(batches)} batches timed")

    base = results[f"hearth, {n} concurrent (continuous batching)"]["output_tokens_per_s"]  # the same dtype as transformers
    for name, r in results.items():
        rows.append([name, r["output_tokens_per_s"], f"{r['output_tokens_per_s'] / base:.2f}x", r["seconds"], r["note"]])
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    md = "\n".join([
        f"### {n} requests of {p_len} prompt + {o_len} output tokens: {description}, {args.dtype}, {plural(threads(), 'thread')}",
        "",
        f"`{command}`",
        "",
        machine_markdown(info),
        "",
        table(["how", "output tok/s", "vs continuous batching", "seconds timed", "timed"], rows),
    ])
    write_results(args.out, md, {"machine": info, "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
