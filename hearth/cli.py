"""The `hearth` command: generate and chat (hearth/cli_generation.py), tokenize, inspect, perplexity, convert, quantize, imatrix (and serve, bench)."""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import os
import sys
from pathlib import Path

from hearth.engine_args import add_engine_arguments, add_model_argument, add_option
from hearth.cli_generation import add_generate_and_chat
from hearth.errors import HearthError
from hearth.options import parse_size

def cmd_tokenize(args) -> None:
    from hearth.loading.loader import read_model

    _, _, tokenizer = read_model(args.model, progress=False)
    ids = tokenizer.encode(args.text, add_special_tokens=not args.no_special)
    pieces = [tokenizer.id_to_piece(i) for i in ids]
    if args.json:
        print(json.dumps({"ids": ids, "pieces": pieces}, ensure_ascii=False))
    else:
        for i, piece in zip(ids, pieces):
            print(f"{i:>8}  {piece!r}")


def cmd_watermark_detect(args) -> None:
    from hearth.loading.loader import read_model
    from hearth.watermark import detect

    _, _, tokenizer = read_model(args.model, progress=False)
    score = detect(tokenizer.encode(args.text, add_special_tokens=False), args.key, args.gamma)
    if args.json:
        print(json.dumps({"z": score.z, "watermarked": score.watermarked, "num_scored": score.num_scored,
                          "num_green": score.num_green, "gamma": score.gamma}))
    else:
        verdict = "watermarked" if score.watermarked else "not watermarked"
        print(f"z = {score.z:.2f} ({score.num_green} green of {score.num_scored} token pairs, gamma {score.gamma}): {verdict}")


def cmd_inspect(args) -> None:
    from hearth.model_info import model_info

    info = model_info(args.model, args.kv_budget, args.kv_bytes_per_element, args.kv_cache_dtype,
                      args.max_num_seqs, args.max_model_len)
    if args.json:
        print(json.dumps(info, indent=2))
        return
    print(f"model            {info['path']}")
    print(f"architecture     {info['architecture']} ({info['embeddings']} embeddings)")
    print(f"parameters       {info['parameters']:,}")
    if "experts" in info:
        e = info["experts"]
        shared = f", a shared expert of {e['shared_intermediate_size']}" if e["shared_intermediate_size"] else ""
        print(f"experts          {e['count']} of intermediate size {e['intermediate_size']}, {e['used_per_token']} per "
              f"token{' (weights renormalised)' if e['normalised'] else ''}{shared}; "
              f"{e['active_parameters']:,} parameters active per token")
    if "latent_attention" in info:
        a = info["latent_attention"]
        print(f"latent attention rank {a['kv_lora_rank']} + rotated key {a['qk_rope_head_dim']}: "
              f"{a['values_per_token_per_layer']} cached values per token and layer (per-head K and V: "
              f"{a['per_head_kv_values_per_token_per_layer']:,})")
    if "vision" in info:
        v = info["vision"]
        print(f"vision           {v['family']}: {v['summary']} (docs/vision.md)")
    for kind, v in info["weight_types"].items():
        print(f"  {kind:<14} {v['parameters']:>14,} params {v['bytes'] / 2**20:>10.1f} MiB")
    print(f"weights          {info['weight_bytes'] / 2**20:.1f} MiB")
    print(f"context length   {info['context_length']}")
    config = info["config"]
    if config["sliding_window"] is not None:
        layers = config["sliding_layers"]
        which = "every layer" if layers is None else f"layers {', '.join(map(str, layers)) or 'none'}"
        print(f"sliding window   {config['sliding_window']} tokens ({which})")
    caps = [f"{kind} {config[f'{kind}_logit_softcapping']:g}" for kind in ("attn", "final")
            if config[f"{kind}_logit_softcapping"] is not None]
    if caps:
        print(f"soft-capping     {', '.join(caps)}")
    _print_kv_cache(info)
    which = " (hearth serve's default)" if info["kv_budget_default"] else ""
    if "state_layers" in info:
        kinds = info["state_layers"]["layer_types"]
        layers = ", ".join(f"{kinds.count(kind)} {kind}" for kind in dict.fromkeys(kinds))
        print(f"state cache      {info['state_layers']['state_bytes_per_sequence']:,} bytes/sequence (layers: {layers})")
        checkpoints = info["kv_budget_state_checkpoints"]
        kept = f", {checkpoints:,} prefix-cache state checkpoints" if checkpoints else ""
        print(f"budget           {info['kv_budget_bytes'] / 2**20:.1f} MiB holds the states of "
              f"{info['kv_budget_sequences']:,} sequences{kept} and {info['kv_budget_tokens']:,} tokens{which}")
        print(f"sequences        {info['kv_budget_sequences']:,}: {info['kv_budget_why']} (max_model_len "
              f"{info['kv_budget_max_model_len']:,}; --max-num-seqs and --max-model-len change it)")
        if checkpoints:
            print(f"checkpoints      {info['kv_budget_state_checkpoint_bytes'] / 2**20:.1f} MiB of it: states at "
                  f"prefix-cache block boundaries, one per sequence")
        return
    print(f"KV budget        {info['kv_budget_bytes'] / 2**20:.1f} MiB holds {info['kv_budget_tokens']:,} tokens{which}")



