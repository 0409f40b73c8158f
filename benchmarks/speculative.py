#!/usr/bin/env python
"""Decode tokens/s with and without speculation (--methods: ngram, lookahead, lookahead-full, draft, early-exit), side
by side in one run (lookahead-full: lookahead as published, --lookahead-mode full).

Three tasks. `repeat` is input-grounded: the model is asked to repeat a code block with one name
changed, so its output is mostly a copy of its prompt. `write`: the model writes code from a
one-line description (nothing to copy). `python` (draft's default, on the built-in model and its
draft `builtin-draft`): continuing the openings of Python functions (PYTHON_OPENINGS). Greedy, a
fixed number of output tokens (ignore_eos). With --speculative-tree-width W > 1 each method runs
twice, as a chain and as token trees of W branches ("METHOD tree"), side by side.
Batch 1 and N concurrent requests (N variants of the task); each engine runs the same requests
in alternation, --runs times; medians. The plain and speculative outputs are checked to be
token-identical.

    python benchmarks/speculative.py --threads 2 --out benchmarks/results/speculative-smollm2
    python benchmarks/speculative.py --threads 1 --cpu-time   # a shared machine: CPU seconds
    python benchmarks/speculative.py --methods draft --threads 1 --cpu-time --out benchmarks/results/speculative-draft
    python benchmarks/speculative.py --methods draft --speculative-tree-width 3 --threads 1 --cpu-time
    python benchmarks/speculative.py --methods early-exit --exit-layers 12,18,24 --task write --threads 2

early-exit runs one engine per exit layer ("early-exit N": the model's first N layers draft).
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
TOPICS = ["parses a JSON string without the json module", "merges two sorted lists", "reads a CSV file into dicts",
          "checks whether a string is a palindrome", "computes the n-th Fibonacci number iteratively",
          "flattens a nested list", "counts the words of a text file", "implements binary search"]


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


def prompts(llm, task: str, count: int, lines: int) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    if task == "python":
        return [tokenizer.encode(PYTHON_OPENINGS[i % len(PYTHON_OPENINGS)]) for i in range(count)]
    code = code_block(lines)
    out = []
    for i in range(count):
        version = '' if i < len(NAMES) else f' (version {i})'
        if task == "repeat":
            ask = (f"Repeat this Python code exactly, but rename the variable `pos` to `{NAMES[i % len(NAMES)]}`"
                   f"{version}:\n\n```python\n{code}\n```")
        else:
            ask = f"Write a Python function that {TOPICS[i % len(TOPICS)]}{version}."
        text = tokenizer.apply_chat_template([{"role": "user", "content": ask}], True)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="ngram",
                    help="comma-separated: ngram, lookahead, lookahead-full, draft, early-exit")
    ap.add_argument("--exit-layers", default="15,20,25", help="early-exit: comma-separated exit layers, an engine each")
    ap.add_argument("--model", default=None, help="default: builtin with draft, else SmolLM2")
    ap.add_argument("--speculative-model", default="builtin-draft", help="draft: the draft model")
    ap.add_argument("--no-speculative-adaptive", action="store_true",
                    help="the speculative engines always make their full number of guesses")
    ap.add_argument("--task", choices=["repeat", "write", "python"], default=None,
                    help="default: python with draft, else repeat")
    ap.add_argument("--lines", type=int, default=24, help="lines of the code block (repeat)")
    ap.add_argument("--output-len", type=int, default=192)
    ap.add_argument("--concurrent", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-speculative-tokens", type=int, default=None, help="default: the engine's")
    ap.add_argument("--speculative-tree-width", type=int, default=1,
                    help="above 1: each method also with token trees of this many branches")
    ap.add_argument("--kv-cache-dtype", default="auto", help="every engine's --kv-cache-dtype")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cpu-time", action="store_true",
                    help="time in CPU seconds of the one thread (needs --threads 1): what a shared machine can compare")
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = ap.parse_args()
    if args.cpu_time and args.threads != 1:
        sys.exit("--cpu-time counts one thread's seconds: add --threads 1")
    methods = args.methods.split(",")
    args.methods = ",".join(name for method in methods for name in (
        [f"early-exit {layer}" for layer in args.exit_layers.split(",")] if method == "early-exit" else [method]))
    args.model = args.model or ("builtin" if "draft" in methods else str(DATA / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    args.task = args.task or ("python" if "draft" in methods else "repeat")
    return args


def build_engines(args: argparse.Namespace, methods: list[str]) -> tuple[dict, list[str], list[int]]:
    """The plain engine and one per method (and per method's token trees): (engines by name, the methods'
    names with their "METHOD tree" variants, the tree widths)."""
    from hearth import LLM

    common = dict(progress=False, max_num_seqs=args.concurrent, kv_cache_memory=1 << 30, kv_cache_dtype=args.kv_cache_dtype)
    engines = {"plain": LLM(args.model, **common)}
    widths = [1] + ([args.speculative_tree_width] if args.speculative_tree_width > 1 else [])
    names = list(methods)
    for method in methods:
        base, _, exit_layer = method.partition(" ")  # "early-exit N"
        draft = (dict(speculative_model=args.speculative_model) if base == "draft" else
                 dict(exit_layer=int(exit_layer)) if base == "early-exit" else
                 dict(lookahead_mode="full") if base == "lookahead-full" else {})
        base = base.removesuffix("-full")  # lookahead-full: lookahead as published (a token tree a step)
        for width in widths:
            name = method if width == 1 else f"{method} tree"
            engines[name] = LLM(args.model, speculative_method=base, num_speculative_tokens=args.num_speculative_tokens,
                                speculative_adaptive=not args.no_speculative_adaptive, speculative_tree_width=width,
                                **draft, **common)
            names += [name] if width > 1 else []
    return engines, names, widths


def measure(args: argparse.Namespace, engines: dict, methods: list[str], batches: dict, clock,
            data: dict) -> list[list]:
    """Every engine on each batch in turn, args.runs times: the table's rows; the runs into data."""
    from hearth.bench.latency import one_run
    from hearth.engine.speculation.stats import SpecDecodeCounts

    rows = []
    for size, batch in batches.items():
        for llm in engines.values():  # warm-up
            one_run(llm.engine, batch[:1], 8)
        rates = {name: [] for name in engines}
        counts = {name: SpecDecodeCounts() for name in methods}
        for _ in range(args.runs):
            for name, llm in engines.items():
                before = llm.engine.spec_decode_totals.copy()
                rates[name].append(one_run(llm.engine, batch, args.output_len, clock)["decode_tokens_per_s"])
                if name in counts:
                    counts[name].add(llm.engine.spec_decode_totals.since(before))
        plain = median(rates["plain"])
        data["results"][size] = {"plain": rates["plain"]}
        for name in methods:
            c, spec = counts[name], median(rates[name])
            chain = median(rates[name.removesuffix(" tree")])
            rows.append([size, name, plain, spec, spec / plain, spec / chain if name.endswith(" tree") else None,
                         c.acceptance_rate, c.num_accepted_tokens / max(c.num_drafts, 1)])
            data["results"][size][name] = {"rates": rates[name], "spec_decode": vars(c)}
            print(rows[-1], file=sys.stderr)
    return rows


