"""`hearth bench throughput`: offline throughput of many requests given to the engine at once.

Prompts are N random token-id prompts of --input-len tokens, or the prompts of a dataset file
(a text file with one prompt per line, or JSON lines with "prompt" and optionally
"output_len"). Every request generates exactly its output length (ignore_eos).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from hearth.bench.latency import format_spec_decode, random_prompts, spec_decode_report
from hearth.errors import HearthError
from hearth.sampling_params import SamplingParams


def read_dataset(path: str | Path, num_prompts: int | None = None) -> list[tuple[str, int | None]]:
    """(prompt text, output length or None) per entry of a text or JSON-lines file."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise HearthError(f"{path}: cannot read: {e.strerror}") from None
    entries: list[tuple[str, int | None]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                item = json.loads(line)
                entries.append((str(item["prompt"]), item.get("output_len")))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise HearthError(f"{path}:{number}: expected a JSON object with a \"prompt\"") from None
        else:
            entries.append((line.replace("\\n", "\n"), None))
    if not entries:
        raise HearthError(f"{path}: no prompts")
    if num_prompts is not None:
        entries = [entries[i % len(entries)] for i in range(num_prompts)]
    return entries


def run_throughput(llm, num_prompts: int, input_len: int, output_len: int, dataset: str | Path | None = None,
                   seed: int = 0, progress: bool = True) -> dict:
    """Generate every request to completion in one `generate` call; requests/s and tokens/s."""
    if num_prompts < 1 or output_len < 1 or (dataset is None and input_len < 1):
        raise ValueError("number of prompts, input length and output length must be at least 1")
    engine = llm.engine
    if dataset is not None:
        entries = read_dataset(dataset, num_prompts)
        prompts = [text for text, _ in entries]
        params = [SamplingParams(temperature=0, max_tokens=out or output_len, ignore_eos=True) for _, out in entries]
    else:
        prompts = random_prompts(num_prompts, input_len, engine.model_config.vocab_size, random.Random(seed))
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    spec_before = engine.spec_decode_totals.copy()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    ttft = sorted(o.metrics.time_to_first_token for o in outputs if o.metrics and o.metrics.time_to_first_token is not None)
    return {
        "model": str(engine.model_path),
        "num_prompts": len(prompts),
        "input_len": None if dataset is not None else input_len,
        "output_len": output_len,
        "dataset": None if dataset is None else str(dataset),
        "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "device": str(engine.device),
        "elapsed_s": elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": len(prompts) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "median_ttft_s": ttft[len(ttft) // 2] if ttft else None,
        **spec_decode_report(engine, spec_before),
    }


def format_throughput(r: dict) -> str:
    source = r["dataset"] or f"{r['num_prompts']} random prompts of {r['input_len']} tokens"
    return "\n".join([
        f"model {r['model']}  {source}, {r['output_len']} output tokens each  "
        f"({r['dtype']} on {r['device']}, max {r['max_num_seqs']} sequences)",
        f"{'elapsed':<16} {r['elapsed_s']:>10.2f} s",
        f"{'requests':<16} {r['requests_per_s']:>10.3f} req/s",
        f"{'output tokens':<16} {r['output_tokens_per_s']:>10.2f} tok/s ({r['output_tokens']} tokens)",
        f"{'total tokens':<16} {r['total_tokens_per_s']:>10.2f} tok/s ({r['prompt_tokens']} prompt tokens)",
        *format_spec_decode(r),
    ])
