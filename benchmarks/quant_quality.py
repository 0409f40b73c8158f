#!/usr/bin/env python
"""What quantization costs in quality, hearth's quantizer beside llama.cpp's: perplexity and the mean KL
divergence from the original model (`hearth perplexity --kl-divergence`) on held-out text, per mix, plain,
with an importance matrix (`hearth imatrix`, the same file given to both quantizers) and with AWQ's scales
(`hearth quantize --awq`, hearth only: llama.cpp's quantizer has none).

    python benchmarks/quant_quality.py --original smollm2-f32.gguf --mixes q4_k_m,q3_k_m,iq2_xs \\
        --out benchmarks/results/quant-quality-smollm2

The original must be F32/F16/BF16 (SmolLM2's: `benchmarks/requantize.py ... --type f32` of the Q4_1 file in
../shared/data, the only SmolLM2 weights there). Calibration: the first halves of the two texts beside SmolLM2
in ../shared/data (the Apache license and a Python source); scored: their second halves, in windows of --ctx.
Every file is scored by hearth's cpu backend (so llama.cpp's files are judged by the same arithmetic).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, UNIFORM_IMATRIX_TYPES, llama_cpp_quantize, table, write_results

TEXTS = REPO.parent / "shared" / "data" / "models" / "smollm2-135m-instruct"


def split_texts(tokenizer) -> tuple[list[int], list[int]]:
    """(calibration, held-out) token ids: the first and second halves of each text."""
    halves = [tokenizer.encode((TEXTS / name).read_text(), add_special_tokens=False)
              for name in ("text-apache-2.0.txt", "text-json-decoder.py.txt")]
    return [t for ids in halves for t in ids[:len(ids) // 2]], [t for ids in halves for t in ids[len(ids) // 2:]]


def make_files(original: Path, mix: str, work: Path, calibration: Path, imatrix_file: Path, ctx: int) -> dict:
    """{way: GGUF path} for one mix: hearth plain / imatrix / AWQ, llama.cpp plain / imatrix; the mixes both
    quantizers write only with an importance matrix (IQ2_XS...) with it alone, AWQ's too. How long each
    of hearth's took is printed."""
    from hearth.cli import main as hearth
    from hearth.loading.imatrix_file import read_imatrix

    importance = read_imatrix(imatrix_file)
    needs_imatrix = mix in UNIFORM_IMATRIX_TYPES
    awq = ["--type", mix, "--awq", str(calibration), "--awq-ctx", str(ctx)]
    jobs = {"hearth + imatrix": ["--type", mix, "--imatrix", str(imatrix_file)]}
    if needs_imatrix:
        jobs["hearth + AWQ + imatrix"] = [*awq, "--imatrix", str(imatrix_file)]
    else:
        jobs = {"hearth": ["--type", mix], **jobs, "hearth + AWQ": awq}
    files = {}
    for way, options in jobs.items():
        files[way] = work / f"{mix}-{way.replace(' + ', '-').replace(' ', '-')}.gguf"
        start = time.perf_counter()
        if hearth(["quantize", str(original), str(files[way]), *options]) != 0:
            raise SystemExit(f"hearth quantize {mix} ({way}) failed")
        print(f"{mix} {way}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if not needs_imatrix:
        files["llama.cpp"] = Path(llama_cpp_quantize(str(original), str(work / f"{mix}-llamacpp.gguf"), mix))
    files["llama.cpp + imatrix"] = Path(llama_cpp_quantize(str(original), str(work / f"{mix}-llamacpp-imatrix.gguf"),
                                                          mix, importance))
    return files


def load_cpu(path: Path):
    """The model at `path` on hearth's cpu backend, float32."""
    import torch

    from hearth.backend import choose_backend
    from hearth.loading.loader import load_model

    cpu = torch.device("cpu")
    return load_model(path, torch.float32, cpu, progress=False, backend=choose_backend(cpu, torch.float32, "auto"))


def score(path: Path, reference, held_out: list[int], ctx: int) -> dict:
    import torch

    from hearth.perplexity import perplexity

    result = perplexity(load_cpu(path).model, held_out, ctx, torch.device("cpu"), reference=reference)
    return {**result, "bytes": path.stat().st_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--original", required=True, help="the F32/F16/BF16 GGUF the mixes are made from")
    ap.add_argument("--mixes", default="q4_k_m,q3_k_m,iq2_xs")
    ap.add_argument("--ctx", type=int, default=128, help="window of the scoring and of the calibration chunks")
    ap.add_argument("--work", default=None, help="where the files go (default: a temporary folder)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from hearth.cli import main as hearth

    original = load_cpu(Path(args.original))
    calibration_ids, held_out = split_texts(original.tokenizer)
    work = Path(args.work or tempfile.mkdtemp(prefix="quant-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    calibration = work / "calibration.txt"
    calibration.write_text(original.tokenizer.decode(calibration_ids))
    imatrix_file = work / "imatrix.gguf"
    if hearth(["imatrix", args.original, "--text-file", str(calibration), "-o", str(imatrix_file),
               "--ctx", str(args.ctx)]) != 0:
        raise SystemExit("hearth imatrix failed")
    base = score(Path(args.original), original.model, held_out, args.ctx)
    rows, data = [["original", "", f"{base['perplexity']:.3f}", "0", "100%", f"{base['bytes'] / 1e6:.1f}"]], {}
    for mix in args.mixes.split(","):
        for way, path in make_files(Path(args.original), mix, work, calibration, imatrix_file, args.ctx).items():
            result = score(path, original.model, held_out, args.ctx)
            data[f"{mix} {way}"] = result
            rows.append([mix, way, f"{result['perplexity']:.3f}", f"{result['kld']:.4f}",
                         f"{100 * result['same_top']:.1f}%", f"{result['bytes'] / 1e6:.1f}"])
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    markdown = "\n".join([
        f"### Quantization quality: {Path(args.original).name}, {base['tokens']} held-out tokens, windows of {args.ctx}",
        "", table(["mix", "quantizer", "perplexity", "KL divergence", "same top token", "MB"], rows)])
    print(markdown)
    write_results(args.out, markdown, {"original": base, "files": data, "ctx": args.ctx})


if __name__ == "__main__":
    main()
