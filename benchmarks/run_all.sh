#!/usr/bin/env bash
# Every measurement behind docs/benchmarks.md, in one run (about 40 minutes on 2 shared cores).
# Results (markdown, JSON, plots) go to benchmarks/results/. Benchmark models are made on first use
# under $HEARTH_BENCH_MODELS (default ~/.cache/hearth/bench-models; TinyLlama-1.1B shape: ~6 GB).
# llama-cpp-python is needed for the llama.cpp rows only:
#   pip install ../shared/wheels/llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl
#
#   THREADS=1 benchmarks/run_all.sh     # every engine on 1 thread; results in benchmarks/results/threads-1/
#
# THREADS (default: torch's default, one per core) is given to every engine. On a machine shared
# with other work, 1 thread is the steadier choice: OpenMP's barriers between 2 threads that
# compete with other processes for 2 cores can slow small ops tens of times.
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-$(python -c "import torch; print(torch.get_num_threads())")}
R=benchmarks/results/threads-$THREADS
T="--threads $THREADS"
MODELS=${HEARTH_BENCH_MODELS:-$HOME/.cache/hearth/bench-models}
TINYLLAMA=$MODELS/tinyllama-1.1b
mkdir -p "$R"
step() { echo; echo "=== $* ($(date +%T), load $(cut -d' ' -f1-3 /proc/loadavg))"; }

step "benchmark models"
python -m hearth.cli bench make-model --arch tinyllama-1.1b --out "$TINYLLAMA" --gguf f16,q8_0,q4_0

step "64 concurrent vs one at a time vs transformers static batches: tiny model"
python benchmarks/batching.py --model tiny --sequential-sample 16 $T --out "$R/batching-tiny"

step "hearth vs llama.cpp: TinyLlama-1.1B shape, q8_0 and q4_0"
if python -c "import llama_cpp" 2>/dev/null; then
    python benchmarks/hearth_vs_llamacpp.py --arch tinyllama-1.1b --types q8_0,q4_0 --runs 3 --batches 1,8,32 $T --out "$R/llamacpp-tinyllama"
else
    echo "llama-cpp-python is not installed: skipped"
fi

step "hearth vs llama.cpp: TinyLlama-1.1B shape, llama.cpp's own Q4_K_M, Q5_K_M and Q6_K files; SmolLM2-135M Q4_1"
SMOLLM2=../shared/data/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
if python -c "import llama_cpp" 2>/dev/null; then
    python benchmarks/hearth_vs_llamacpp.py --arch tinyllama-1.1b --types q4_k_m,q5_k_m,q6_k --runs 3 --batches 1,32 $T \
        --out "$R/llamacpp-kquants"
    if [ -f "$SMOLLM2" ]; then
        python benchmarks/hearth_vs_llamacpp.py --gguf "$SMOLLM2" --runs 5 --batches 1 $T --out "$R/llamacpp-smollm2"
    fi
else
    echo "llama-cpp-python is not installed: skipped"
fi

step "decode attention: gather + SDPA vs the paged kernel vs split-KV"
python benchmarks/decode_attention.py --runs 7 $T --out "$R/decode-attention"

step "hearth vs transformers generate: TinyLlama-1.1B shape, float32"
python benchmarks/hearth_vs_transformers.py --arch tinyllama-1.1b --runs 3 $T --out "$R/transformers-tinyllama"

step "roofline: TinyLlama-1.1B shape q8_0"
python -m hearth.cli roofline "$TINYLLAMA/tinyllama-1.1b-q8_0.gguf" --batch-sizes 1,8,32 --context 512 $T \
    --json > "$R/roofline-tinyllama.json"
python -m hearth.cli roofline "$TINYLLAMA/tinyllama-1.1b-q8_0.gguf" --batch-sizes 1,8 --context 128 --measure $T \
    --plot "$R/roofline-tinyllama.png" | tee "$R/roofline-tinyllama-measured.txt"

step "bench serve against hearth serve: tiny model"
TINY=$(cd benchmarks && python -c "from common import tiny_model; print(tiny_model()[0])")
PORT=${PORT:-8391}
OMP_NUM_THREADS=$THREADS python -m hearth.cli serve "$TINY" --port "$PORT" --served-model-name tiny --no-access-log --log-level warning &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
python -m hearth.cli bench serve --base-url "http://127.0.0.1:$PORT" --model tiny --concurrency 1,4,16,32 \
    --num-prompts 32 --input-len 64 --output-len 64 --vocab-size 256 --goodput ttft:500 tpot:100 \
    --plot "$R/serve-tiny.png" --no-progress | tee "$R/serve-tiny.txt"
python -m hearth.cli bench serve --base-url "http://127.0.0.1:$PORT" --model tiny --request-rate 2,8,32 \
    --num-prompts 32 --input-len 64 --output-len 64 --vocab-size 256 --goodput ttft:500 tpot:100 \
    --no-progress | tee -a "$R/serve-tiny.txt"
kill $SERVER

step "one request through chat completions, responses and messages: SmolLM2-135M Q4_1"
if [ -f "$SMOLLM2" ]; then
    (cd benchmarks && python agent_apis.py "../$SMOLLM2" --runs 7 --max-tokens 128 $T --out "../$R/agent-apis")
else
    echo "$SMOLLM2 is absent: skipped"
fi

step "64 concurrent vs one at a time vs transformers static batches: TinyLlama-1.1B shape, bfloat16"
python benchmarks/batching.py --model tinyllama-1.1b --dtype bfloat16 --also-gguf q8_0 --sequential-sample 1 \
    --static-sample 1 $T --out "$R/batching-tinyllama"

step "prefix caching on a hybrid model (state checkpoints): TTFT of requests sharing a 1k-token prefix"
python benchmarks/hybrid_prefix_cache.py --hidden 256 --layers 4 --runs 2 $T --out "$R/hybrid_prefix_cache"

step "done"
