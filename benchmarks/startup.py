#!/usr/bin/env python
"""Whole commands against llama.cpp (llama-cpp-python), wall clock from launch to exit, N runs of
each interleaved (hearth, llama.cpp, hearth, ...) on a shared machine, medians:

- generate: one prompt to its first token (`hearth generate --max-tokens 1`; llama.cpp: load the
  model with a context of the model's length, as hearth's cache, and complete with max_tokens=1);
- chat: one turn to its first token, through the model's chat template;
- perplexity: hearth perplexity's windows over a text file (benchmarks/llamacpp_perplexity.py on
  llama.cpp, logits at every position as hearth computes them).

    python benchmarks/startup.py MODEL.gguf TEXT_FILE --runs 3 --threads 2 --out benchmarks/results/startup
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

from common import REPO, machine, machine_markdown, median, table, write_results

PROMPT = "What is the capital of France?"

LLAMA_CPP_GENERATE = """
import sys
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_ctx=0, n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]), verbose=False)
if sys.argv[3] == "chat":
    out = llm.create_chat_completion([{"role": "user", "content": sys.argv[4]}], max_tokens=1, temperature=0)
    print(out["choices"][0]["message"]["content"])
else:
    print(sys.argv[4] + llm(sys.argv[4], max_tokens=1, temperature=0)["choices"][0]["text"])
"""


def commands(model: str, text: str, threads: int, context: int) -> dict[str, dict[str, tuple[list[str], str | None]]]:
    """{task: {engine: (argv, standard input)}}."""
    py = sys.executable
    hearth = [py, "-m", "hearth.cli"]
    return {
        "generate": {
            "hearth": (hearth + ["generate", model, "--prompt", PROMPT, "--max-tokens", "1", "--temperature", "0"], None),
            "llama.cpp": ([py, "-c", LLAMA_CPP_GENERATE, model, str(threads), "generate", PROMPT], None),
        },
        "chat": {
            "hearth": (hearth + ["chat", model, "--max-tokens", "1", "--temperature", "0"], PROMPT + "\n"),
            "llama.cpp": ([py, "-c", LLAMA_CPP_GENERATE, model, str(threads), "chat", PROMPT], None),
        },
        "perplexity": {
            "hearth": (hearth + ["perplexity", model, "--text-file", text, "--context", str(context)], None),
            "llama.cpp": ([py, str(REPO / "benchmarks" / "llamacpp_perplexity.py"), model, text,
                           "--context", str(context), "--threads", str(threads)], None),
        },
    }


def run(argv: list[str], stdin: str | None, threads: int) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the command: user + system, all threads, its last output line)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # torch's threads in hearth
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, cwd=REPO, env=env)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])}... failed:\n{done.stderr[-2000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return seconds, cpu, done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("text_file")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=512, help="perplexity window")
    ap.add_argument("--tasks", default="generate,chat,perplexity")
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = ap.parse_args()

    info = machine()
    tasks = commands(args.model, args.text_file, args.threads, args.context)
    results = {}
    for task in args.tasks.split(","):
        times = {engine: [] for engine in tasks[task]}
        cpu = {engine: [] for engine in tasks[task]}
        outputs = {}
        for _ in range(args.runs):
            for engine, (argv, stdin) in tasks[task].items():
                seconds, cpu_seconds, outputs[engine] = run(argv, stdin, args.threads)
                times[engine].append(seconds)
                cpu[engine].append(cpu_seconds)
                print(f"{task} {engine}: {seconds:.2f} s ({cpu_seconds:.2f} s CPU)  {outputs[engine][:70]!r}",
                      file=sys.stderr)
        results[task] = {"seconds": times, "cpu_seconds": cpu, "last_output": outputs}
    rows = []
    for task, result in results.items():
        hearth, llama = median(result["seconds"]["hearth"]), median(result["seconds"]["llama.cpp"])
        rows.append([task, hearth, llama, llama / hearth, median(result["cpu_seconds"]["hearth"]),
                     median(result["cpu_seconds"]["llama.cpp"]), " ".join(f"{t:.2f}" for t in result["seconds"]["hearth"]),
                     " ".join(f"{t:.2f}" for t in result["seconds"]["llama.cpp"])])
    markdown = "\n".join([
        f"Whole commands, wall seconds, median of {args.runs} interleaved runs, {args.threads} threads; "
        f"model {os.path.basename(args.model)}; perplexity windows of {args.context} over {args.text_file}",
        "",
        table(["command", "hearth s", "llama.cpp s", "speed vs llama.cpp", "hearth CPU s", "llama.cpp CPU s",
               "hearth runs", "llama.cpp runs"], rows),
        "",
        machine_markdown(info),
    ])
    write_results(args.out, markdown, {"machine": info, "runs": args.runs, "threads": args.threads,
                                       "context": args.context, "results": results})


if __name__ == "__main__":
    main()
