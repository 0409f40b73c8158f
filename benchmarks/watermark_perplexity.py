"""The green-list watermark's cost in perplexity and its detection, on a real model.

    python benchmarks/watermark_perplexity.py [--model SmolLM2-135M-Instruct.Q4_1.gguf] [--deltas 0,1,2,4]

For each delta, the same prompts and seeds generate 200 tokens at temperature 1; perplexity is
that of the model itself on its own text (the raw, unwatermarked distribution's logprobs of the
sampled tokens: what the bias costs), z the detector's score under the generation's key.
"""

from __future__ import annotations

import argparse
import math
import statistics

from hearth import LLM, SamplingParams, WatermarkParams
from hearth.watermark import detect

PROMPTS = [
    "Write a short story about a lighthouse keeper.", "Explain how a refrigerator works.",
    "What should I pack for a week of hiking?", "Describe the city of Lisbon.",
    "Give me advice on learning to play the piano.", "Why is the sky blue?",
    "Write a letter to a friend who moved abroad.", "How do vaccines train the immune system?",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="/work/shared/data/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--deltas", default="0,1,2,4")
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    llm = LLM(args.model, progress=False)
    prompts = [llm.render_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    print("| delta | perplexity (mean over prompts) | z (mean, min) |\n|---|---|---|")
    for delta in (float(d) for d in args.deltas.split(",")):
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.tokens, ignore_eos=True,
                                 watermark=WatermarkParams(1000 + i, delta) if delta else None)
                  for i in range(len(prompts))]
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        ppl = statistics.mean(math.exp(-o.cumulative_logprob / len(o.token_ids)) for o in outs)
        zs = [detect(o.token_ids, 1000 + i).z for i, o in enumerate(outs)]
        print(f"| {delta:g} | {ppl:.2f} | {statistics.mean(zs):.1f}, {min(zs):.1f} |", flush=True)


if __name__ == "__main__":
    main()
