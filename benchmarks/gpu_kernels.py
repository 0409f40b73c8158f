#!/usr/bin/env python
"""hearth's Triton kernels on a GPU, one by one: achieved bandwidth against a device copy.

    python benchmarks/gpu_kernels.py --out benchmarks/results/gpu/kernels

  quant matmul  x [M, K] bf16 @ W^T with W in GGUF blocks (Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K), the
                Llama-3.2-1B projections' shapes; GB/s = weight bytes / time; beside it torch's
                bf16 matmul of the same shape (cuBLAS reading 2 bytes a weight)
  gemv-sweep    the small-M kernel's launches (quant_matmul.GEMV_CANDIDATES: block_n, block_k, warps,
                programs per SM) per shape class (square, long rows, wide, vocab) and format at M = 1:
                the fastest per cell against today's, and the GEMV_CONFIGS table to paste in
                (--sections gemv-sweep; ~5 minutes on an H100, not part of benchmarks/gpu.sh)
  decode attn   the paged split-KV decode kernel over the Llama-3.2-1B layer shape (32 heads, 8 KV
                heads, head_dim 64): GB/s = K/V bytes / time
  latent attn   the same for multi-head latent attention over DeepSeek-V2-Lite's latent cache (16 heads,
                kv_lora_rank 512 + 64 rotated): GB/s = latent bytes / time
Times are medians of triton.testing.do_bench (CUDA events).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common import REPO, table

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
          "lm_head": (128256, 2048)}


def random_blocks(qtype, n: int, k: int):
    """Valid GGUF blocks of `qtype`: random bytes with every f16 scale field set to a small value."""
    import numpy as np
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    fields = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q5_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}[qtype]
    for start in fields:
        blocks[..., start:start + 2] = scale
    return torch.from_numpy(blocks.reshape(n, -1))


# per GEMV shape class (quant_matmul.shape_class), the matrices the sweep times: Llama-3.2-1B's and Llama-3-8B's
CLASS_SHAPES = {"square": [(2048, 2048), (3072, 2048), (4096, 4096), (6144, 4096)],
                "long_rows": [(2048, 8192), (4096, 14336)],
                "wide": [(16384, 2048), (28672, 4096)],
                "vocab": [(128256, 2048)]}


def gemv_sweep(data: dict, formats: list[str] | None = None) -> str:
    """Every launch of GEMV_CANDIDATES at M = 1, per shape class and format (of `formats`, by GGML
    name; None: every supported one): the fastest by time summed over the class's matrices, against
    the launch GEMV_CONFIGS gives today, each printed as it is found; then the table to paste into
    hearth/triton_kernels/quant_matmul.py."""
    import itertools

    import torch
    import triton

    from hearth.triton_kernels import quant_matmul as qm

    def quick(fn) -> float:
        return triton.testing.do_bench(fn, warmup=3, rep=10, return_mode="median") / 1e3

    launches = [qm.GemvConfig(*c) for c in itertools.product(*qm.GEMV_CANDIDATES.values())]
    rows, best = [], {}
    for cls, shapes in CLASS_SHAPES.items():
        for qtype in [q for q in qm.SUPPORTED_QTYPES if formats is None or q.name in formats]:
            weights = [qm.TritonQuantWeight.from_blocks(random_blocks(qtype, n, k), qtype, (n, k), "cuda")
                       for n, k in shapes]
            xs = [torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _, k in shapes]

            def total(config, weights=weights, xs=xs):
                return sum(quick(lambda w=w, x=x: w.gemv(x, config=config)) for w, x in zip(weights, xs))

            today = total(weights[0].gemv_config)
            times = {}
            for config in launches:
                try:
                    times[config] = total(config)
                except Exception as e:  # a launch the compiler refuses (registers, shared memory)
                    print(f"{cls} {qtype.name} {config}: {type(e).__name__}", file=sys.stderr)
            config = min(times, key=times.get)
            best[(cls, qtype.name)] = (config, times[config], today)
            print(f"{cls} {qtype.name}: {config!r} {times[config] * 1e6:.1f} us (today {today * 1e6:.1f})", flush=True)
            rows.append([cls, qtype.name, config.block_n, config.block_k, config.warps, config.programs_per_sm,
                         times[config] * 1e6, today * 1e6, today / times[config]])
            data.setdefault("gemv_sweep", []).append(
                {"class": cls, "qtype": qtype.name, "shapes": shapes, "today_us": today * 1e6,
                 "us": {repr(c): t * 1e6 for c, t in times.items()}})
            del weights
    literal = ["GEMV_CONFIGS: dict[tuple[str, str], GemvConfig] = {"]
    literal += [f'    ("{cls}", "{name}"): {config!r},  # {t * 1e6:.1f} us (was {today * 1e6:.1f})'
                for (cls, name), (config, t, today) in best.items()]
    literal += ['    **{(c, "*"): GemvConfig() for c in SHAPE_CLASSES},', "}"]
    return "\n".join([
        "GEMV launches at M = 1 per shape class and format: the fastest of "
        f"{len(launches)}, us summed over the class's matrices", "",
        table(["class", "format", "block_n", "block_k", "warps", "programs/SM", "best us", "today us", "speed-up"],
              rows), "", "To paste into hearth/triton_kernels/quant_matmul.py:", "", "```python", *literal, "```"])


def bench(fn) -> float:
    """Seconds per call: triton's median over 100 ms after 25 ms of warm-up."""
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def quant_section(rows_m: list[int], data: dict) -> str:
    """Quantized matmul against cuBLAS bf16 on each matrix: weight bytes over time."""
    import torch

    from hearth.triton_kernels.quant_matmul import SUPPORTED_QTYPES, TritonQuantWeight

    rows = []
    for m in rows_m:
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            dense_s = bench(lambda: x @ dense.T)
            row = [m, f"{name} {n}x{k}", f"{2 * n * k / dense_s / 1e9:,.0f}"]
            for qtype in SUPPORTED_QTYPES:
                weight = TritonQuantWeight.from_blocks(random_blocks(qtype, n, k), qtype, (n, k), "cuda")
                seconds = bench(lambda: weight.matmul(x))
                row.append(f"{weight.nbytes / seconds / 1e9:,.0f} ({dense_s / seconds:.2f}x)")
                data["quant"].append({"m": m, "shape": name, "qtype": qtype.name, "seconds": seconds,
                                      "bytes": weight.nbytes, "bf16_seconds": dense_s})
            rows.append(row)
            del dense
    return table(["M", "matrix", "bf16 cuBLAS GB/s"] + [f"{q.name} GB/s (vs bf16)" for q in SUPPORTED_QTYPES], rows)


