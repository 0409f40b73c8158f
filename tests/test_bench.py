"""The benchmark tools: each command on a tiny model (JSON keys and sane values), the roofline's
arithmetic against hand-computed bytes and FLOPs, the load generator against stand-in servers
(token counts, percentiles against numpy, Poisson arrivals), the benchmark-model generator.
No timing is asserted: timings belong in benchmarks."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hearth.bench import models as bench_models
from hearth.bench.roofline import Machine, file_weight_bytes, model_weight_bytes, roofline_row, step_cost
from hearth.bench.serve import (RequestResult, parse_goodput, percentile, poisson_arrivals, run_serve, summarize)
from hearth.cli import main
from hearth.config import ModelConfig

# A small qwen2-shaped spec (q/k/v biases, tied embeddings) and a llama3-rope one, for the generator.
TINY = dataclasses.replace(
    bench_models.ARCHS["qwen2.5-0.5b"], name="tiny-qwen2", vocab_size=1024, hidden_size=64, intermediate_size=128,
    num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=512, bos_token_id=1000, eos_token_id=1000,
    parameters=None)
TINY_LLAMA3 = dataclasses.replace(
    bench_models.ARCHS["llama-3.2-1b"], name="tiny-llama3", vocab_size=1024, hidden_size=64, intermediate_size=128,
    num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=512, bos_token_id=1000, eos_token_id=1001,
    parameters=None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """DIR/hf and DIR/tiny-qwen2-{f16,q8_0,q4_0}.gguf."""
    root = tmp_path_factory.mktemp("bench-model")
    report = bench_models.make_model(TINY, root, ["f16", "q8_0", "q4_0"], progress=False)
    return report["files"]


def run_cli(capsys, *argv) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


# ---------------------------------------------------------------- benchmark models

def test_architecture_shapes_have_the_published_parameter_counts():
    for spec in bench_models.ARCHS.values():
        if spec.parameters is not None:
            assert spec.num_parameters() == spec.parameters, spec.name
    assert {"tinyllama-1.1b", "llama-3.2-1b", "qwen2.5-0.5b", "gemma-2-2b", "gemma-3-1b"} <= set(bench_models.ARCHS)


@pytest.mark.parametrize("name,layers,published", [("qwen3-30b-a3b-4l", 48, 30_532_122_624),
                                                   ("mixtral-8x7b-2l", 32, 46_702_792_704)])
def test_reduced_depth_experts_have_the_published_layers(name, layers, published):
    """A reduced-depth mixture of experts, extended to the release's depth layer by layer, has the
    release's parameter count (Qwen3-30B-A3B, Mixtral-8x7B): each layer is the release's."""
    spec = bench_models.ARCHS[name]
    per_layer = spec.num_parameters() - dataclasses.replace(spec, num_layers=spec.num_layers - 1).num_parameters()
    assert spec.num_parameters() + (layers - spec.num_layers) * per_layer == published


@pytest.mark.parametrize("name", ["qwen3-30b-a3b-4l", "mixtral-8x7b-2l", "gemma-2-2b", "gemma-3-1b"])
def test_new_family_shapes_make_models_hearth_runs(name, tmp_path):
    """The families' specs, shrunk, written and converted: hearth loads the HF folder and the GGUF as
    the family (experts, local layers) and the two give the same greedy tokens."""
    from hearth import LLM, SamplingParams

    spec = dataclasses.replace(bench_models.ARCHS[name], vocab_size=1024, hidden_size=64, intermediate_size=64,
                               num_layers=2, num_heads=4, num_kv_heads=2, bos_token_id=1000, eos_token_id=1001,
                               parameters=None, extra={**bench_models.ARCHS[name].extra, "head_dim": 16})
    files = bench_models.make_model(spec, tmp_path, ["f32"], progress=False)["files"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = []
    for path in (files["hf"], files["f32"]):
        llm = LLM(path, kv_cache_memory=1 << 20, progress=False)
        config = llm.engine.model_config
        assert bool(config.num_experts) == name.startswith(("qwen3-30b", "mixtral"))
        assert (config.sliding_layers is not None) == name.startswith("gemma")
        outputs.append(llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 6


def test_recent_family_shapes(tmp_path):
    """Qwen3.5-0.8B's text model (0.75B parameters: the release's 0.8B less its vision tower) and gpt-oss-20b
    at full depth (20.9B) from their specs; shrunk, each runs in hearth as in transformers, and make-model
    writes gpt-oss's GGUF and says why it writes no GGUF where hearth's converter has none."""
    from hearth.loading.convert import GGUF_ARCHITECTURES
    from hearth.loading.loader import load_model
    from hearth.engine.runner import BatchEntry, ModelRunner
    from models import load_hf_reference

    def logits(path: str) -> torch.Tensor:
        model = load_model(path, progress=False).model
        runner = ModelRunner(model, 4, 16, torch.device("cpu"), torch.float32, num_state_slots=1)
        hidden, _ = runner.forward([BatchEntry(tokens, 0, [3, 1, 0, 2], state_slot=0)])
        return model.compute_logits(hidden).float()

    qwen, gpt_oss = bench_models.ARCHS["qwen3.5-0.8b"], bench_models.ARCHS["gpt-oss-20b-2l"]
    per_layer = gpt_oss.num_parameters() - dataclasses.replace(gpt_oss, num_layers=1).num_parameters()
    assert round(qwen.num_parameters() / 1e7) == 75 and round((gpt_oss.num_parameters() + 22 * per_layer) / 1e8) == 209
    small = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 64, "num_heads": 4, "num_kv_heads": 2,
             "bos_token_id": 1000, "eos_token_id": 1001}
    shrunk = [dataclasses.replace(qwen, **small, num_layers=4, extra={
                  **qwen.extra, "head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                  "linear_num_key_heads": 2, "linear_num_value_heads": 4}),
              dataclasses.replace(gpt_oss, **small, extra={**gpt_oss.extra, "head_dim": 16, "num_local_experts": 4,
                                                           "num_experts_per_tok": 2, "experts_per_token": 2})]
    tokens = list(range(5, 25))
    for spec, architecture in zip(shrunk, ("qwen3_5", "gpt_oss")):
        report = bench_models.make_model(spec, tmp_path / spec.name, ["f32"], progress=False)
        assert ("f32" in report["files"]) == (architecture in GGUF_ARCHITECTURES)
        assert ("gguf_skipped" in report) == (architecture not in GGUF_ARCHITECTURES)
        assert load_model(report["files"]["hf"], progress=False).config.architecture == architecture
        if architecture == "qwen3_5":  # (gpt-oss's experts are named per expert, as hearth reads them, not transformers)
            with torch.no_grad():
                want = load_hf_reference(Path(report["files"]["hf"]))(torch.tensor([tokens])).logits[0].float()
        else:
            want = logits(report["files"]["f32"])
        got = logits(report["files"]["hf"])
        assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-2, architecture


def test_generated_model_loads_as_hf_and_gguf(tiny):
    from hearth.loading.loader import read_model
    from hearth.quant import QuantTensor

    expected_types = {"f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0"}
    for kind, path in tiny.items():
        config, weights, tokenizer = read_model(path, progress=False)
        assert (config.architecture, config.vocab_size, config.hidden_size, config.num_layers) == ("qwen2", 1024, 64, 2)
        assert config.attention_bias and config.num_kv_heads == 2
        assert "lm_head.weight" not in weights  # tied, as Qwen2.5-0.5B
        assert tokenizer.eos_token_ids and TINY.eos_token_id in tokenizer.eos_token_ids
        assert sum(math.prod(tuple(w.shape)) for w in weights.values()) == TINY.num_parameters()
        q = weights["model.layers.0.self_attn.q_proj.weight"]
        if kind in expected_types:
            name = q.qtype.name if isinstance(q, QuantTensor) else "F16"
            assert name == expected_types[kind]
        # every id of the vocabulary decodes (random weights sample anywhere)
        assert isinstance(tokenizer.decode([0, 500, 1023]), str)


def test_llama3_shape_keeps_rope_scaling_and_special_ids(tmp_path):
    from hearth.loading.loader import read_model

    bench_models.write_hf_folder(TINY_LLAMA3, tmp_path, progress=False)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["rope_scaling"]["rope_type"] == "llama3" and hf["tie_word_embeddings"] is True
    config, _, tokenizer = read_model(tmp_path, progress=False)
    assert config.rope_scaling["factor"] == 32.0
    assert tokenizer.bos_token_id == 1000 and 1001 in tokenizer.eos_token_ids
    assert tokenizer.encode("hello")[0] == 1000  # adds BOS, as Llama 3 does


def test_make_model_command(tmp_path, capsys):
    out = run_cli(capsys, "bench", "make-model", "--arch", "hearth-tiny", "--out", str(tmp_path), "--gguf", "q8_0",
                  "--json")
    assert out["arch"] == "hearth-tiny" and set(out["files"]) == {"hf", "q8_0"}
    assert (tmp_path / "hf" / "config.json").exists() and (tmp_path / "hearth-tiny-q8_0.gguf").exists()


# ---------------------------------------------------------------- latency, throughput

def test_latency_json(tiny, capsys):
    r = run_cli(capsys, "bench", "latency", tiny["q8_0"], "--input-len", "20", "--output-len", "4",
                "--batch-size", "3", "--runs", "2", "--warmup", "1", "--json")
    assert (r["batch_size"], r["input_len"], r["output_len"], r["runs"]) == (3, 20, 4, 2)
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "latency_s", "ttft_s"):
        s = r[key]
        assert 0 < s["min"] <= s["median"] <= s["max"], key
    assert len(r["per_run"]) == 2
    assert all(run["output_tokens"] == 3 * 4 for run in r["per_run"])
    for run in r["per_run"]:  # the phases add up to the whole
        assert run["prefill_s"] + run["decode_s"] == pytest.approx(run["latency_s"], rel=1e-6)
    assert r["weight_bytes_per_step"] > 0 and r["decode_gb_per_s"] > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_latency_reports_speculation(tiny, capsys, method):
    """vLLM's spec_decode counts in the report; the draft is the model itself (every guess right)."""
    options = ["--prompt-lookup-min", "1"] if method == "ngram" else ["--speculative-model", str(tiny["q8_0"])]
    r = run_cli(capsys, "bench", "latency", tiny["q8_0"], "--input-len", "20", "--output-len", "6",
                "--batch-size", "2", "--runs", "1", "--warmup", "0", "--json", "--speculative-method", method,
                "--no-speculative-adaptive", *options)
    spec = r["spec_decode"]
    assert r["speculative_method"] == method and all(run["output_tokens"] == 2 * 6 for run in r["per_run"])
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] >= spec["num_accepted_tokens"] >= 0
    assert sum(spec["accepted_per_position"]) == spec["num_accepted_tokens"]
    assert spec["acceptance_rate"] == spec["num_accepted_tokens"] / spec["num_draft_tokens"]
    if method == "draft":
        assert spec["acceptance_rate"] == 1


