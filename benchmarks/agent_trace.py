#!/usr/bin/env python
"""An agent's turns over a long shared prefix: time to the first token of each turn, with the prefix
cache alone, across restarts with and without the disk tier (--kv-cache-dir), and with other traffic
evicting the conversation between turns, with and without the RAM tier (--kv-cache-ram).

The trace: a prefix of --prefix tokens of real text (the repository's README and docs, as a system
prompt and tool descriptions would be), then --turns turns; turn t's prompt is the prefix, every
earlier turn's user message and reply (fixed text: the trace is replayed, not generated), and its own
user message of --turn-tokens tokens. A turn's TTFT is its one-token generate, greedy, in the process's CPU time and by the wall clock.

Set-ups (--setups; each run takes them in turn, so that the machine's load falls on all):
  cache          one engine, the prefix cache (no tier): turns 2.. find the earlier turns' blocks
  restart        a new engine for every turn, no tier: nothing survives a restart
  restart+disk   a new engine for every turn on one --kv-cache-dir (fresh each run)
  evict          one engine whose KV budget holds the longest prompt and --slack tokens more; between
                 turns a request of other tokens evicts the conversation's last --evict tokens
  evict+ram      the same with a RAM tier of --ram (the evicted blocks wait there)
The engine's load and its first call (8 random tokens) are not in a TTFT (the load is reported apart).

    python benchmarks/agent_trace.py ../shared/data/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --prefix 6000 --turns 8 --runs 2 --threads 2 --out benchmarks/results/agent-trace
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import asdict
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, machine, machine_markdown, median, set_threads, table, write_results

SETUPS = ("cache", "restart", "restart+disk", "evict", "evict+ram")


def trace(tokenizer, prefix: int, turns: int, turn_tokens: int) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """(prefix, user messages, replies): token ids cut from the repository's docs, in order, no overlap."""
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    ids = tokenizer.encode(text)
    need = prefix + 2 * turns * turn_tokens
    if len(ids) < need:
        sys.exit(f"the docs give {len(ids):,} tokens, the trace needs {need:,}")
    cut = iter(range(prefix, need, turn_tokens))
    pieces = [ids[i : i + turn_tokens] for i in cut]
    return ids[:prefix], pieces[0::2], pieces[1::2]


def prompts(prefix: list[int], users: list[list[int]], replies: list[list[int]]) -> list[list[int]]:
    """Each turn's prompt: the prefix, the earlier turns' messages and replies, its own message."""
    out, history = [], list(prefix)
    for user, reply in zip(users, replies):
        out.append(history + user)
        history = history + user + reply
    return out


def engine(model: str, args: argparse.Namespace, tokens: int | None = None, **options):
    from hearth import LLM

    memory = None if tokens is None else tokens * args.kv_bytes_per_token
    return LLM(model, progress=False, max_num_seqs=1, kv_cache_memory=memory, **options)


def ttft(llm, prompt: list[int]) -> tuple[float, float, int]:
    """Seconds of a one-token greedy generate by the wall clock and in the process's CPU time (what a
    machine shared with other jobs can compare), and the prompt tokens it found cached."""
    from hearth import SamplingParams

    wall, cpu = time.perf_counter(), time.process_time()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    return time.perf_counter() - wall, time.process_time() - cpu, out.num_cached_tokens


def run_setup(setup: str, model: str, args: argparse.Namespace, turns: list[list[int]], rng: random.Random,
              vocab: int) -> dict:
    """One pass over the turns: TTFT and cached tokens per turn, engine loads (seconds)."""
    budget = max(len(p) for p in turns) + args.slack
    timings, loads = [], []
    with tempfile.TemporaryDirectory() as folder:
        tier = {"restart+disk": dict(kv_cache_dir=folder), "evict+ram": dict(kv_cache_ram=args.ram_mib << 20)}.get(setup, {})
        llm = None
        for t, prompt in enumerate(turns):
            if llm is None or setup.startswith("restart"):
                if llm is not None:
                    llm.engine.close()  # (as a process's exit: the disk tier's queued blocks written)
                del llm
                gc.collect()
                start = time.perf_counter()
                llm = engine(model, args, budget if setup.startswith("evict") else None, **tier)
                loads.append(time.perf_counter() - start)
                ttft(llm, [rng.randrange(vocab) for _ in range(8)])  # a first call's one-off costs, outside turn 1
            if setup.startswith("evict") and t > 0:  # fills what the last turn left free, then evicts args.evict more
                ttft(llm, [rng.randrange(vocab) for _ in range(budget - len(turns[t - 1]) + args.evict)])
            timings.append(ttft(llm, prompt))
            print(f"{setup}: turn {t + 1}: {timings[-1][0] * 1e3:.0f} ms, CPU {timings[-1][1] * 1e3:.0f} ms, "
                  f"{timings[-1][2]} cached", file=sys.stderr, flush=True)
        counts = asdict(llm.engine.kv_disk_totals if "disk" in setup else llm.engine.kv_ram_totals)
    return {"ttft_s": [t[0] for t in timings], "ttft_cpu_s": [t[1] for t in timings], "cached": [t[2] for t in timings],
            "loads_s": loads,
            "tier_counts_last_engine": counts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--prefix", type=int, default=6000)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--turn-tokens", type=int, default=64, help="tokens of each user message and each reply")
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--slack", type=int, default=256, help="evict: KV budget past the longest prompt, tokens")
    p.add_argument("--evict", type=int, default=1024,
                   help="evict: tokens of the conversation the request between turns evicts (its last blocks)")
    p.add_argument("--ram-mib", type=int, default=1024, help="evict+ram: the RAM tier's size, MiB")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    set_threads(args.threads)
    setups = args.setups.split(",")

    from hearth.loading.loader import read_model

    config, _, tokenizer = read_model(args.model, progress=False)
    args.kv_bytes_per_token = config.kv_bytes_per_token(4)  # float32 on a CPU
    turns = prompts(*trace(tokenizer, args.prefix, args.turns, args.turn_tokens))
    rng = random.Random(0)
    runs = {s: [] for s in setups}
    for _ in range(args.runs):
        for s in setups:
            runs[s].append(run_setup(s, args.model, args, turns, rng, config.vocab_size))
    rows = []
    for s, results in runs.items():
        row = [s]
        for key in ("ttft_cpu_s", "ttft_s"):
            per_turn = [median([r[key][t] for r in results]) for t in range(args.turns)]
            later = median(per_turn[1:])
            row += [per_turn[0] * 1e3, later * 1e3, f"{later / per_turn[0]:.3f}x"]
        rows.append(row + [" / ".join(str(c) for c in results[0]["cached"][1:]),
                           median([x for r in results for x in r["loads_s"]])])
    info = machine()
    markdown = (f"{machine_markdown(info)}\n\n`python benchmarks/agent_trace.py {shlex.join(sys.argv[1:])}`\n\n"
                f"{Path(args.model).name}; a {args.prefix:,}-token prefix, {args.turns} turns of {args.turn_tokens}-token "
                f"messages and replies (prompts {len(turns[0]):,} to {len(turns[-1]):,} tokens); TTFT medians of "
                f"{args.runs} runs, the set-ups interleaved\n\n"
                + table(["set-up", "turn 1 CPU ms (cold)", f"turns 2-{args.turns} CPU ms (median)", "ratio",
                         "turn 1 wall ms", f"turns 2-{args.turns} wall ms", "ratio",
                         "cached tokens, turns 2.. (run 1)", "engine load s (wall)"], rows))
    write_results(args.out, markdown, {"args": vars(args), "machine": info, "runs": runs})


if __name__ == "__main__":
    main()
