"""The fp8 (e4m3) KV cache (hearth/kv_format.py) on the gpu backend's Triton kernels (under
Triton's interpreter without a GPU: tests/conftest.py): the cache write stores torch's own
float8_e4m3fn cast of x / scale, saturated; decode (split and whole) and prefill attention read the
cache as its dequantized values; attention over fp8 stays within e4m3's precision of attention over
the float values; the built-in model's perplexity and greedy tokens; twice the tokens of a 16-bit
cache in a budget; and the refusals where fp8 cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hearth import LLM, SamplingParams
from hearth.backend import choose_backend
from hearth.backend.base import AttentionMetadata, Backend, apply_rope
from hearth.kv_format import Fp8Cache, quantize_fp8
from hearth.loading.loader import load_model
from hearth.perplexity import perplexity
from test_kv_quant import BLOCK_SIZE, _mixed_step, assert_float32_close

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # without a GPU: Triton's interpreter on CPU tensors
E4M3_MAX_RELATIVE_ERROR = 2.0**-4  # half the spacing of 3 mantissa bits, relative to the value

pytestmark = pytest.mark.usefixtures("interpreter_bf16_dot")  # (tests/conftest.py)


def e4m3_values() -> torch.Tensor:
    """Every finite float8_e4m3fn value, in float32, sorted (the largest 448)."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return values[values.isfinite()].unique()


