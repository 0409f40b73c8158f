"""TTFT of a prompt with one image on a SmolVLM-256M-shape model (random weights, fp32): hearth against
transformers, and hearth again with the image in its encoder cache.

    python benchmarks/vision_ttft.py [--size 448] [--threads 2] [--repeats 2] [--out benchmarks/results/vision]

The model: SmolVLM-256M's shapes (SigLIP 768 wide, 12 layers, tiles of 512, patches of 16, a pixel shuffle
of 4; a llama of 576 x 30 layers) and its processor's (longest edge 2048: a 448 x 448 image becomes
4 x 4 tiles and the global image, 17 x 64 = 1,088 image tokens). TTFT: from the request to its first
token, the processor's work included (transformers: processor, then generate with max_new_tokens=1).
hearth's three cases: a cold image; the same image after other text (its encoding from the encoder
cache, the prefix cache missing from the first token); the same prompt again (prefix cache too).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common import REPO, machine, machine_markdown, set_threads, table, write_results

SMOLVLM_256M_TEXT = dict(vocab_size=49280, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0)
SMOLVLM_256M_VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)
PROMPT = "<|im_start|>user\n{}<image>What is in this image?<|im_end|>\n<|im_start|>assistant\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=448, help="the image's width and height")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    set_threads(args.threads)
    import sys

    from PIL import Image

    sys.path.insert(0, str(REPO / "tests"))
    from models import make_vlm

    folder = make_vlm(Path(tempfile.mkdtemp()) / "smolvlm-256m", text=SMOLVLM_256M_TEXT, vision=SMOLVLM_256M_VISION,
                      longest_edge=2048, spread=False)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (args.size, args.size, 3), dtype=np.uint8))
    results = {"transformers": [], "hearth, cold image": [], "hearth, image in the encoder cache": [],
               "hearth, same prompt again (prefix cache)": []}
    reference = _transformers(folder)
    llm = _hearth(folder)
    for repeat in range(args.repeats):
        fresh = Image.fromarray(np.asarray(image) ^ repeat)  # another image each repeat: a cold encoder cache
        runs = [("transformers", reference, f"run {repeat} "), ("hearth, cold image", llm, f"run {repeat} "),
                ("hearth, image in the encoder cache", llm, f"again {repeat} "),
                ("hearth, same prompt again (prefix cache)", llm, f"again {repeat} ")]
        for name, ttft, words in runs:
            results[name].append(ttft(fresh, PROMPT.format(words)))
            print(f"{name}: {results[name][-1]:.2f} s", flush=True)
    info = machine()
    rows = [[name, f"{statistics.median(times):.2f}", ", ".join(f"{t:.2f}" for t in times)]
            for name, times in results.items()]
    markdown = (f"TTFT, one {args.size}x{args.size} image (1,088 image tokens), SmolVLM-256M shape, fp32, "
                f"{args.threads} threads\n\n" + table(["", "median s", "runs s"], rows) + "\n\n" + machine_markdown(info))
    print(markdown)
    write_results(args.out, markdown, {"results": results, "machine": info, "size": args.size})


def _transformers(folder: Path):
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(folder)
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()

    def ttft(image, text: str) -> float:
        start = time.perf_counter()
        inputs = processor(text=[text], images=[[image]], return_tensors="pt")
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=1, do_sample=False)
        return time.perf_counter() - start

    return ttft


def _hearth(folder: Path):
    from hearth import LLM, SamplingParams

    llm = LLM(str(folder), progress=False, dtype="float32")
    params = SamplingParams(max_tokens=1, temperature=0)

    def ttft(image, text: str) -> float:
        start = time.perf_counter()
        llm.generate({"prompt": text, "multi_modal_data": {"image": [image]}}, params, use_tqdm=False)
        return time.perf_counter() - start

    return ttft


if __name__ == "__main__":
    main()