def _paged_tables(batch: int, context: int, block: int):
    """Shuffled block tables int32 [batch, context / block] and context lengths, every sequence `context` long."""
    import torch

    tables = torch.randperm(batch * context // block, device="cuda").to(torch.int32).reshape(batch, -1)
    return tables, torch.full((batch,), context, dtype=torch.int32, device="cuda")


def attention_section(cells: tuple, data: dict) -> list[list]:
    """Paged decode attention, bf16 K/V, 32 heads / 8 KV heads x 64: the table's rows."""
    import torch

    from hearth.triton_kernels import attention

    attn_rows = []
    heads, kv_heads, head_dim, block = 32, 8, 64, 16
    for batch, context in cells:
        tables, lens = _paged_tables(batch, context, block)
        k_cache = torch.randn(batch * context, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        seconds = bench(lambda: attention.decode_attention(q, k_cache, v_cache, tables, lens, 0.125, block))
        nbytes = 2 * k_cache.numel() * 2
        attn_rows.append([batch, context, seconds * 1e6, nbytes / seconds / 1e9])
        data["attention"].append({"batch": batch, "context": context, "seconds": seconds, "bytes": nbytes})
    return attn_rows


def latent_section(cells: tuple, data: dict) -> list[list]:
    """Paged decode attention over a bf16 latent cache, DeepSeek-V2-Lite's 16 heads x (512 + 64): the table's rows."""
    import torch

    from hearth.triton_kernels import attention, latent_attention

    rows = []
    heads, rank, width, block = 16, 512, 576, 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch, context in cells:
        tables, lens = _paged_tables(batch, context, block)
        cache = torch.randn(batch * context, 1, width, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(batch, heads, width, device="cuda", dtype=torch.bfloat16)
        splits = attention.choose_num_splits(batch, latent_attention.decode_programs(heads), context, sms)
        seconds = bench(lambda: latent_attention.decode_attention(q, cache, rank, tables, lens, 0.07, block, splits))
        rows.append([batch, context, splits, seconds * 1e6, cache.numel() * 2 / seconds / 1e9])
        data["latent_attention"].append({"batch": batch, "context": context, "splits": splits, "seconds": seconds,
                                         "bytes": cache.numel() * 2})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--sections", default="quant,attention")
    ap.add_argument("--formats", default=None, help="the GEMV sweep's formats, e.g. Q4_K,Q6_K (default: all)")
    args = ap.parse_args()
    import torch

    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    copy_gb_s = 2 * src.numel() * 4 / bench(lambda: dst.copy_(src)) / 1e9
    del src, dst
    data = {"copy_gb_per_s": copy_gb_s, "quant": [], "attention": [], "latent_attention": []}
    sections = args.sections.split(",")
    quant_table = quant_section(list(map(int, args.rows.split(","))) if "quant" in sections else [], data)
    cells = ((1, 1024), (1, 8192), (64, 1024), (256, 512)) if "attention" in sections else ()
    attn_rows, latent_rows = attention_section(cells, data), latent_section(cells, data)
    formats = None if args.formats is None else args.formats.split(",")
    sweep_table = gemv_sweep(data, formats) if "gemv-sweep" in sections else ""
    markdown = "\n".join([
        f"### Triton kernels on {torch.cuda.get_device_name()} (device copy {copy_gb_s:,.0f} GB/s read + written)",
        "", "Quantized matmul, x bf16 [M, K]: weight bytes / time", "", quant_table, "",
        "Paged decode attention, bf16 K/V, 32 heads / 8 KV heads x 64", "",
        table(["batch", "context", "us", "GB/s of K/V"], attn_rows), "",
        "Paged decode attention over the latent (multi-head latent attention), bf16, 16 heads x (512 + 64)", "",
        table(["batch", "context", "splits", "us", "GB/s of the latent"], latent_rows), "", sweep_table,
    ])
    print(markdown)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(markdown + "\n")
        out.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
