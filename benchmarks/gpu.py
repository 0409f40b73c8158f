#!/usr/bin/env python
"""hearth on a GPU, in one command: the figures of issue 17, side by side with transformers.

    python benchmarks/gpu.py --out benchmarks/results/gpu/h100      (benchmarks/gpu.sh wraps it)

What it measures (Llama-3.2-1B shape, random weights made by `hearth bench make-model`, bf16):
  bandwidth     device-to-device copy of 1 GiB, bytes read + written / time: the HBM ceiling
  decode b=1    one prompt of 128 tokens, 256 new tokens: decode tokens/s, GB/s of weights + KV
                read per step, % of the measured bandwidth; hearth with CUDA graphs, hearth
                --enforce-eager, transformers `generate` (static shapes: generate(257) - generate(1))
  decode b=64   64 prompts of 128 tokens decoding 128 tokens together, the same three
  (both decodes also with hearth --kv-cache-dtype fp8: K/V as e4m3 bytes, GB/s counted with them)
  throughput    512 requests x (128 prompt + 128 output), at most 256 running: output tokens/s
  GGUF          the same model as GGUF files: Q8_0 (hearth's converter) and Q4_K_M (hearth quantize, byte-equal
                to llama.cpp's quantizer): decode b=1 with the weights kept
                quantized on the GPU
Every figure is the median of --runs runs, engines interleaved run by run.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
import traceback
from pathlib import Path

from common import REPO, median, table, timed

ARCH = "llama-3.2-1b"
HEARTH_OPTIONS: dict = {}  # every hearth engine's extra options (--async-scheduling / --no-async-scheduling)


def hbm_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read and written (median of 20)."""
    import torch

    src = torch.randn(1 << 28, device="cuda")  # 1 GiB of float32
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * 4 / median(times) / 1e9


def make_files(work: Path) -> dict:
    """The HF folder, a Q8_0 GGUF and a Q4_K_M GGUF of the benchmark shape. Q4_K_M comes from
    `hearth quantize`, whose K-quant mixes are byte-equal to llama-quantize's (tests/test_quantize.py),
    so no llama.cpp build has to travel to the GPU machine."""
    from hearth.bench.models import make_model
    from hearth.loading.quantize import quantize_model

    files = make_model(ARCH, work, ["f16", "q8_0"], progress=False)["files"]
    q4km = work / f"{ARCH}-q4_k_m.gguf"
    if not q4km.exists():
        quantize_model(files["f16"], q4km, "q4_k_m", progress=False)
    files["q4_k_m"] = q4km
    return files


def hearth_llm(path, enforce_eager: bool = False, kv_cache_dtype: str = "auto"):
    from hearth import LLM

    return LLM(str(path), dtype="bfloat16", device="cuda", enforce_eager=enforce_eager, kv_cache_memory=8 << 30,
               kv_cache_dtype=kv_cache_dtype, max_model_len=1024, max_num_seqs=256, max_num_batched_tokens=8192,
               progress=False, **HEARTH_OPTIONS)


def hearth_decode(llm, batch: int, input_len: int, output_len: int, rng: random.Random) -> dict:
    from hearth.bench.latency import one_run, random_prompts

    run = one_run(llm.engine, random_prompts(batch, input_len, llm.engine.model_config.vocab_size, rng), output_len)
    return {"tokens_per_s": run["decode_tokens_per_s"], "prefill_tokens_per_s": run["prefill_tokens_per_s"]}


def step_bytes(llm, batch: int, context: int) -> int:
    """What a decode step reads: the weights as held on the GPU plus the batch's K/V at `context`."""
    from hearth.kv_format import kv_bytes_per_element
    from hearth.bench.roofline import model_weight_bytes, step_cost

    engine = llm.engine
    cost = step_cost(engine.model_config, model_weight_bytes(engine.model), "decode", batch, context,
                     kv_bytes_per_element(engine.config.cache.kv_cache_dtype, engine.dtype.itemsize))
    return cost.bytes


