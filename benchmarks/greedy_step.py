#!/usr/bin/env python
"""A greedy decode step at batch 1 on the cpu backend, two ways in one process, alternating: as one kernel call
(CpuBackend._greedy_step: embedding, layers, norm, LM head, argmax and log-probability) and through the modules
(the model's forward, compute_logits and the step's head). Each round: a fresh 64-token prompt, 10 untimed steps,
then --steps timed ones; medians over --rounds rounds of milliseconds a step (wall clock).

    python benchmarks/greedy_step.py --gguf ../shared/data/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import random
import time

from common import machine, machine_markdown, median, set_threads, table, write_results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=150, help="timed decode steps a round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = ap.parse_args()
    set_threads(args.threads)
    info = machine()  # (the load average before the model loads)

    from hearth import LLM, SamplingParams
    from hearth.bench.latency import random_prompts

    engine = LLM(args.gguf, progress=False, max_num_seqs=1, max_model_len=1024).engine
    backend, rng = engine.runner.backend, random.Random(0)
    paths = {"one kernel call": backend._greedy_step, "the modules": lambda *step: None}
    ms = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, greedy_step in paths.items():
            backend._greedy_step = greedy_step
            prompt = random_prompts(1, 64, engine.model_config.vocab_size, rng)[0]
            engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=args.steps + 20, ignore_eos=True))
            for _ in range(10):
                engine.step()
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            ms[name].append((time.perf_counter() - start) / args.steps * 1e3)
            while engine.has_unfinished_requests():
                engine.step()
    rows = [[name, f"{median(v):.3f}", ", ".join(f"{x:.2f}" for x in v)] for name, v in ms.items()]
    command = "python benchmarks/greedy_step.py --gguf " + args.gguf
    md = "\n".join([f"`{command}` (medians of {args.rounds} alternated rounds)", "",
                    machine_markdown(info), "",
                    table(["greedy step", "ms a step", "rounds"], rows), "",
                    f"one call / modules: {median(ms['one kernel call']) / median(ms['the modules']):.3f}"])
    write_results(args.out, md, {"gguf": args.gguf, "machine": info, "ms_per_step": ms})


if __name__ == "__main__":
    main()
