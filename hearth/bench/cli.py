"""The `hearth bench ...` and `hearth roofline` commands (registered by hearth/cli.py)."""

from __future__ import annotations

import argparse
import json

from hearth.engine_config import DEFAULT_MAX_NUM_SEQS
from hearth.engine_args import add_engine_arguments, add_model_argument, apply_threads, build_llm


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _element_sizes(args) -> tuple[float, int]:
    """Bytes per K or V value of the engine options' KV cache, and per value of its compute dtype."""
    from hearth.kv_format import kv_bytes_per_element
    from hearth.engine.memory import choose_device, choose_dtype

    itemsize = choose_dtype(args.dtype, choose_device(args.device)).itemsize
    return kv_bytes_per_element(args.kv_cache_dtype, itemsize), itemsize


def _llm(args, tokens_needed: int | None, num_seqs: int):
    """An LLM from the engine options; a KV cache just large enough for the run (num_seqs sequences at
    once) unless one is given: K/V for tokens_needed tokens, and a hybrid model's states for num_seqs
    sequences with max_model_len the run's longest (hearth/engine/memory.py, split_budget)."""
    kv = args.kv_cache_memory
    # without --max-num-seqs, where the run does not size the cache: the engine's own count (split_budget's)
    auto = args.max_num_seqs is None and (kv is not None or tokens_needed is None)
    options = {"max_num_seqs": None if auto else num_seqs}
    if kv is None and tokens_needed is not None:
        from hearth.engine.memory import state_bytes_per_slot
        from hearth.loading.loader import read_model

        config, _, _ = read_model(args.model, progress=False)
        element, itemsize = _element_sizes(args)
        blocks = -(-tokens_needed // 16) + 2 * num_seqs  # whole blocks per sequence, and slack
        kv = config.kv_bytes_per_token(element) * 16 * blocks
        if config.is_hybrid:
            kv += num_seqs * state_bytes_per_slot(config.state_bytes_per_sequence(itemsize), args.enable_prefix_caching)
            options["max_model_len"] = args.max_model_len or -(-tokens_needed // num_seqs)
    return build_llm(args, kv_cache_memory=kv, progress=not args.json, **options)


def _print(report: dict, args, formatter, plot=None) -> None:
    """The report as JSON or as `formatter`'s text; with --plot, `plot(report, path)` draws it first."""
    if plot is not None and args.plot:
        report["plot"] = str(plot(report, args.plot))
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(formatter(report))
    if report.get("plot"):
        print(f"plot: {report['plot']}")


def cmd_latency(args) -> None:
    from hearth.bench.latency import format_latency, run_latency

    num_seqs = max(args.max_num_seqs or 1, args.batch_size)
    llm = _llm(args, args.batch_size * (args.input_len + args.output_len), num_seqs)
    report = run_latency(llm, args.batch_size, args.input_len, args.output_len, args.runs, args.warmup,
                         args.seed, progress=not args.json)
    _print(report, args, format_latency)


def cmd_throughput(args) -> None:
    from hearth.bench.throughput import format_throughput, run_throughput

    num_seqs = min(args.num_prompts, args.max_num_seqs or DEFAULT_MAX_NUM_SEQS)
    needed = None if args.dataset is not None else num_seqs * (args.input_len + args.output_len)
    llm = _llm(args, needed, num_seqs)
    report = run_throughput(llm, args.num_prompts, args.input_len, args.output_len, args.dataset, args.seed,
                            progress=not args.json)
    _print(report, args, format_throughput)


def cmd_serve(args) -> None:
    from hearth.bench.serve import format_serve, run_serve

    report = run_serve(
        args.base_url, args.model, args.num_prompts, args.input_len, args.output_len,
        concurrency=args.concurrency, request_rate=args.request_rate, dataset=args.dataset,
        vocab_size=args.vocab_size, goodput=args.goodput, seed=args.seed,
        progress=not args.no_progress, timeout=args.timeout,
    )
    from hearth.bench.plots import serve_plot

    _print(report, args, format_serve, serve_plot)


def cmd_make_model(args) -> None:
    from hearth.bench.models import make_model

    kinds = [k for k in args.gguf.split(",") if k.strip()] if args.gguf else []
    report = make_model(args.arch, args.out, kinds, seed=args.seed, force=args.force, progress=not args.json)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{report['arch']}: {report['parameters']:,} parameters (random)")
        for kind, path in report["files"].items():
            print(f"  {kind:<5} {path}")
        if "gguf_skipped" in report:
            print(f"  no GGUF: {report['gguf_skipped']}")


def cmd_roofline(args) -> None:
    from hearth.bench.roofline_report import run_roofline

    apply_threads(args)
    engine = {
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": args.enable_prefix_caching,
        "enable_chunked_prefill": args.enable_chunked_prefill,
        "max_model_len": args.max_model_len,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    if args.kv_cache_memory is not None:
        engine["kv_cache_memory"] = args.kv_cache_memory
    elif args.measure:
        from hearth.loading.loader import read_model

        config, _, _ = read_model(args.model, progress=False)
        element, _ = _element_sizes(args)
        longest = max(args.batch_sizes)
        tokens = longest * (args.context + args.measure_tokens + 1 + 32)
        engine["kv_cache_memory"] = config.kv_bytes_per_token(element) * tokens
    report = run_roofline(args.model, args.batch_sizes, args.context, args.dtype, args.device, args.measure,
                          args.measure_tokens, args.runs, engine, progress=not args.json)
    from hearth.bench.plots import roofline_plot

    _print(report, args, format_roofline, roofline_plot)


def format_roofline(r: dict) -> str:
    m = r["machine"]
    lines = [
        f"machine   {m['device']}, {m['threads']} threads: {m['bandwidth'] / 1e9:.1f} GB/s memory; matmul "
        + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in m["flops_by_dtype"].items())
        + f" GFLOP/s; roof {m['flops'] / 1e9:.0f} ({m['dtype']}), ridge {m['ridge_flops_per_byte']:.1f} FLOPs/byte",
        f"model     {r['model']} ({r['architecture']}): {r['weight_bytes_per_step'] / 1e9:.3f} GB of weights per step "
        f"as stored; KV {r['kv_bytes_per_element']} bytes/element; context {r['context']}",
    ]
    if "loaded_weight_bytes_per_step" in r:
        lines.append(f"          hearth holds {r['loaded_weight_bytes_per_step'] / 1e9:.3f} GB of weights per step")
    measured = any("measured_tokens_per_s" in row for row in r["rows"])
    head = f"{'phase':<8} {'batch':>5} {'GFLOP/step':>11} {'MB/step':>10} {'FLOP/B':>8} {'bound':>8} {'ceiling tok/s':>14}"
    if measured:
        head += f" {'hearth tok/s':>13} {'share':>7} {'GB/s':>7} {'share (as held)':>16}"
    lines.append(head)
    for row in r["rows"]:
        line = (f"{row['phase']:<8} {row['batch_size']:>5} {row['flops_per_step'] / 1e9:>11.2f} "
                f"{row['bytes_per_step'] / 1e6:>10.1f} {row['arithmetic_intensity']:>8.2f} {row['bound']:>8} "
                f"{row['ceiling_tokens_per_s']:>14.1f}")
        if "measured_tokens_per_s" in row:
            line += (f" {row['measured_tokens_per_s']:>13.2f} {row['share_of_ceiling']:>7.1%} "
                     f"{row['measured_gb_per_s']:>7.2f} {row['share_of_loaded_ceiling']:>16.1%}")
        lines.append(line)
    if "plot" in r:
        lines.append(f"plot: {r['plot']}")
    return "\n".join(lines)


def add_bench_parsers(sub) -> None:
    """Register `bench` (latency, throughput, serve, make-model) and `roofline` on the hearth parser."""
    bench = sub.add_parser("bench", help="benchmarks: latency, throughput, serve (load generator), make-model")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    _add_latency_and_throughput(bsub)
    _add_serve(bsub)
    _add_make_model(bsub)
    _add_roofline(sub)


def _add_latency_and_throughput(bsub) -> None:
    p = bsub.add_parser("latency", help="prefill and decode tokens/s of one batch")
    add_model_argument(p)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default 128)")
    p.add_argument("--output-len", type=int, default=32, help="new tokens per request (default 32)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--runs", type=int, default=3, help="timed runs (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    add_engine_arguments(p)
    p.set_defaults(func=cmd_latency)

    p = bsub.add_parser("throughput", help="offline throughput of many requests at once")
    add_model_argument(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dataset", default=None,
                   help="prompts: a text file (one per line) or JSON lines with \"prompt\" (and \"output_len\")")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    add_engine_arguments(p)
    p.set_defaults(func=cmd_throughput)


def _add_serve(bsub) -> None:
    p = bsub.add_parser("serve", help="load generator for any OpenAI-compatible server")
    p.add_argument("--base-url", required=True, help="e.g. http://localhost:8000")
    p.add_argument("--model", required=True, help="the model name the server expects")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--concurrency", type=_int_list, default=None,
                      help="requests in flight; a list (1,4,16) gives one run each")
    load.add_argument("--request-rate", type=_float_list, default=None,
                      help="Poisson arrivals per second; a list gives one run each")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="prompt token ids per request")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens (with ignore_eos)")
    p.add_argument("--dataset", default=None, help="text prompts instead of random token ids")
    p.add_argument("--vocab-size", type=int, default=256, help="random prompt ids are drawn from [0, this)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="latency targets for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, metavar="OUT.png", help="latency percentiles and throughput against load")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_serve)