class TransformersRunner:
    def __init__(self, folder):
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
        self.model.generation_config.eos_token_id = None  # fixed lengths, as ignore_eos
        self.model.generation_config.pad_token_id = 0
        self.vocab = self.model.config.vocab_size

    def generate(self, ids, new: int) -> float:
        torch = self.torch
        with torch.inference_mode():
            torch.cuda.synchronize()
            seconds = timed(lambda: self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                                        min_new_tokens=new, do_sample=False))
            torch.cuda.synchronize()
        return seconds

    def decode(self, batch: int, input_len: int, output_len: int, rng: random.Random) -> dict:
        ids = self.torch.tensor([[rng.randrange(self.vocab) for _ in range(input_len)] for _ in range(batch)],
                                device="cuda")
        first = self.generate(ids, 1)
        whole = self.generate(ids, output_len + 1)
        return {"tokens_per_s": batch * output_len / (whole - first)}


class GpuRun:
    """The sections of one run: the engines loaded, each figure measured, the table's rows, and the
    errors of sections that failed (one broken section must not lose the others' figures)."""

    def __init__(self, args: argparse.Namespace, bandwidth: float, files: dict, results: dict) -> None:
        self.args, self.bandwidth, self.files, self.results = args, bandwidth, files, results
        self.rng = random.Random(0)
        self.rows: list[list] = []
        self.measured: dict[tuple[str, str], float] = {}
        self.loaded: dict = {}

    def section(self, name: str, fn) -> None:
        try:
            fn()
        except Exception as e:
            self.results["errors"][name] = "".join(traceback.format_exception(e))[-3000:]
            print(f"{name}: FAILED\n{self.results['errors'][name]}", file=sys.stderr, flush=True)

    def load_engines(self, skip: set[str]) -> None:
        hf = self.files["hf"]
        engines = {"hearth": lambda: hearth_llm(hf)}
        if "eager" not in skip:
            engines["hearth --enforce-eager"] = lambda: hearth_llm(hf, enforce_eager=True)
        if "fp8" not in skip:
            engines["hearth --kv-cache-dtype fp8"] = lambda: hearth_llm(hf, kv_cache_dtype="fp8")
        if "transformers" not in skip:
            engines["transformers"] = lambda: TransformersRunner(hf)
        for name, make in engines.items():
            self.section(f"load {name}", lambda: self.loaded.__setitem__(name, make()))

    def _decode(self, name: str, engine, batch: int, input_len: int, output_len: int) -> dict:
        if name == "transformers":
            return engine.decode(batch, input_len, output_len, self.rng)
        return hearth_decode(engine, batch, input_len, output_len, self.rng)

    def decode_tables(self) -> None:
        for batch, input_len, output_len in ((1, 128, 256), (64, 128, 128)):
            for name, engine in self.loaded.items():  # warm-up (graph capture, Triton compilation)
                self._decode(name, engine, batch, input_len, 8)
            runs: dict[str, list[float]] = {name: [] for name in self.loaded}
            for _ in range(self.args.runs):
                for name, engine in self.loaded.items():
                    runs[name].append(self._decode(name, engine, batch, input_len, output_len)["tokens_per_s"])
            for name, values in runs.items():
                nbytes = step_bytes(self.loaded[name if name != "transformers" else "hearth"], batch,
                                    input_len + output_len // 2)
                tok_s = median(values)
                gb_s = nbytes * tok_s / batch / 1e9
                self.measured[(f"decode b={batch}", name)] = tok_s
                self.rows.append([f"decode, batch {batch}", name, tok_s, gb_s, 100 * gb_s / self.bandwidth,
                                  ", ".join(f"{v:,.0f}" for v in values)])
            self.results[f"decode_b{batch}"] = runs

    def throughput(self) -> None:
        from hearth.bench.throughput import run_throughput

        llm = self.loaded["hearth"]
        run_throughput(llm, 32, 128, 16, progress=False)  # warm-up: graphs of the larger buckets
        values = [run_throughput(llm, 512, 128, 128, seed=i, progress=False)["output_tokens_per_s"]
                  for i in range(self.args.runs)]
        self.measured[("throughput", "hearth")] = median(values)
        self.rows.append(["512 x (128 + 128), 256 at once: output tok/s", "hearth", median(values), None, None,
                          ", ".join(f"{v:,.0f}" for v in values)])
        self.results["throughput_512"] = values

    def gguf(self, kind: str) -> None:
        llm = hearth_llm(self.files[kind])
        hearth_decode(llm, 1, 128, 8, self.rng)
        values = [hearth_decode(llm, 1, 128, 256, self.rng)["tokens_per_s"] for _ in range(self.args.runs)]
        nbytes = step_bytes(llm, 1, 128 + 128)
        gb_s = nbytes * median(values) / 1e9
        self.measured[(f"decode b=1 {kind}", "hearth")] = median(values)
        self.rows.append([f"decode, batch 1, {kind.upper()} GGUF", "hearth", median(values), gb_s,
                          100 * gb_s / self.bandwidth, ", ".join(f"{v:,.0f}" for v in values)])
        self.results[f"decode_b1_{kind}"] = values
        self.results[f"weight_bytes_{kind}"] = nbytes

    def markdown(self, torch_version: str) -> str:
        ratios = []
        for (test, name), value in self.measured.items():
            if name == "transformers" and (test, "hearth") in self.measured:
                ratios.append(f"{test}: hearth / transformers = {self.measured[(test, 'hearth')] / value:.2f}x")
        return "\n".join([
            f"### hearth on {self.results['device']} ({ARCH} shape, bf16, random weights)",
            "",
            f"- device-to-device copy: {self.bandwidth:,.0f} GB/s (read + written); torch {torch_version}",
            f"- command: `{self.results['command']}`; medians of {self.args.runs} runs, engines interleaved",
            "",
            table(["test", "engine", "tokens/s", "GB/s read", "% of copy bandwidth", "runs"], self.rows),
            "",
            *[f"- {r}" for r in ratios],
            *[f"- {name}: failed (see the JSON)" for name in self.results["errors"]],
        ])


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    ap.add_argument("--work", default="/tmp/hearth-gpu-bench", help="where the model files are made")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: transformers,eager,fp8,throughput,gguf")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="every hearth engine with asynchronous scheduling on or off (default: the engine's default)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    skip = set(filter(None, args.skip.split(",")))
    if args.async_scheduling is not None:
        HEARTH_OPTIONS["async_scheduling"] = args.async_scheduling
    import torch

    results: dict = {"command": "python benchmarks/gpu.py " + shlex.join(sys.argv[1:]),
                     "device": torch.cuda.get_device_name(), "torch": torch.__version__, "errors": {}}
    results["hbm_gb_per_s"] = bandwidth = hbm_bandwidth()
    print(f"{results['device']}: device-to-device copy {bandwidth:,.0f} GB/s", flush=True)
    start = time.perf_counter()
    files = make_files(Path(args.work))
    print(f"model files made in {time.perf_counter() - start:.0f} s", flush=True)
    run = GpuRun(args, bandwidth, files, results)
    run.load_engines(skip)
    run.section("decode", run.decode_tables)
    if "throughput" not in skip:
        run.section("throughput", run.throughput)
    run.loaded.clear()
    torch.cuda.empty_cache()
    if "gguf" not in skip:
        for kind in ("q8_0", "q4_k_m"):
            if kind in files:
                run.section(f"gguf {kind}", lambda: run.gguf(kind))
    markdown = run.markdown(torch.__version__)
    print(markdown)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(markdown + "\n")
        out.with_suffix(".json").write_text(json.dumps(results, indent=2, default=str) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
