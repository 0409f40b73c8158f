#!/usr/bin/env python
"""`hearth quantize` against llama.cpp's quantizer (llama-cpp-python's `llama_model_quantize`) on the
same F16/F32 GGUF, the same mix and thread count, run after run in one process (llama.cpp first),
then whether every tensor's type and bytes agree.

    python benchmarks/quantize_vs_llamacpp.py MODEL-f16.gguf --type q4_k_m --threads 2 --runs 1
"""

from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source")
    ap.add_argument("--type", default="q4_k_m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--out-dir", default="/tmp")
    args = ap.parse_args()

    import gguf
    import llama_cpp
    import torch

    from hearth.loading.quantize import MIXES, quantize_model

    torch.set_num_threads(args.threads)
    llama_cpp.llama_backend_init()
    theirs, ours = Path(args.out_dir) / "llamacpp.gguf", Path(args.out_dir) / "hearth.gguf"
    for run in range(args.runs):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = int(MIXES[args.type][0]), args.threads
        start = time.perf_counter()
        llama_cpp.llama_model_quantize(args.source.encode(), str(theirs).encode(), ctypes.byref(params))
        middle = time.perf_counter()
        quantize_model(args.source, ours, args.type, progress=False)
        end = time.perf_counter()
        print(f"run {run}: llama.cpp {middle - start:.1f} s, hearth {end - middle:.1f} s "
              f"(hearth / llama.cpp {(end - middle) / (middle - start):.2f})", flush=True)
    want = {t.name: t for t in gguf.GGUFReader(theirs).tensors}
    got = {t.name: t for t in gguf.GGUFReader(ours).tensors}
    differ = [name for name, t in want.items() if name not in got or got[name].tensor_type != t.tensor_type
              or not np.array_equal(np.asarray(got[name].data).view(np.uint8), np.asarray(t.data).view(np.uint8))]
    print(f"{len(want)} tensors, {len(differ)} differ{': ' + ', '.join(differ[:5]) if differ else ''}")


if __name__ == "__main__":
    main()
