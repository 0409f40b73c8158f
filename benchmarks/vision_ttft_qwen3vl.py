"""TTFT of a prompt with one image on a Qwen3-VL-2B-shape model (random weights, fp32): hearth against
transformers and llama.cpp (libmtmd through llama-cpp-python), and hearth again with the image in its encoder cache
and with the prompt in its prefix cache.

    python benchmarks/vision_ttft_qwen3vl.py [--size 448] [--threads 1] [--repeats 3] [--layers 28]
        [--engines transformers,hearth,llama.cpp] [--folder DIR] [--out benchmarks/results/vision-ttft-qwen3vl]

The model: Qwen3-VL-2B-Instruct's shapes (a ViT 1024 wide, 24 layers, 16 heads, patches of 16 merged 2 x 2,
deepstack from layers 5, 11 and 17; a qwen3 text model 2048 wide, 28 layers (--layers fewer), 16 heads of 128,
8 KV heads, MLP 6144, vocabulary 151,936, tied embeddings, M-RoPE sections 24, 20, 20) and its processor's (a
448 x 448 image stays 448 x 448: 28 x 28 patches, 196 tokens). The folder (bf16 shards, made once at --folder)
is loaded in fp32 by transformers and hearth; llama.cpp runs the F32 text GGUF and mmproj that `hearth convert
--type f32 --mmproj` writes from it once (F32 KV cache, flash attention off in the text model and the encoder: its
CPU kernel rounds K and V to F16), as tests/llama_mtmd.py drives it.

Each engine runs in a process of its own, one at a time (two 8.5 GB fp32 copies would not fit beside other
work), transformers, hearth, llama.cpp, --repeats rounds: interleaved. In each process a small image first
(warm-up, not counted), then a fresh image each round. TTFT: from the request to its first token, the processor's
work included (transformers: processor, then generate with max_new_tokens=1; llama.cpp: mtmd_tokenize, which
preprocesses the image, mtmd_helper_eval_chunks, which encodes it and prefills, and the first token's argmax), as
wall seconds and as the process's CPU seconds (time.process_time: at 1 thread, the work done, less disturbed by
other processes on a loaded machine). hearth's three cases: a cold image; the same image after other text (its
encoding from the encoder cache, the prefix cache missing from the first token); the same prompt again (prefix
cache too). The load average is read before each process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from common import REPO, machine, machine_markdown, set_threads, table, write_results

# Qwen3-VL-2B-Instruct's config.json (its text model Qwen3-1.7B's widths)
TEXT = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=262144,
            rms_norm_eps=1e-6, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                             "mrope_interleaved": True})
VISION = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, patch_size=16, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=2048, num_position_embeddings=2304,
              deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh")
GGUF = ("text-f32.gguf", "mmproj-f32.gguf")  # llama.cpp's files, written from the folder once
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = "<|im_start|>user\n{}" + IMAGE + "What is in this image?<|im_end|>\n<|im_start|>assistant\n"
ENGINES = ("transformers", "hearth", "llama.cpp")
CASES = ("transformers", "llama.cpp", "hearth, cold image", "hearth, image in the encoder cache",
         "hearth, same prompt again (prefix cache)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=448, help="the image's width and height")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=28, help="the text model's layers (Qwen3-VL-2B's: 28)")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help="which engines run (llama.cpp: llama-cpp-python with its libmtmd)")
    parser.add_argument("--folder", default="/tmp/hearth-bench-qwen3-vl-2b")
    parser.add_argument("--out", default=None)
    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)  # (one process's)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = Path(args.folder) / f"{args.layers}-layers"
    if args.engine:
        set_threads(args.threads)
        print(json.dumps(_measure(args.engine, folder, args.size, args.round, args.threads)), flush=True)
        return
    engines = args.engines.split(",")
    if not set(engines) <= set(ENGINES):
        parser.error(f"--engines: of {', '.join(ENGINES)}")
    if not (folder / "config.json").exists():
        _make_model(folder, args.layers)
    if "llama.cpp" in engines and not (folder / GGUF[1]).exists():
        subprocess.run([sys.executable, "-m", "hearth.cli", "convert", str(folder), str(folder / GGUF[0]), "--type",
                        "f32", "--mmproj", str(folder / GGUF[1])], env=_environment(args.threads), check=True)
    results: dict[str, list[dict]] = {}
    info, loads = machine(), []
    for repeat in range(args.repeats):
        for engine in engines:
            loads.append(os.getloadavg()[0])
            done = subprocess.run([sys.executable, __file__, "--engine", engine, "--round", str(repeat), "--size",
                                   str(args.size), "--threads", str(args.threads), "--layers", str(args.layers),
                                   "--folder", args.folder], env=_environment(args.threads), capture_output=True,
                                  text=True, check=True)
            for case, times in json.loads(done.stdout.strip().splitlines()[-1]).items():
                results.setdefault(case, []).append(times)
                tokens = f", {times['image_tokens']} image tokens" if "image_tokens" in times else ""
                print(f"round {repeat}, {case}: {times['wall']:.2f} s wall, {times['cpu']:.2f} s CPU{tokens}, load "
                      f"average {loads[-1]:.2f}", flush=True)
    info["threads"] = args.threads
    _report(args, results, info, loads)


def _environment(threads: int) -> dict[str, str]:
    # this worktree's hearth first, then what PYTHONPATH held (llama-cpp-python where it is not installed)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": path}


def _report(args: argparse.Namespace, results: dict[str, list[dict]], info: dict, loads: list[float]) -> None:
    rows = [[case, *(f"{statistics.median(t[clock] for t in results[case]):.2f}" for clock in ("cpu", "wall")),
             ", ".join(f"{t['cpu']:.2f}" for t in results[case])] for case in CASES if case in results]
    depth = "" if args.layers == 28 else f" (the text model at {args.layers} of its 28 layers)"
    markdown = (f"TTFT, one {args.size}x{args.size} image, Qwen3-VL-2B shape{depth}, fp32, {args.threads} thread(s), "
                f"median of {args.repeats} interleaved runs\n\n"
                + table(["", "median CPU s", "median wall s", "runs, CPU s"], rows) + "\n\n" + machine_markdown(info)
                + f"\n- load average (1 min) before each process: {min(loads):.2f} to {max(loads):.2f}")
    print(markdown)
    write_results(args.out, markdown, {"results": results, "machine": info, "size": args.size, "layers": args.layers,
                                       "load_averages": loads})


def _make_model(folder: Path, layers: int) -> None:
    """The random Qwen3-VL-2B-shape folder: bf16 shards, the tokenizer with Qwen's vision tokens, the processor's
    settings (Qwen3-VL-2B-Instruct's preprocessor_config.json)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    sys.path.insert(0, str(REPO / "tests"))
    from models import QWEN_VL_SPECIAL, make_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    make_tokenizer(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VL_SPECIAL})
    tokenizer.save_pretrained(folder)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_VL_SPECIAL}
    config = transformers.Qwen3VLConfig(
        text_config={**TEXT, "num_hidden_layers": layers}, vision_config=VISION, tie_word_embeddings=True,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # (half the memory while it is made)
    model = transformers.Qwen3VLForConditionalGeneration(config)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                             size={"shortest_edge": 65536, "longest_edge": 16777216},
                             image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(folder)


def _measure(engine: str, folder: Path, size: int, round_: int, threads: int) -> dict[str, dict[str, float]]:
    """One process's runs: a warm-up with a small image, then the round's cases, {case: {wall, cpu}}."""
    from PIL import Image

    rng = np.random.default_rng(round_ + 1)  # another image each round: a cold encoder cache
    image = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    small = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    ttft = {"transformers": _transformers, "hearth": _hearth, "llama.cpp": _llama_cpp}[engine](folder, threads)
    ttft(small, PROMPT.format("warm up "))
    if engine != "hearth":
        return {engine: ttft(image, PROMPT.format(f"run {round_} "))}
    return {"hearth, cold image": ttft(image, PROMPT.format(f"run {round_} ")),
            "hearth, image in the encoder cache": ttft(image, PROMPT.format(f"again {round_} ")),
            "hearth, same prompt again (prefix cache)": ttft(image, PROMPT.format(f"again {round_} "))}


def _clock(run) -> dict[str, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}


def _transformers(folder: Path, threads: int):
    import transformers

    sys.path.insert(0, str(REPO / "tests"))
    from models import qwen_vl_processor

    processor = qwen_vl_processor(folder)
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()

    def ttft(image, text: str) -> dict[str, float]:
        def run():
            inputs = processor(text=[text], images=[image], return_tensors="pt")
            with torch.no_grad():
                model.generate(**inputs, max_new_tokens=1, do_sample=False)

        return _clock(run)

    return ttft


def _hearth(folder: Path, threads: int):
    from hearth import LLM, SamplingParams

    llm = LLM(str(folder), progress=False, dtype="float32", kv_cache_memory=1 << 30)
    params = SamplingParams(max_tokens=1, temperature=0)

    def ttft(image, text: str) -> dict[str, float]:
        return _clock(lambda: llm.generate({"prompt": text, "multi_modal_data": {"image": [image]}}, params,
                                           use_tqdm=False))

    return ttft


def _llama_cpp(folder: Path, threads: int):
    import llama_cpp
    from llama_cpp import mtmd_cpp

    sys.path.insert(0, str(REPO / "tests"))
    from llama_mtmd import MARKER, MtmdRunner

    runner = MtmdRunner(mtmd_cpp, llama_cpp, str(folder / GGUF[0]), str(folder / GGUF[1]), threads)
    image_token_id = json.loads((folder / "config.json").read_text())["image_token_id"]

    def ttft(image, text: str) -> dict[str, float]:
        ids = []

        def run():
            ids.extend(runner.prefill(text.replace(IMAGE, MARKER), image, image_token_id))
            runner.logits().argmax()

        # the image's tokens as mtmd's preprocessing made them (as the others': 196 at 448 x 448)
        return {**_clock(run), "image_tokens": ids.count(image_token_id)}

    return ttft


if __name__ == "__main__":
    main()
