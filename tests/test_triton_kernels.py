"""Triton model kernels (hearth/triton_kernels/: attention, norm, rope, activation) against plain
torch references written here from first principles, in float64.

Attention references gather each sequence's K/V densely from its block table and run an explicit
masked softmax; block tables hold shuffled block ids, padded with 0 (a block some other sequence
owns). Outputs passed through `out=` are poisoned with NaN first, so an unwritten element fails.

Tolerances: float32 to ~1e-5 (IEEE dots and fp32 accumulation); bfloat16 by relative norm error
||out - ref|| / ||ref|| < 1e-2. Without a GPU the kernels run in Triton's interpreter
(tests/conftest.py), which rounds float32 to bf16 by truncation and multiplies bf16 tl.dot
operands as their raw bits (numpy has no bf16): `_interpreter_bf16_dot` widens them to float32
(exact), as bf16 tensor cores do.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton.language as tl

from hearth.backend.base import AttentionMetadata, Backend, StepInputs
from hearth.backend.gpu import GpuBackend
from hearth.kv_format import Fp8Cache, Q8Cache, quantize_fp8, quantize_q8_0
from hearth.triton_kernels.activation import act_and_mul
from hearth.triton_kernels.attention import MAX_SPLITS, choose_num_splits, decode_attention, prefill_attention
from hearth.triton_kernels.norm import rms_norm
from hearth.triton_kernels.rope import rope_and_store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.bfloat16]


pytestmark = pytest.mark.usefixtures("interpreter_bf16_dot")


def _assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """out (in dtype) against a float64 reference."""
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    out, ref = out.double().cpu(), ref.double().cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        assert (out - ref).norm() <= 1e-2 * ref.norm()


# ---- attention -------------------------------------------------------------------------


def _paged_cache(context_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype, seed: int):
    """Random K/V caches [slots, kv_heads, head_dim] with each sequence's blocks at shuffled ids,
    one spare padding column of 0s in the block table, and a few blocks nobody owns."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-length // block_size) for length in context_lens]
    num_blocks = sum(needed) + 3
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(context_lens), max(needed) + 1, dtype=torch.int32)
    used = 0
    for s, count in enumerate(needed):
        tables[s, :count] = ids[used : used + count]
        used += count
    k_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=gen)
    return k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype), tables.to(DEVICE)


