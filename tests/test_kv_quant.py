"""The q8_0 KV cache (hearth/kv_format.py): blocks as gguf-py's Q8_0 quantizer writes them,
attention over them as over gguf's dequantized K/V on every path (reference, CPU kernels, Triton
under the interpreter), the built-in model's perplexity as with a float cache, the engine's
matrix, and the tokens a budget holds. The float16 cache (llama.cpp's default): rows rounded as
torch rounds them, attention over them as over torch's widening of them on the CPU paths (the
reference's, the C++ kernels', the one-call decode step), and the tokens a budget holds."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from hearth import LLM, SamplingParams
from hearth.backend.base import AttentionMetadata, Backend, StepInputs, apply_rope
from hearth.engine_config import EngineConfig
from hearth.kv_format import Q8Cache, dequantize_q8_0, quantize_q8_0
from hearth.loading.loader import load_model
from hearth.perplexity import perplexity
from models import make_hf_model

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16


def gguf_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf-py's Q8_0 blocks of x [..., D] as (int8 codes [..., D], float16 scales [..., D / 32])."""
    raw = gguf.quants.quantize(x.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
    blocks = raw.reshape(*x.shape[:-1], x.shape[-1] // 32, 34)
    scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(x.shape)
    return torch.from_numpy(codes), torch.from_numpy(scales)


def gguf_dequantized(cache: Q8Cache) -> torch.Tensor:
    """gguf-py's dequantizer on the cache's blocks, as float32 [slots, kv_heads, head_dim]."""
    blocks = np.concatenate([cache.scales.numpy()[..., None].view(np.uint8),
                             cache.codes.numpy().reshape(*cache.scales.shape, 32).view(np.uint8)], axis=-1)
    values = gguf.quants.dequantize(blocks.reshape(-1), gguf.GGMLQuantizationType.Q8_0)
    return torch.from_numpy(values.reshape(cache.codes.shape).astype(np.float32))


def random_rows(*shape: int, seed: int = 0) -> torch.Tensor:
    """Values of very different sizes per block, all-zero blocks, and exact halves (rounding's edge)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * torch.rand(*shape[:-1], 1, generator=gen) * 20
    x.view(-1, shape[-1])[0, :32] = 0
    x.view(-1, shape[-1])[1, :32] = torch.arange(32) - 15.5  # codes at x.5 exactly
    return x


def assert_float32_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float32 rounding in sums of a few hundred terms of values up to ~50."""
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_quantize_and_dequantize_equal_gguf():
    x = random_rows(300, 3, 64)
    codes, scales = quantize_q8_0(x)
    expected_codes, expected_scales = gguf_q8_0(x)
    assert torch.equal(codes, expected_codes) and torch.equal(scales, expected_scales)
    cache = Q8Cache(codes, scales)
    assert torch.equal(dequantize_q8_0(codes, scales), gguf_dequantized(cache))


def _q8_caches(num_slots: int, kv_heads: int, head_dim: int, seed: int) -> tuple[Q8Cache, Q8Cache]:
    return tuple(Q8Cache(*quantize_q8_0(random_rows(num_slots, kv_heads, head_dim, seed=seed + i))) for i in range(2))


def _mixed_step(context_lens: list[int], query_lens: list[int], num_blocks: int, seed: int) -> StepInputs:
    """A step of sequences with shuffled blocks: each its last query_lens rows of context_lens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_blocks, generator=gen).numpy()
    widest = max(-(-n // BLOCK_SIZE) for n in context_lens)
    tables = np.zeros((len(context_lens), widest), dtype=np.int32)
    used = 0
    for s, n in enumerate(context_lens):
        count = -(-n // BLOCK_SIZE)
        tables[s, :count] = ids[used:used + count]
        used += count
    positions = np.concatenate([np.arange(n - q, n) for n, q in zip(context_lens, query_lens)])
    seq_of_row = np.repeat(np.arange(len(context_lens)), query_lens)
    slots = tables[seq_of_row, positions // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
    return StepInputs(input_ids=np.zeros(len(positions), dtype=np.int64), positions=positions, slot_mapping=slots,
                      query_start_loc=np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32),
                      seq_lens=np.array(context_lens, dtype=np.int32), block_tables=tables, block_size=BLOCK_SIZE)


def _float16_caches(num_slots: int, kv_heads: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(random_rows(num_slots, kv_heads, head_dim, seed=seed + i).half() for i in range(2))


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("kind", ["q8_0", "float16"])
def test_attention_over_the_cache_equals_attention_over_its_values(kind, backend, window):
    """Prompts (the reference path's SDPA on both backends) and decodes (the CPU kernel, split or
    not) against the reference attention over the cache's values: gguf's dequantization of q8_0
    blocks, torch's float32 copy of float16 rows."""
    from hearth.backend import choose_backend

    ops = choose_backend(torch.device("cpu"), torch.float32, backend)
    kv_heads, heads, head_dim = 2, 4, 64
    if kind == "q8_0":
        k_cache, v_cache = _q8_caches(40 * BLOCK_SIZE, kv_heads, head_dim, seed=1)
        k_values, v_values = gguf_dequantized(k_cache), gguf_dequantized(v_cache)
    else:
        k_cache, v_cache = _float16_caches(40 * BLOCK_SIZE, kv_heads, head_dim, seed=1)
        k_values, v_values = k_cache.float(), v_cache.float()
    step = _mixed_step([37, 1, 300, 90], [9, 1, 1, 1], 40, seed=2)
    meta = AttentionMetadata.from_step(step, torch.device("cpu"))
    q = torch.randn(len(step.positions), heads, head_dim, generator=torch.Generator().manual_seed(3))
    out = ops.attention(q, k_cache, v_cache, meta, 0.125, window=window)
    expected = Backend().attention(q, k_values, v_values, AttentionMetadata.from_step(step, torch.device("cpu")),
                                   0.125, window=window)
    assert_float32_close(out, expected)
    if backend == "cpu":  # the decodes again, cut into splits of 64 tokens
        rows = meta.decode_token_index
        split = ops.decode_attention(q[rows], k_cache, v_cache, meta, 0.125, split_len=64, window=window)
        assert_float32_close(split, expected[rows])


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("kind", ["q8_0", "float16"])
def test_rope_and_store_writes_the_cache(kind, backend):
    """q8_0: v's blocks exactly gguf's; k's gguf's blocks of k rotated as the reference rotates it, up
    to the last bit of the rotation (the kernel may fuse its multiply-adds): codes within 1, scales
    within 1e-3. float16: v's rows exactly torch's rounding of v; k's that of k rotated, within one
    float16 step (the rotation's last bit)."""
    from hearth.backend import choose_backend

    ops = choose_backend(torch.device("cpu"), torch.float32, backend)
    tokens, heads, kv_heads, head_dim = 7, 4, 2, 64
    qkv = random_rows(tokens, heads + 2 * kv_heads, head_dim, seed=4)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)  # strided views of one projection, as the model's
    angles = torch.arange(100)[:, None] * 10000 ** (-torch.arange(head_dim // 2) / (head_dim // 2))
    positions = torch.tensor([0, 3, 50, 51, 52, 98, 99])
    rotary = ops.rotary(angles.cos(), angles.sin(), positions, torch.float32)
    caches = (_q8_caches if kind == "q8_0" else _float16_caches)(64, kv_heads, head_dim, seed=5)
    slots = torch.tensor([5, 0, 63, 17, 18, 40, 2])
    ops.rope_and_store_kv(q, k, v, rotary, caches, slots)
    k_rotated = apply_rope(k, (angles.cos()[positions, None], angles.sin()[positions, None]))
    if kind == "float16":
        assert torch.equal(caches[1][slots], v.half())
        steps = (caches[0][slots].view(torch.int16).int() - k_rotated.half().view(torch.int16).int()).abs()
        assert steps.max() <= 1 and (steps == 0).float().mean() > 0.9
        return
    codes, scales = gguf_q8_0(v)
    assert torch.equal(caches[1].codes[slots], codes) and torch.equal(caches[1].scales[slots], scales)
    codes, scales = gguf_q8_0(k_rotated)
    assert (caches[0].codes[slots].int() - codes.int()).abs().max() <= 1
    torch.testing.assert_close(caches[0].scales[slots], scales, rtol=1e-3, atol=0)


def test_triton_kernels_over_q8_0_equal_them_over_gguf_dequantized():
    """Under Triton's interpreter without a GPU (tests/conftest.py): the RoPE + store kernel writes
    gguf's blocks, and decode (split and whole) and prefill attention read them as gguf dequantizes them."""
    from hearth.triton_kernels import attention, rope

    kv_heads, heads, head_dim = 2, 4, 64
    k_cache, v_cache = _q8_caches(24 * BLOCK_SIZE, kv_heads, head_dim, seed=6)
    v = random_rows(5, kv_heads, head_dim, seed=7)
    k = torch.zeros_like(v)  # rotated zeros: zero blocks (scale 0) for k, v's own blocks for v
    angles = torch.arange(64)[:, None] * 10000 ** (-torch.arange(head_dim // 2) / (head_dim // 2))
    slots = torch.tensor([3, 9, 10, -1, 20])  # -1: a CUDA graph's padding row, stored nowhere
    before = v_cache.codes.clone()
    rope.rope_and_store_kv(torch.zeros(5, heads, head_dim), k, v, torch.arange(5), angles.cos(), angles.sin(),
                           k_cache, v_cache, slots)
    codes, scales = gguf_q8_0(v)
    kept = slots >= 0
    assert torch.equal(v_cache.codes[slots[kept]], codes[kept]) and torch.equal(v_cache.scales[slots[kept]], scales[kept])
    assert (k_cache.codes[slots[kept]] == 0).all() and (k_cache.scales[slots[kept]] == 0).all()
    unwritten = torch.ones(len(before), dtype=torch.bool)
    unwritten[slots[kept]] = False
    assert torch.equal(v_cache.codes[unwritten], before[unwritten])

    k_values, v_values = gguf_dequantized(k_cache), gguf_dequantized(v_cache)
    step = _mixed_step([37, 200, 90], [6, 1, 1], 24, seed=8)
    tables, lens = torch.from_numpy(step.block_tables), torch.from_numpy(step.seq_lens)
    q = torch.randn(len(step.positions), heads, head_dim, generator=torch.Generator().manual_seed(9))
    decodes = q[[6, 7]]
    for splits in (1, 3):
        out = attention.decode_attention(decodes, k_cache, v_cache, tables[1:], lens[1:], 0.125, BLOCK_SIZE,
                                         num_splits=splits, window=50)
        expected = attention.decode_attention(decodes, k_values, v_values, tables[1:], lens[1:], 0.125, BLOCK_SIZE,
                                              num_splits=splits, window=50)
        assert_float32_close(out, expected)
    starts = torch.from_numpy(step.query_start_loc)
    out = attention.prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.125, BLOCK_SIZE, 6)
    expected = Backend().attention(q, k_values, v_values, AttentionMetadata.from_step(step, torch.device("cpu")), 0.125)
    assert_float32_close(out, expected)


def test_builtin_perplexity_within_half_a_percent_of_the_float_cache():
    loaded = load_model("builtin", progress=False)
    ids = loaded.tokenizer.encode((ROOT / "hearth" / "engine" / "scheduler.py").read_text(encoding="utf-8"))[:1500]
    float_cache = perplexity(loaded.model, ids, 512, torch.device("cpu"))
    q8_0 = perplexity(loaded.model, ids, 512, torch.device("cpu"), kv_cache_dtype="q8_0")
    assert q8_0["tokens"] == float_cache["tokens"] == 1497
    assert q8_0["perplexity"] != float_cache["perplexity"]  # the cache really was quantized
    assert abs(q8_0["perplexity"] - float_cache["perplexity"]) / float_cache["perplexity"] <= 0.005


def _greedy(llm: LLM, prompts: list[str], max_tokens: int = 24):
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)


def _token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
           "# sort a list\n" * 6, "for i in range(10):\n    print(i)\n" * 3, "x = [1, 2, 3]\n"]


@pytest.mark.parametrize("options", [
    dict(max_num_batched_tokens=8),  # prompts in chunks of 8
    dict(enable_chunked_prefill=False, enable_prefix_caching=False),
    dict(kv_cache_memory=14 * BLOCK_SIZE * 1632),  # 14 blocks: preemption
    dict(speculative_method="ngram", prompt_lookup_min=1, speculative_adaptive=False),
], ids=["chunked", "unchunked", "preempted", "ngram"])
def test_engine_matrix_with_a_q8_0_cache(options):
    """The built-in model with a q8_0 cache: each configuration's greedy tokens as one request at a
    time; then prompts that extend earlier ones (prefix-cache hits); every block free at the end."""
    alone = LLM("builtin", kv_cache_dtype="q8_0", max_num_seqs=1, enable_prefix_caching=False, progress=False)
    prompts = PROMPTS + [PROMPTS[3] + "def f():\n", PROMPTS[4] + "y = 2\n"]
    expected = [_token_ids(_greedy(alone, [p]))[0] for p in prompts]
    llm = LLM("builtin", kv_cache_dtype="q8_0", progress=False, **options)
    outputs = _greedy(llm, prompts[:6]) + _greedy(llm, prompts[6:])
    assert _token_ids(outputs) == expected
    engine = llm.engine
    assert engine.block_manager.check_all_free()
    if "kv_cache_memory" in options:
        assert engine.num_blocks == 14 and sum(o.metrics.num_preemptions for o in outputs) > 0
    elif options.get("enable_prefix_caching", True):  # (14 blocks evict what the first requests left)
        assert engine.block_manager.prefix_cache_hits > 0


@pytest.mark.parametrize("kind", ["q8_0", "float16"])
def test_decode_layers_path_with_the_cache(kind, tmp_path):
    """A q8_0 GGUF (every projection on the int8 kernel: decode steps in one C++ call) with a q8_0
    or float16 cache: greedy tokens as the reference backend's with the same cache (its attention
    and cache in torch, given the cpu backend's matmul modules: the same int8 rounding), and first
    log-probabilities not those of a float32 cache (the cache really is what it is named)."""
    from hearth.backend.base import Backend
    from hearth.backend.cpu_decode import CpuDecodePath
    from hearth.backend.cpu_linear import cpu_linear
    from hearth.loading.convert import convert_hf_to_gguf

    def cpu_matmuls(backend, module, weight, dtype):
        embedding = isinstance(module, torch.nn.Embedding)
        return reference_module(backend, module, weight, dtype) if embedding else cpu_linear(weight, module.bias)

    reference_module = Backend.stored_module

    # head_dim 32; every matrix a whole number of q8_0 blocks wide
    folder = make_hf_model(tmp_path / "llama", "llama", num_attention_heads=2, intermediate_size=128)
    path = convert_hf_to_gguf(folder, tmp_path / "m.gguf", "q8_0", progress=False)
    prompts = [[5, 9, 30, 2, 77, 15], list(range(40, 80))]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)
    runs = {}
    for backend, kv in (("cpu", kind), ("reference", kind), ("cpu", "auto")):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Backend, "stored_module", cpu_matmuls)
            llm = LLM(path, backend=backend, kv_cache_dtype=kv, progress=False)
        runs[backend, kv] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        if backend == "cpu":
            assert isinstance(llm.engine.model.backend_state["decode_path"], CpuDecodePath)
            assert llm.engine.kv_cache_dtype == ("float32" if kv == "auto" else kind)
    assert [o.token_ids for o in runs["cpu", kind]] == [o.token_ids for o in runs["reference", kind]]
    assert [o.logprobs[0] for o in runs["cpu", kind]] != [o.logprobs[0] for o in runs["cpu", "auto"]]