def _add_make_model(bsub) -> None:
    from hearth.bench.models import ARCHS

    p = bsub.add_parser("make-model", help="random weights in the shapes of a real architecture (HF + GGUF)")
    p.add_argument("--arch", required=True, choices=list(ARCHS))
    p.add_argument("--out", required=True, help="folder: OUT/hf and OUT/<arch>-<type>.gguf")
    p.add_argument("--gguf", default="f16,q8_0,q4_0", help="GGUF types to write (comma-separated; '' for none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rewrite files that exist")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_make_model)


def _add_roofline(sub) -> None:
    p = sub.add_parser("roofline", help="bytes, FLOPs and the tokens/s ceiling of prefill and decode on this machine")
    add_model_argument(p)
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 8, 32])
    p.add_argument("--context", type=int, default=512, help="prompt length of prefill, cached tokens of decode")
    p.add_argument("--measure", action="store_true", help="also measure hearth and report its share of the ceiling")
    p.add_argument("--measure-tokens", type=int, default=8, help="decode steps timed per batch size (with --measure)")
    p.add_argument("--runs", type=int, default=1, help="timed runs per batch size (with --measure)")
    p.add_argument("--plot", default=None, metavar="OUT.png")
    p.add_argument("--json", action="store_true")
    add_engine_arguments(p)
    p.set_defaults(func=cmd_roofline)
