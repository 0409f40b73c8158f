#!/usr/bin/env python
"""Quantized KV caches (q8_0, fp8 e4m3) against the float one: capacity, perplexity, greedy
agreement, decode speed.

For one model (a GGUF path or `builtin`), on the CPU backend (fp8 on the reference backend: torch's
e4m3 cast, the bytes the gpu backend's Triton cache write stores; the cpu backend refuses fp8):
  * capacity: tokens a --budget of KV memory holds (float32, as the CPU computes; bfloat16; q8_0;
    fp8_e4m3);
  * perplexity over the text files (hearth/perplexity.py, windows of --context) with each cache;
  * greedy agreement: --prompts windows of the text as prompts, --max-tokens greedy tokens with
    each cache; the share of tokens before the first difference and of identical continuations,
    beside the same for float rounding alone (the float32 cache on the reference backend);
  * decode speed (CPU backend: float32 and q8_0) at a long context: --batch sequences of --decode-context random tokens prefilled
    through the ModelRunner, then --steps decode steps timed in CPU time (process_time: the machine
    is shared), median of --runs interleaved runs.

    python benchmarks/kv_cache_dtype.py /path/to/model.gguf --threads 1 --decode-context 2000 \
        --text ../shared/data/models/smollm2-135m-instruct/text-apache-2.0.txt --out benchmarks/results/kv-q8_0
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from common import decode_step_ms, machine, machine_markdown, median, set_threads, table, threads, write_results

KINDS = ("auto", "q8_0")  # on the CPU backend
FP8 = "fp8_e4m3"  # on the reference backend


def capacity(config, budget: int) -> list[list[str]]:
    from hearth.kv_format import kv_bytes_per_element

    rows = []
    for name, kind, itemsize in (("float32", "auto", 4), ("bfloat16", "auto", 2), ("q8_0", "q8_0", 4), (FP8, FP8, 4)):
        per_token = config.kv_bytes_per_token(kv_bytes_per_element(kind, itemsize))
        rows.append([name, f"{per_token:,}", f"{budget // per_token:,}"])
    return rows


def greedy_agreement(model: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """Greedy continuations with a q8_0 cache (CPU backend) and an fp8 one (reference backend)
    against a float32 one (CPU backend), and, as the yardstick of float rounding alone, the float32
    cache on the reference backend against the same."""
    from hearth import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = {}
    for backend, kind in (("cpu", "auto"), ("cpu", "q8_0"), ("reference", FP8), ("reference", "auto")):
        llm = LLM(model, backend=backend, kv_cache_dtype=kind, max_num_seqs=len(prompts), progress=False)
        outputs[backend, kind] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    result = {}
    for name, other in (("q8_0", outputs["cpu", "q8_0"]), (f"{FP8}, reference backend", outputs["reference", FP8]),
                        ("float32, reference backend", outputs["reference", "auto"])):
        pairs = list(zip(outputs["cpu", "auto"], other))
        prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in pairs)
        result[name] = {"tokens_before_first_difference": prefix / (len(prompts) * max_tokens),
                        "identical_continuations": sum(a == b for a, b in pairs)}
    return result


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--text", action="append", required=True, help="a text file for perplexity (repeatable)")
    ap.add_argument("--context", type=int, default=512, help="perplexity windows")
    ap.add_argument("--budget", type=int, default=1 << 30, help="KV bytes for the capacity table")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--decode-context", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def report(args: argparse.Namespace, command: str, config, ppl: dict, ms: dict, agreement: dict) -> str:
    """The capacity, perplexity, agreement and speed tables."""
    ppl_rows = [[kind if kind != "auto" else "float32", f"{ppl[kind]['perplexity']:.4f}",
                 f"{(ppl[kind]['perplexity'] / ppl['auto']['perplexity'] - 1) * 100:+.3f}%"] for kind in (*KINDS, FP8)]
    speed_rows = [[kind if kind != "auto" else "float32", f"{ms[kind]:.2f}", f"{1e3 * args.batch / ms[kind]:.1f}",
                   f"{ms['auto'] / ms[kind]:.2f}x"] for kind in KINDS]
    capacity_header = ["KV dtype", "bytes / token", f"tokens in {args.budget / 2**30:g} GiB"]
    ppl_header = ["KV dtype", f"perplexity ({ppl['auto']['tokens']} tokens, context {args.context})", "vs float32"]
    speed_header = ["KV dtype", f"CPU ms / decode step (context {args.decode_context}, batch {args.batch})",
                    "tokens / CPU s", "speed vs float32"]
    agreement_header = ["against float32 (CPU backend)", "tokens before the first difference", "identical continuations"]
    agreement_rows = [[name, f"{a['tokens_before_first_difference']:.1%}", f"{a['identical_continuations']} of {args.prompts}"]
                      for name, a in agreement.items()]
    return (
        f"# q8_0 and fp8 KV caches vs float32: {args.model}\n\n{machine_markdown(machine())}\n\n`{command}`\n\n"
        f"{table(capacity_header, capacity(config, args.budget))}\n\n{table(ppl_header, ppl_rows)}\n\n"
        f"greedy agreement with the float32 cache over {args.prompts} prompts of {args.prompt_len} tokens, "
        f"{args.max_tokens} tokens each:\n\n{table(agreement_header, agreement_rows)}\n\n"
        f"{table(speed_header, speed_rows)}\n"
    )


def main() -> None:
    args = parse_args()
    set_threads(args.threads)
    import torch

    from hearth.backend.base import Backend
    from hearth.loading.loader import load_model
    from hearth.perplexity import perplexity

    loaded = load_model(args.model, torch.float32, torch.device("cpu"), progress=False)
    model, config = loaded.model, loaded.config
    text = "".join(open(path, encoding="utf-8").read() for path in args.text)
    ids = loaded.tokenizer.encode(text)
    ppl = {kind: perplexity(model, ids, args.context, torch.device("cpu"), kv_cache_dtype=kind) for kind in KINDS}
    reference = load_model(args.model, torch.float32, torch.device("cpu"), progress=False, backend=Backend()).model
    ppl[FP8] = perplexity(reference, ids, args.context, torch.device("cpu"), kv_cache_dtype=FP8)
    step = max(1, (len(ids) - args.prompt_len) // args.prompts)
    prompts = [ids[i * step:i * step + args.prompt_len] for i in range(args.prompts)]
    agreement = greedy_agreement(args.model, prompts, args.max_tokens)
    samples = {kind: [] for kind in KINDS}
    for _ in range(args.runs):  # interleaved: both caches see the same machine load
        for kind in KINDS:
            samples[kind].append(decode_step_ms(model, args.decode_context, args.batch, args.steps,
                                                time.process_time, kind))
    ms = {kind: median(samples[kind]) for kind in KINDS}

    command = "python benchmarks/kv_cache_dtype.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    markdown = report(args, command, config, ppl, ms, agreement)
    write_results(args.out, markdown, {"machine": machine(), "threads": threads(), "command": command,
                                       "capacity": capacity(config, args.budget), "perplexity": ppl,
                                       "agreement": agreement, "decode_cpu_ms": samples})


if __name__ == "__main__":
    main()
