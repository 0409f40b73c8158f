#!/usr/bin/env python
"""A batch through OpenAI's Batch API (`hearth serve`'s /v1/files and /v1/batches, the openai SDK) against
`hearth bench throughput`'s offline run of the same requests (its run_throughput, with a dataset of the
same prompts and output lengths).

The requests: --lines completions of a text prompt (random token ids of the model's vocabulary, decoded,
--prompt-tokens long before re-tokenization) and --output-len tokens each (greedy, ignore_eos). The server
runs in a child process with the same engine flags (--max-num-seqs, --threads); its throughput counts the
tokens of every line over the time from the batch's creation (its input file uploaded before) to its
`completed` status, and the server's CPU time over that span (/proc). The offline run counts the same
tokens over run_throughput's generate, in this process's CPU time. The two alternate run by run.

    python benchmarks/batch_vs_throughput.py ../shared/data/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --lines 1000 --runs 3 --threads 1 --out benchmarks/results/threads-1/batch-vs-throughput-smollm2
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shlex
import sys
import tempfile
import time

from common import hearth_serve, machine, machine_markdown, median, set_threads, table, write_results


def process_cpu_seconds(pid: int) -> float:
    """A process's user and system CPU time (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_pid() -> int:
    """The pid of the `hearth serve` child (this process's only child)."""
    import psutil

    (child,) = psutil.Process().children()
    return child.pid


def run_batch(client, url: str, pid: int, lines: list[str]) -> dict:
    batch_input = client.files.create(file=("requests.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    cpu, wall = process_cpu_seconds(pid), time.perf_counter()
    batch = client.batches.create(input_file_id=batch_input.id, endpoint="/v1/completions", completion_window="24h")
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.1)
        batch = client.batches.retrieve(batch.id)
    wall, cpu = time.perf_counter() - wall, process_cpu_seconds(pid) - cpu
    if batch.status != "completed" or batch.request_counts.failed:
        sys.exit(f"the batch ended {batch.status}: {batch.request_counts}")
    usage = [json.loads(line)["response"]["body"]["usage"] for line in client.files.content(batch.output_file_id).text.splitlines()]
    tokens = sum(u["prompt_tokens"] + u["completion_tokens"] for u in usage)
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu}


def run_offline(llm, dataset: str, lines: int, output_len: int) -> dict:
    from hearth.bench.throughput import run_throughput

    cpu = time.process_time()
    r = run_throughput(llm, lines, 0, output_len, dataset=dataset, progress=False)
    cpu = time.process_time() - cpu
    tokens = r["prompt_tokens"] + r["output_tokens"]
    return {"wall_s": r["elapsed_s"], "cpu_s": cpu, "tokens": tokens, "tokens_per_s": tokens / r["elapsed_s"],
            "tokens_per_cpu_s": tokens / cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--lines", type=int, default=1000)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    set_threads(args.threads)
    import openai

    from hearth import LLM

    llm = LLM(args.model, progress=False, max_num_seqs=args.max_num_seqs)
    tokenizer, vocab = llm.engine.tokenizer, llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [tokenizer.decode([rng.randrange(vocab) for _ in range(args.prompt_tokens)]) for _ in range(args.lines)]
    body = dict(model="m", max_tokens=args.output_len, temperature=0, ignore_eos=True)
    lines = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                         "body": {**body, "prompt": prompt}}) for i, prompt in enumerate(prompts)]
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("\n".join(json.dumps({"prompt": prompt, "output_len": args.output_len}) for prompt in prompts))
    dataset = f.name
    results = {"bench throughput": [], "Batch API": []}
    options = ["--max-num-seqs", str(args.max_num_seqs), "--threads", str(args.threads), "--batch-dir",
               tempfile.mkdtemp(prefix="batch-bench-")]
    with hearth_serve(args.model, options) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=3600)
        pid = server_pid()
        run_batch(client, url, pid, lines[: args.max_num_seqs])  # warm-up: the first call's one-off costs
        run_offline(llm, dataset, args.max_num_seqs, args.output_len)
        for run in range(args.runs):
            for name, measure in (("bench throughput", lambda: run_offline(llm, dataset, args.lines, args.output_len)),
                                  ("Batch API", lambda: run_batch(client, url, pid, lines))):
                results[name].append(measure())
                r = results[name][-1]
                print(f"run {run + 1}: {name}: {r['tokens_per_s']:.1f} tok/s, {r['tokens_per_cpu_s']:.1f} tok/CPU-s "
                      f"({r['tokens']} tokens)", file=sys.stderr, flush=True)
    os.unlink(dataset)
    rows, base = [], None
    for name, runs in results.items():
        cpu, wall = median([r["tokens_per_cpu_s"] for r in runs]), median([r["tokens_per_s"] for r in runs])
        base = base or (cpu, wall)
        per_run = median([r["tokens_per_cpu_s"] / o["tokens_per_cpu_s"] for r, o in zip(runs, results["bench throughput"])])
        rows.append([name, cpu, f"{cpu / base[0]:.3f}x", f"{per_run:.3f}x", wall, f"{wall / base[1]:.3f}x",
                     runs[0]["tokens"]])
    info = machine()
    markdown = (f"{machine_markdown(info)}\n\n`python benchmarks/batch_vs_throughput.py {shlex.join(sys.argv[1:])}`\n\n"
                f"{args.lines} completions, prompts of random tokens ({args.prompt_tokens} before re-tokenization), "
                f"{args.output_len} output tokens each, --max-num-seqs {args.max_num_seqs}; medians of {args.runs} runs, "
                f"interleaved\n\n"
                + table(["run", "tokens / CPU-s", "ratio", "median of per-run ratios", "tokens / s (wall)",
                         "ratio (wall)", "tokens (run 1)"], rows))
    write_results(args.out, markdown, {"args": vars(args), "machine": info, "results": results})


if __name__ == "__main__":
    main()
