#!/usr/bin/env python
"""A batch through OpenAI's Batch API (`hearth serve`'s /v1/files and /v1/batches, the openai SDK) against
`hearth bench throughput`'s offline run of the same requests (its run_throughput, with a dataset of the
same prompts and output lengths).

The requests: --lines completions of a text prompt (random token ids of the model's vocabulary, decoded,
--prompt-tokens long before re-tokenization) and --output-len tokens each (greedy, ignore_eos). The server
runs in a child process with the same engine flags (--max-num-seqs, --threads); its throughput counts the
tokens of every line over the time from the batch's creation (its input file uploaded before) to its
`completed` status (polled every --poll seconds, more often once the lines done say that it ends sooner),
and the server's CPU time over that span (/proc: its engine, its event loop and the answers to the polls;
the event loop's thread, the main one, also apart). The offline run counts the same tokens over
run_throughput's generate, in this process's CPU time. The set-ups alternate run by run. --before SRC
adds a server run from another source tree (a checkout of the commit before a change) as a third set-up.

    python benchmarks/batch_vs_throughput.py ../shared/data/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --lines 1000 --runs 3 --threads 1 --out benchmarks/results/threads-1/batch-vs-throughput-smollm2
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time

from common import REPO, hearth_serve, machine, machine_markdown, median, set_threads, table, write_results


def process_cpu_seconds(pid: int, thread: int | None = None) -> float:
    """A process's user and system CPU time (all its threads, or the one thread id `thread`), from /proc."""
    with open(f"/proc/{pid}/task/{thread}/stat" if thread else f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_batch(client, pid: int, lines: list[str], poll: float) -> dict:
    batch_input = client.files.create(file=("requests.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    cpu, loop, wall = process_cpu_seconds(pid), process_cpu_seconds(pid, pid), time.perf_counter()
    batch = client.batches.create(input_file_id=batch_input.id, endpoint="/v1/completions", completion_window="24h")
    polls = 0
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(next_poll(batch.request_counts, time.perf_counter() - wall, poll))
        batch, polls = client.batches.retrieve(batch.id), polls + 1
    wall, cpu, loop = time.perf_counter() - wall, process_cpu_seconds(pid) - cpu, process_cpu_seconds(pid, pid) - loop
    if batch.status != "completed" or batch.request_counts.failed:
        sys.exit(f"the batch ended {batch.status}: {batch.request_counts}")
    usage = [json.loads(line)["response"]["body"]["usage"] for line in client.files.content(batch.output_file_id).text.splitlines()]
    tokens = sum(u["prompt_tokens"] + u["completion_tokens"] for u in usage)
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu,
            "polls": polls, "event_loop_cpu_s": loop}


def next_poll(counts, elapsed: float, poll: float) -> float:
    """Seconds to the next status poll: `poll`, or sooner where the lines done so far say the batch ends
    sooner (so that its end is seen within 0.05 s, not within `poll`)."""
    done = counts.completed + counts.failed if counts else 0
    if not done:
        return poll
    return min(poll, max(0.05, (counts.total - done) * elapsed / done))


def poll_cpu_seconds(client, pid: int, count: int = 200) -> float:
    """The server's CPU time for one status poll (of a finished batch: the HTTP request alone)."""
    batch_id = client.batches.list(limit=1).data[0].id
    cpu = process_cpu_seconds(pid)
    for _ in range(count):
        client.batches.retrieve(batch_id)
    return (process_cpu_seconds(pid) - cpu) / count


def source_label(source) -> str:
    """A source tree's commit (its folder's name where it is not a git checkout)."""
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=source, capture_output=True, text=True)
    return found.stdout.strip() if found.returncode == 0 else os.path.basename(os.path.abspath(source))


def run_offline(llm, dataset: str, lines: int, output_len: int) -> dict:
    from hearth.bench.throughput import run_throughput

    cpu = time.process_time()
    r = run_throughput(llm, lines, 0, output_len, dataset=dataset, progress=False)
    cpu = time.process_time() - cpu
    tokens = r["prompt_tokens"] + r["output_tokens"]
    return {"wall_s": r["elapsed_s"], "cpu_s": cpu, "tokens": tokens, "tokens_per_s": tokens / r["elapsed_s"],
            "tokens_per_cpu_s": tokens / cpu}


def requests(args, llm) -> tuple[list[str], str]:
    """The batch's input lines, and the same requests as a dataset file for run_throughput."""
    tokenizer, vocab = llm.engine.tokenizer, llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [tokenizer.decode([rng.randrange(vocab) for _ in range(args.prompt_tokens)]) for _ in range(args.lines)]
    body = dict(model="m", max_tokens=args.output_len, temperature=0, ignore_eos=True)
    lines = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                         "body": {**body, "prompt": prompt}}) for i, prompt in enumerate(prompts)]
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("\n".join(json.dumps({"prompt": prompt, "output_len": args.output_len}) for prompt in prompts))
    return lines, f.name


