#!/usr/bin/env python
"""hearth against llama.cpp (llama-cpp-python) on the same GGUF file with the same thread count.

Measured side by side, interleaved run by run (so both see the same machine load):
  prefill P   one prompt of P tokens (default 512), tokens/s
  decode B    B sequences with C tokens cached each decode D tokens together, tokens/s over all

Beside tokens/s: GB/s (bytes each engine reads per decode step: llama.cpp the file's blocks,
hearth its weights as loaded) or GFLOP/s for prefill, and the share of this machine's
roofline ceiling for the file (see `hearth roofline`).

    python benchmarks/hearth_vs_llamacpp.py --arch tinyllama-1.1b --types q8_0 --out benchmarks/results/llamacpp
    python benchmarks/hearth_vs_llamacpp.py --types q4_k_m,q5_k_m,q6_k --threads 1 --cpu-time

--types takes hearth's converter types (f16, q8_0, q4_0...) and llama.cpp's K-quant and i-quant mixes
(q4_k_m, q5_k_m, q6_k, iq4_xs, iq3_s, iq2_xs, iq1_m...: the f16 file requantized by llama.cpp's own
`llama_model_quantize`; the mixes it writes only with an importance matrix get one of ones).
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys

from common import (bench_model, machine, machine_markdown, median, plural, set_threads, table, threads,
                    write_results)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="tinyllama-1.1b")
    ap.add_argument("--types", default="q8_0", help="GGUF types, comma-separated (f16, q8_0, q4_0)")
    ap.add_argument("--gguf", default=None, help="a GGUF file instead of --arch/--types")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--context", type=int, default=64, help="tokens cached before decoding")
    ap.add_argument("--decode", type=int, default=16, help="decode steps timed")
    ap.add_argument("--batches", default="1,8", help="decode batch sizes")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="hearth's compute dtype")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="hearth's --kv-cache-dtype (llama.cpp keeps its default: float16 K and V)")
    ap.add_argument("--threads", type=int, default=None, help="threads for every engine (default: torch's)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="count CPU seconds, not wall time (1 thread only): on a machine shared with other jobs, "
                         "what each engine's own work costs")
    ap.add_argument("--multi-step", type=int, default=0, metavar="K",
                    help="also decode with a second hearth engine, --speculative-method multi-step "
                         "--num-speculative-tokens K (interleaved with the others: rows 'decode ... multi-step K')")
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = ap.parse_args()
    for name in ("prefill", "context", "decode", "runs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    return args


def interleaved_runs(args: argparse.Namespace, engine, cpp, vocab: int, batches: list[int],
                     clock, multi_step=None) -> dict[tuple[str, str, int], list[float]]:
    """A warm-up, then args.runs rounds of prefill and each batch's decode, hearth and llama.cpp in turn
    (and hearth's multi_step engine's decode, where given): {(engine, test, batch): tokens/s of each run}."""
    from hearth.bench.latency import one_run, random_prompts

    rng = random.Random(0)
    times: dict[tuple[str, str, int], list[float]] = {}

    def record(engine_name: str, test: str, b: int, tok_s: float) -> None:
        times.setdefault((engine_name, test, b), []).append(tok_s)
        print(f"{engine_name} {test} B={b}: {tok_s:.2f} tok/s", file=sys.stderr, flush=True)  # progress

    for warm in (engine, multi_step):
        if warm is not None:
            one_run(warm, random_prompts(1, 32, vocab, rng), 4)
    cpp.clear()
    cpp.prefill(random_prompts(1, 32, vocab, rng)[0])
    for _ in range(args.runs):
        prompt = random_prompts(1, args.prefill, vocab, rng)[0]
        record("hearth", "prefill", 1, one_run(engine, [prompt], 1, clock)["prefill_tokens_per_s"])
        cpp.clear()
        record("llama.cpp", "prefill", 1, args.prefill / cpp.prefill(prompt))
        for b in batches:
            prompts = random_prompts(b, args.context, vocab, rng)
            # hearth: the first step after prefill is the first decode; D + 1 tokens gives D decode steps
            record("hearth", "decode", b, one_run(engine, prompts, args.decode + 1, clock)["decode_tokens_per_s"])
            record("llama.cpp", "decode", b, b * args.decode / cpp.decode(prompts, args.decode))
            if multi_step is not None:
                record("hearth multi-step", "decode", b,
                       one_run(multi_step, prompts, args.decode + 1, clock)["decode_tokens_per_s"])
    return times


def result_rows(args: argparse.Namespace, path: str, config, stored, loaded, kv_element: float, roof,
                times: dict, batches: list[int]) -> tuple[list[list], list[dict]]:
    """The table's rows and the JSON's results for one file: medians, rates (GB/s for decode, GFLOP/s
    for prefill), the roofline's bound and ceiling."""
    from hearth.bench.roofline import roofline_row, step_cost

    rows, results = [], []
    name = path.rsplit("/", 1)[-1]
    hearths = ["hearth"] + ["hearth multi-step"] * bool(args.multi_step)  # (the second engine: decode only)
    for engine, test, b in [("hearth", "prefill", 1)] + [(e, "decode", b) for e in hearths for b in batches]:
        multi = engine != "hearth"
        context = args.prefill if test == "prefill" else args.context + args.decode // 2
        ceiling = roofline_row(step_cost(config, stored, test, b, context, kv_element), roof)
        file_cost = step_cost(config, stored, test, b, context, kv_element)
        held_cost = step_cost(config, loaded, test, b, context, kv_element)
        h = median(times[(engine, test, b)])
        c = median(times[("llama.cpp", test, b)])
        if test == "decode":  # bytes per step x steps per second
            h_rate = held_cost.bytes * h / b / 1e9
            c_rate = file_cost.bytes * c / b / 1e9
            unit = "GB/s"
        else:  # FLOPs per token x tokens per second
            h_rate = held_cost.flops / held_cost.tokens * h / 1e9
            c_rate = file_cost.flops / file_cost.tokens * c / 1e9
            unit = "GFLOP/s"
        label = (f"prefill {args.prefill}" if test == "prefill" else f"decode B={b} (context {args.context})"
                 + f", multi-step {args.multi_step}" * multi)
        rows.append([name, label, h, c, f"{h / c:.2f}x", f"{h_rate:.1f} / {c_rate:.1f} {unit}",
                     ceiling["bound"], ceiling["ceiling_tokens_per_s"],
                     f"{h / ceiling['ceiling_tokens_per_s']:.1%} / {c / ceiling['ceiling_tokens_per_s']:.1%}"])
        results.append({
            "file": path, "test": test, "batch_size": b, "context": context, "multi_step": args.multi_step * multi,
            "hearth_tokens_per_s": times[(engine, test, b)], "llamacpp_tokens_per_s": times[("llama.cpp", test, b)],
            "hearth_median": h, "llamacpp_median": c, "ratio": h / c, "bound": ceiling["bound"],
            "ceiling_tokens_per_s": ceiling["ceiling_tokens_per_s"],
            "hearth_rate": h_rate, "llamacpp_rate": c_rate, "rate_unit": unit,
            "hearth_weight_bytes_per_step": loaded.per_step, "file_weight_bytes_per_step": stored.per_step,
        })
    return rows, results