def _print_kv_cache(info: dict) -> None:
    """`hearth inspect`'s lines on the KV cache: bytes per token, the MTP layers', the layers' shapes, the window."""
    print(f"KV cache         {info['kv_cache_bytes_per_token']:,} bytes/token in {info['kv_cache_dtype']} "
          f"({info['kv_bytes_per_element']:g} bytes/element)")
    if "mtp_layers" in info:
        print(f"MTP layers       {info['mtp_layers']['count']}: {info['mtp_layers']['kv_cache_bytes_per_token']:,} "
              "bytes/token of K/V beside the target's with --speculative-method mtp (in its KV budget then)")
    if "kv_layers" in info:
        shapes = "; ".join(f"layers {', '.join(map(str, s['layers']))}: {s['kv_heads']} KV heads of {s['head_dim']}"
                           for s in info["kv_layers"]["shapes"])
        shared = ", ".join(f"{layer} -> {source}" for layer, source in info["kv_layers"]["shared"].items())
        print(f"KV layers        {shapes}" + (f"; reading an earlier layer's: {shared}" if shared else ""))
    if info["kv_window"] is not None:
        print(f"KV blocks        freed once older than every layer's window ({info['kv_window']} tokens)")


def cmd_perplexity(args) -> None:
    from hearth.backend import choose_backend
    from hearth.engine_config import SparsityConfig
    from hearth.engine.memory import choose_device, choose_dtype
    from hearth.loading.loader import load_model
    from hearth.perplexity import perplexity

    text = _read_text(args)
    device = choose_device(args.device)
    dtype = choose_dtype(args.dtype, device)
    sparsity = SparsityConfig(args.activation_sparsity, args.activation_thresholds)
    backend = choose_backend(device, dtype, args.backend)
    loaded = load_model(args.model, dtype, device, progress=not args.json, backend=backend, sparsity=sparsity)
    reference = None if args.kl_divergence is None else load_model(args.kl_divergence, dtype, device,
                                                                   progress=not args.json, backend=backend)
    context = min(args.context or loaded.config.max_position_embeddings, loaded.config.max_position_embeddings)
    ids = loaded.tokenizer.encode(text)
    result = perplexity(loaded.model, ids, context, device, kv_cache_dtype=args.kv_cache_dtype,
                        reference=None if reference is None else reference.model)
    result["context"] = context
    if args.json:
        print(json.dumps(result))
        return
    print(f"perplexity {result['perplexity']:.4f}  (nll {result['nll']:.4f} over {result['tokens']} tokens, context {context})")
    if reference is not None:
        print(f"KL divergence from {args.kl_divergence}: {result['kld']:.6f} nats a token (mean); "
              f"the same top token {100 * result['same_top']:.2f}% of the time")


def _read_text(args) -> str:
    if args.text_file is None:
        return args.text
    try:
        return Path(args.text_file).read_text(encoding="utf-8")
    except OSError as e:
        raise HearthError(f"{args.text_file}: cannot read: {e.strerror}") from None


def cmd_imatrix(args) -> None:
    from tqdm import tqdm

    from hearth.backend import choose_backend
    from hearth.engine.memory import choose_device, choose_dtype
    from hearth.imatrix import compute_imatrix
    from hearth.loading.imatrix_file import write_imatrix
    from hearth.loading.loader import load_model

    text = _read_text(args)
    device = choose_device(args.device)
    dtype = choose_dtype(args.dtype, device)
    loaded = load_model(args.model, dtype, device, backend=choose_backend(device, dtype, args.backend))
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    tok = loaded.tokenizer
    total = len(ids) // args.ctx if args.chunks is None else min(args.chunks, len(ids) // args.ctx)
    with tqdm(total=total, desc="imatrix", unit="chunk") as bar:
        sums = compute_imatrix(loaded.model, ids, args.ctx, device, tok.bos_token_id if tok.add_bos else None,
                               args.chunks, on_chunks=bar.update)
    sums.datasets = [args.text_file or "(--text)"]
    out = write_imatrix(args.output, sums)
    print(f"wrote {out}: {len(sums.sums)} weights, {sums.chunks} chunks of {sums.chunk_size} tokens")


