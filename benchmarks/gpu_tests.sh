#!/usr/bin/env bash
# Every test that runs the gpu backend, compiled for real on a GPU (without one they run under Triton's
# interpreter in the suite): the files that are all GPU code, and the gpu-backend tests of the others.
# On 2026-11-27 the first such run on an H100 found 11 failures the interpreter cannot show
# (benchmarks/results/gpu/h100-2026-11-27.md).
#
#   benchmarks/gpu_tests.sh [PYTEST ARGS...]       e.g. -n 6 (pytest-xdist: Triton compiles on the CPU cores)
#
# Needs torch with CUDA, triton, transformers, gguf and llguidance (nothing else of the test extras).
set -uo pipefail
cd "$(dirname "$0")/.."
whole="tests/test_gpu_backend.py tests/test_triton_kernels.py tests/test_triton_quant_matmul.py
       tests/test_triton_state_ops.py tests/test_kv_fp8.py tests/test_decode_inputs.py tests/test_library_quant.py"
# files with some gpu-backend tests: those whose names say gpu or triton
some="tests/test_gemma4.py tests/test_latent_attention.py tests/test_mtp.py tests/test_gpt_oss.py tests/test_vision.py
      tests/test_vision_qwen.py tests/test_vision_gemma.py tests/test_vision_gemma4.py tests/test_vision_qwen3_5.py
      tests/test_async_scheduling.py tests/test_speculative.py tests/test_contrastive_search.py tests/test_kv_disk_tier.py"
selected=$(python3 -m pytest -p no:cacheprovider -o addopts="" --collect-only -q -k "gpu or triton" $some 2>/dev/null | grep "::")
python3 -m pytest -p no:cacheprovider -rs "$@" $whole $selected
