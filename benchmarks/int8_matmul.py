#!/usr/bin/env python
"""hearth's int8_matmul per GGUF format: one TinyLlama MLP matrix (5632 x 2048, random blocks with
sane float16 scales), CPU milliseconds per call at 1 thread (CPU time: a machine shared with other
jobs still gives each call's own cost), GB/s of the weight's bytes and GOP/s. The grid i-quants
(IQ3_S, IQ2_XS, ...) are timed as the cpu backend reads them, rewritten at load into nibble blocks
(`grid_nibbles`): the file's bytes and the bytes read are both shown.

    python benchmarks/int8_matmul.py --rows 1,4,16,64,512
    python benchmarks/int8_matmul.py --paths avx512-vnni,avx2 --types Q4_K,Q6_K
    python benchmarks/int8_matmul.py --rows 1 --repeats 40 --types Q4_K,IQ4_XS,IQ3_S,IQ3_XXS,IQ2_S,IQ2_XS,IQ2_XXS,IQ1_M,IQ1_S
    python benchmarks/int8_matmul.py --paths avx2,module --types Q8_0,Q4_0,Q4_1,IQ4_NL,MXFP4 --rows 1,4,32

The path `module` times the cpu backend's own module for the weight (Int8Linear: where it repacks the blocks,
e.g. into groups of 8 rows, those), beside int8_matmul's paths on the blocks as stored.
"""

from __future__ import annotations

import argparse
import sys
import time

from common import REPO, table, write_results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q3_K,Q2_K,Q4_0,Q4_1,Q5_0,Q5_1,Q8_0")
    ap.add_argument("--rows", default="1,4,16,64,512", help="activation rows M")
    ap.add_argument("--shape", default="5632,2048", help="N,K of the weight")
    ap.add_argument("--paths", default=None,
                    help="the kernel's code paths to time, comma-separated (default: the fastest; see int8_paths), "
                         "or module: the cpu backend's module")
    ap.add_argument("--repeats", type=int, default=9, help="calls per cell (median)")
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = ap.parse_args()

    import torch
    from gguf import GGMLQuantizationType

    sys.path.insert(0, str(REPO / "tests"))
    from test_iquants import random_iquant
    from test_quant_linear import random_weight

    from hearth.backend.cpu_linear import cpu_linear
    from hearth.quant import QuantTensor, kernels

    torch.set_num_threads(1)
    ext = kernels.extension()
    if ext is None:
        sys.exit("hearth's C++ kernels could not be built here")
    n, k = (int(v) for v in args.shape.split(","))
    rows = [int(m) for m in args.rows.split(",")]
    paths = args.paths.split(",") if args.paths else [next(iter(ext.int8_paths))]
    g = torch.Generator().manual_seed(0)
    cells, data = [], []
    for name in args.types.split(","):
        qtype = kernel_qtype = GGMLQuantizationType[name]
        grid = qtype in kernels.GRID_FORMATS
        weight = (random_iquant if grid or qtype.name.startswith(("IQ4", "MX")) else random_weight)(qtype, n, k, g)
        file_bytes = f"{weight.numel() / 1e6:.2f} MB"
        module = cpu_linear(QuantTensor(weight.clone(), qtype, (n, k))) if "module" in paths else None
        if grid:
            weight, kernel_qtype = ext.grid_nibbles(weight, qtype, n, k)
        for path in paths:
            held = sum(b.numel() for b in module.buffers()) if path == "module" else weight.numel()
            row = [name, path, file_bytes, f"{held / 1e6:.2f} MB"]
            for m in rows:
                x = torch.randn(m, k, generator=g)
                call = (lambda x=x: module(x)) if path == "module" else \
                    (lambda x=x, path=path: ext.int8_matmul(x, weight, int(kernel_qtype), n, path))
                call()
                times = []
                for _ in range(args.repeats):
                    start = time.process_time()
                    call()
                    times.append(time.process_time() - start)
                t = sorted(times)[len(times) // 2]
                row.append(f"{t * 1e3:.2f} ms, {held / t / 1e9:.1f} GB/s, {2 * m * n * k / t / 1e9:.0f} GOP/s")
                data.append({"type": name, "path": path, "rows": m, "cpu_seconds": t})
            cells.append(row)
    command = "python " + " ".join(sys.argv)
    md = "\n".join([f"`{command}` (1 thread, CPU time, median of {args.repeats} calls; weight {n} x {k})", "",
                    table(["format", "path", "file bytes", "bytes read"] + [f"M = {m}" for m in rows], cells)])
    write_results(args.out, md, {"shape": [n, k], "results": data})


if __name__ == "__main__":
    main()