def cmd_sparsify(args) -> None:
    from hearth.backend import choose_backend
    from hearth.engine.memory import choose_device, choose_dtype
    from hearth.loading.activation_thresholds import write_thresholds
    from hearth.loading.loader import load_model
    from hearth.sparsify import calibrate

    if args.ctx < 2:
        raise HearthError(f"--ctx must be at least 2 tokens (got {args.ctx})")
    text = _read_text(args)
    device = choose_device(args.device)
    dtype = choose_dtype(args.dtype, device)
    loaded = load_model(args.model, dtype, device, progress=False, backend=choose_backend(device, dtype, args.backend))
    thresholds = calibrate(loaded.model, loaded.tokenizer.encode(text), args.ctx, device, loaded.path.name)
    out = write_thresholds(args.output, thresholds)
    print(f"wrote {out}: thresholds of {len(thresholds.thresholds)} inputs from {thresholds.tokens} tokens")


def cmd_convert(args) -> None:
    from hearth.loading.convert import convert_hf_to_gguf

    out = convert_hf_to_gguf(Path(args.hf_dir), Path(args.out), args.type)
    print(f"wrote {out}")
    if args.mmproj is not None:
        from hearth.loading.mmproj import write_mmproj

        print(f"wrote {write_mmproj(Path(args.hf_dir), Path(args.mmproj), args.type)}")


def cmd_quantize(args) -> None:
    from hearth.loading.quantize import quantize_model

    imatrix = None
    if args.imatrix is not None:
        from hearth.loading.imatrix_file import read_imatrix

        imatrix = read_imatrix(args.imatrix)
    if args.awq is None:
        out = quantize_model(Path(args.source), Path(args.out), args.type.lower(), imatrix=imatrix)
    else:
        from hearth.awq import awq_quantize

        out = awq_quantize(Path(args.source), Path(args.out), args.type.lower(), Path(args.awq), args.awq_ctx, imatrix)
    print(f"wrote {out}")


def _add_serve(sub) -> None:
    from hearth.server.limits import add_limit_arguments
    from hearth.fleet.launch import serve
    from hearth.tool_calls import PARSERS

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    add_model_argument(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port")
    p.add_argument("--api-key", default=None, help="clients must send 'Authorization: Bearer KEY'")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    p.add_argument("--max-queue", type=int, default=None, help="requests queued behind a full batch before 503s")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--shutdown-timeout", type=float, default=10.0, help="seconds open requests get to finish on SIGTERM")
    p.add_argument("--step-timeout", type=float, default=300.0,
                   help="seconds one engine step may run before the engine counts as stalled: every request "
                        "ends with a 503 and /health answers 503 (default %(default)s)")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                   help="the format of tool calls in replies (default: the one the chat template writes)")
    p.add_argument("--batch-dir", type=Path, default=None,
                   help="where /v1/files and /v1/batches keep their state; a server started again on it takes up "
                        "its unfinished batches (default: $XDG_CACHE_HOME/hearth/batches, or ~/.cache/hearth/batches)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests give their own chat template (vLLM's `chat_template` field; a template is "
                        "code, run in a sandbox)")
    p.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="hosts whose images a request may give by http(s) URL, fetched by the server (vLLM's option; "
                        "default: none, images come as data URLs)")
    add_limit_arguments(p, parse_size)
    _add_replicas(p)
    _add_models(p)
    add_engine_arguments(p)
    p.set_defaults(func=serve)


