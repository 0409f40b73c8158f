#!/usr/bin/env python
"""What the KV cache tiers cost when nothing hits: `hearth bench throughput`'s workload (unique random
prompts, so the prefix cache and the tiers never hit) with the tiers off, a RAM tier (--kv-cache-ram) and a
disk tier (--kv-cache-dir), on a KV budget small enough that every finished request's blocks are evicted
by the next ones (so the tiers take every block: their whole cost, and none of their gain).

One engine per set-up, loaded once and warmed up; then --runs runs, the set-ups interleaved run by run,
each run new prompts (the same for every set-up). Throughput by the wall clock and by the process's CPU
time (what a machine shared with other jobs can compare; a background thread's work counts too: each run
ends when the disk tier's writer thread has written its blocks). The tiers' part of the engine's step, the
evicted blocks copied out of the cache and handed over (LLMEngine._copy_to_tiers), is timed by the wall clock
and by its thread's CPU time, as a share of the run's wall and CPU time (the CPU share resolves under load).

    python benchmarks/tier_overhead.py ../shared/data/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --runs 5 --threads 1 --out benchmarks/results/threads-1/tier-overhead-smollm2
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import tempfile
import time
from dataclasses import asdict

from common import machine, machine_markdown, median, set_threads, table, write_results


def measure(llm, prompts: list[list[int]], output_len: int) -> dict:
    from hearth import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine = llm.engine
    written = [asdict(c) for c in (engine.kv_ram_totals, engine.kv_disk_totals)]
    copy_before, copy_cpu_before = engine.copy_seconds, engine.copy_cpu_seconds
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if engine.kv_tiers is not None:
        engine.kv_tiers.close()  # the disk tier's writer thread done with this run's blocks, inside its times
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outputs)
    after = [asdict(c) for c in (engine.kv_ram_totals, engine.kv_disk_totals)]
    return {"wall_s": wall, "cpu_s": cpu, "tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu,
            "cached_tokens": sum(o.num_cached_tokens for o in outputs),
            "blocks_written": [a["blocks_written"] - b["blocks_written"] for a, b in zip(after, written)],
            "hits": [a["hits"] - b["hits"] for a, b in zip(after, written)],
            "dropped": after[1]["dropped"] - written[1]["dropped"],  # the disk tier's writer did not keep up
            "tier_write_s": sum(a["write_seconds"] - b["write_seconds"] for a, b in zip(after, written)),
            "copy_s": engine.copy_seconds - copy_before, "copy_cpu_s": engine.copy_cpu_seconds - copy_cpu_before}


def time_copies(engine) -> None:
    """engine.copy_seconds and copy_cpu_seconds: the time and its thread's CPU time in LLMEngine._copy_to_tiers
    (the evicted blocks' bytes read from the cache and handed to the tiers), the tiers' cost in the engine's step when nothing hits (the disk tier's
    writer thread hashes and writes the files beside it: its time is the CPU time's, not the step's)."""
    copy, engine.copy_seconds, engine.copy_cpu_seconds = engine._copy_to_tiers, 0.0, 0.0

    def timed(*args, **kwargs):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return copy(*args, **kwargs)
        finally:
            engine.copy_seconds += time.perf_counter() - start
            engine.copy_cpu_seconds += time.thread_time() - cpu

    engine._copy_to_tiers = timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--ram-mib", type=int, default=2048)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    set_threads(args.threads)
    from hearth import LLM
    from hearth.loading.loader import read_model

    config, _, _ = read_model(args.model, progress=False)
    # the running requests' blocks and one request more: a finished request's blocks are evicted soon after
    tokens = (args.max_num_seqs + 1) * (args.input_len + args.output_len + 16)
    common = dict(progress=False, max_num_seqs=args.max_num_seqs, kv_cache_memory=tokens * config.kv_bytes_per_token(4))
    folder = tempfile.TemporaryDirectory()
    setups = {"off": {}, "ram": dict(kv_cache_ram=args.ram_mib << 20), "disk": dict(kv_cache_dir=folder.name)}
    engines = {name: LLM(args.model, **common, **options) for name, options in setups.items()}
    for llm in engines.values():
        time_copies(llm.engine)
    rng = random.Random(0)

    def new_prompts() -> list[list[int]]:
        return [[rng.randrange(config.vocab_size) for _ in range(args.input_len)] for _ in range(args.num_prompts)]

    warm = new_prompts()[: args.max_num_seqs]
    for llm in engines.values():
        measure(llm, warm, args.output_len)
    results = {name: [] for name in setups}
    for run in range(args.runs):
        prompts = new_prompts()
        for name, llm in engines.items():
            results[name].append(measure(llm, prompts, args.output_len))
            r = results[name][-1]
            print(f"run {run + 1}: {name}: {r['tokens_per_s']:.1f} tok/s, {r['tokens_per_cpu_s']:.1f} tok/CPU-s, "
                  f"{r['blocks_written']} blocks to (RAM, disk), {r['cached_tokens']} cached", file=sys.stderr, flush=True)
    rows = []
    base = {key: median([r[key] for r in results["off"]]) for key in ("tokens_per_s", "tokens_per_cpu_s")}
    for name, runs in results.items():
        wall, cpu = median([r["tokens_per_s"] for r in runs]), median([r["tokens_per_cpu_s"] for r in runs])
        per_run = [r["tokens_per_cpu_s"] / o["tokens_per_cpu_s"] for r, o in zip(runs, results["off"])]
        rows.append([name, cpu, f"{cpu / base['tokens_per_cpu_s']:.3f}x", f"{median(per_run):.3f}x", wall,
                     f"{wall / base['tokens_per_s']:.3f}x", f"{median([r['copy_s'] / r['wall_s'] for r in runs]):.2%}",
                     f"{median([r['copy_cpu_s'] / r['cpu_s'] for r in runs]):.2%}",
                     sum(r["cached_tokens"] for r in runs),
                     " / ".join(str(r["blocks_written"]) for r in runs[:1])])
    info = machine()
    markdown = (f"{machine_markdown(info)}\n\n`python benchmarks/tier_overhead.py {shlex.join(sys.argv[1:])}`\n\n"
                f"{args.num_prompts} unique random prompts of {args.input_len} tokens, {args.output_len} output tokens "
                f"each, at most {args.max_num_seqs} at once, a KV budget of {tokens:,} tokens; medians of {args.runs} "
                f"runs, the set-ups interleaved\n\n"
                + table(["tiers", "tokens / CPU-s", "ratio", "median of per-run ratios", "tokens / s (wall)",
                         "ratio (wall)", "copies to the tiers / wall", "their CPU / CPU", "cached tokens (all runs)", "blocks written (RAM, disk), run 1"], rows))
    write_results(args.out, markdown, {"args": vars(args), "machine": info, "results": results})
    folder.cleanup()


if __name__ == "__main__":
    main()