def test_a_float16_budget_holds_twice_the_tokens_of_float32():
    budget = 64 << 20
    engines = {kv: LLM("builtin", kv_cache_dtype=kv, kv_cache_memory=budget, progress=False).engine
               for kv in ("auto", "float16")}
    assert engines["auto"].kv_cache_dtype == "float32"
    config = engines["float16"].model_config
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    assert engines["float16"].num_blocks == budget // (per_token * BLOCK_SIZE)
    assert all(k.dtype == v.dtype == torch.float16 for k, v in engines["float16"].runner.kv_caches)
    assert engines["float16"].kv_cache_tokens / engines["auto"].kv_cache_tokens == pytest.approx(2, rel=0.01)


@pytest.mark.parametrize("dtype,ratio", [("float32", 4 / (34 / 32)), ("bfloat16", 2 / (34 / 32))])
def test_a_budget_holds_about_twice_the_tokens(dtype, ratio):
    """Tokens per budget from bytes per token: 2 x layers x kv heads x (head_dim int8 codes +
    head_dim / 32 float16 scales); the tensors the runner allocates are that size."""
    budget = 64 << 20
    engines = {kv: LLM("builtin", dtype=dtype, backend="reference", kv_cache_dtype=kv, kv_cache_memory=budget,
                       progress=False).engine for kv in ("auto", "q8_0")}
    config = engines["q8_0"].model_config
    per_token = 2 * config.num_layers * config.num_kv_heads * (config.head_dim + 2 * config.head_dim // 32)
    assert engines["q8_0"].num_blocks == budget // (per_token * BLOCK_SIZE)
    tensors = [t for k, v in engines["q8_0"].runner.kv_caches for t in (*k, *v)]
    assert sum(t.nbytes for t in tensors) == engines["q8_0"].num_blocks * BLOCK_SIZE * per_token
    assert engines["q8_0"].kv_cache_tokens / engines["auto"].kv_cache_tokens == pytest.approx(ratio, rel=0.01)


def test_unsupported_kv_cache_dtypes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="auto, float16, q8_0, fp8 or fp8_e4m3"):
        EngineConfig.from_options(kv_cache_dtype="int4")
    for split in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        with pytest.raises(ValueError, match="not implemented with tensor or pipeline parallelism"):
            EngineConfig.from_options(kv_cache_dtype="q8_0", **split)
    folder = make_hf_model(tmp_path / "llama", "llama")  # head_dim 16
    with pytest.raises(ValueError, match="multiple of 32.*16"):
        LLM(folder, kv_cache_dtype="q8_0", progress=False)