def measure_file(args: argparse.Namespace, path: str, batches: list[int], n_threads: int, clock,
                 roof) -> tuple[list[list], list[dict]]:
    """Both engines on one file, sized for the longest test: result_rows' rows and results."""
    from hearth.engine.memory import state_bytes_per_slot
    from hearth.kv_format import kv_bytes_per_element
    from hearth.bench.roofline import file_weight_bytes, model_weight_bytes
    from hearth.llm import LLM
    from hearth.loading.loader import read_model
    from llamacpp_runner import LlamaCpp

    config, weights, _ = read_model(path, progress=False)
    stored = file_weight_bytes(config, weights)
    del weights
    # tokens cached at once (every sequence of the largest batch), and the longest sequence (within the model's context)
    cached = max(args.prefill, max(batches) * (args.context + args.decode + 2)) + 64
    longest = min(max(args.prefill, args.context + args.decode + 2) + 64, config.max_position_embeddings)
    # a hybrid model's budget keeps each running sequence's states (and a prefix-cache checkpoint beside
    # them) before K/V: without them here, 32 sequences would get one state slot and run one at a time
    states = (max(batches) + 1) * state_bytes_per_slot(config.state_bytes_per_sequence(4), True)
    options = dict(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, max_model_len=longest,
                   kv_cache_memory=config.kv_bytes_per_token(4) * cached + states, max_num_seqs=max(batches),
                   max_num_batched_tokens=max(2048, args.prefill), progress=False)
    engine = LLM(path, **options).engine
    multi_step = None if not args.multi_step else LLM(
        path, **options, speculative_method="multi-step", num_speculative_tokens=args.multi_step).engine
    loaded = model_weight_bytes(engine.model)
    kv_element = kv_bytes_per_element(args.kv_cache_dtype, engine.dtype.itemsize)
    cpp = LlamaCpp(path, n_threads, n_ctx=cached, n_seq_max=max(batches), clock=clock)
    times = interleaved_runs(args, engine, cpp, config.vocab_size, batches, clock, multi_step)
    cpp.close()
    return result_rows(args, path, config, stored, loaded, kv_element, roof, times, batches)


