"""The `hearth roofline` report: the roofline's rows (roofline.py's cost model) for a model file on
this machine and, with --measure, hearth's own tokens/s beside them, measured by the latency bench.
"""

from __future__ import annotations

from hearth.bench.latency import run_latency
from hearth.bench.roofline import (file_weight_bytes, machine_dict, measure_machine, model_weight_bytes, roofline_row,
                                   roofline_table, step_cost)


def run_roofline(model_path, batch_sizes: list[int], context: int, dtype: str = "auto", device: str = "auto",
                 measure: bool = False, measure_tokens: int = 8, runs: int = 1, engine_kwargs: dict | None = None,
                 progress: bool = True) -> dict:
    """The `hearth roofline` report: machine, model bytes, a row per phase and batch size;
    with measure, hearth's measured tokens/s and its share of the ceiling."""
    from hearth.default_model import resolve_model
    from hearth.engine.memory import choose_device, choose_dtype
    from hearth.kv_format import kv_bytes_per_element
    from hearth.loading.loader import read_model

    model_path = resolve_model(model_path)
    dev = choose_device(device)
    torch_dtype = choose_dtype(dtype, dev)
    config, weights, _ = read_model(model_path, progress=False)
    stored = file_weight_bytes(config, weights)
    del weights
    machine = measure_machine(dev, torch_dtype)
    kv_element = kv_bytes_per_element((engine_kwargs or {}).get("kv_cache_dtype", "auto"), torch_dtype.itemsize)
    rows = roofline_table(config, stored, machine, batch_sizes, context, kv_element)
    report = {
        "model": str(model_path),
        "architecture": config.architecture,
        "machine": machine_dict(machine),
        "context": context,
        "kv_bytes_per_element": kv_element,
        "weight_bytes_per_step": stored.per_step,
        "weights": "as stored in the file",
        "rows": rows,
    }
    if measure:
        from hearth.llm import LLM

        longest = max(batch_sizes)
        llm = LLM(model_path, dtype=dtype, device=device, progress=progress,
                  **{"max_num_seqs": max(longest, 1), **(engine_kwargs or {})})
        loaded = model_weight_bytes(llm.engine.model)
        report["loaded_weight_bytes_per_step"] = loaded.per_step
        run_latency(llm, 1, min(context, 16), 2, runs=1, warmup=0, progress=False)  # warm-up, once
        for b in batch_sizes:
            result = run_latency(llm, b, context, measure_tokens + 1, runs=runs, warmup=0, progress=False)
            for row in rows:
                if row["batch_size"] != b:
                    continue
                measured = result[f"{row['phase']}_tokens_per_s"]["median"]
                # the ceiling for the weights as hearth holds them (e.g. dequantized to float32)
                as_loaded = roofline_row(step_cost(config, loaded, row["phase"], b, context, kv_element), machine)
                row["measured_tokens_per_s"] = measured
                row["share_of_ceiling"] = measured / row["ceiling_tokens_per_s"]
                row["loaded_ceiling_tokens_per_s"] = as_loaded["ceiling_tokens_per_s"]
                row["share_of_loaded_ceiling"] = measured / as_loaded["ceiling_tokens_per_s"]
                steps_per_s = measured / as_loaded["tokens_per_step"]
                row["measured_gb_per_s"] = as_loaded["bytes_per_step"] * steps_per_s / 1e9
                row["measured_gflop_per_s"] = as_loaded["flops_per_step"] * steps_per_s / 1e9
    return report
