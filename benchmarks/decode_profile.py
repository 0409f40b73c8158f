#!/usr/bin/env python
"""hearth alone on one GGUF file: B sequences of C prompt tokens, then D decode steps, timed in
CPU seconds (1 thread by default: what a profile of the decode step reads). With --perf-control
FIFO the decode steps alone are profiled: perf starts disabled and this script enables it over
each timed run's decode steps (prefills and loading stay out of the profile).

    mkfifo /tmp/perf-ctl
    perf record -D -1 --control fifo:/tmp/perf-ctl -F 1999 -o /tmp/decode.data \\
        python benchmarks/decode_profile.py --gguf MODEL.gguf --perf-control /tmp/perf-ctl
    perf report -i /tmp/decode.data --no-children --sort sym
"""

from __future__ import annotations

import argparse
import random
import time

from common import median, set_threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--batch", type=int, default=32, help="sequences decoding together")
    ap.add_argument("--context", type=int, default=64, help="prompt tokens of each sequence")
    ap.add_argument("--decode", type=int, default=16, help="decode steps timed per run")
    ap.add_argument("--runs", type=int, default=3, help="timed runs, after one untimed")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto, float16, q8_0 (hearth's --kv-cache-dtype)")
    ap.add_argument("--perf-control", default=None, help="perf's control FIFO: 'enable' / 'disable' around decode steps")
    args = ap.parse_args()
    set_threads(args.threads)

    from hearth.bench.latency import random_prompts
    from hearth.llm import LLM
    from hearth.loading.loader import read_model
    from hearth.sampling_params import SamplingParams

    def perf(command: str) -> None:
        if args.perf_control:
            with open(args.perf_control, "w") as fifo:
                fifo.write(command + "\n")

    config, _, _ = read_model(args.gguf, progress=False)
    longest = args.batch * (args.context + args.decode + 2) + 64
    engine = LLM(args.gguf, kv_cache_memory=config.kv_bytes_per_token(4) * longest, kv_cache_dtype=args.kv_cache_dtype,
                 max_num_seqs=args.batch,
                 max_num_batched_tokens=max(2048, args.batch * args.context), progress=False).engine
    rng = random.Random(0)
    rates = []
    for run in range(args.runs + 1):
        params = SamplingParams(temperature=0, max_tokens=args.decode + 1, ignore_eos=True)
        for prompt in random_prompts(args.batch, args.context, config.vocab_size, rng):
            engine.add_request(None, prompt, params)
        engine.step()  # the prefill: every prompt fits one step's token budget
        if run:
            perf("enable")
        start, tokens = time.process_time(), 0
        while engine.has_unfinished_requests():
            engine.step()
            tokens += engine.last_step.num_generated
        seconds = time.process_time() - start
        if run:
            perf("disable")
            rates.append(tokens / seconds)
    print(f"decode, {args.batch} sequences: {median(rates):.1f} tokens per CPU-second "
          f"(runs: {', '.join(f'{r:.1f}' for r in rates)})")


if __name__ == "__main__":
    main()
