#!/usr/bin/env bash
# hearth on a GPU in one command: every gpu-backend test compiled for real (benchmarks/gpu_tests.sh: Triton
# kernels, the gpu backend against transformers, CUDA graphs against the eager path), then every benchmark figure.
#
#   benchmarks/gpu.sh [OUT_DIR]        (default benchmarks/results/gpu)
#
# Needs torch with CUDA, triton, transformers, gguf; llama-cpp-python for the Q4_K_M file
# (pip install ../shared/wheels/llama_cpp_python-*.whl). Writes OUT_DIR/{tests.log, kernels.md,
# engine.md, trace.md} and their JSON, and trace.trace.json (benchmarks/gpu_step.sh: the short check).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu}
mkdir -p "$out"
benchmarks/gpu_tests.sh -n 6 2>&1 | tee "$out/tests.log"
python3 benchmarks/gpu_kernels.py --out "$out/kernels"
python3 benchmarks/gpu.py --out "$out/engine"
python3 benchmarks/gpu_trace.py --out "$out/trace"