def edge_rows(rows: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Rows [rows, kv_heads, head_dim] holding every e4m3 value, every midpoint between neighbours
    (a tie: rounds to the even one), values past +-448 (saturate), below the smallest subnormal, and
    random ones of every size."""
    values = e4m3_values()
    special = torch.cat([values, (values[1:] + values[:-1]) / 2, torch.tensor([449.0, 463.9, 464.0, 1e6, 3e-4]),
                         -torch.tensor([449.0, 500.0, 1e-4, 0.0])])
    gen = torch.Generator().manual_seed(11)
    count = rows * kv_heads * head_dim
    noise = torch.randn(count - len(special), generator=gen) * 10.0 ** torch.randint(-3, 3, (count - len(special),), generator=gen)
    return torch.cat([special, noise]).view(rows, kv_heads, head_dim)


def fp8_cache(num_slots: int, kv_heads: int, head_dim: int, scale: float, seed: int) -> Fp8Cache:
    gen = torch.Generator().manual_seed(seed)
    return Fp8Cache(quantize_fp8(torch.randn(num_slots, kv_heads, head_dim, generator=gen), scale), scale)


def dequantized(cache: Fp8Cache) -> torch.Tensor:
    return cache.values.float() * cache.scale


def on_device(cache: Fp8Cache) -> Fp8Cache:
    return Fp8Cache(cache.values.to(DEVICE), cache.scale)


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.25, 8.0)])
def test_cache_write_stores_torchs_e4m3_of_x_over_scale(k_scale, v_scale):
    """v rows (stored unrotated) byte for byte torch's float8_e4m3fn cast of v / scale saturated to
    +-448: round to nearest, ties to even, subnormals, signed zeros; k's within one e4m3 step of that
    of the reference rotation (the kernel may round the rotation's float32 differently), nearly all
    equal; the padding row (slot -1) and unwritten slots untouched."""
    from hearth.triton_kernels import rope

    tokens, heads, kv_heads, head_dim = 8, 4, 2, 64
    v = edge_rows(tokens, kv_heads, head_dim)
    k = edge_rows(tokens, kv_heads, head_dim).flip(0)
    angles = torch.arange(64)[:, None] * 10000 ** (-torch.arange(head_dim // 2) / (head_dim // 2))
    positions = torch.tensor([0, 7, 3, 60, 1, 2, 5, 9])
    slots = torch.tensor([3, 9, 10, -1, 20, 0, 31, 5])
    k_cache, v_cache = fp8_cache(32, kv_heads, head_dim, k_scale, 1), fp8_cache(32, kv_heads, head_dim, v_scale, 2)
    before = v_cache.values.view(torch.uint8).clone(), k_cache.values.view(torch.uint8).clone()
    k_cache, v_cache = on_device(k_cache), on_device(v_cache)
    rope.rope_and_store_kv(*(t.to(DEVICE) for t in (torch.zeros(tokens, heads, head_dim), k, v, positions, angles.cos(),
                                                      angles.sin())), k_cache, v_cache, slots.to(DEVICE))
    k_cache, v_cache = Fp8Cache(k_cache.values.cpu(), k_scale), Fp8Cache(v_cache.values.cpu(), v_scale)
    kept = slots >= 0
    stored = v_cache.values[slots[kept]].view(torch.uint8)
    assert torch.equal(stored, quantize_fp8(v[kept], v_scale).view(torch.uint8))
    k_rotated = apply_rope(k, (angles.cos()[positions, None], angles.sin()[positions, None]))
    expected = quantize_fp8(k_rotated[kept], k_scale).float()
    stored = k_cache.values[slots[kept]].float()
    step = torch.maximum(expected.abs() * 2.0**-3, torch.tensor(2.0**-9))
    assert ((stored - expected).abs() <= step).all()
    assert (stored == expected).float().mean() > 0.99
    unwritten = torch.ones(32, dtype=torch.bool)
    unwritten[slots[kept]] = False
    assert torch.equal(v_cache.values.view(torch.uint8)[unwritten], before[0][unwritten])
    assert torch.equal(k_cache.values.view(torch.uint8)[unwritten], before[1][unwritten])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_over_fp8_equals_attention_over_its_values(dtype):
    """Decode (whole, 3 splits, a window) and prefill attention over fp8 caches with scales other
    than 1 against the reference backend's over the caches' dequantized values (scale x stored), and
    the reference backend's own fp8 path (read_rows) the same: float32 to ~1e-5, bfloat16 by relative
    norm error 1e-2."""
    from hearth.triton_kernels import attention

    kv_heads, heads, head_dim = 2, 4, 64
    k_cache, v_cache = fp8_cache(24 * BLOCK_SIZE, kv_heads, head_dim, 0.5, 3), fp8_cache(24 * BLOCK_SIZE, kv_heads, head_dim, 3.0, 4)
    k_values, v_values = dequantized(k_cache), dequantized(v_cache)
    step = _mixed_step([37, 130, 90], [6, 1, 1], 24, seed=8)
    tables, lens = torch.from_numpy(step.block_tables).to(DEVICE), torch.from_numpy(step.seq_lens).to(DEVICE)
    q = torch.randn(len(step.positions), heads, head_dim, generator=torch.Generator().manual_seed(9))
    k_fp8, v_fp8 = on_device(k_cache), on_device(v_cache)
    meta = AttentionMetadata.from_step(step, torch.device("cpu"))

    def check(out: torch.Tensor, expected: torch.Tensor) -> None:
        assert out.dtype == dtype
        out = out.cpu()
        if dtype == torch.float32:
            assert_float32_close(out, expected)
        else:
            assert (out.float() - expected).norm() <= 1e-2 * expected.norm()

    decodes = q[[6, 7]]
    for splits, window in ((1, None), (3, None), (3, 50)):
        expected = Backend().decode_attention(decodes, k_values, v_values, AttentionMetadata.from_step(
            step.sequences(1, 3), torch.device("cpu")), 0.125, window=window)
        out = attention.decode_attention(decodes.to(DEVICE, dtype), k_fp8, v_fp8, tables[1:], lens[1:], 0.125,
                                         BLOCK_SIZE, num_splits=splits, window=window)
        check(out, expected)
    expected = Backend().attention(q, k_values, v_values, meta, 0.125)
    starts = torch.from_numpy(step.query_start_loc).to(DEVICE)
    check(attention.prefill_attention(q.to(DEVICE, dtype), k_fp8, v_fp8, tables, starts, lens, 0.125, BLOCK_SIZE, 6),
          expected)
    check(Backend().attention(q.to(dtype), k_cache, v_cache, AttentionMetadata.from_step(step, torch.device("cpu")), 0.125),
          expected)


def test_fp8_attention_stays_within_e4m3_precision_of_the_float_cache():
    """The same float32 K/V (unit normal) stored as fp8 (scale 1): prefill and decode outputs within
    e4m3's largest relative rounding error (2^-4) of attention over the float cache, by relative norm
    error (each K and V value moves by up to 2^-4 of itself)."""
    from hearth.triton_kernels import attention

    kv_heads, heads, head_dim = 2, 4, 64
    gen = torch.Generator().manual_seed(12)
    k_values, v_values = (torch.randn(24 * BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(DEVICE) for _ in range(2))
    k_cache, v_cache = Fp8Cache(quantize_fp8(k_values, 1.0), 1.0), Fp8Cache(quantize_fp8(v_values, 1.0), 1.0)
    step = _mixed_step([37, 130, 90], [6, 1, 1], 24, seed=13)
    tables, lens, starts = (torch.from_numpy(a).to(DEVICE) for a in (step.block_tables, step.seq_lens, step.query_start_loc))
    q = torch.randn(len(step.positions), heads, head_dim, generator=gen).to(DEVICE)
    errors = []
    for caches in ((k_cache, v_cache), (k_values, v_values)):
        errors.append((attention.prefill_attention(q, *caches, tables, starts, lens, 0.125, BLOCK_SIZE, 6),
                       attention.decode_attention(q[[6, 7]], *caches, tables[1:], lens[1:], 0.125, BLOCK_SIZE,
                                                  num_splits=3)))
    for fp8_out, float_out in zip(*errors):
        relative = float((fp8_out - float_out).norm() / float_out.norm())  # measured: 3.5% and 4.0%
        assert 0 < relative <= E4M3_MAX_RELATIVE_ERROR


def _scheduler_tokens(tokenizer, count: int) -> list[int]:
    return tokenizer.encode((ROOT / "hearth" / "engine" / "scheduler.py").read_text(encoding="utf-8"))[:count]


def test_builtin_perplexity_with_fp8_within_half_a_percent_of_the_float_cache():
    """The reference backend's fp8 cache (torch's cast: the bytes the Triton cache write stores) over
    1,497 tokens of code (measured: +0.06%); the issue's bound for q8_0, 0.5%, holds for fp8 too."""
    loaded = load_model("builtin", progress=False, backend=Backend())
    ids = _scheduler_tokens(loaded.tokenizer, 1500)
    float_cache = perplexity(loaded.model, ids, 512, torch.device("cpu"))
    fp8 = perplexity(loaded.model, ids, 512, torch.device("cpu"), kv_cache_dtype="fp8")
    assert fp8["tokens"] == float_cache["tokens"] == 1497
    assert fp8["perplexity"] != float_cache["perplexity"]  # the cache really was quantized
    assert abs(fp8["perplexity"] - float_cache["perplexity"]) / float_cache["perplexity"] <= 0.005


def test_builtin_model_on_the_gpu_backend_with_fp8():
    """The built-in model on the gpu backend (Triton under the interpreter: few tokens) with an fp8
    cache: perplexity over 32 tokens as the reference backend's fp8 path computes it (to 1e-4: a
    rotated K the kernel rounds differently may land on the next e4m3 value); greedy tokens as the
    reference backend's with the same cache, prompts in chunks of 8 tokens, the last prompt's first
    block from the prefix cache."""
    device = torch.device(DEVICE)
    gpu = load_model("builtin", device=device, progress=False, backend=choose_backend(device, torch.float32, "gpu"))
    reference = load_model("builtin", progress=False, backend=Backend())
    ids = _scheduler_tokens(gpu.tokenizer, 32)
    on_gpu = perplexity(gpu.model, ids, 32, device, kv_cache_dtype="fp8")["perplexity"]
    assert on_gpu == pytest.approx(perplexity(reference.model, ids, 32, torch.device("cpu"),
                                              kv_cache_dtype="fp8")["perplexity"], rel=1e-4)
    assert on_gpu != perplexity(reference.model, ids, 32, torch.device("cpu"))["perplexity"]

    stack = "class Stack:\n    def __init__(self):\n        self.items = []\n"  # 19 tokens: a whole block
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    runs = {}
    for backend, device in (("gpu", DEVICE), ("reference", "cpu")):
        llm = LLM("builtin", device=device, dtype="float32", backend=backend, kv_cache_dtype="fp8",
                  max_num_batched_tokens=8, progress=False)
        outputs = [*llm.generate(["def fibonacci(n):", stack], params, use_tqdm=False),
                   *llm.generate([stack + "    def push(self, item):\n"], params, use_tqdm=False)]
        runs[backend] = [o.outputs[0].token_ids for o in outputs]
        assert llm.engine.block_manager.prefix_cache_hits > 0 and llm.engine.block_manager.check_all_free()
    assert runs["gpu"] == runs["reference"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_budget_holds_twice_the_tokens_of_a_16_bit_cache(dtype):
    """One byte per K/V value against two: twice the blocks in the same budget; the runner's fp8
    tensors are that size."""
    budget = 48 << 20
    engines = {kv: LLM("builtin", dtype=dtype, backend="reference", kv_cache_dtype=kv, kv_cache_memory=budget,
                       progress=False).engine for kv in ("auto", "fp8")}
    config = engines["fp8"].model_config
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim
    assert engines["fp8"].num_blocks == budget // (per_token * BLOCK_SIZE) == 2 * engines["auto"].num_blocks
    caches = [c for k, v in engines["fp8"].runner.kv_caches for c in (k, v)]
    assert all(c.values.dtype == torch.float8_e4m3fn and c.scale == 1.0 for c in caches)
    assert sum(c.values.nbytes for c in caches) == engines["fp8"].num_blocks * BLOCK_SIZE * per_token
    assert engines["fp8"].kv_cache_dtype == "fp8_e4m3"


def test_fp8_is_refused_where_it_cannot_run():
    from hearth.backend.gpu import GpuBackend
    from hearth.engine_config import EngineConfig

    with pytest.raises(ValueError, match="gpu backend.*q8_0"):
        LLM("builtin", device="cpu", backend="cpu", kv_cache_dtype="fp8", progress=False)
    with pytest.raises(ValueError, match="fp8_e5m2 is not implemented"):
        EngineConfig.from_options(kv_cache_dtype="fp8_e5m2")
    gpu = GpuBackend("cpu")
    gpu.capability = (8, 0)  # an A100
    with pytest.raises(ValueError, match="compute capability 8.9 or newer.*this one is 8.0.*q8_0"):
        gpu.check_kv_cache_dtype("fp8_e4m3")
    gpu.check_kv_cache_dtype("q8_0")
    gpu.capability = (9, 0)  # an H100
    gpu.check_kv_cache_dtype("fp8_e4m3")


def test_cli_inspect_perplexity_and_the_start_up_line_with_an_fp8_cache(capsys):
    """inspect's KV line and JSON, the engine's start-up line; perplexity --backend reference with
    fp8 as the library computes it, and on the cpu backend a clear error naming q8_0."""
    import json

    from hearth.cli import main

    assert main(["inspect", "builtin", "--kv-cache-dtype", "fp8", "--kv-budget", "1MiB", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    config = info["config"]
    per_token = 2 * config["num_layers"] * config["num_kv_heads"] * config["head_dim"]
    assert (info["kv_cache_dtype"], info["kv_cache_bytes_per_token"]) == ("fp8_e4m3", per_token)
    assert info["kv_budget_tokens"] == (1 << 20) // per_token
    assert main(["inspect", "builtin", "--kv-cache-dtype", "fp8_e4m3"]) == 0
    assert f"KV cache         {per_token:,} bytes/token in fp8_e4m3 (1 bytes/element)" in capsys.readouterr().out
    LLM("builtin", backend="reference", kv_cache_dtype="fp8", kv_cache_memory=1 << 20, progress=True)
    assert "MiB (fp8_e4m3) holds" in capsys.readouterr().err

    text = (ROOT / "hearth" / "perplexity.py").read_text(encoding="utf-8")
    assert main(["perplexity", "builtin", "--text", text, "--device", "cpu", "--backend", "reference",
                 "--kv-cache-dtype", "fp8", "--context", "256", "--json"]) == 0
    loaded = load_model("builtin", progress=False, backend=Backend())
    expected = perplexity(loaded.model, loaded.tokenizer.encode(text), 256, torch.device("cpu"), kv_cache_dtype="fp8")
    assert json.loads(capsys.readouterr().out)["perplexity"] == pytest.approx(expected["perplexity"], rel=1e-9)
    assert main(["perplexity", "builtin", "--text", text, "--device", "cpu", "--backend", "cpu",
                 "--kv-cache-dtype", "fp8"]) == 1
    assert "hearth: error: kv_cache_dtype fp8 is for the gpu backend" in capsys.readouterr().err
