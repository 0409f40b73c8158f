"""Constrained decoding's cost per decode step, and a JSON schema's compile time, on a real model.

    python benchmarks/structured_overhead.py [--model SmolLM2-135M-Instruct.Q4_1.gguf] [--batches 1,32] [--threads 1]
                                             [--temperature 1]

B requests decode together at temperature 1 (or --temperature: 0 is greedy); a step is timed around LLMEngine.step() only while
all B are decoding (prefill steps left out). The requests are all unconstrained, or all held to
SCHEMA, a list of at least 100 records, so that no grammar completes while steps are timed and
every step computes B masks (llguidance, on a thread, while the sampler draws its noise).
Unconstrained and constrained runs alternate `--repeats` times after a warm-up of each; the
medians of wall time and of the process's CPU time (every thread: the mask threads' work
shows there even when it overlaps the forward pass) are reported.

Compile time: GrammarCompiler.compile (schema to llguidance grammar, checked) on schemas not
seen before, and the first mask of a new matcher (llguidance builds its lexer lazily).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hearth import SamplingParams, StructuredOutputsParams
from hearth.engine_config import EngineConfig
from hearth.engine.engine import LLMEngine
from hearth.engine.sampler import GrammarBitmask

SCHEMA = {"type": "array", "minItems": 100, "items": {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "role": {"enum": ["admin", "user", "guest"]},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
    "required": ["name", "age", "role", "tags"], "additionalProperties": False}}
PROMPT = "List the members of the chess club as JSON records."


def step_times(engine: LLMEngine, batch: int, steps: int, constrained: bool, seed: int,
               temperature: float = 1.0) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each step taken while all `batch` requests decode."""
    structured = StructuredOutputsParams(json=SCHEMA) if constrained else None
    for i in range(batch):
        engine.add_request(f"{seed}-{i}", PROMPT, SamplingParams(temperature=temperature, seed=seed * 1000 + i, ignore_eos=True,
                                                                 max_tokens=steps + 8, structured_outputs=structured))
    times = []
    while engine.has_unfinished_requests():
        decoding = engine.scheduler.num_running == batch and engine.last_step.num_tokens == batch
        start, cpu = time.perf_counter(), time.process_time()
        engine.step()
        elapsed = (time.perf_counter() - start, time.process_time() - cpu)
        if decoding and engine.last_step.num_tokens == batch and len(times) < steps:
            times.append(elapsed)
    return times


def compile_times(engine: LLMEngine, count: int) -> tuple[list[float], list[float]]:
    compiles, first_masks = [], []
    for i in range(count):
        schema = {**SCHEMA, "title": f"club {i}"}  # not in the compiler's cache
        start = time.perf_counter()
        grammar = engine.grammars.compile(StructuredOutputsParams(json=schema))
        compiles.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.grammars.start_masks([engine.grammars.matcher(grammar)], new_bitmask=GrammarBitmask).result()
        first_masks.append(time.perf_counter() - start)
    return compiles, first_masks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "models" /
                                               "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"),
                        help="default: SmolLM2 from ../shared/data beside the repository")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: as the other benchmarks on this shared machine)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy (no noise is drawn)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(args.model, EngineConfig(), progress=False)
    engine.grammars.compile(StructuredOutputsParams(json=SCHEMA))  # the tokenizer's trie, built once per engine
    print(f"vocabulary {engine.model_config.vocab_size:,} tokens")
    print("| batch | unconstrained step, wall / CPU (ms) | JSON-schema step, wall / CPU (ms) | overhead, wall / CPU |\n"
          "|---|---|---|---|")
    seed = 0
    for batch in (int(b) for b in args.batches.split(",")):
        for constrained in (False, True):  # warm-up: kernels, the KV cache's first pages, the grammar's lexer
            step_times(engine, batch, args.steps, constrained, seed := seed + 1, args.temperature)
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.repeats):
            for constrained in (False, True):
                runs[constrained] += step_times(engine, batch, args.steps, constrained, seed := seed + 1, args.temperature)
        (a_wall, a_cpu), (b_wall, b_cpu) = ([statistics.median(t[k] for t in runs[c]) * 1e3 for k in (0, 1)]
                                            for c in (False, True))
        print(f"| {batch} | {a_wall:.1f} / {a_cpu:.1f} | {b_wall:.1f} / {b_cpu:.1f} | "
              f"{100 * (b_wall / a_wall - 1):+.1f}% / {100 * (b_cpu / a_cpu - 1):+.1f}% |")
    compiles, first_masks = compile_times(engine, 10)
    print(f"\ncompile (median of 10 new schemas): {statistics.median(compiles) * 1e3:.2f} ms; "
          f"first mask of a new matcher: {statistics.median(first_masks) * 1e3:.2f} ms; "
          f"schema {len(json.dumps(SCHEMA))} characters")


if __name__ == "__main__":
    main()