def test_throughput_json_random_and_dataset(tiny, capsys, tmp_path):
    r = run_cli(capsys, "bench", "throughput", tiny["f16"], "--num-prompts", "6", "--input-len", "10",
                "--output-len", "5", "--max-num-seqs", "4", "--json")
    assert (r["num_prompts"], r["prompt_tokens"], r["output_tokens"]) == (6, 60, 30)
    assert r["max_num_seqs"] == 4
    assert r["output_tokens_per_s"] == pytest.approx(30 / r["elapsed_s"])
    assert r["total_tokens_per_s"] == pytest.approx(90 / r["elapsed_s"])
    assert r["requests_per_s"] == pytest.approx(6 / r["elapsed_s"])

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "hello there", "output_len": 3}\n{"prompt": "abc"}\n')
    r = run_cli(capsys, "bench", "throughput", tiny["hf"], "--num-prompts", "4", "--output-len", "2",
                "--dataset", str(data), "--json")
    assert r["num_prompts"] == 4 and r["output_tokens"] == 3 + 2 + 3 + 2


# ---------------------------------------------------------------- roofline

CONFIG = ModelConfig("llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16)


def _meta_weights(dtype=torch.float32) -> dict:
    """The HF tensors of CONFIG (untied), on the meta device: shapes and dtypes only."""
    shapes = {"model.embed_tokens.weight": (1000, 64), "model.norm.weight": (64,), "lm_head.weight": (1000, 64)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (64,), p + "post_attention_layernorm.weight": (64,),
                       p + "self_attn.q_proj.weight": (64, 64), p + "self_attn.k_proj.weight": (32, 64),
                       p + "self_attn.v_proj.weight": (32, 64), p + "self_attn.o_proj.weight": (64, 64),
                       p + "mlp.gate_proj.weight": (128, 64), p + "mlp.up_proj.weight": (128, 64),
                       p + "mlp.down_proj.weight": (64, 128)})
    return {k: torch.empty(v, dtype=dtype, device="meta") for k, v in shapes.items()}


