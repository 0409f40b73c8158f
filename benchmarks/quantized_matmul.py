#!/usr/bin/env python
"""Measure the quantized matmul paths: the numbers behind docs/quantized-matmul.md.

    python benchmarks/quantized_matmul.py paths MODEL.gguf [--rows 1,32,512] [--layers 4]
    python benchmarks/quantized_matmul.py model MODEL.gguf [--llama-cpp] [--runs 3]

`paths` runs every candidate over the matmul weights of the first --layers layers of the file
(more bytes than the last-level cache: the weights stream from DRAM, as in a decode step) and
prints, per path and number of activation rows, GB/s of stored weights read and the rate in
tokens-equivalent (rows per second for one pass over the whole model). `model` times hearth's
model (ModelRunner, no engine) decoding at batch 1, prefilling 512 tokens and decoding 32
sequences together, next to llama.cpp (llama-cpp-python) on the same file, interleaved run by
run so that both see the same machine load.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from common import REPO  # noqa: F401 - puts this checkout's hearth first on the path


def _best(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _weight_only_candidates(dense: list[torch.Tensor]) -> dict:
    """PyTorch's weight-only kernels: they need their own (requantized) weights, per-row int8 and
    int4 groups of 32."""
    int8 = []
    for d in dense:
        scale = d.abs().amax(1).clamp_min(1e-8) / 127
        int8.append(((d / scale[:, None]).round().to(torch.int8), scale.to(torch.bfloat16)))
    candidates = {"torch._weight_int8pack_mm (per-row int8)":
                  lambda x, i: torch._weight_int8pack_mm(x.to(torch.bfloat16), int8[i][0], int8[i][1])}
    try:
        int4 = []
        for d in dense:
            n, k = d.shape
            groups = d.reshape(n, k // 32, 32)
            lo, hi = groups.amin(-1), groups.amax(-1)
            scale = ((hi - lo) / 15).clamp_min(1e-8)
            q = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
            packed4 = torch._convert_weight_to_int4pack_for_cpu(q, 1)
            zeros = lo + 8 * scale
            scales_zeros = torch.stack([scale, zeros], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
            int4.append((packed4, scales_zeros))
        candidates["torch._weight_int4pack_mm_for_cpu (g32)"] = (
            lambda x, i: torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), int4[i][0], 32, int4[i][1]))
    except Exception as e:  # the op's signature moved between releases
        print(f"(int4pack skipped: {type(e).__name__}: {e})")
    return candidates


def _print_rates(candidates: dict, raw: list, rows: list[int], runs: int, stored: int, total: int) -> None:
    """The table: per path and number of activation rows, the time of one pass over `raw`'s
    matrices, GB/s of the weights the path reads and the tokens/s of a pass over the whole model."""
    elements = sum(shape[0] * shape[1] for _, shape in raw)
    bytes_of = {"F.linear fp32": 4 * elements, "F.linear bf16": 2 * elements, "torch._weight_int8pack_mm": elements,
                "torch._weight_int4pack_mm": elements // 2 + elements // 32 * 4}  # others read the stored blocks
    print("| path | rows | ms / pass | GB/s of its weights | tokens/s equivalent |")
    print("|---|---|---|---|---|")
    for name, fn in candidates.items():
        nbytes = next((b for prefix, b in bytes_of.items() if name.startswith(prefix)), stored)
        if fn is None:
            continue
        for m in rows:
            if m > 32 and name.startswith(("torch:", "F.linear fp32")):
                continue
            xs = {k: torch.randn(m, k) for k in {shape[1] for _, shape in raw}}
            seconds = _best(lambda: [fn(xs[raw[i][1][1]], i) for i in range(len(raw))], runs)
            print(f"| {name} | {m} | {seconds * 1e3:.1f} | {nbytes / seconds / 1e9:.1f} | "
                  f"{m / (seconds * total / stored):.1f} |", flush=True)


def paths(path: str, rows: list[int], layers: int, runs: int) -> None:
    from hearth.loading.gguf import load_gguf
    from hearth.quant import QuantTensor, kernels
    from hearth.backend.cpu_linear import PACKED_QTYPES
    from hearth.backend.stored import DequantLinear

    ext = kernels.extension()
    config, weights, _ = load_gguf(path, progress=False)
    chosen = [w for name, w in weights.items() if isinstance(w, QuantTensor)
              and any(f"layers.{i}." in name for i in range(layers))]
    stored = sum(w.nbytes for w in chosen)
    total = sum(w.nbytes for name, w in weights.items() if isinstance(w, QuantTensor) and "embed" not in name)
    qtype = chosen[0].qtype
    raw = [(w.data.reshape(w.shape[0], -1), w.shape) for w in chosen]
    packed = [ext.repack(d, int(qtype), *shape) for d, shape in raw] if ext and qtype in PACKED_QTYPES else None
    dense = [w.dequantize(torch.float32) for w in chosen]
    bf16 = [d.to(torch.bfloat16) for d in dense]
    candidates = {
        "packed_matmul (int8 x, repacked)": packed and (lambda x, i: ext.packed_matmul(x, *packed[i], int(qtype), raw[i][1][0])),
        "int8_matmul (int8 x, GGUF layout in place)": ext and (lambda x, i: ext.int8_matmul(x, raw[i][0], int(qtype), raw[i][1][0])),
        "torch: dequantize tiles + F.linear": lambda x, i: DequantLinear(chosen[i])(x),
        "F.linear fp32 (dense, 4 B/weight)": lambda x, i: F.linear(x, dense[i]),
        "F.linear bf16 (dense, 2 B/weight)": lambda x, i: F.linear(x.to(torch.bfloat16), bf16[i]),
        **_weight_only_candidates(dense),
    }
    print(f"{path}: {qtype.name}, {len(chosen)} matrices of the first {layers} layers, {stored / 1e6:.0f} MB stored "
          f"(whole model {total / 1e9:.2f} GB); {torch.get_num_threads()} threads")
    _print_rates(candidates, raw, rows, runs, stored, total)


def _hearth_tests(net, tokens) -> tuple:
    """hearth's model (ModelRunner, no engine): (decode(batch, steps) tok/s, prefill() tok/s)."""
    from hearth.engine.runner import BatchEntry, ModelRunner

    runner = ModelRunner(net, 32 * 8 + 40, 16, torch.device("cpu"), torch.float32)

    def decode(batch: int, steps: int = 16, context: int = 64) -> float:
        tables = [list(range(i * 8, (i + 1) * 8)) for i in range(batch)]
        for table in tables:
            runner.forward([BatchEntry(tokens(context), 0, table)])
        start = time.perf_counter()
        for s in range(steps):
            hidden, last = runner.forward([BatchEntry(tokens(1), context + s, t) for t in tables])
            net.compute_logits(hidden[last] if last is not None else hidden)
        return batch * steps / (time.perf_counter() - start)

    def prefill(n: int = 512) -> float:
        table = list(range(32 * 8, 32 * 8 + 40))
        start = time.perf_counter()
        hidden, _ = runner.forward([BatchEntry(tokens(n), 0, table)])
        net.compute_logits(hidden[-1:])
        return n / (time.perf_counter() - start)

    return decode, prefill