def _reference_attention(q, k_cache, v_cache, table, context_len, block_size, scale, softcap=None, window=None):
    """q [rows, H, D]: the sequence's last `rows` positions against its whole context, causal, float64;
    softcap: scores capped as softcap * tanh(score / softcap) (gemma2); window: each row sees only the
    last `window` positions."""
    rows, num_heads, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    if context_len == 0:
        return out
    positions = torch.arange(context_len)
    slots = table.cpu().long()[positions // block_size] * block_size + positions % block_size
    group = num_heads // k_cache.shape[1]
    keys = k_cache.cpu()[slots].double().repeat_interleave(group, dim=1)  # [L, H, D]
    values = v_cache.cpu()[slots].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.cpu().double(), keys) * scale  # [H, rows, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    query_positions = torch.arange(context_len - rows, context_len)
    scores = scores.masked_fill(positions[None, :] > query_positions[:, None], float("-inf"))
    if window is not None:
        scores = scores.masked_fill(positions[None, :] <= query_positions[:, None] - window, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def _decode_case(context_lens, num_heads, num_kv_heads, dtype, head_dim=64, block_size=16, seed=0):
    k_cache, v_cache, tables = _paged_cache(context_lens, num_kv_heads, head_dim, block_size, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    ref = torch.stack([_reference_attention(q[b : b + 1], k_cache, v_cache, tables[b], length, block_size, scale)[0]
                       for b, length in enumerate(context_lens)])
    return q, k_cache, v_cache, tables, lens, scale, ref


def test_choose_num_splits():
    assert choose_num_splits(256, 8, 4096) == 1  # the batch alone fills the GPU
    assert choose_num_splits(1, 8, 100) == 1  # too short to split
    assert choose_num_splits(1, 8, 131072) == 33  # 2 x 132 programs
    assert choose_num_splits(1, 1, 131072) == MAX_SPLITS
    assert choose_num_splits(1, 8, 1024) == 4  # one split per 256 tokens
    assert choose_num_splits(4, 2, 1 << 20, num_sms=16) == 4
    assert choose_num_splits(0, 8, 0) == 1
    counts = [choose_num_splits(b, 4, 8192) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert counts == sorted(counts, reverse=True) and counts[-1] == 1


DECODE_CASES = {
    # name: (context lengths, heads, kv heads)
    "one sequence, 17 tokens, GQA": ([17], 8, 2),
    "contexts of 1, MHA": ([1, 1, 1], 4, 4),
    "4096 tokens, GQA": ([4096, 33], 4, 2),
    # lengths 1-40 in 3 rounds (the pattern repeats every 40 sequences: 300 ran it 7.5 times under the interpreter)
    "120 sequences, MQA": ([1 + (7 * i) % 40 for i in range(120)], 4, 1),
    "padding rows of length 0": ([0, 17, 0, 64], 8, 2),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_attention(case, dtype):
    context_lens, num_heads, num_kv_heads = DECODE_CASES[case]
    q, k_cache, v_cache, tables, lens, scale, ref = _decode_case(context_lens, num_heads, num_kv_heads, dtype)
    out = torch.full_like(q, float("nan"))
    assert decode_attention(q, k_cache, v_cache, tables, lens, scale, 16, out=out) is out  # default splits
    _assert_matches(out, ref, dtype)
    for b, length in enumerate(context_lens):
        if length == 0:
            assert (out[b] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_split_kv_equals_one_split(dtype):
    """3 and 8 splits of contexts long enough for each split to hold work (and one of length 0)
    give the single-split result; `out` is written in full."""
    context_lens = [1000, 17, 0, 300]
    q, k_cache, v_cache, tables, lens, scale, ref = _decode_case(context_lens, 8, 2, dtype, head_dim=32,
                                                                 block_size=8)
    single = decode_attention(q, k_cache, v_cache, tables, lens, scale, 8, num_splits=1)
    _assert_matches(single, ref, dtype)
    for splits in (3, 8):
        out = torch.full_like(q, float("nan"))
        assert decode_attention(q, k_cache, v_cache, tables, lens, scale, 8, num_splits=splits, out=out) is out
        _assert_matches(out, ref, dtype)
        torch.testing.assert_close(out.float(), single.float(), rtol=1e-5 if dtype == torch.float32 else 2e-2,
                                   atol=1e-6 if dtype == torch.float32 else 2e-2)
        assert (out[2] == 0).all()


def test_decode_attention_odd_shapes():
    """head_dim 80 (padded to a 128 tile), 32 query heads on one KV head (a group of 32 rows),
    blocks of 12 slots."""
    q, k_cache, v_cache, tables, lens, scale, ref = _decode_case([5, 130], 32, 1, torch.float32, head_dim=80,
                                                                 block_size=12)
    _assert_matches(decode_attention(q, k_cache, v_cache, tables, lens, scale, 12, num_splits=2), ref, torch.float32)


PREFILL_CASES = {
    # name: (prefix lengths, query lengths, heads, kv heads); a query length 1 row is a decode
    "mixed, GQA": ([0, 7, 40, 0, 100, 16, 3], [1, 5, 33, 17, 1, 64, 70], 8, 2),
    "MQA": ([0, 20, 5], [33, 1, 9], 4, 1),
    "MHA": ([12, 0], [5, 20], 2, 2),
    "long prefix": ([4000, 0], [96, 1], 2, 1),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_attention(case, dtype):
    prefix_lens, query_lens, num_heads, num_kv_heads = PREFILL_CASES[case]
    head_dim, block_size = 64, 16
    context_lens = [p + n for p, n in zip(prefix_lens, query_lens)]
    k_cache, v_cache, tables = _paged_cache(context_lens, num_kv_heads, head_dim, block_size, dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    starts = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    result = prefill_attention(q, k_cache, v_cache, tables, starts, lens, scale, block_size, max(query_lens), out=out)
    assert result is out
    ref = torch.cat([_reference_attention(q[starts[s] : starts[s + 1]], k_cache, v_cache, tables[s], length,
                                          block_size, scale) for s, length in enumerate(context_lens)])
    _assert_matches(out, ref, dtype)


@pytest.mark.parametrize("softcap,window", [(2.0, None), (None, 40), (2.0, 100)])
def test_soft_capped_and_windowed_attention(softcap, window):
    """A cap that bites (scores up to ~3x it), a sliding window shorter than the contexts: split
    decode and prefill (rows whose window starts past whole tiles) against the reference."""
    context_lens = [300, 17]
    q, k_cache, v_cache, tables, lens, _, _ = _decode_case(context_lens, 8, 2, torch.float32, head_dim=32, block_size=8)
    scale = 0.5
    ref = torch.stack([_reference_attention(q[b : b + 1], k_cache, v_cache, tables[b], length, 8, scale, softcap,
                                            window)[0] for b, length in enumerate(context_lens)])
    for splits in (1, 3):
        out = decode_attention(q, k_cache, v_cache, tables, lens, scale, 8, num_splits=splits, softcap=softcap,
                               window=window)
        _assert_matches(out, ref, torch.float32)
    plain = decode_attention(q, k_cache, v_cache, tables, lens, scale, 8, num_splits=1)
    assert (plain - ref.to(plain)).abs().max() > 1e-2  # the cap or the window changes the result
    starts = torch.tensor([0, 90, 107], dtype=torch.int32, device=DEVICE)  # 90 and 17 new rows
    rows = torch.randn(107, 8, 32, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    out = prefill_attention(rows, k_cache, v_cache, tables, starts, lens, scale, 8, 90, softcap=softcap, window=window)
    ref = torch.cat([_reference_attention(rows[starts[s] : starts[s + 1]], k_cache, v_cache, tables[s], length, 8,
                                          scale, softcap, window) for s, length in enumerate(context_lens)])
    _assert_matches(out, ref, torch.float32)


def test_prefill_attention_strided_q():
    """q as a view of a merged projection output (row stride > heads x head_dim)."""
    heads, kv_heads, head_dim, block_size = 4, 2, 32, 8
    prefix_lens, query_lens = [3, 0], [6, 11]
    context_lens = [p + n for p, n in zip(prefix_lens, query_lens)]
    k_cache, v_cache, tables = _paged_cache(context_lens, kv_heads, head_dim, block_size, torch.float32, seed=5)
    merged = torch.randn(sum(query_lens), (heads + 2 * kv_heads) * head_dim, device=DEVICE)
    q = merged[:, : heads * head_dim].view(-1, heads, head_dim)
    starts = torch.tensor([0, 6, 17], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    out = prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.3, block_size, 11)
    ref = torch.cat([_reference_attention(q[starts[s] : starts[s + 1]], k_cache, v_cache, tables[s], length,
                                          block_size, 0.3) for s, length in enumerate(context_lens)])
    _assert_matches(out, ref, torch.float32)


# ---- rms_norm ----------------------------------------------------------------------------


def _reference_rms_norm(x, weight, eps, weight_offset):
    x = x.double().cpu()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (weight.double().cpu() + weight_offset)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
@pytest.mark.parametrize("hidden", [300, 8192])
def test_rms_norm(dtype, weight_offset, hidden):
    """Rows of a wider tensor (strided), with and without the residual add."""
    gen = torch.Generator().manual_seed(hidden)
    tokens = 5
    wide = torch.randn(tokens, hidden + 24, generator=gen).to(DEVICE, dtype)
    x = wide[:, 8 : 8 + hidden]
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(DEVICE, dtype)
    _assert_matches(rms_norm(x, weight, 1e-6, weight_offset), _reference_rms_norm(x, weight, 1e-6, weight_offset),
                    dtype)

    residual = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    expected_sum = residual + x  # torch's add, rounded to dtype
    out, returned = rms_norm(x, weight, 1e-6, weight_offset, residual=residual)
    assert returned is residual
    if dtype == torch.float32:
        torch.testing.assert_close(residual, expected_sum, rtol=0, atol=0)
    else:  # the interpreter rounds to bf16 by truncation: 1 ulp
        torch.testing.assert_close(residual, expected_sum, rtol=2**-7, atol=0)
    _assert_matches(out, _reference_rms_norm(expected_sum, weight, 1e-6, weight_offset), dtype)


def test_rms_norm_of_heads():
    """q/k norms: x [T, heads, head_dim] viewed out of a merged projection output."""
    tokens, heads, head_dim = 6, 3, 64
    merged = torch.randn(tokens, (heads + 2) * head_dim, device=DEVICE)
    x = merged[:, head_dim : (heads + 1) * head_dim].view(tokens, heads, head_dim)
    weight = torch.randn(head_dim, device=DEVICE)
    out = rms_norm(x, weight, 1e-5)
    assert out.shape == x.shape and out.is_contiguous()
    _assert_matches(out, _reference_rms_norm(x, weight, 1e-5, 0.0), torch.float32)


# ---- rope --------------------------------------------------------------------------------


def _reference_rope(x, cos, sin):
    """HF's rotate-half: x [T, heads, D], cos/sin [T, D/2], float64."""
    x, cos, sin = x.double().cpu(), cos.double().cpu()[:, None], sin.double().cpu()[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)  # int32: the graph runner's buffers
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_and_store_kv(dtype, index_dtype):
    tokens, heads, kv_heads, head_dim, num_slots = 7, 4, 2, 64, 40
    gen = torch.Generator().manual_seed(6)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(512, dtype=torch.float32), inv_freq)
    cos_table, sin_table = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    merged = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    q, k, v = (part.view(tokens, -1, head_dim) for part in
               merged.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    positions = torch.tensor([300, 5, 0, 511, 17, 5, 100], dtype=index_dtype, device=DEVICE)
    slots = torch.tensor([3, -1, 0, 39, -1, 12, 7], dtype=index_dtype, device=DEVICE)
    k_cache = torch.full((num_slots, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))

    q_out = rope_and_store_kv(q, k, v, positions, cos_table, sin_table, k_cache, v_cache, slots)

    cos, sin = cos_table[positions], sin_table[positions]
    assert q_out.is_contiguous()
    _assert_matches(q_out, _reference_rope(q, cos, sin), dtype)
    stored = slots >= 0
    _assert_matches(k_cache[slots[stored]], _reference_rope(k[stored], cos[stored], sin[stored]), dtype)
    assert torch.equal(v_cache[slots[stored]], v[stored])
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[slots[stored]] = False
    assert k_cache[untouched].isnan().all() and v_cache[untouched].isnan().all()


# ---- act_and_mul -------------------------------------------------------------------------

ACTIVATION_REFERENCES = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy: sigmoid(-large) = 0
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATION_REFERENCES)
def test_act_and_mul(activation, dtype):
    """gate and up: the halves of one [T, 2I] output, I past one 1024-column block."""
    tokens, width = 5, 1500
    merged = (3 * torch.randn(tokens, 2 * width, generator=torch.Generator().manual_seed(7))).to(DEVICE, dtype)
    gate, up = merged[:, :width], merged[:, width:]
    out = act_and_mul(gate, up, activation)
    assert out.is_contiguous()
    ref = ACTIVATION_REFERENCES[activation](gate.double().cpu()) * up.double().cpu()
    _assert_matches(out, ref, dtype)


# ---- what the cpu backend's attention does too: sinks, images both ways, token trees ------------------------------
# (against the reference backend's own torch attention, on the same step's StepInputs: its masks are the definition)


def _step_of(prefix_lens, query_lens, tables, block_size, images=None, trees=None) -> StepInputs:
    """StepInputs of sequences with these prefixes and new rows over block `tables`. images: int64 [N, 3]
    (sequence, first, end position); trees: {sequence: its rows' masks}, the others causal as the runner
    lays them out (tree_start at the first new row, row r's bits 0..r)."""
    lens = np.add(prefix_lens, query_lens)
    starts = np.concatenate(([0], np.cumsum(query_lens))).astype(np.int32)
    positions = np.concatenate([np.arange(p, p + n) for p, n in zip(prefix_lens, query_lens)]).astype(np.int64)
    tree_start = tree_masks = None
    if trees is not None:
        tree_start = np.array(prefix_lens, dtype=np.int32)
        row_in_seq = positions - np.repeat(prefix_lens, query_lens)
        tree_masks = (np.int64(2) << np.minimum(row_in_seq, 62)) - 1
        for s, masks in trees.items():
            tree_masks[starts[s] : starts[s + 1]] = masks
            positions[starts[s] : starts[s + 1]] = [prefix_lens[s] + int(m).bit_count() - 1 for m in masks]
    return StepInputs(np.zeros(len(positions), np.int64), positions, np.zeros(len(positions), np.int64), starts,
                      lens.astype(np.int32), tables.cpu().numpy(), block_size, tree_start, tree_masks,
                      image_blocks=None if images is None else np.array(images, dtype=np.int64))


def _gpu_attention(q, k_cache, v_cache, step, **options):
    backend = GpuBackend(DEVICE)
    model = SimpleNamespace(config=SimpleNamespace(num_kv_heads=k_cache.shape[1]))
    return backend.attention(q, k_cache, v_cache, backend.inputs(model, step)[2], 0.4, **options)


def _reference_backend(q, k_cache, v_cache, step, **options):
    return Backend().attention(q.cpu(), _on_cpu(k_cache), _on_cpu(v_cache), AttentionMetadata.from_step(step, "cpu"),
                               0.4, **options)


def _on_cpu(cache):
    return type(cache)(*(x.cpu() if isinstance(x, torch.Tensor) else x for x in cache)) \
        if isinstance(cache, tuple) else cache.cpu()


def _caches(kv_format: str, context_lens, block_size: int, seed: int):
    """Paged K/V caches (4 heads on 2 KV heads of 32) as floats, q8_0 or fp8, with their tables."""
    k_cache, v_cache, tables = _paged_cache(context_lens, 2, 32, block_size, torch.float32, seed)
    if kv_format == "q8_0":
        return Q8Cache(*quantize_q8_0(k_cache)), Q8Cache(*quantize_q8_0(v_cache)), tables
    if kv_format == "fp8":
        return Fp8Cache(quantize_fp8(k_cache, 0.5), 0.5), Fp8Cache(quantize_fp8(v_cache, 0.25), 0.25), tables
    return k_cache, v_cache, tables


# the cases: (KV format, prefix lengths, query lengths, images, trees); a query length of 1 is a decode
MASK_CASES = {
    # gpt-oss's sinks: a prompt's chunk, a decode, a verification of two guesses
    "sinks": ("float32", [5, 40, 9], [20, 1, 3], None, None),
    # gemma3: two images in a chunk (the second past the chunk's end: the cache holds its first rows), a decode
    "images, fp8": ("fp8", [3, 30], [30, 1], [[0, 5, 14], [0, 20, 40]], None),
    # a token tree (root, two children, a grandchild under each), a plain decode, a prompt's chunk
    "trees, q8_0": ("q8_0", [11, 7, 2], [5, 1, 20], None, {0: [1, 0b11, 0b101, 0b1011, 0b10101]}),
}


@pytest.mark.parametrize("case", MASK_CASES)
def test_sinks_images_and_trees_as_the_reference_backend(case):
    """The prefill kernel (any step with images or trees, or with a prompt's rows), with and without a sliding
    window shorter than the contexts, against Backend.attention on the same StepInputs."""
    kv_format, prefix_lens, query_lens, images, trees = MASK_CASES[case]
    k_cache, v_cache, tables = _caches(kv_format, np.add(prefix_lens, query_lens).tolist(), 8, seed=11)
    step = _step_of(prefix_lens, query_lens, tables, 8, images, trees)
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(sum(query_lens), 4, 32, generator=gen).to(DEVICE)
    sinks = torch.randn(4, generator=gen).to(DEVICE) * 2 if case == "sinks" else None
    for window in (None, 4):
        out = _gpu_attention(q, k_cache, v_cache, step, window=window, sinks=sinks)
        ref = _reference_backend(q, k_cache, v_cache, step, window=window, sinks=None if sinks is None else sinks.cpu())
        _assert_matches(out, ref, torch.float32)
    causal = _gpu_attention(q, k_cache, v_cache, _step_of(prefix_lens, query_lens, tables, 8))
    assert (causal - out).abs().max() > 1e-2  # the feature changes the result


def test_decode_attention_with_sinks_in_split_contexts():
    """Decodes only (the split-KV kernel): each head's sink joins the softmax once whatever the splits (1, 3), a
    padding row of length 0 gives zeros, a window too."""
    context_lens = [300, 17, 0]
    k_cache, v_cache, tables = _caches("float32", context_lens, 8, seed=13)
    q = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(14)).to(DEVICE)
    sinks = torch.tensor([3.0, -1.0, 0.5, 8.0], device=DEVICE)
    step = _step_of([n - 1 if n else 0 for n in context_lens], [1, 1, 1], tables, 8)
    step.seq_lens[2] = 0
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    for window in (None, 40):
        ref = _reference_backend(q[:2], k_cache, v_cache, step.sequences(0, 2), window=window, sinks=sinks.cpu())
        for splits in (1, 3):
            out = decode_attention(q, k_cache, v_cache, tables, lens, 0.4, 8, num_splits=splits, window=window,
                                   sinks=sinks)
            _assert_matches(out[:2], ref, torch.float32)
            assert (out[2] == 0).all()
