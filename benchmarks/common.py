"""Shared by the side-by-side benchmark scripts: the machine and versions, model paths, timing, tables."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODELS_DIR = Path(os.environ.get("HEARTH_BENCH_MODELS", Path.home() / ".cache" / "hearth" / "bench-models"))


# llama.cpp's own quantization mixes, made from the f16 file by llama.cpp's `llama_model_quantize`
# (what its llama-quantize tool runs: Q4_K_M mixes Q4_K and Q6_K tensors, and so on)
LLAMA_CPP_TYPES = {"q2_k": "Q2_K", "q3_k_m": "Q3_K_M", "q4_k_s": "Q4_K_S", "q4_k_m": "Q4_K_M", "q5_k_s": "Q5_K_S",
                   "q5_k_m": "Q5_K_M", "q6_k": "Q6_K", "iq4_xs": "IQ4_XS", "iq3_m": "IQ3_M", "iq3_s": "IQ3_S",
                   "iq3_xxs": "IQ3_XXS", "iq2_m": "IQ2_M", "iq2_xs": "IQ2_XS", "iq2_xxs": "IQ2_XXS", "iq1_s": "IQ1_S",
                   "iq1_m": "IQ1_M"}
# of those, the mixes llama.cpp writes only with an importance matrix: given one of ones (every column
# alike: these random weights have no important columns, and the files are for timing)
UNIFORM_IMATRIX_TYPES = ("iq3_xxs", "iq2_m", "iq2_xs", "iq2_xxs", "iq1_s", "iq1_m")


def bench_model(arch: str, gguf_types=("f16", "q8_0", "q4_0")) -> dict:
    """Paths of the random benchmark model `arch` (made on first use: `hearth bench make-model`,
    then llama.cpp's quantizer for LLAMA_CPP_TYPES)."""
    from hearth.bench.models import make_model

    ours = [t for t in gguf_types if t not in LLAMA_CPP_TYPES]
    theirs = [t for t in gguf_types if t in LLAMA_CPP_TYPES]
    files = make_model(arch, MODELS_DIR / arch, ours + (["f16"] if theirs and "f16" not in ours else []),
                       progress=True)["files"]
    for kind in theirs:
        files[kind] = llama_cpp_quantize(files["f16"], str(MODELS_DIR / arch / f"{arch}-{kind}.gguf"), kind)
    return files


def llama_cpp_quantize(source: str, target: str, kind: str, imatrix: dict | None = None) -> str:
    """`target`, written from `source` by llama.cpp's quantizer as llama-quantize SOURCE TARGET
    {LLAMA_CPP_TYPES[kind]} would (kept if it exists); with `imatrix` (importance by tensor name, as
    hearth.loading.imatrix_file.read_imatrix gives it) as with --imatrix, else for the mixes llama.cpp
    writes only with one a uniform one."""
    if Path(target).exists():
        return target
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{LLAMA_CPP_TYPES[kind]}")
    params.nthread = os.cpu_count() or 1
    if imatrix is None and kind in UNIFORM_IMATRIX_TYPES:
        imatrix = uniform_imatrix(source)
    if imatrix is not None:
        entries = llama_cpp_imatrix(llama_cpp, imatrix)
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    print(f"llama.cpp quantizing {source} to {LLAMA_CPP_TYPES[kind]}", file=sys.stderr)
    if llama_cpp.llama_model_quantize(source.encode(), target.encode(), params) != 0:
        Path(target).unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not quantize {source} to {kind}")
    return target


def uniform_imatrix(source: str) -> dict:
    """Importance of ones for every column of every matrix of `source`."""
    import gguf
    import numpy as np

    return {t.name: np.ones(int(t.shape[0]), dtype=np.float32) for t in gguf.GGUFReader(source).tensors
            if len(t.shape) >= 2}


def llama_cpp_imatrix(llama_cpp, importance: dict):
    """llama.cpp's importance entries (a null-terminated array, as llama-quantize passes what it read)
    of `importance` (tensor name -> float32 per column); the arrays stay alive with the returned array."""
    import numpy as np

    entries = (llama_cpp.llama_model_imatrix_data * (len(importance) + 1))()
    entries._arrays = [np.ascontiguousarray(values, dtype=np.float32) for values in importance.values()]
    for entry, name, values in zip(entries, importance, entries._arrays):
        entry.name, entry.data, entry.size = name.encode(), values.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), len(values)
    return entries


def tiny_model() -> tuple[str, str, str]:
    """(GGUF path, HF folder, description) of the tiny model: hearth's built-in model when it exists
    (with an HF copy for transformers), else a random model of its shape (hearth-tiny)."""
    from hearth.default_model import builtin_model_path

    default = builtin_model_path()
    if default.exists():
        folder = gguf_to_hf(default, MODELS_DIR / "default-hf")
        return str(default), str(folder), "hearth's built-in model (default.gguf)"
    files = bench_model("hearth-tiny", ("f16",))
    return files["f16"], files["hf"], "hearth-tiny (random weights, the built-in model's shape), f16 GGUF"