def _llama_cpp_tests(path: str, tokens) -> tuple:
    """llama.cpp (llama-cpp-python) on the same file: (decode() tok/s at batch 1, prefill() tok/s)."""
    import llama_cpp as lc

    llm = lc.Llama(model_path=path, n_threads=torch.get_num_threads(), n_threads_batch=torch.get_num_threads(),
                   n_ctx=1024, n_batch=512, verbose=False)

    def decode(steps: int = 16) -> float:
        llm.reset()
        llm.eval(tokens(64))
        start = time.perf_counter()
        for t in tokens(steps):
            llm.eval([t])
        return steps / (time.perf_counter() - start)

    def prefill(n: int = 512) -> float:
        llm.reset()
        start = time.perf_counter()
        llm.eval(tokens(n))
        return n / (time.perf_counter() - start)

    return decode, prefill


def model(path: str, runs: int, llama_cpp: bool) -> None:
    from hearth.loading.loader import load_model

    loaded = load_model(path, progress=False)
    vocab = loaded.config.vocab_size
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    hearth_decode, hearth_prefill = _hearth_tests(loaded.model, tokens)
    cpp_decode, cpp_prefill = _llama_cpp_tests(path, tokens) if llama_cpp else (None, None)
    tests = {"decode B=1": (lambda: hearth_decode(1), cpp_decode), "prefill 512": (hearth_prefill, cpp_prefill),
             "decode B=32 (all)": (lambda: hearth_decode(32, steps=4), None)}
    results: dict[str, list[list[float]]] = {k: [[], []] for k in tests}
    tests["decode B=1"][0]()  # warm-up (and the kernels' build, once)
    for _ in range(runs):
        for name, (ours, theirs) in tests.items():
            results[name][0].append(ours())
            if theirs is not None:
                results[name][1].append(theirs())
    print(f"{path}: {torch.get_num_threads()} threads, medians of {runs} interleaved runs")
    print("| test | hearth tok/s | llama.cpp tok/s |")
    print("|---|---|---|")
    for name, (ours, theirs) in results.items():
        cpp = f"{statistics.median(theirs):.1f}" if theirs else "-"
        print(f"| {name} | {statistics.median(ours):.1f} | {cpp} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("paths")
    p.add_argument("model")
    p.add_argument("--rows", default="1,32,512")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--runs", type=int, default=5)
    m = sub.add_parser("model")
    m.add_argument("model")
    m.add_argument("--runs", type=int, default=3)
    m.add_argument("--llama-cpp", action="store_true")
    for parser in (p, m):
        parser.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.command == "paths":
        paths(args.model, [int(r) for r in args.rows.split(",")], args.layers, args.runs)
    else:
        model(args.model, args.runs, args.llama_cpp)


if __name__ == "__main__":
    main()