def report(args: argparse.Namespace, n_threads: int, info: dict, roof, rows: list[list]) -> str:
    import torch

    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    return "\n".join([
        f"### hearth vs llama.cpp (same GGUF, {plural(n_threads, 'thread')})",
        "",
        f"`{command}` — medians of {args.runs} interleaved runs"
        + (" timed in CPU seconds (tokens per CPU-second of the one thread)" if args.cpu_time else "")
        + "; hearth computes in "
        f"{str(torch.float32 if args.dtype == 'auto' else args.dtype).removeprefix('torch.')}.",
        "",
        machine_markdown(info),
        f"- roofline of this machine (measured by the script, best of 5): {roof.bandwidth / 1e9:.1f} GB/s; matmul "
        + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in roof.flops_by_dtype.items())
        + f" GFLOP/s (the roof: {roof.dtype}). Ceiling = the roofline's tokens/s for the file's bytes per step.",
        "",
        table(["model file", "test", "hearth tok/s", "llama.cpp tok/s", "hearth / llama.cpp",
               "hearth / llama.cpp rate", "bound", "ceiling tok/s", "share of ceiling (hearth / llama.cpp)"], rows),
    ])


def main() -> None:
    args = parse_args()
    set_threads(args.threads)
    import time

    import torch

    from hearth.bench.roofline import measure_machine

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        sys.exit("llama-cpp-python is not installed: pip install ../shared/wheels/llama_cpp_python-*.whl")

    batches = [int(b) for b in args.batches.split(",")]
    files = [args.gguf] if args.gguf else [bench_model(args.arch, args.types.split(","))[t] for t in args.types.split(",")]
    n_threads = threads()
    if args.cpu_time and n_threads != 1:
        sys.exit("--cpu-time counts one thread's seconds: add --threads 1")
    clock = time.process_time if args.cpu_time else time.perf_counter
    info = machine()
    roof = measure_machine("cpu", torch.float32, matmul_n=1024)  # 2048^3 in bf16 takes minutes without AVX-512 BF16
    rows, data = [], {"machine": info, "roofline_machine": vars(roof), "results": []}
    for path in files:
        file_rows, results = measure_file(args, path, batches, n_threads, clock, roof)
        rows += file_rows
        data["results"] += results
    write_results(args.out, report(args, n_threads, info, roof, rows), data)


if __name__ == "__main__":
    main()
