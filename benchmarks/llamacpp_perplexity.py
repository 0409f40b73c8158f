#!/usr/bin/env python
"""llama.cpp's perplexity of a GGUF model on a text, on hearth's windows (`hearth perplexity`'s
definition, hearth/perplexity.py): the tokens cut into windows of CONTEXT tokens, every token after
the first of each window scored, the last window possibly shorter.

llama.cpp's own `llama-perplexity` scores only the second half of each full window; this scores
the same tokens as hearth does, with llama.cpp's logits (llama-cpp-python, logits for every
position) and the log-softmax in float64. The KV cache is float32 by default, as hearth's on a CPU:
llama.cpp's own default (f16, --cache-type f16) rounds every K and V, which alone moves SmolLM2's
perplexity by ~0.5% on the SmolLM2 texts. Used as a whole command by benchmarks/startup.py and as
the reference of tests/test_perplexity.py.

    python benchmarks/llamacpp_perplexity.py MODEL.gguf TEXT_FILE --context 512 --threads 2 --json
"""

from __future__ import annotations

import argparse
import json
import math

CACHE_TYPES = {"f32": 0, "f16": 1}  # ggml types


def window_starts(num_tokens: int, context: int) -> list[int]:
    return [s for s in range(0, num_tokens - 1, context) if num_tokens - s >= 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("text_file")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-type", choices=list(CACHE_TYPES), default="f32", help="llama.cpp's K and V cache type")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import numpy as np
    from llama_cpp import Llama

    llm = Llama(args.model, n_ctx=args.context, n_batch=args.context, n_ubatch=args.context, logits_all=True,
                n_threads=args.threads, n_threads_batch=args.threads, verbose=False,
                type_k=CACHE_TYPES[args.cache_type], type_v=CACHE_TYPES[args.cache_type])
    with open(args.text_file, encoding="utf-8") as f:
        ids = llm.tokenize(f.read().encode("utf-8"), add_bos=llm.metadata.get("tokenizer.ggml.add_bos_token") != "false")
    total, scored = 0.0, 0
    for start in window_starts(len(ids), args.context):
        window = ids[start:start + args.context]
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[: len(window) - 1], dtype=np.float64)  # [n - 1, vocab]
        peak = logits.max(axis=1, keepdims=True)
        log_norm = np.log(np.exp(logits - peak).sum(axis=1)) + peak[:, 0]
        total += float((log_norm - logits[np.arange(len(window) - 1), window[1:]]).sum())
        scored += len(window) - 1
    nll = total / scored
    result = {"perplexity": math.exp(nll), "nll": nll, "tokens": scored, "context": args.context}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"perplexity {result['perplexity']:.4f}  (nll {nll:.4f} over {scored} tokens, context {args.context})")


if __name__ == "__main__":
    main()