def start_servers(stack: contextlib.ExitStack, args) -> dict[str, tuple]:
    """Each Batch API set-up's (client, server pid), its server started (this branch's, and --before's)."""
    import openai
    import psutil

    sources = {"Batch API": REPO}
    if args.before:
        sources[f"Batch API, before ({source_label(args.before)})"] = args.before
    servers = {}
    for name, source in sources.items():
        options = ["--max-num-seqs", str(args.max_num_seqs), "--threads", str(args.threads), "--batch-dir",
                   tempfile.mkdtemp(prefix="batch-bench-")]
        children = {c.pid for c in psutil.Process().children()}
        url = stack.enter_context(hearth_serve(args.model, options, source))
        (pid,) = {c.pid for c in psutil.Process().children()} - children
        servers[name] = (openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=3600), pid)
    return servers


def report(args, results: dict, poll_ms: dict, info: dict) -> str:
    rows, base = [], None
    offline = results["bench throughput"]
    for name, runs in results.items():
        cpu, wall = median([r["tokens_per_cpu_s"] for r in runs]), median([r["tokens_per_s"] for r in runs])
        base = base or (cpu, wall)
        per_run = [r["tokens_per_cpu_s"] / o["tokens_per_cpu_s"] for r, o in zip(runs, offline)]
        server = [median([r[key] for r in runs]) if key in runs[0] else None for key in ("polls", "event_loop_cpu_s")]
        rows.append([name, cpu, f"{cpu / base[0]:.3f}x", ", ".join(f"{x:.3f}x" for x in per_run), wall,
                     f"{wall / base[1]:.3f}x", *server, poll_ms.get(name), runs[0]["tokens"]])
    with open("/proc/loadavg") as f:
        load_end = " ".join(f.read().split()[:3])
    return (f"{machine_markdown(info)}; at the end {load_end}\n\n`python benchmarks/batch_vs_throughput.py "
            f"{shlex.join(sys.argv[1:])}`\n\n{args.lines} completions, prompts of random tokens ({args.prompt_tokens} "
            f"before re-tokenization), {args.output_len} output tokens each, --max-num-seqs {args.max_num_seqs}, the "
            f"batch polled every {args.poll:g} s (more often near its end); medians of {args.runs} runs, interleaved\n\n"
            + table(["run", "tokens / CPU-s", "ratio", "per-run ratios", "tokens / s (wall)", "ratio (wall)",
                     "polls", "event loop CPU-s", "server CPU ms a poll", "tokens (run 1)"], rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--lines", type=int, default=1000)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--poll", type=float, default=1.0, help="seconds between the batch's status polls")
    p.add_argument("--before", default=None, help="a hearth source tree whose server runs the batch too")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    set_threads(args.threads)
    from hearth import LLM

    llm = LLM(args.model, progress=False, max_num_seqs=args.max_num_seqs)
    info = machine()  # (the load average at the start)
    lines, dataset = requests(args, llm)
    with contextlib.ExitStack() as stack:
        servers = start_servers(stack, args)
        for client, pid in servers.values():  # warm-up: the first calls' one-off costs
            run_batch(client, pid, lines[: args.max_num_seqs], args.poll)
        run_offline(llm, dataset, args.max_num_seqs, args.output_len)
        setups = {"bench throughput": lambda: run_offline(llm, dataset, args.lines, args.output_len)}
        setups |= {name: (lambda c=client, pid=pid: run_batch(c, pid, lines, args.poll))
                   for name, (client, pid) in servers.items()}
        results = {name: [] for name in setups}
        for run in range(args.runs):
            for name, measure in setups.items():
                r = measure()
                results[name].append(r)
                print(f"run {run + 1}: {name}: {r['tokens_per_s']:.1f} tok/s, {r['tokens_per_cpu_s']:.1f} tok/CPU-s "
                      f"({r['tokens']} tokens)", file=sys.stderr, flush=True)
        poll_ms = {name: round(1000 * poll_cpu_seconds(client, pid), 2) for name, (client, pid) in servers.items()}
    os.unlink(dataset)
    write_results(args.out, report(args, results, poll_ms, info), {"args": vars(args), "machine": info, "results": results,
                                                              "poll_cpu_ms": poll_ms})


if __name__ == "__main__":
    main()