_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM"}


def gguf_to_hf(gguf: str | Path, folder: str | Path) -> Path:
    """An HF folder (config.json, float32 model.safetensors) with the weights of a GGUF file, for
    transformers (whose own GGUF reader needs accelerate). hearth's loader already gives HF names
    and HF's Q/K row order."""
    from safetensors.torch import save_file

    from hearth.loading.loader import read_model
    from hearth.quant import QuantTensor

    folder = Path(folder)
    weights_file = folder / "model.safetensors"
    if (folder / "config.json").exists() and weights_file.exists() and weights_file.stat().st_mtime > Path(gguf).stat().st_mtime:
        return folder  # made from this GGUF already
    config, weights, tokenizer = read_model(gguf, progress=False)
    tensors = {name: (w.dequantize() if isinstance(w, QuantTensor) else w.float()).contiguous()
               for name, w in weights.items() if name != "rope_freqs"}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    hf = {
        "architectures": [_HF_ARCHITECTURES[config.architecture]], "model_type": config.architecture,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling,
        "tie_word_embeddings": "lm_head.weight" not in weights, "hidden_act": config.hidden_act,
        "attention_bias": config.attention_bias, "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": (tokenizer.eos_token_ids or [None])[0], "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    return folder


def set_threads(count: int | None) -> None:
    """Every engine in the script uses `count` threads (torch's intra-op pool; llama.cpp's n_threads)."""
    if count:
        import torch

        torch.set_num_threads(count)


def threads() -> int:
    import torch

    return torch.get_num_threads()


def vector_isa(flags: list[str]) -> str:
    """The vector instructions the kernels build for, as the figures' machine kinds are told apart: "AVX-512
    (VNNI, BF16)", "AVX2", ... (a ratio from one kind does not carry to another)."""
    if "avx512f" not in flags:
        return "AVX2" if "avx2" in flags else "no AVX2"
    extras = [name for flag, name in (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16")) if flag in flags]
    return "AVX-512" + (f" ({', '.join(extras)})" if extras else "")


def machine() -> dict:
    """CPU model, cores, memory, and the versions of everything measured."""
    info = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
        info["cpu"] = fields.get("Model name", "?").strip()
        info["cpus"] = fields.get("CPU(s)", "?").strip()
        info["vector_isa"] = vector_isa(fields.get("Flags", "").split())
    except (OSError, subprocess.CalledProcessError):
        info["cpu"] = platform.processor()
    try:
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    import torch

    info["torch"] = torch.__version__
    info["threads"] = torch.get_num_threads()
    from importlib.metadata import PackageNotFoundError, version

    for key, dist in (("transformers", "transformers"), ("llama_cpp", "llama_cpp_python"), ("gguf", "gguf")):
        try:
            info[key] = version(dist)
        except PackageNotFoundError:  # not installed: the table says so
            info[key] = None
    try:
        with open("/proc/loadavg") as f:
            info["load_average"] = f.read().split()[:3]
    except OSError:
        pass
    try:
        info["hearth_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                               text=True).stdout.strip()
    except OSError:
        info["hearth_commit"] = None
    return info


def machine_markdown(info: dict) -> str:
    return (f"- machine: {info.get('cpu')} with {info.get('vector_isa', '?')}, {info.get('cpus')} CPUs, "
            f"{info.get('memory_gib')} GiB; "
            f"{plural(info['threads'], 'thread')} for every engine; load average at the start "
            f"{' '.join(info.get('load_average', ['?']))} (the machine is shared)\n"
            f"- versions: Python {info['python']}, torch {info['torch']}, transformers {info['transformers']}, "
            f"llama-cpp-python {info['llama_cpp']}, gguf {info['gguf']}, hearth {info['hearth_commit']}")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved_medians(ways: dict, runs: int) -> dict[str, float]:
    """Seconds per call of each way (a function of no arguments), medians of `runs` rounds that call every way in
    turn, after one warm-up call each."""
    times = {name: [] for name in ways}
    for fn in ways.values():
        fn()
    for _ in range(runs):
        for name, fn in ways.items():
            times[name].append(timed(fn))
    return {name: median(t) for name, t in times.items()}


def write_interleaved_table(out: str | None, title: str, runs: int, header: list[str], rows: list[list],
                            data: list[dict]) -> None:
    """A one-layer kernel comparison's result files (interleaved_medians' figures): the title with the thread
    count, the command that ran, the machine, the table; `data` as the JSON's rows."""
    info = machine()
    command = "python " + shlex.join(sys.argv)
    markdown = "\n".join([f"### {title} ({threads()} threads)", "", f"`{command}` — medians of {runs} interleaved runs.",
                          "", machine_markdown(info), "", table(header, rows)])
    write_results(out, markdown, {"machine": info, "command": command, "rows": data})


def plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def median(values: list[float]) -> float:
    return statistics.median(values)


def free_memory() -> None:
    gc.collect()


def table(header: list[str], rows: list[list]) -> str:
    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:,.2f}" if abs(v) < 1000 else f"{v:,.0f}"
        return "–" if v is None else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(path: str | Path | None, markdown: str, data: dict) -> None:
    """Print the markdown; with a path, also write PATH.md and PATH.json."""
    print(markdown)
    if path:
        # PATH + suffix, not with_suffix: a name with a dot of its own (llamacpp-qwen3.5-0.8b-q8_0) keeps it whole
        base = str(path).removesuffix(".md").removesuffix(".json")
        Path(base).parent.mkdir(parents=True, exist_ok=True)
        Path(base + ".md").write_text(markdown + "\n")
        Path(base + ".json").write_text(json.dumps(data, indent=2) + "\n")


def decode_step_ms(model, context: int, batch: int, steps: int, clock=time.perf_counter,
                   kv_cache_dtype: str = "auto") -> float:
    """Median milliseconds (by `clock`) of a decode step of `batch` sequences at `context` random
    tokens, through hearth's ModelRunner on the CPU (the first 2 steps left out)."""
    import torch

    from hearth.engine.runner import BatchEntry, ModelRunner

    block = 16
    per_seq = -(-(context + steps + 1) // block)
    runner = ModelRunner(model, per_seq * batch, block, torch.device("cpu"), torch.float32,
                         kv_cache_dtype=kv_cache_dtype)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(batch)]
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    for s in range(batch):  # prefill the context
        runner.forward([BatchEntry(torch.randint(0, vocab, (context,), generator=g).tolist(), 0, tables[s])])
    times = []
    for step in range(steps):
        entries = [BatchEntry([int(torch.randint(0, vocab, (1,), generator=g))], context + step, tables[s])
                   for s in range(batch)]
        start = clock()
        runner.forward(entries)
        times.append(clock() - start)
    return median(times[2:]) * 1e3


@contextlib.contextmanager
def hearth_serve(model: str | None, options: list[str], source: Path = REPO):
    """`hearth serve MODEL OPTIONS` (served as "m", any free port) as a child process; yields its URL
    (without /v1), then stops it. model None: the options name the models (--model NAME=PATH).
    source: the hearth source tree it runs (another checkout: a before-and-after comparison)."""
    named = [model, "--served-model-name", "m"] if model is not None else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "hearth.cli", "serve", *named, "--port", "0", "--no-access-log", "--log-level",
         "warning", *options],
        cwd=source, env={**os.environ, "PYTHONPATH": str(source)}, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True)
    try:
        url = next((line.split()[1].removesuffix("/v1") for line in proc.stdout if line.startswith("listening")), None)
        if url is None:
            raise RuntimeError(f"the server did not start: hearth serve {model} {' '.join(options)}")
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def workload_parser(doc: str, num_prompts: int) -> argparse.ArgumentParser:
    """The options of a script comparing set-ups on one workload: [MODEL], runs, the requests, --out."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="default: the built-in model")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", default=None)
    return parser


def run_interleaved(setups: dict, measure, runs: int, metric: str) -> dict[str, list[dict]]:
    """measure(options) of every set-up, the set-ups alternating run by run; each run's report by set-up."""
    results = {name: [] for name in setups}
    for run in range(runs):
        for name, options in setups.items():
            results[name].append(measure(options))
            print(f"run {run + 1}: {name}: {metric} {results[name][-1][metric]:.1f}", file=sys.stderr)
    return results


def report_interleaved(results: dict[str, list[dict]], model: str, args, metric: tuple[str, str],
                       extra: tuple[str, str]) -> None:
    """Print (and with --out write) the medians of metric and extra, each (column, key), per set-up,
    with the ratio of metric to the first set-up's."""
    rows, base = [], None
    for name, runs in results.items():
        throughput = median([r[metric[1]] for r in runs])
        base = base or throughput
        rows.append([name, f"{throughput:.1f}", f"{median([r[extra[1]] for r in runs]):.1f}",
                     f"{throughput / base:.2f}x"])
    markdown = (f"{machine_markdown(machine())}\n\n{args.num_prompts} requests at once, {args.input_len} prompt / "
                f"{args.output_len} output tokens, {model}; medians of {args.runs} runs, interleaved\n\n"
                + table(["set-up", metric[0], extra[0], "ratio"], rows))
    write_results(args.out, markdown, {"model": model, "args": vars(args), "results": results})
