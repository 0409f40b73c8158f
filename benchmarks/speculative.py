#!/usr/bin/env python
"""Decode tokens/s with and without speculation, side by side in one run.

--method ngram (prompt lookup), task `repeat`: input-grounded; the model is asked to repeat a code
block with one name changed, so its output is mostly a copy of its prompt (SmolLM2 by default).
--method draft, task `python`: the built-in model with its draft (`builtin-draft`) continuing the
openings of Python functions (PYTHON_OPENINGS).
Greedy, a fixed number of output tokens (ignore_eos). Batch 1 and N concurrent requests; each
engine runs the same requests in alternation, --runs times; medians. The plain and speculative
outputs are checked to be token-identical.

    python benchmarks/speculative.py --threads 2 --out benchmarks/results/speculative-smollm2
    python benchmarks/speculative.py --method draft --threads 1 --cpu-time --out benchmarks/results/speculative-draft
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


# Openings of Python functions and methods (not copied from the standard library the built-in
# model was trained on); request i continues PYTHON_OPENINGS[i % len(PYTHON_OPENINGS)].
PYTHON_OPENINGS = [
    "def read_config(path):\n    \"\"\"Return the settings in the file at path.\"\"\"\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "def parse_header(line):\n    name, _, value = line.partition(':')\n",
    "import os\n\n\ndef walk_files(root):\n",
    "def merge_sorted(left, right):\n    result = []\n",
    "class Matrix:\n    def __init__(self, rows, cols):\n        self.rows = rows\n",
    "def format_size(num_bytes):\n    for unit in ('B', 'KiB', 'MiB'):\n",
    "def test_split_lines(self):\n",
    "    def __repr__(self):\n",
    "def retry(func, attempts=3):\n    for attempt in range(attempts):\n",
    "class Token:\n    def __init__(self, kind, value):\n",
    "def escape(text):\n    \"\"\"Return text with the special characters escaped.\"\"\"\n",
]


def python_prompts(llm, count: int) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    return [tokenizer.encode(PYTHON_OPENINGS[i % len(PYTHON_OPENINGS)]) for i in range(count)]


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
    ap.add_argument("--method", choices=["ngram", "draft"], default="ngram")
    ap.add_argument("--model", default=None, help="default: SmolLM2 (ngram), builtin (draft)")
    ap.add_argument("--speculative-model", default="builtin-draft", help="draft: the draft model")
    ap.add_argument("--no-speculative-adaptive", action="store_true",
                    help="the speculative engine always makes its full number of guesses")
    ap.add_argument("--cpu-time", action="store_true", help="time in CPU seconds (with --threads 1)")
    ap.add_argument("--lines", type=int, default=24, help="lines of the code block")
    ap.add_argument("--output-len", type=int, default=192)
    ap.add_argument("--concurrent", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = ap.parse_args()
    if args.cpu_time and args.threads != 1:
        sys.exit("--cpu-time counts one thread's seconds: add --threads 1")
    args.model = args.model or (str(DATA / "SmolLM2-135M-Instruct.Q4_1.gguf") if args.method == "ngram" else "builtin")
    set_threads(args.threads)
    from hearth import LLM
    from hearth.bench.latency import one_run

    clock = time.process_time if args.cpu_time else time.perf_counter
    common = dict(progress=False, max_num_seqs=args.concurrent, kv_cache_memory=1 << 30)
    method = dict(speculative_method=args.method, num_speculative_tokens=args.num_speculative_tokens,
                  speculative_adaptive=not args.no_speculative_adaptive)
    if args.method == "draft":
        method["speculative_model"] = args.speculative_model
    engines = {"plain": LLM(args.model, **common), args.method: LLM(args.model, **method, **common)}
    make = python_prompts if args.method == "draft" else lambda llm, n: prompts(llm, n, args.lines)
    batches = {1: make(engines["plain"], 1), args.concurrent: make(engines["plain"], args.concurrent)}
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
        plain, spec = median(rates["plain"]), median(rates[args.method])
        c = counts[args.method]
        rows.append([size, plain, spec, spec / plain, c.acceptance_rate, c.num_accepted_tokens / max(c.num_drafts, 1)])
        data["results"][size] = {"plain": rates["plain"], args.method: rates[args.method], "spec_decode": vars(c)}
        print(rows[-1], file=sys.stderr)
    same = all(
        [o.outputs[0].token_ids for o in engines["plain"].generate(batch, _greedy(args.output_len), use_tqdm=False)]
        == [o.outputs[0].token_ids for o in engines[args.method].generate(batch, _greedy(args.output_len),
                                                                          use_tqdm=False)]
        for batch in batches.values())
    markdown = "\n".join([
        f"`python benchmarks/{Path(__file__).name} {shlex.join(sys.argv[1:])}`", "",
        machine_markdown(data["machine"]),
        f"- model {Path(args.model).name}"
        + (f", draft {Path(args.speculative_model).name}; the task: continue openings of Python functions; "
           if args.method == "draft" else
           f"; the task: repeat a {args.lines}-line code block renaming one variable; ")
        + f"greedy, {args.output_len} output tokens; decode tokens/s"
        + (" per CPU-second" if args.cpu_time else "") + f", median of {args.runs} runs; guesses "
        + ("fixed" if args.no_speculative_adaptive else "adaptive") + "; outputs "
        f"{'token-identical' if same else 'DIFFERENT'} with and without speculation", "",
        table(["requests", "plain tok/s", f"{args.method} tok/s", "ratio", "acceptance", "accepted per verification"],
              rows),
    ])
    write_results(args.out, markdown, data)


def _greedy(max_tokens: int):
    from hearth import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


if __name__ == "__main__":
    main()