def test_cli_inspect_and_perplexity_with_a_q8_0_cache(capsys):
    import json

    from hearth.cli import main

    assert main(["inspect", "builtin", "--kv-cache-dtype", "q8_0", "--kv-budget", "1MiB", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    config = info["config"]
    per_token = 2 * config["num_layers"] * config["num_kv_heads"] * config["head_dim"] // 32 * 34
    assert (info["kv_cache_dtype"], info["kv_cache_bytes_per_token"]) == ("q8_0", per_token)
    assert info["kv_budget_tokens"] == (1 << 20) // per_token and info["kv_window"] is None
    assert main(["inspect", "builtin", "--kv-cache-dtype", "q8_0"]) == 0
    assert f"KV cache         {per_token:,} bytes/token in q8_0 (1.0625 bytes/element)" in capsys.readouterr().out
    text = ["--text", (ROOT / "hearth" / "perplexity.py").read_text(encoding="utf-8")]
    results = {}
    for kind in ("auto", "q8_0"):
        assert main(["perplexity", "builtin", *text, "--kv-cache-dtype", kind, "--json"]) == 0
        results[kind] = json.loads(capsys.readouterr().out)["perplexity"]
    assert results["q8_0"] != results["auto"] and results["q8_0"] == pytest.approx(results["auto"], rel=0.005)
