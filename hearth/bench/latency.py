"""`hearth bench latency`: prefill and decode tokens/s of one batch, median / min / max over runs.

A run adds B prompts of N random token ids at once and steps the engine until each has M
new tokens (ignore_eos). The prefill phase lasts until every request has its first token;
the decode phase is the rest. Fresh random prompts each run, so prefix caching never helps.
"""

from __future__ import annotations

import random
import statistics
import time

from hearth.sampling_params import SamplingParams


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def random_prompts(count: int, length: int, vocab_size: int, rng: random.Random) -> list[list[int]]:
    """Token-id prompts; the first token differs between prompts so no prefix is shared."""
    prompts = []
    firsts = rng.sample(range(vocab_size), count) if count <= vocab_size else [rng.randrange(vocab_size) for _ in range(count)]
    for first in firsts:
        prompts.append([first] + [rng.randrange(vocab_size) for _ in range(length - 1)])
    return prompts


def one_run(engine, prompts: list[list[int]], output_len: int, clock=time.perf_counter) -> dict:
    """Step the engine over one batch; times of the prefill and decode phases (by `clock`:
    time.process_time counts CPU seconds, what a 1-thread run on a shared machine can compare)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = clock()
    ids = [engine.add_request(None, p, params) for p in prompts]
    first: dict[str, float] = {}
    generated = 0
    generated_at_prefill_end = 0
    prefill_end = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = clock()
        generated += engine.last_step.num_generated
        for out in outputs:
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = now
        if prefill_end is None and len(first) == len(ids):
            prefill_end = now
            generated_at_prefill_end = generated
    end = clock()
    prompt_tokens = sum(len(p) for p in prompts)
    prefill_s = prefill_end - start
    decode_s = end - prefill_end
    decode_tokens = generated - generated_at_prefill_end
    return {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "latency_s": end - start,
        "prefill_tokens_per_s": prompt_tokens / prefill_s,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_tokens and decode_s > 0 else 0.0,
        "ttft_s": statistics.median(t - start for t in first.values()),
        "output_tokens": generated,
    }


def run_latency(llm, batch_size: int, input_len: int, output_len: int, runs: int = 3, warmup: int = 1,
                seed: int = 0, progress: bool = True) -> dict:
    """Latency figures of `llm` (a hearth LLM): prefill and decode tokens/s over `runs` runs."""
    from tqdm import tqdm

    from hearth.bench.roofline import model_weight_bytes, step_cost

    if batch_size < 1 or input_len < 1 or output_len < 1 or runs < 1 or warmup < 0:
        raise ValueError("batch size, input length, output length and runs must be at least 1 (warmup at least 0)")
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    rng = random.Random(seed)
    for _ in range(warmup):
        one_run(engine, random_prompts(batch_size, input_len, vocab, rng), output_len)
    results = []
    spec_before = engine.spec_decode_totals.copy()
    for _ in tqdm(range(runs), desc="runs", unit="run", disable=not progress, leave=False):
        results.append(one_run(engine, random_prompts(batch_size, input_len, vocab, rng), output_len))
    keys = ("prefill_tokens_per_s", "decode_tokens_per_s", "latency_s", "prefill_s", "decode_s", "ttft_s")
    report = {
        "model": str(engine.model_path),
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        "runs": runs,
        "warmup": warmup,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "device": str(engine.device),
        "threads": _threads(),
        **{k: summary([r[k] for r in results]) for k in keys},
        "per_run": results,
        **spec_decode_report(engine, spec_before),
    }
    # what a decode step reads (weights as held in memory + the KV cache at the mid context), at the measured rate
    weights = model_weight_bytes(engine.model)
    mid_context = input_len + output_len // 2
    cost = step_cost(engine.model_config, weights, "decode", batch_size, mid_context, engine.dtype.itemsize)
    decode_steps_per_s = report["decode_tokens_per_s"]["median"] / batch_size
    report["weight_bytes_per_step"] = weights.per_step
    report["decode_gb_per_s"] = cost.bytes * decode_steps_per_s / 1e9
    return report


def spec_decode_report(engine, before) -> dict:
    """The speculative-decoding counts of the measured runs (none without speculation)."""
    if engine.config.speculative.method is None:
        return {}
    counts = engine.spec_decode_totals.since(before)
    return {"speculative_method": engine.config.speculative.method, "spec_decode": {
        "num_drafts": counts.num_drafts, "num_draft_tokens": counts.num_draft_tokens,
        "num_accepted_tokens": counts.num_accepted_tokens, "accepted_per_position": counts.accepted_per_position,
        "acceptance_rate": counts.acceptance_rate, "summary": counts.summary()}}


def format_spec_decode(r: dict) -> list[str]:
    return [f"{'speculation':<18} {r['speculative_method']}: {r['spec_decode']['summary']}"] if "spec_decode" in r else []


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def format_latency(r: dict) -> str:
    def line(name: str, key: str, unit: str, scale: float = 1.0) -> str:
        s = r[key]
        return f"{name:<18} {s['median'] * scale:>10.2f} {unit:<6} (min {s['min'] * scale:.2f}, max {s['max'] * scale:.2f})"

    return "\n".join([
        f"model {r['model']}  batch {r['batch_size']}  input {r['input_len']}  output {r['output_len']}  "
        f"{r['dtype']} on {r['device']}, {r['threads']} threads, {r['runs']} runs after {r['warmup']} warm-up",
        line("prefill", "prefill_tokens_per_s", "tok/s"),
        line("decode", "decode_tokens_per_s", "tok/s"),
        line("time to 1st token", "ttft_s", "ms", 1000),
        line("latency", "latency_s", "s"),
        f"{'decode bandwidth':<18} {r['decode_gb_per_s']:>10.2f} GB/s   (weights {r['weight_bytes_per_step'] / 1e9:.3f} GB + KV per step)",
        *format_spec_decode(r),
    ])