def _add_models(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several models (docs/several-models.md)")
    g.add_argument("--model", dest="models", action="append", default=None, metavar="NAME=PATH",
                   help="a model to serve as NAME, loaded on its first request (repeatable; instead of MODEL)")
    g.add_argument("--model-dir", type=Path, default=None,
                   help="serve every GGUF file (named without .gguf) and Hugging Face folder in DIR by its name")
    g.add_argument("--models-preset", type=Path, default=None, metavar="FILE",
                   help="per-model settings, an INI file as llama.cpp's router reads: [NAME] sections of engine flags "
                        "without their dashes (kv-cache-dtype = q8_0), `model = PATH` for a model not given by --model, "
                        "[*] for every model; a model's own section wins over [*], which wins over the command line")
    g.add_argument("--max-loaded-models", type=int, default=None, metavar="N",
                   help="models loaded at once: past N, the least recently used idle one is unloaded (default: all)")
    g.add_argument("--sleep-idle-seconds", type=float, default=None, metavar="S",
                   help="a model idle for S seconds sleeps (its KV cache given back) until its next request")


def _add_replicas(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas (docs/distributed.md)")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="N > 1: N engine replicas behind one endpoint, routed by prompt prefix")
    g.add_argument("--ray", action=argparse.BooleanOptionalAction, default=False,
                   help="run the replicas as Ray actors on a Ray cluster (restarted by Ray if they die)")
    g.add_argument("--ray-address", default=None, help="the Ray cluster to join (default: start a local one)")
    g.add_argument("--routing", default="prefix", choices=["prefix", "least_loaded", "random"],
                   help="how the router picks a replica")
    g.add_argument("--disaggregate", action=argparse.BooleanOptionalAction, default=False,
                   help="prefill and decode on separate workers: --prefill-workers prefill workers and "
                        "--data-parallel-size decode workers behind the router (with --ray: as Ray actors, "
                        "a prompt's KV through Ray's object store)")
    g.add_argument("--prefill-workers", type=int, default=1, help="with --disaggregate: the prefill workers")
    g.add_argument("--role", default=None, choices=["prefill", "decode"],
                   help="this server's part in a disaggregated set: prefill (serves prompts' KV) or decode "
                        "(pulls a prompt's KV from the prefill worker the router names)")


def _add_tokenize_and_watermark(sub) -> None:
    p = sub.add_parser("tokenize", help="show the tokens of a text")
    add_model_argument(p)
    p.add_argument("text")
    p.add_argument("--no-special", action="store_true", help="do not add BOS/EOS")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("watermark", help="detect hearth's green-list watermark in a text")
    wsub = p.add_subparsers(dest="watermark_command", required=True)
    p = wsub.add_parser("detect", help="the z-score of TEXT under KEY (watermarked above 4)")
    p.add_argument("text")
    p.add_argument("--key", type=int, required=True)
    p.add_argument("--gamma", type=float, default=0.25, help="the green fraction it was generated with")
    p.add_argument("--model", default=None, help="the model whose tokenizer wrote it (default: the built-in model)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_watermark_detect)


def _add_inspect_perplexity_convert(sub) -> None:
    p = sub.add_parser("inspect", help="architecture, parameters, weight types, KV cache cost")
    add_model_argument(p)
    p.add_argument("--kv-budget", type=parse_size, default=None,
                   help="how many tokens this KV budget holds (default: the budget `hearth serve` picks)")
    p.add_argument("--kv-bytes-per-element", type=int, default=None, choices=[1, 2, 4],
                   help="the size of a K or V value with --kv-cache-dtype auto (default: the engine's compute "
                        "dtype here: float32 on a CPU, bfloat16 on a GPU)")
    for name in ("kv_cache_dtype", "max_num_seqs", "max_model_len"):  # (the last two: a hybrid's budget split)
        add_option(p, name)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("perplexity", help="perplexity of the model on a text")
    add_model_argument(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text-file")
    src.add_argument("--text")
    p.add_argument("--context", type=int, default=None, help="window length in tokens (default: the model's)")
    p.add_argument("--kl-divergence", metavar="REFERENCE", default=None,
                   help="also the mean KL divergence of MODEL's next-token distributions from REFERENCE's (the "
                        "original a quantized MODEL was made from) on the same windows, and how often both rank "
                        "the same token first")
    for keyword in ("dtype", "device", "backend", "kv_cache_dtype", "activation_sparsity", "activation_thresholds"):
        add_option(p, keyword)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_perplexity)

    p = sub.add_parser("convert", help="write a Hugging Face folder as GGUF")
    p.add_argument("hf_dir")
    p.add_argument("out")
    p.add_argument("--type", default="f16", choices=["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "tq1_0", "tq2_0"],
                   help="tq1_0 / tq2_0: ternary, for models trained with weights in {-1, 0, 1}")
    p.add_argument("--mmproj", metavar="FILE", help="an image-text model: its vision tower written to FILE as "
                                                    "llama.cpp's mmproj GGUF (OUT gets its text model)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("quantize", help="quantize an HF folder or an F32/F16/BF16 GGUF as llama-quantize does")
    p.add_argument("source", help="a Hugging Face model folder or an F32/F16/BF16 GGUF file")
    p.add_argument("out")
    p.add_argument("--type", required=True, type=str.lower, metavar="TYPE",
                   choices=["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k_s", "q3_k_m", "q3_k_l",
                            "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k", "iq4_nl", "iq4_xs", "iq3_m",
                            "iq3_s", "iq3_xs", "iq3_xxs", "iq2_m", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_s", "iq1_m"],
                   help="q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k_s/m/l, q4_k_s/m, q5_k_s/m, q6_k, iq4_nl, iq4_xs, "
                        "iq3_m/s/xs/xxs, iq2_m/s/xs/xxs, iq1_s/m (any case): llama.cpp's mixes, the same type for each "
                        "tensor as llama-quantize (iq3_xxs, iq3_xs, the iq2 mixes and iq1_s/m need --imatrix, as there)")
    p.add_argument("--imatrix", default=None, help="an importance matrix (hearth imatrix, llama-imatrix: GGUF or .dat)")
    p.add_argument("--awq", default=None, metavar="TEXT_FILE",
                   help="search AWQ's per-channel scales on this calibration text and fold them into the weights "
                        "before quantizing (docs/quantize.md)")
    p.add_argument("--awq-ctx", type=int, default=512, help="tokens per calibration chunk of --awq (default %(default)s)")
    p.set_defaults(func=cmd_quantize)

    p = _calibration_command(sub, "imatrix", "an importance matrix for hearth quantize --imatrix (llama-imatrix's GGUF "
                             "format)", "the imatrix file to write (GGUF)", "tokens per chunk (default %(default)s, "
                             "llama-imatrix's)")
    p.add_argument("--chunks", type=int, default=None, help="at most this many chunks (default: the whole text)")
    p.set_defaults(func=cmd_imatrix)


def _calibration_command(sub, name: str, help: str, output: str, ctx: str) -> argparse.ArgumentParser:
    """A command that runs a model over a calibration text and writes what it measured to --output."""
    p = sub.add_parser(name, help=help)
    add_model_argument(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text-file", help="the calibration text")
    src.add_argument("--text")
    p.add_argument("-o", "--output", required=True, help=output)
    p.add_argument("--ctx", type=int, default=512, help=ctx)
    for keyword in ("dtype", "device", "backend"):
        add_option(p, keyword)
    return p


def _add_sparsify(sub) -> None:
    p = _calibration_command(sub, "sparsify", "calibrate activation sparsity's thresholds on a text (docs/sparsity.md)",
                             "the thresholds file to write (JSON)", "tokens per window (default %(default)s)")
    p.set_defaults(func=cmd_sparsify)


class _VersionAction(argparse._VersionAction):
    """--version, the package's version looked up only when asked (importlib.metadata: ~0.1 s a start)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from hearth import __version__

        self.version = f"hearth {__version__}"
        super().__call__(parser, namespace, values, option_string)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; building it (and --help, --version) imports no torch."""
    from hearth.bench.cli import add_bench_parsers

    parser = argparse.ArgumentParser(prog="hearth", description="An LLM inference engine.")
    parser.add_argument("--version", action=_VersionAction)
    # no abbreviated flags: `chat --json` once read as --json-schema, a prefix of it
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=functools.partial(argparse.ArgumentParser, allow_abbrev=False))
    add_generate_and_chat(sub)
    _add_serve(sub)
    _add_tokenize_and_watermark(sub)
    _add_inspect_perplexity_convert(sub)
    _add_sparsify(sub)
    add_bench_parsers(sub)  # bench latency / throughput / serve / make-model, and roofline
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # replicas (hearth serve --data-parallel-size) are started with the same arguments
    try:
        args.func(args)
    except (HearthError, ValueError) as e:
        print(f"hearth: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


# The commands a user waits on start to end, whose process ends with no teardown (_exit_at_once)
QUICK_EXIT_COMMANDS = ("generate", "chat")


def run() -> None:
    """The `hearth` command (pyproject's script, python -m hearth.cli): main, then the process's exit."""
    code = main()
    if sys.argv[1:2] and sys.argv[1] in QUICK_EXIT_COMMANDS:
        _exit_at_once(code)
    sys.exit(code)


def _exit_at_once(code: int) -> None:
    """End the process without the interpreter's teardown, which frees every object one by one: in a
    process that imported torch ~0.6 s of CPU (1-2 s of wall on a busy machine), more than a short
    generate's own work. What the exit must still do runs first: the exit handlers (logging's flush,
    a split model's workers told to stop, temporary folders removed) and the standard streams' flush.
    Threads still alive are pools left idle (the grammar masks', the overlapped passes') and daemons."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said on it
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