def test_roofline_bytes_and_flops_by_hand():
    w = file_weight_bytes(CONFIG, _meta_weights())
    # per layer: q 4096 + k 2048 + v 2048 + o 4096 + mlp 3 x 8192 = 36864 matmul weights, 128 norm weights
    assert w.matmul_params == 2 * 36864
    assert w.per_step == 4 * (2 * 36864 + 2 * 128 + 64 + 64000)  # layers, norms, final norm, lm_head (fp32)
    assert w.embedding_row == 64 * 4

    # decode: 2 sequences, 100 tokens cached each
    d = step_cost(CONFIG, w, "decode", batch_size=2, context=100, kv_bytes_per_element=4)
    attention = 4 * 4 * 16 * 2 * 101 * 2  # 4 x heads x head_dim x layers x (query, key) pairs x sequences
    assert d.tokens == 2
    assert d.flops == 2 * 73728 * 2 + 2 * 1000 * 64 * 2 + attention
    kv_per_token = 2 * 2 * 2 * 16 * 4  # K and V x layers x kv heads x head_dim x fp32
    assert d.kv_bytes == 2 * (100 + 2) * kv_per_token
    assert d.weight_bytes == 552192 + 2 * 256

    # prefill: 2 prompts of 10 tokens; causal pairs 10 * 11 / 2 = 55; logits for each last token only
    p = step_cost(CONFIG, w, "prefill", batch_size=2, context=10, kv_bytes_per_element=4)
    assert p.tokens == 20
    assert p.flops == 2 * 73728 * 20 + 2 * 1000 * 64 * 2 + 4 * 4 * 16 * 2 * 55 * 2
    assert p.bytes == 552192 + 20 * 256 + 2 * 20 * kv_per_token

    machine = Machine("cpu", 1, "float32", bandwidth=1e9, flops=1e9)  # ridge 1 FLOP/byte
    row = roofline_row(p, machine)
    assert row["bound"] == "compute" and row["ceiling_tokens_per_s"] == pytest.approx(20 / (p.flops / 1e9))
    assert row["arithmetic_intensity"] == pytest.approx(p.flops / p.bytes)
    row = roofline_row(d, machine)
    assert row["bound"] == "memory" and row["ceiling_tokens_per_s"] == pytest.approx(2 / (d.bytes / 1e9))