def report(args: argparse.Namespace, engines: dict, methods: list[str], widths: list[int], same: dict,
           data: dict, rows: list[list]) -> str:
    task = {"repeat": f"repeat a {args.lines}-line code block renaming one variable",
            "write": "write a Python function from a one-line description",
            "python": "continue openings of Python functions"}[args.task]
    return "\n".join([
        f"`python benchmarks/{Path(__file__).name} {shlex.join(sys.argv[1:])}`", "",
        machine_markdown(data["machine"]),
        f"- model {Path(args.model).name}"
        + (f", draft {Path(args.speculative_model).name}" if "draft" in methods else "")
        + f"; the task: {task}; greedy, {args.output_len} output tokens, up to "
        + ", ".join(f"{engines[name].engine.config.speculative.num_speculative_tokens} ({name})" for name in methods)
        + f" guesses a step ({'fixed' if args.no_speculative_adaptive else 'adaptive'})"
        + (f", trees of {args.speculative_tree_width} branches" if len(widths) > 1 else "")
        + f"; decode tokens/s{' per CPU-second' if args.cpu_time else ''}, "
        f"median of {args.runs} runs; outputs with each method "
        + ", ".join(f"{name}: {'token-identical' if ok else 'DIFFERENT'}" for name, ok in same.items()), "",
        table(["requests", "method", "plain tok/s", "method tok/s", "ratio", "tree / chain", "acceptance",
               "accepted per verification"], rows),
    ])


def main() -> None:
    args = parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    set_threads(args.threads)
    engines, methods, widths = build_engines(args, args.methods.split(","))
    batches = {size: prompts(engines["plain"], args.task, size, args.lines) for size in (1, args.concurrent)}
    data = {"machine": machine(), "args": vars(args), "results": {}}
    rows = measure(args, engines, methods, batches, clock, data)
    expected = {size: _outputs(engines["plain"], batch, args.output_len) for size, batch in batches.items()}
    same = {name: all(_outputs(engines[name], batch, args.output_len) == expected[size]
                      for size, batch in batches.items()) for name in methods}
    write_results(args.out, report(args, engines, methods, widths, same, data, rows), data)
    if not all(same.values()):  # the ratios compare different texts: greedy speculation must keep plain's tokens
        sys.exit("outputs differ from plain decoding's with " + ", ".join(name for name, ok in same.items() if not ok))


def _outputs(llm, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    from hearth import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(batch, greedy, use_tqdm=False)]


if __name__ == "__main__":
    main()
