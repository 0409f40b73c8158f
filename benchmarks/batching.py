#!/usr/bin/env python
"""Output tokens/s of N concurrent requests (continuous batching) against the same requests run one
at a time, and against transformers `generate` with static batches; same model, dtype and threads.

Requests have P prompt tokens of random ids and exactly O output tokens; P and O are fixed or, given
as LO-HI, drawn per request (uniformly, seeded): the mixed-length workload, where a static batch is
padded to its longest prompt and runs to its longest output. Where every request has the same
shape, a rate measured on a sample of the one-at-a-time requests or of the static batches holds for
all N: --sequential-sample and --static-sample say how many were timed (0: all); with mixed lengths
a sample is an estimate.

    python benchmarks/batching.py --model tiny --out benchmarks/results/batching-tiny
    python benchmarks/batching.py --model tinyllama-1.1b --dtype bfloat16 --sequential-sample 1 \\
        --static-sample 1 --out benchmarks/results/batching-tinyllama
    python benchmarks/batching.py --model tinyllama-1.1b --dtype bfloat16 --input-len 16-512 \\
        --output-len 16-256 --sequential-sample 1 --threads 1 --cpu-time --out benchmarks/results/batching-mixed

--hearth-dtype auto runs hearth as a user's `hearth serve FOLDER` does (on a CPU: float32 activations,
the weights kept in the folder's bf16) against transformers in --dtype.
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from common import (bench_model, machine, machine_markdown, plural, set_threads, table, threads, tiny_model,
                    write_results)


def length_range(text: str) -> tuple[int, int]:
    """'N' -> (N, N); 'LO-HI' -> (LO, HI)."""
    low, _, high = text.partition("-")
    bounds = (int(low), int(high or low))
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected N or LO-HI with 1 <= LO <= HI, got {text!r}")
    return bounds


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="'tiny' or an architecture of hearth bench make-model")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=length_range, default=(128, 128), help="N, or LO-HI drawn per request")
    ap.add_argument("--output-len", type=length_range, default=(128, 128), help="N, or LO-HI drawn per request")
    ap.add_argument("--static-batch", type=int, default=16, help="transformers' batch size")
    ap.add_argument("--sequential-sample", type=int, default=0, help="one-at-a-time requests timed (0: all)")
    ap.add_argument("--static-sample", type=int, default=0, help="static batches timed (0: all)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--hearth-dtype", default=None, choices=["auto", "float32", "bfloat16"],
                    help="hearth's compute dtype (default: --dtype; auto: hearth's default, float32 on a CPU with "
                         "the weights kept in the folder's dtype)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--also-gguf", default=None, metavar="TYPE",
                    help="also run hearth on the model's GGUF of this type (q8_0...), its quantized path")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="hearth's (default: --num-prompts)")
    ap.add_argument("--threads", type=int, default=None, help="threads for every engine (default: torch's)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time in CPU seconds of the process (with --threads 1: what a loaded machine can compare)")
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def make_workload(args: argparse.Namespace, folder: str) -> SimpleNamespace:
    """The N requests (seeded): config, prompts, params, prompt_lens, output_lens, p_max, o_max."""
    from hearth.bench.latency import random_prompts
    from hearth.config import ModelConfig
    from hearth.loading.safetensors import read_json
    from hearth.sampling_params import SamplingParams

    n, (p_min, p_max), (o_min, o_max) = args.num_prompts, args.input_len, args.output_len
    config = ModelConfig.from_hf(read_json(Path(folder) / "config.json"))
    rng = random.Random(0)
    prompt_lens = [rng.randint(p_min, p_max) for _ in range(n)]
    output_lens = [rng.randint(o_min, o_max) for _ in range(n)]
    prompts = [p[:length] for p, length in zip(random_prompts(n, p_max, config.vocab_size, rng), prompt_lens)]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in output_lens]
    return SimpleNamespace(n=n, config=config, prompts=prompts, params=params, prompt_lens=prompt_lens,
                           output_lens=output_lens, p_max=p_max, o_max=o_max)


def add_result(results: dict, name: str, outputs: int, requests: int, seconds: float, note: str) -> None:
    results[name] = {"requests_timed": requests, "output_tokens": outputs, "seconds": seconds,
                     "output_tokens_per_s": outputs / seconds, "note": note}


def run_hearth(args: argparse.Namespace, work: SimpleNamespace, path: str, dtype_name: str, label: str, clock,
               results: dict) -> None:
    """N requests at once (continuous batching), then a sample of them one at a time."""
    import torch

    from hearth.bench.latency import random_prompts
    from hearth.llm import LLM
    from hearth.sampling_params import SamplingParams

    n, config = work.n, work.config
    element = getattr(torch, dtype_name).itemsize if dtype_name != "auto" else 4
    llm = LLM(path, dtype=dtype_name, max_num_seqs=args.max_num_seqs or n,
              max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory=config.kv_bytes_per_token(element) * (n * (work.p_max + work.o_max) + 32 * n),
              progress=False)
    llm.generate(random_prompts(2, 16, config.vocab_size, random.Random(1)),
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    start = clock()
    outputs = llm.generate(work.prompts, work.params, use_tqdm=False)
    elapsed = clock() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == work.output_lens
    add_result(results, f"hearth{label}, {n} concurrent (continuous batching)", sum(work.output_lens), n, elapsed,
               "all requests")
    sample = args.sequential_sample or n
    start = clock()
    for prompt, p in zip(work.prompts[:sample], work.params):  # one request in the engine at a time
        llm.generate([prompt], p, use_tqdm=False)
    add_result(results, f"hearth{label}, one at a time", sum(work.output_lens[:sample]), sample, clock() - start,
               f"{sample} of {n} requests timed")


def run_transformers(args: argparse.Namespace, work: SimpleNamespace, folder: str, clock, results: dict) -> None:
    """transformers `generate` in static batches: each padded on the left to its longest prompt, every
    row run to the batch's longest output."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype)).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    n, batch, prompts, prompt_lens, output_lens = work.n, args.static_batch, work.prompts, work.prompt_lens, work.output_lens
    batches = [range(i, min(n, i + batch)) for i in range(0, n, batch)]
    timed_batches = batches[: args.static_sample or len(batches)]
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0][:16]]), max_new_tokens=4, do_sample=False)  # warm-up
        start = clock()
        for group in timed_batches:
            longest, steps = max(prompt_lens[i] for i in group), max(output_lens[i] for i in group)
            ids = torch.tensor([[0] * (longest - prompt_lens[i]) + prompts[i] for i in group])
            mask = torch.tensor([[0] * (longest - prompt_lens[i]) + [1] * prompt_lens[i] for i in group])
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
            assert out.shape[1] == longest + steps
        seconds = clock() - start
    add_result(results, f"transformers generate, static batches of {batch}",
               sum(output_lens[i] for g in timed_batches for i in g), sum(len(g) for g in timed_batches), seconds,
               f"{len(timed_batches)} of {len(batches)} batches timed")