def test_roofline_tied_embeddings_count_the_table_once():
    weights = _meta_weights(torch.float16)
    del weights["lm_head.weight"]
    w = file_weight_bytes(CONFIG, weights)
    assert w.per_step == 2 * (2 * 36864 + 2 * 128 + 64 + 64000)


def test_loaded_model_weight_bytes(tiny):
    from hearth.loading.loader import load_model, read_model
    from hearth.model.transformer import Transformer

    # dense float32 weights: 4 bytes per parameter, the tied lm_head being the table itself
    config = ModelConfig.from_hf(TINY.hf_config())
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(shape, generator=generator) for name, shape in TINY.tensor_shapes()}
    with torch.device("meta"):
        model = Transformer(config)
    model.load_weights(weights, torch.float32)
    model.backend.prepare(model, torch.float32)
    w = model_weight_bytes(model)
    assert w.per_step == 4 * TINY.num_parameters()
    assert w.matmul_params == 2 * (64 * 64 * 2 + 32 * 64 * 2 + 3 * 64 * 128)
    assert w.embedding_row == 64 * 4

    # from a q8_0 file: what the model holds is the file's blocks (in place or VNNI tiles), groups of 8 rows
    # (AVX2 builds: 36 bytes a block for the file's 34, float32 scales), or dense float32
    loaded = load_model(tiny["q8_0"], torch.float32, progress=False)
    w = model_weight_bytes(loaded.model)
    stored = file_weight_bytes(loaded.config, read_model(tiny["q8_0"], progress=False)[1])
    assert stored.per_step < 4 * TINY.num_parameters() / 3  # q8_0: about 1.06 bytes per weight
    assert w.per_step == 4 * TINY.num_parameters() or stored.per_step <= w.per_step <= stored.per_step * 36 / 34
    assert w.matmul_params == stored.matmul_params


