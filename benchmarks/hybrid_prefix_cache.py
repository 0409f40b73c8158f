#!/usr/bin/env python
"""Time to first token of a request sharing a long prefix with one before it, on a hybrid model, with
prefix caching (its state checkpoints, docs/architecture.md "Prefix caching through state checkpoints")
and without.

A random Qwen3.5-shape model (Gated DeltaNet and gated attention, three to one; transformers writes it)
in an HF folder with a word-level tokenizer. Per run, a fresh engine serves a first request (the prefix
and a tail of its own, max_tokens 1), then a second and a third one (the prefix and other tails): their
TTFT is the time of their one-token generate. A prefix that ends on a block boundary is found by the
second request at the first's checkpoint; one that does not is found by the third at the junction
the second left (the second recomputes it). The two settings alternate run by run (a shared
machine's load falls on both).

    python benchmarks/hybrid_prefix_cache.py --prefixes 1024 1000 --runs 3 --out benchmarks/results/hybrid_prefix_cache
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from common import machine, machine_markdown, median, set_threads, table, write_results

VOCAB = 2048


def make_model(folder: Path, hidden: int, layers: int) -> Path:
    """A random Qwen3.5 text model (float32) and a word-level tokenizer of VOCAB words."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models

    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=2, head_dim=128, linear_num_key_heads=hidden // 128,
        linear_num_value_heads=hidden // 64, linear_key_head_dim=64, linear_value_head_dim=64,
        max_position_embeddings=4096, bos_token_id=0, eos_token_id=1)
    transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).save_pretrained(folder)
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w2")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "w0", "eos_token": "w1"}))
    return folder


def later_ttfts(folder: Path, caching: bool, prefix: list[int], tails: list[list[int]]) -> list[tuple[float, int]]:
    """After a first request (the prefix and tails[0]), per later one (the prefix and each other tail, in
    turn): (seconds of its one-token generate, its prompt tokens found cached)."""
    from hearth import LLM, SamplingParams

    llm = LLM(folder, enable_prefix_caching=caching, progress=False)
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([prefix + tails[0]], params, use_tqdm=False)
    timings = []
    for tail in tails[1:]:
        start = time.perf_counter()
        output = llm.generate([prefix + tail], params, use_tqdm=False)[0]
        timings.append((time.perf_counter() - start, output.num_cached_tokens))
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefixes", type=int, nargs="+", default=[1024, 1000],
                        help="shared prefix lengths: one a multiple of the block size (16), one not")
    parser.add_argument("--tail", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    set_threads(args.threads)
    rng = random.Random(0)
    info, rows, data = machine(), [], {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model(Path(tmp) / "qwen3_5", args.hidden, args.layers)
        for length in args.prefixes:
            prefix = [rng.randrange(2, VOCAB) for _ in range(length)]
            tails = [[rng.randrange(2, VOCAB) for _ in range(args.tail)] for _ in range(3)]
            runs = {False: [], True: []}
            for _ in range(args.runs):
                for caching in runs:
                    runs[caching].append(later_ttfts(folder, caching, prefix, tails))
                    print(f"prefix {length}, caching {caching}: {runs[caching][-1]}", file=sys.stderr, flush=True)
            for caching, timings in runs.items():
                row = [length, "on" if caching else "off"]
                for i in range(2):  # the second request, the third
                    row += [median([t[i][0] for t in timings]) * 1000, timings[0][i][1]]
                rows.append(row)
            data[length] = {str(k): v for k, v in runs.items()}
    markdown = (f"Qwen3.5 shape (random weights, float32): hidden {args.hidden}, {args.layers} layers; requests "
                f"sharing a prefix, each with a tail of {args.tail} tokens of its own, one after another on a fresh "
                f"engine; median of {args.runs} runs\n\n"
                + table(["prefix", "prefix caching", "2nd TTFT ms", "2nd cached", "3rd TTFT ms", "3rd cached"], rows)
                + "\n\n" + machine_markdown(info))
    write_results(args.out, markdown, {"machine": info, "args": vars(args), "runs": data})


if __name__ == "__main__":
    main()