def report(args: argparse.Namespace, description: str, info: dict, results: dict) -> str:
    n = args.num_prompts
    base = results[f"hearth, {n} concurrent (continuous batching)"]["output_tokens_per_s"]
    rows = [[name, r["output_tokens_per_s"], f"{r['output_tokens_per_s'] / base:.2f}x", r["seconds"], r["note"]]
            for name, r in results.items()]
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    lengths = [f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in (args.input_len, args.output_len)]
    return "\n".join([
        f"### {n} requests of {lengths[0]} prompt + {lengths[1]} output tokens: {description}, {args.dtype}"
        + (f" (hearth: {args.hearth_dtype})" if args.hearth_dtype else "") + ", "
        f"{plural(threads(), 'thread')}" + (", CPU seconds" if args.cpu_time else ""),
        "",
        f"`{command}`",
        "",
        machine_markdown(info),
        "",
        table(["how", "output tok/s", "vs continuous batching", "seconds timed", "timed"], rows),
    ])


def main() -> None:
    args = parse_args()
    if args.cpu_time and args.threads != 1:
        sys.exit("--cpu-time counts one thread's seconds: add --threads 1")
    set_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    if args.model == "tiny":
        if args.also_gguf:
            sys.exit("--also-gguf needs an architecture of hearth bench make-model as --model")
        source, folder, description = tiny_model()
    else:
        folder = bench_model(args.model, ())["hf"]
        source, description = folder, f"{args.model} (random weights), HF folder"
    info = machine()
    work = make_workload(args, folder)
    results: dict = {}
    run_hearth(args, work, source, args.hearth_dtype or args.dtype, "", clock, results)
    if args.also_gguf:  # the same weights as a quantized GGUF, in hearth's own compute dtype
        gguf = bench_model(args.model, (args.also_gguf,))[args.also_gguf]
        run_hearth(args, work, gguf, "auto", f" on the {args.also_gguf} GGUF (float32 activations)", clock, results)
    run_transformers(args, work, folder, clock, results)
    write_results(args.out, report(args, description, info, results), {"machine": info, "args": vars(args),
                                                                       "results": results})


if __name__ == "__main__":
    main()