def test_roofline_command(tiny, capsys, tmp_path):
    plot = tmp_path / "roofline.png"
    r = run_cli(capsys, "roofline", tiny["q8_0"], "--batch-sizes", "1,2", "--context", "16", "--measure",
                "--measure-tokens", "2", "--json", "--plot", str(plot))
    m = r["machine"]
    assert m["bandwidth"] > 1e8 and m["flops"] > 1e8 and m["ridge_flops_per_byte"] == pytest.approx(m["flops"] / m["bandwidth"])
    assert [(row["phase"], row["batch_size"]) for row in r["rows"]] == [
        ("prefill", 1), ("prefill", 2), ("decode", 1), ("decode", 2)]
    for row in r["rows"]:
        assert row["bound"] in ("memory", "compute")
        assert row["ceiling_tokens_per_s"] > 0 and row["measured_tokens_per_s"] > 0
        assert row["share_of_ceiling"] == pytest.approx(row["measured_tokens_per_s"] / row["ceiling_tokens_per_s"])
        assert row["loaded_ceiling_tokens_per_s"] <= row["ceiling_tokens_per_s"] * 1.0001  # never fewer bytes
    assert r["loaded_weight_bytes_per_step"] >= r["weight_bytes_per_step"]
    assert plot.stat().st_size > 10_000


# ---------------------------------------------------------------- load generator: arithmetic

def test_percentile_matches_numpy():
    rng = random.Random(1)
    for n in (1, 2, 7, 100):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert math.isnan(percentile([], 50))


