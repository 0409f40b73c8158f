#!/usr/bin/env python
"""Decode tokens/s with and without prompt-lookup speculation, side by side in one run.

The task is input-grounded: the model is asked to repeat a code block with one name changed, so
its output is mostly a copy of its prompt. Greedy, a fixed number of output tokens (ignore_eos).
Batch 1 and N concurrent requests (N copies of the task with different names); each engine runs
the same requests in alternation, --runs times; medians. The plain and speculative outputs are
checked to be token-identical.

    python benchmarks/speculative.py --threads 2 --out benchmarks/results/speculative-smollm2
    python benchmarks/speculative.py --threads 1 --cpu-time   # a shared machine: CPU seconds
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from common import machine, machine_markdown, median, set_threads, table, write_results

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "smollm2-135m-instruct"
NAMES = ["position", "offset", "index", "where", "at", "cursor", "place", "spot"]


def code_block(lines: int) -> str:
    text = (DATA / "text-json-decoder.py.txt").read_text()
    start = text.index("class JSONDecodeError")
    return "\n".join(text[start:].splitlines()[:lines])


def prompts(llm, count: int, lines: int) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    code = code_block(lines)
    out = []
    for i in range(count):
        ask = (f"Repeat this Python code exactly, but rename the variable `pos` to `{NAMES[i % len(NAMES)]}`"
               f"{'' if i < len(NAMES) else f' (version {i})'}:\n\n```python\n{code}\n```")
        text = tokenizer.apply_chat_template([{"role": "user", "content": ask}], True)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DATA / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--lines", type=int, default=24, help="lines of the code block")
    ap.add_argument("--output-len", type=int, default=192)
    ap.add_argument("--concurrent", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cpu-time", action="store_true",
                    help="time in CPU seconds of the one thread (needs --threads 1): what a shared machine can compare")
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = ap.parse_args()
    if args.cpu_time and args.threads != 1:
        sys.exit("--cpu-time counts one thread's seconds: add --threads 1")
    clock = time.process_time if args.cpu_time else time.perf_counter
    set_threads(args.threads)
    from hearth import LLM
    from hearth.bench.latency import one_run

    common = dict(progress=False, max_num_seqs=args.concurrent, kv_cache_memory=1 << 30)
    engines = {"plain": LLM(args.model, **common),
               "ngram": LLM(args.model, speculative_method="ngram",
                            num_speculative_tokens=args.num_speculative_tokens, **common)}
    batches = {1: prompts(engines["plain"], 1, args.lines), args.concurrent: prompts(engines["plain"],
                                                                                     args.concurrent, args.lines)}
    rows, data = [], {"machine": machine(), "args": vars(args), "results": {}}
    for size, batch in batches.items():
        for llm in engines.values():  # warm-up, and the outputs compared
            one_run(llm.engine, batch[:1], 8)
        rates = {name: [] for name in engines}
        counts = {}
        for _ in range(args.runs):
            for name, llm in engines.items():
                before = llm.engine.spec_decode_totals.copy()
                rates[name].append(one_run(llm.engine, batch, args.output_len, clock)["decode_tokens_per_s"])
                counts[name] = llm.engine.spec_decode_totals.since(before)
        plain, spec = median(rates["plain"]), median(rates["ngram"])
        c = counts["ngram"]
        rows.append([size, plain, spec, spec / plain, c.acceptance_rate, c.num_accepted_tokens / max(c.num_drafts, 1)])
        data["results"][size] = {"plain": rates["plain"], "ngram": rates["ngram"], "spec_decode": vars(c)}
        print(rows[-1], file=sys.stderr)
    same = all(
        [o.outputs[0].token_ids for o in engines["plain"].generate(batch, _greedy(args.output_len), use_tqdm=False)]
        == [o.outputs[0].token_ids for o in engines["ngram"].generate(batch, _greedy(args.output_len), use_tqdm=False)]
        for batch in batches.values())
    markdown = "\n".join([
        f"`python benchmarks/{Path(__file__).name} {shlex.join(sys.argv[1:])}`", "",
        machine_markdown(data["machine"]),
        f"- model {Path(args.model).name}; the task: repeat a {args.lines}-line code block renaming one variable; "
        f"greedy, {args.output_len} output tokens; decode tokens/s{' (per CPU-second)' if args.cpu_time else ''}, "
        f"median of {args.runs} runs; outputs "
        f"{'token-identical' if same else 'DIFFERENT'} with and without speculation", "",
        table(["requests", "plain tok/s", "ngram tok/s", "ratio", "acceptance", "accepted per verification"], rows),
    ])
    write_results(args.out, markdown, data)


def _greedy(max_tokens: int):
    from hearth import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


if __name__ == "__main__":
    main()
