#!/usr/bin/env bash
# Issue 37's GPU check in one go (~6 minutes on an H100): the GPU tests of the decode step's device
# inputs, in-graph draws and quantized GEMV launches compiled for real; bf16 decode at batch 1 and 64
# and Q8_0 / Q4_K_M GGUF decode at batch 1 (one run each, no transformers, eager or fp8 engines);
# a torch.profiler trace of 20 batch-1 decode steps with the GPU's idle time between steps.
#
#   benchmarks/gpu_step.sh [OUT_DIR]      (default benchmarks/results/gpu; SKIP_TESTS=1 skips the tests)
#
# Writes OUT_DIR/{step-tests.log, engine-step.md, engine-step.json, trace.md, trace.json,
# trace.trace.json}. Needs what benchmarks/gpu.sh needs (llama-cpp-python for the Q4_K_M file).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu}
mkdir -p "$out"
if [ -z "${SKIP_TESTS:-}" ]; then
    python3 -m pytest -q -p no:cacheprovider tests/test_decode_inputs.py tests/test_triton_quant_matmul.py \
        tests/test_gpu_backend.py -k "rebuild or fits_only or launch or split_over_k or decode_graphs or draws_in \
        or gguf_weights" 2>&1 | tee "$out/step-tests.log"
fi
python3 benchmarks/gpu.py --runs 1 --skip transformers,eager,fp8,throughput --out "$out/engine-step"
python3 benchmarks/gpu_trace.py --steps 20 --batch 1 --out "$out/trace"