def test_poisson_arrivals():
    times = poisson_arrivals(20000, rate=4.0, rng=random.Random(0))
    gaps = np.diff(times)
    assert times[0] == 0 and all(g >= 0 for g in gaps)
    assert gaps.mean() == pytest.approx(1 / 4.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: coefficient of variation 1
    assert poisson_arrivals(3, math.inf, random.Random(0)) == [0.0, 0.0, 0.0]


def test_summary_goodput_and_tpot():
    results = [RequestResult(True, 10, 5, ttft=0.1 * i, itl=[0.01] * 4, latency=0.1 * i + 0.04) for i in range(1, 5)]
    results.append(RequestResult(False, 10, 0, error="HTTP 500: boom"))
    s = summarize(results, duration=2.0, targets=parse_goodput(["ttft:250", "tpot:20"]))
    assert (s["completed"], s["failed"], s["output_tokens"], s["prompt_tokens"]) == (4, 1, 20, 40)
    assert s["good_requests"] == 2 and s["goodput"] == 1.0  # ttft 0.1 and 0.2 meet 250 ms
    assert s["p50_tpot_ms"] == pytest.approx(10.0)
    assert s["request_throughput"] == 2.0 and s["output_throughput"] == 10.0
    assert s["errors"] == ["HTTP 500: boom"]
    with pytest.raises(Exception):
        parse_goodput(["latency:5"])


# ---------------------------------------------------------------- load generator: stand-in servers

def standin_app(tokens_per_chunk: int = 1, delay: float = 0.002, usage: bool = True, status: int = 200):
    """A minimal OpenAI-style SSE server: max_tokens tokens in chunks of tokens_per_chunk."""
    app = FastAPI()
    app.state.in_flight = 0
    app.state.most_in_flight = 0
    app.state.bodies = []

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.bodies.append(body)
        if status != 200:
            return JSONResponse({"error": {"message": "boom"}}, status_code=status)
        n = body["max_tokens"]

        async def events():
            app.state.in_flight += 1
            app.state.most_in_flight = max(app.state.most_in_flight, app.state.in_flight)
            try:
                sent = 0
                while sent < n:
                    await asyncio.sleep(delay)
                    k = min(tokens_per_chunk, n - sent)
                    sent += k
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'text': ' x' * k}]})}\n\n"
                if usage:
                    u = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
                    yield f"data: {json.dumps({'choices': [], 'usage': u})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                app.state.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class Served:
    """Run an ASGI app under uvicorn in a thread, on a free port."""

    def __init__(self, app):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the stand-in server did not start")
            threading.Event().wait(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def test_serve_counts_tokens_and_percentiles_against_standin():
    app = standin_app(tokens_per_chunk=1)
    with Served(app) as url:
        r = run_serve(url, "stand-in", num_prompts=12, input_len=7, output_len=5, concurrency=[3],
                      goodput=["ttft:60000"], progress=False)
    assert app.state.most_in_flight <= 3
    body = app.state.bodies[0]
    assert body["stream"] is True and body["ignore_eos"] is True and body["max_tokens"] == 5
    assert body["model"] == "stand-in" and len(body["prompt"]) == 7
    run = r["runs"][0]
    assert (run["completed"], run["failed"], run["output_tokens"], run["prompt_tokens"]) == (12, 0, 60, 84)
    assert run["good_requests"] == 12
    rows = run["requests"]
    assert all(row["output_tokens"] == 5 and len(row["itl"]) == 4 for row in rows)
    for metric, key in (("ttft", "ttft"), ("e2el", "latency"), ("tpot", "tpot")):
        values = [row[key] * 1000 for row in rows]
        for q in (50, 90, 99):
            assert run[f"p{q}_{metric}_ms"] == pytest.approx(float(np.percentile(values, q)))
    itl = [g * 1000 for row in rows for g in row["itl"]]
    assert run["p99_itl_ms"] == pytest.approx(float(np.percentile(itl, 99)))
    for row in rows:
        assert 0 < row["ttft"] <= row["latency"]
        assert row["tpot"] == pytest.approx((row["latency"] - row["ttft"]) / 4)


def test_serve_token_counts_with_and_without_usage():
    with Served(standin_app(tokens_per_chunk=3, usage=True)) as url:  # usage is the truth: 7 tokens, 3 chunks
        run = run_serve(url, "m", 4, 3, 7, request_rate=[1000.0], progress=False)["runs"][0]
    assert run["output_tokens"] == 4 * 7 and all(len(row["itl"]) == 2 for row in run["requests"])
    with Served(standin_app(tokens_per_chunk=1, usage=False)) as url:  # no usage: one token per chunk
        run = run_serve(url, "m", 4, 3, 6, concurrency=[4], progress=False)["runs"][0]
    assert run["output_tokens"] == 4 * 6 and run["prompt_tokens"] == 4 * 3


def test_serve_command_several_loads_and_plot(capsys, tmp_path):
    plot = tmp_path / "serve.png"
    with Served(standin_app()) as url:
        r = run_cli(capsys, "bench", "serve", "--base-url", url, "--model", "m", "--concurrency", "1,4",
                    "--num-prompts", "8", "--input-len", "4", "--output-len", "3", "--json", "--plot", str(plot),
                    "--no-progress")
    assert [run["concurrency"] for run in r["runs"]] == [1, 4]
    assert all(run["completed"] == 8 and run["output_tokens"] == 24 for run in r["runs"])
    assert plot.stat().st_size > 10_000


def test_serve_reports_a_server_that_fails(capsys):
    with Served(standin_app(status=500)) as url:
        assert main(["bench", "serve", "--base-url", url, "--model", "m", "--concurrency", "2",
                     "--num-prompts", "2", "--output-len", "2", "--no-progress"]) == 1
    assert "HTTP 500" in capsys.readouterr().err
    # nothing listening: a one-line error, not a traceback
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--concurrency", "1",
                 "--num-prompts", "1", "--output-len", "2", "--no-progress"]) == 1
    assert "failed" in capsys.readouterr().err


def test_serve_against_hearths_own_server(tiny):
    from hearth.server import app as app_module
    from hearth.engine.async_engine import AsyncEngine
    from hearth.llm import LLM

    engine = LLM(tiny["q8_0"], kv_cache_memory=1 << 22, progress=False).engine
    async_engine = AsyncEngine(engine)
    try:
        with Served(app_module.build_app(async_engine, "tiny")) as url:
            r = run_serve(url, "tiny", num_prompts=6, input_len=8, output_len=4, concurrency=[3],
                          vocab_size=TINY.vocab_size, progress=False)
    finally:
        async_engine.shutdown()
    run = r["runs"][0]
    assert (run["completed"], run["output_tokens"], run["prompt_tokens"]) == (6, 24, 48)
    assert all(row["ttft"] > 0 for row in run["requests"])
