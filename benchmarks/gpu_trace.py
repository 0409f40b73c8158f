#!/usr/bin/env python
"""A torch.profiler trace of decode steps on a GPU, and the GPU's idle time between them (issue 37:
at most 100 us a step at batch 1 on an H100).

    python benchmarks/gpu_trace.py --out benchmarks/results/gpu/trace      (benchmarks/gpu.sh runs it)

The Llama-3.2-1B shape in bf16 (benchmarks/gpu.py's model files, made if absent), one request (or
--batch) decoding greedily: a whole request first (graphs captured, kernels compiled), then a
prefill and two decode steps unprofiled, then --steps decode steps under torch.profiler (CPU and
CUDA activity). Written: OUT.trace.json (the Chrome trace: chrome://tracing or ui.perfetto.dev),
OUT.md and OUT.json with, from the trace's GPU activity (kernels, copies, memsets merged into busy
intervals): the span from the first GPU work to the last, the busy time, the idle time (span - busy)
per step, and the largest gaps.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from common import REPO, table

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_idle(trace: dict, steps: int) -> dict:
    """Busy and idle microseconds of the GPU in a Chrome trace's events (timestamps in us)."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in trace["traceEvents"]
                   if e.get("cat") in GPU_CATEGORIES and e.get("ph") == "X")
    if not spans:
        raise RuntimeError("no GPU activity in the trace (CUPTI unavailable?)")
    merged = [list(spans[0])]
    for start, end in spans[1:]:
        if start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    gaps = sorted((b[0] - a[1] for a, b in zip(merged, merged[1:])), reverse=True)
    span = merged[-1][1] - merged[0][0]
    busy = sum(end - start for start, end in merged)
    return {"steps": steps, "span_us": span, "busy_us": busy, "idle_us": span - busy,
            "idle_us_per_step": (span - busy) / steps, "step_us": span / steps,
            "largest_gaps_us": gaps[:steps], "gaps_over_20us": sum(g > 20 for g in gaps)}


def profile_decode(args: argparse.Namespace, out: Path) -> dict:
    import torch

    from gpu import ARCH, hearth_llm
    from hearth import SamplingParams
    from hearth.bench.latency import one_run, random_prompts
    from hearth.bench.models import make_model

    files = make_model(ARCH, args.work, [], progress=False)["files"]
    llm = hearth_llm(files["hf"])
    engine, rng = llm.engine, random.Random(0)
    vocab = engine.model_config.vocab_size
    one_run(engine, random_prompts(args.batch, 128, vocab, rng), 16)  # warm-up: capture, compilation
    params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
    for prompt in random_prompts(args.batch, 128, vocab, rng):
        engine.add_request(None, prompt, params)
    for _ in range(3):  # the prefill, two decodes
        engine.step()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    trace_path = out.with_suffix(".trace.json")
    prof.export_chrome_trace(str(trace_path))
    while engine.has_unfinished_requests():
        engine.step()
    result = gpu_idle(json.loads(trace_path.read_text()), args.steps)
    result.update(device=torch.cuda.get_device_name(), batch=args.batch, trace=str(trace_path))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/gpu/trace", help="writes OUT.trace.json, OUT.md, OUT.json")
    ap.add_argument("--work", default="/tmp/hearth-gpu-bench", help="where the model files are (made if absent)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    r = profile_decode(args, out)
    markdown = "\n".join([
        f"### GPU idle time between decode steps, {r['device']}, batch {r['batch']}, {r['steps']} steps (profiled)",
        "", table(["span us", "busy us", "step us", "idle us / step", "gaps > 20 us", "largest gaps us"],
                  [[r["span_us"], r["busy_us"], r["step_us"], r["idle_us_per_step"], r["gaps_over_20us"],
                    ", ".join(f"{g:.0f}" for g in r["largest_gaps_us"][:5])]]),
        "", f"Trace: `{r['trace']}` (the profiler's own overhead is in it: host times run long)."])
    print(markdown)
    out.with_suffix(".md").write_text(markdown + "\n")
    out.with_suffix(".json").write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
