"""The CPU backend's kernels (hearth/backend/cpu_kernels/) and the reference backend: paged decode
attention against torch's SDPA over each sequence's context gathered densely; RMSNorm and RoPE
against transformers' modules. And their build (hearth/native.py): what it says while compiling,
and why it says the kernels are missing."""

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hearth import native
from hearth.backend.base import AttentionMetadata, Backend
from hearth.backend.cpu import DECODE_SPLIT_LEN, CpuBackend, cpu_kernels
from hearth.model.layers import RMSNorm


def _cpu_backend() -> CpuBackend:
    if cpu_kernels() is None:
        pytest.skip("the C++ kernels cannot be built here")
    return CpuBackend()

BLOCK = 16


def _case(lens, heads, kv_heads, head_dim=64, dtype=torch.float32, seed=0, rows=None):
    """Caches with blocks handed out in a shuffled order, so tables are not contiguous; rows[i]
    query rows for sequence i (its last rows[i] positions: a verification), one each by default."""
    g = torch.Generator().manual_seed(seed)
    rows = rows or [1] * len(lens)
    blocks_per_seq = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in blocks_per_seq:
        tables.append(order[used : used + n])
        used += n
    k_cache = torch.randn(num_blocks * BLOCK, kv_heads, head_dim, generator=g, dtype=dtype)
    v_cache = torch.randn(num_blocks * BLOCK, kv_heads, head_dim, generator=g, dtype=dtype)
    q = torch.randn(sum(rows), heads, head_dim, generator=g, dtype=dtype)
    width = max(blocks_per_seq)
    padded = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), prefills=[], decode_token_index=torch.arange(sum(rows)),
        decode_query_start=torch.tensor([0, *rows], dtype=torch.int32).cumsum(0, dtype=torch.int32),
        decode_block_tables=padded, decode_context_lens=torch.tensor(lens, dtype=torch.int32),
        decode_max_len=max(lens), block_size=BLOCK,
    )
    return q, k_cache, v_cache, tables, meta


def _reference(q, k_cache, v_cache, tables, lens, scale, rows=None, window=None):
    """Each query row by itself: SDPA over its sequence's context up to its own position (and
    within the window), gathered densely, in float64."""
    out, row, rows = [], 0, rows or [1] * len(lens)
    for i, n in enumerate(lens):
        for r in range(rows[i]):
            end = n - rows[i] + 1 + r
            begin = 0 if window is None else max(0, end - window)
            slots = torch.tensor([tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(begin, end)])
            k = k_cache[slots].transpose(0, 1).double()  # [kv_heads, end - begin, head_dim]
            v = v_cache[slots].transpose(0, 1).double()
            o = F.scaled_dot_product_attention(q[row].double()[:, None], k, v, scale=scale,
                                               enable_gqa=q.shape[1] != k.shape[0])
            out.append(o[:, 0])
            row += 1
    return torch.stack(out)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("split_len", [1, 7, DECODE_SPLIT_LEN, 4096])
def test_decode_kernel_matches_sdpa(heads, kv_heads, split_len):
    backend = _cpu_backend()
    lens = [1, 5, 16, 17, 300, 1000]
    q, k_cache, v_cache, tables, meta = _case(lens, heads, kv_heads)
    # 10: scores hundreds apart, most weights underflow to 0; float32 scores of that size are
    # off by ~1e-5, so are the weights
    for scale, tolerance in ((0.125, 1e-5), (10.0, 1e-4)):
        out = backend.decode_attention(q, k_cache, v_cache, meta, scale, split_len)
        torch.testing.assert_close(out.double(), _reference(q, k_cache, v_cache, tables, lens, scale),
                                   rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("head_dim", [16, 96, 128])
def test_decode_kernel_head_dims(head_dim):
    """Head sizes other than 64 and 40 (16-value slices and what is left over), 8 query heads on 2
    KV heads, several rows for some sequences, contexts of 1, 17 and 300."""
    lens, rows = [1, 17, 300], [1, 3, 2]
    q, k_cache, v_cache, tables, meta = _case(lens, 8, 2, head_dim=head_dim, rows=rows)
    out = _cpu_backend().decode_attention(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out.double(), _reference(q, k_cache, v_cache, tables, lens, 0.125, rows),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (8, 1)])
@pytest.mark.parametrize("split_len", [1, 7, DECODE_SPLIT_LEN])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_decode_kernel_with_several_rows_per_sequence(heads, kv_heads, split_len, window, head_dim):
    """Verification steps: a few query rows per sequence (different counts side by side), each
    causal among its sequence's new rows; the reference backend's SDPA path likewise. The kernel
    takes a sequence's rows and heads 16 at a time (here up to 16 x 8 of them) and head values in
    slices of 16: a head size of 40 leaves 8 over."""
    lens, rows = [1, 5, 16, 17, 300, 1000], [1, 5, 3, 1, 16, 2]
    q, k_cache, v_cache, tables, meta = _case(lens, heads, kv_heads, head_dim, rows=rows)
    expected = _reference(q, k_cache, v_cache, tables, lens, 0.125, rows, window)
    out = _cpu_backend().decode_attention(q, k_cache, v_cache, meta, 0.125, split_len, window=window)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(Backend().decode_attention(q, k_cache, v_cache, meta, 0.125, window=window).double(),
                               expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", [{"sinks": torch.randn(8, generator=torch.Generator().manual_seed(1)) * 3},
                                     {"softcap": 5.0}])
def test_decode_kernel_with_sinks_and_soft_capping(options):
    """gpt-oss's sinks (a logit per query head in each row's softmax, with no value) and gemma2's soft-capped
    scores. The kernel (across splits, several rows per sequence, a window) and the reference backend against
    the softmax written out in float64."""
    lens, rows, window, scale = [1, 17, 300], [1, 3, 2], 20, 0.5
    q, k_cache, v_cache, tables, meta = _case(lens, 8, 2, head_dim=32, rows=rows)
    sinks, softcap = options.get("sinks"), options.get("softcap")
    expected, row = [], 0
    for i, n in enumerate(lens):
        for r in range(rows[i]):
            end = n - rows[i] + 1 + r
            slots = torch.tensor([tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(max(0, end - window), end)])
            k, v = (c[slots].double().repeat_interleave(4, dim=1).transpose(0, 1) for c in (k_cache, v_cache))
            scores = q[row].double()[:, None] @ k.transpose(1, 2) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            if sinks is not None:
                scores = torch.cat([scores, sinks.double()[:, None, None]], -1)
            expected.append((scores.softmax(-1)[..., : k.shape[1]] @ v)[:, 0])
            row += 1
    expected = torch.stack(expected)
    for split_len in (7, DECODE_SPLIT_LEN):
        out = _cpu_backend().decode_attention(q, k_cache, v_cache, meta, scale, split_len, window=window, **options)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    reference = Backend().decode_attention(q, k_cache, v_cache, meta, scale, window=window, **options)
    torch.testing.assert_close(reference.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 100])
def test_decode_kernel_row_bits_do_not_depend_on_the_step(heads, kv_heads, window):
    """Greedy speculation keeps plain decoding's tokens only if a verification's rows are bit for
    bit those of single-row steps: each row of an R-row step (1 to 12 rows: the kernel's 4, 8, 16,
    32 and 48 lanes for SmolLM2's 3 query heads a KV head) beside other sequences, against the
    same row alone; contexts across split boundaries, and windows that start in other splits."""
    backend = _cpu_backend()
    for rows in range(1, 13):
        lens = [DECODE_SPLIT_LEN + 45, 3 * DECODE_SPLIT_LEN + 3, 20]
        q, k_cache, v_cache, tables, meta = _case(lens, heads, kv_heads, rows=[rows, 2, 1], seed=rows)
        together = backend.decode_attention(q, k_cache, v_cache, meta, 0.125, window=window)
        for r in range(rows):
            single = replace(meta, decode_query_start=torch.tensor([0, 1], dtype=torch.int32),
                             decode_context_lens=meta.decode_context_lens[:1] - rows + r + 1,
                             decode_block_tables=meta.decode_block_tables[:1], decode_token_index=torch.arange(1))
            alone = backend.decode_attention(q[r : r + 1], k_cache, v_cache, single, 0.125, window=window)
            assert torch.equal(alone, together[r : r + 1]), f"row {r} of {rows}"


def _tree_reference(q, k_cache, v_cache, tables, lens, rows, tree_start, parents, scale, window):
    """Each query row by itself: SDPA over the positions it sees, gathered densely in float64: its
    sequence's context before tree_start, then its ancestors in `parents` (slot index in the tree
    region -> parent's, -1: none) and itself; the window counted back from its depth."""
    out, row = [], 0
    for i, n in enumerate(lens):
        for r in range(rows[i]):
            node, path = n - rows[i] + r - tree_start[i], []  # the row's slot in the tree region
            while node >= 0:
                path.insert(0, tree_start[i] + node)
                node = parents[i][node]
            end = tree_start[i] + len(path)  # one past its position
            begin = 0 if window is None else max(0, end - window)
            seen = [p for p in range(begin, tree_start[i])] + [s for d, s in enumerate(path) if tree_start[i] + d >= begin]
            slots = torch.tensor([tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in seen])
            k, v = k_cache[slots].transpose(0, 1).double(), v_cache[slots].transpose(0, 1).double()
            o = F.scaled_dot_product_attention(q[row].double()[:, None], k, v, scale=scale,
                                               enable_gqa=q.shape[1] != k.shape[0])
            out.append(o[:, 0])
            row += 1
    return torch.stack(out)


@pytest.mark.parametrize("split_len", [DECODE_SPLIT_LEN, 1, 7])
@pytest.mark.parametrize("window", [None, 3, 40])
def test_decode_kernel_with_token_trees(split_len, window):
    """Token trees: a sequence's rows see the context before its tree region and, in the region,
    only their ancestors (a root with two branches; a draft's pass whose new rows are the second
    level of a tree whose first level is already cached; a plain causal sequence beside them)."""
    lens, rows = [40, 300, 20], [6, 3, 4]
    tree_start = [34, 297 - 3, 16]
    parents = [[-1, 0, 0, 1, 2, 3],  # root, two children, then each branch one deeper
               [-1, -1, -1, 0, 1, 2],  # three first-level nodes (cached), their three children (new)
               [-1, 0, 1, 2]]  # causal
    q, k_cache, v_cache, tables, meta = _case(lens, 8, 2, rows=rows)
    masks = []
    for i, n in enumerate(lens):
        for r in range(rows[i]):
            node, bits = n - rows[i] + r - tree_start[i], 0
            while node >= 0:
                bits |= 1 << node
                node = parents[i][node]
            masks.append(bits)
    meta.decode_tree_start = torch.tensor(tree_start, dtype=torch.int32)
    meta.decode_tree_masks = torch.tensor(masks, dtype=torch.int64)
    expected = _tree_reference(q, k_cache, v_cache, tables, lens, rows, tree_start, parents, 0.125, window)
    out = _cpu_backend().decode_attention(q, k_cache, v_cache, meta, 0.125, split_len, window=window)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(Backend().decode_attention(q, k_cache, v_cache, meta, 0.125, window=window).double(),
                               expected, rtol=1e-5, atol=1e-5)


def test_decode_kernel_tree_rows_equal_their_branch_decoded_alone():
    """Greedy speculation with token trees keeps plain decoding's tokens only if a tree row's
    attention is bit for bit that of its branch decoded alone, with its ancestors at their positions
    (as plain decoding and runner._move_kept_guesses lay them out): rows of every branch, not only
    the first (whose slots are its positions), trees across a split boundary, and a draft's second
    level (first level cached, three roots)."""
    backend = _cpu_backend()
    lens, rows = [DECODE_SPLIT_LEN + 4, 40, 300], [6, 6, 3]
    tree_start = [DECODE_SPLIT_LEN - 2, 34, 294]
    parents = [[-1, 0, 0, 1, 2, 3], [-1, 0, 0, 1, 2, 4], [-1, -1, -1, 0, 1, 2]]
    q, k_cache, v_cache, tables, meta = _case(lens, 9, 3, rows=rows, seed=3)
    masks, paths = [], []
    for i, n in enumerate(lens):
        for r in range(rows[i]):
            node, path = n - rows[i] + r - tree_start[i], []
            while node >= 0:
                path.insert(0, node)
                node = parents[i][node]
            masks.append(sum(1 << node for node in path))
            paths.append((i, path))
    meta.decode_tree_start = torch.tensor(tree_start, dtype=torch.int32)
    meta.decode_tree_masks = torch.tensor(masks, dtype=torch.int64)
    together = backend.decode_attention(q, k_cache, v_cache, meta, 0.125)
    for row, (i, path) in enumerate(paths):
        slot = lambda p: tables[i][p // BLOCK] * BLOCK + p % BLOCK  # noqa: E731
        moved_k, moved_v = k_cache.clone(), v_cache.clone()
        for d, node in enumerate(path):  # the ancestors' K/V at their positions
            moved_k[slot(tree_start[i] + d)] = k_cache[slot(tree_start[i] + node)]
            moved_v[slot(tree_start[i] + d)] = v_cache[slot(tree_start[i] + node)]
        alone_meta = replace(meta, decode_query_start=torch.tensor([0, 1], dtype=torch.int32),
                             decode_context_lens=torch.tensor([tree_start[i] + len(path)], dtype=torch.int32),
                             decode_block_tables=meta.decode_block_tables[i : i + 1], decode_token_index=torch.arange(1),
                             decode_tree_start=None, decode_tree_masks=None)
        alone = backend.decode_attention(q[row : row + 1], moved_k, moved_v, alone_meta, 0.125)
        assert torch.equal(alone, together[row : row + 1]), f"sequence {i}, path {path}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_decode_attention_matches(dtype):
    # the reference backend's batched SDPA over padded gathers
    lens = [3, 40, 17]
    q, k_cache, v_cache, tables, meta = _case(lens, 8, 2, head_dim=32, dtype=dtype)
    ref = _reference(q, k_cache, v_cache, tables, lens, 0.2).to(dtype)
    torch.testing.assert_close(Backend().decode_attention(q, k_cache, v_cache, meta, 0.2), ref)


def test_silu_and_mul_matches_torch():
    """The one-call decode path's SiLU, which the modules' path on the CPU backend runs too, against
    torch's (gate and up as the halves of one merged projection's rows; other layouts: torch's)."""
    backend = _cpu_backend()
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(7, 2 * 300, generator=g) * 6
    gate, up = gate_up.split(300, dim=-1)
    expected = F.silu(gate.double()) * up.double()
    torch.testing.assert_close(backend.act_and_mul(gate, up, "silu").double(), expected, rtol=1e-6, atol=1e-6)
    separate = backend.act_and_mul(gate.contiguous(), up.contiguous(), "silu")
    torch.testing.assert_close(separate.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_rms_norm_matches_transformers(arch):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(1)
    dim = 200
    reference = LlamaRMSNorm(dim, eps=1e-6) if arch == "llama" else GemmaRMSNorm(dim, eps=1e-6)
    reference.weight.data = torch.randn(dim, generator=g)
    ours = RMSNorm(dim, 1e-6, _cpu_backend(), weight_offset=1.0 if arch == "gemma" else 0.0)
    ours.weight.data = reference.weight.data.clone()
    for rows in (1, 3, 700):  # 700 x 200: enough work for the kernel's threads
        x = torch.randn(rows, dim, generator=g) * 3
        with torch.no_grad():
            torch.testing.assert_close(ours(x), reference(x), rtol=1e-5, atol=1e-5)
            # the residual add fused in: (norm(residual + x), residual + x), the sum in place
            residual = torch.randn(rows, dim, generator=g)
            expected_sum = residual + x
            out, new_residual = ours(x, residual)
            torch.testing.assert_close(new_residual, expected_sum)
            torch.testing.assert_close(out, reference(expected_sum), rtol=1e-5, atol=1e-5)
    x, residual = (torch.randn(2, 5, dim, generator=g).to(torch.bfloat16) for _ in range(2))
    ours.ops = Backend()  # the reference path, in bfloat16
    ours.to(torch.bfloat16), reference.to(torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), reference(x))
        out, new_residual = ours(x, residual)
        torch.testing.assert_close(new_residual, residual + x)
        torch.testing.assert_close(out, reference(residual + x))


@pytest.mark.parametrize("compiled", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("tokens", [1, 300])  # 300 x 10 heads x 64: enough work for the threads
def test_rope_and_store_kv_matches_transformers(compiled, tokens):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from hearth.config import ModelConfig
    from hearth.model.layers import RotaryEmbedding
    from models import hf_config

    backend = _cpu_backend() if compiled else Backend()
    hf = hf_config("llama", num_attention_heads=8, num_key_value_heads=2, hidden_size=512,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    heads, kv_heads, head_dim = 8, 2, 64
    g = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 512, (tokens,), generator=g)
    # q, k, v as views of one merged projection's output, as the model passes them
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                                  kv_heads * head_dim], dim=-1))
    num_slots = tokens + 7
    slots = torch.randperm(num_slots, generator=g)[:tokens]
    k_cache, v_cache = torch.zeros(num_slots, kv_heads, head_dim), torch.zeros(num_slots, kv_heads, head_dim)
    rope = RotaryEmbedding(ModelConfig.from_hf(hf.to_dict()), 512, backend)
    q_out = backend.rope_and_store_kv(q, k, v, rope(positions, torch.float32), (k_cache, v_cache), slots)

    cos, sin = LlamaRotaryEmbedding(hf)(v, positions[None])  # [1, T, head_dim]
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(q_out, q_ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_cache[slots], k_ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    assert torch.equal(v_cache[slots], v)
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize("vocab", [1, 31, 32, 49_152 + 5])
def test_token_bitmask_matches_numpy_unpackbits(vocab):
    """Grammar masks on rows 4 and 1 of 6 (bitmask rows in that order): numpy unpacks each int32
    word's bits, least significant first, as llguidance lays them out."""
    import numpy as np

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g)
    rows = torch.tensor([4, 1])
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, (vocab + 31) // 32), generator=g, dtype=torch.int32)
    bitmask[1, 0] = -1  # a word allowing all of its 32 tokens
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    expected = logits.numpy().copy()
    for row, ok in zip(rows.tolist(), allowed):
        expected[row][~ok] = -np.inf
    for backend in (Backend, _cpu_backend()):
        before = logits.clone()
        out = backend.apply_token_bitmask(logits, rows, bitmask)
        assert torch.equal(out, torch.from_numpy(expected))
        assert torch.equal(logits, before)  # the raw logits stay as they were (logprobs read them)


@pytest.mark.parametrize("vocab", [1, 17, 49_152 + 5])
def test_argmax_and_logsumexp_match_torch(vocab):
    """The greedy sampler's fused reductions against torch's argmax and float64 logsumexp: random
    rows, rows with tied maxima (the first wins), every logit -inf, a +inf, NaNs (the first NaN
    wins and the sum is NaN, as torch's), and a row-strided view (a step's last rows)."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=g) * 8
    logits[1, vocab // 2 :] = logits[1].max()  # tied maxima
    logits[2] = float("-inf")
    logits[3, vocab // 3] = float("inf")
    logits[4, vocab - 1] = logits[4, vocab // 2] = float("nan")
    ids, lse = _cpu_backend().argmax_and_logsumexp(logits)
    assert torch.equal(ids, logits.argmax(dim=-1))
    torch.testing.assert_close(lse, logits.double().logsumexp(dim=-1).float(), rtol=1e-6, atol=1e-6, equal_nan=True)
    strided = logits[::2]
    ids, lse = _cpu_backend().argmax_and_logsumexp(strided)
    assert torch.equal(ids, strided.argmax(dim=-1))
    torch.testing.assert_close(lse, strided.double().logsumexp(dim=-1).float(), rtol=1e-6, atol=1e-6, equal_nan=True)


_ASK_FOR_KERNELS = ("from hearth.quant import kernels; from hearth.backend.cpu import cpu_kernels; "
                    "assert kernels.extension() is None and cpu_kernels() is None; "
                    "assert kernels.extension() is None and cpu_kernels() is None")


def _stderr_asking_for_kernels(**env: str) -> str:
    """stderr of a new process that asks twice for both extensions (neither builds), with `env` set."""
    result = subprocess.run([sys.executable, "-c", _ASK_FOR_KERNELS], capture_output=True, text=True, timeout=300,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_kernels_turned_off_say_so_once_with_what_runs_instead():
    """HEARTH_KERNELS=0: each extension says once that it is off, why, and what runs in its place."""
    err = _stderr_asking_for_kernels(HEARTH_KERNELS="0")
    lines = err.splitlines()
    for what, instead in (("quantized matmul", "dequantize their weights in torch instead (slower)"),
                          ("attention and norm", "reference backend's torch ops instead (slower)")):
        said = [line for line in lines if line.startswith(f"hearth: {what} kernels are off (HEARTH_KERNELS=0 is set)")]
        assert len(said) == 1 and instead in said[0], err
    assert "compiling" not in err


def test_a_missing_compiler_is_named_by_its_own_error(tmp_path):
    """CXX naming no binary and nothing built yet (an empty kernels folder): the build is announced,
    then each extension says it could not be built with the shell's error line for that compiler
    (once: the second request does not try again), and what runs instead."""
    compiler = tmp_path / "no-such-compiler"
    err = _stderr_asking_for_kernels(CXX=str(compiler), HEARTH_KERNELS_DIR=str(tmp_path / "kernels"))
    assert "hearth: compiling hearth's CPU kernels for quantized matmul (once, about" in err
    for what in ("quantized matmul", "attention and norm"):
        said = [line for line in err.splitlines() if line.startswith(f"hearth: {what} kernels could not be built")]
        assert len(said) == 1 and (f"{compiler}: not found" in said[0] or f"{compiler}: No such file" in said[0]), err
        assert "instead (slower)" in said[0]
    assert "WARNING" not in err  # torch's banner about compilers and its ABI (these sources include no torch header)


def test_a_build_says_what_it_compiles_and_reads_every_included_file(tmp_path, monkeypatch, capsys):
    """A build (torch's loader stubbed: it writes the objects) announces itself with its estimate,
    names each source as its object appears, and the time it took; a second request imports
    nothing new. The build's folder is named by every file it reads: a header a source includes
    (also through another header, from another folder) changes it."""
    from torch.utils import cpp_extension

    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "base.h").write_text("int base();\n")
    (tmp_path / "job.h").write_text('#include "shared/base.h"\n')
    sources = [tmp_path / "a.cpp", tmp_path / "b.cpp"]
    for source in sources:
        source.write_text('#include "job.h"\n')
    loads = []

    def load(name, sources, build_directory, **_):
        for source in sources:
            (Path(build_directory) / f"{Path(source).stem}.o").touch()
        loads.append(name)
        return name

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setenv("HEARTH_KERNELS_DIR", str(tmp_path / "kernels"))
    monkeypatch.delenv("HEARTH_KERNELS", raising=False)
    first = native.build("hearth_test", sources, "a test", seconds=7, without="none")
    assert native.build("hearth_test", sources, "a test", seconds=7, without="none") == first == loads[0]
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "hearth: compiling hearth's CPU kernels for a test (once, about 7 s): 2 sources"
    assert sorted(line.split(" (")[0] for line in err[1:3]) == ["hearth:   a.cpp", "hearth:   b.cpp"]
    assert err[3].startswith("hearth: a test kernels compiled in ") and len(err) == 4
    (tmp_path / "shared" / "base.h").write_text("int base(int);\n")
    assert native.build("hearth_test", sources, "a test", seconds=7, without="none") != first
    assert len(loads) == 2


def test_a_build_killed_midway_does_not_block_the_next(tmp_path, monkeypatch):
    """A process killed while building leaves torch's lock file (`lock`, created and deleted by its
    loader) in the build's folder; torch's loader waits while it exists, forever. The next build
    (under hearth's flock, which dies with its holder) goes ahead: the loader is stubbed as torch's
    waits (its FileBaton, given up after 5 s here), the stale file is left by a killed child."""
    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton

    source = tmp_path / "a.cpp"
    source.write_text("int a();\n")
    monkeypatch.setenv("HEARTH_KERNELS_DIR", str(tmp_path / "kernels"))
    monkeypatch.delenv("HEARTH_KERNELS", raising=False)
    folder = tmp_path / "kernels" / f"hearth_stale_{native._key([source])}"
    folder.mkdir(parents=True)
    child = subprocess.Popen([sys.executable, "-c", "import os, sys, time; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)"
                              "; print(flush=True); time.sleep(60)", str(folder / "lock")], stdout=subprocess.PIPE)
    child.stdout.readline()
    child.kill()  # SIGKILL mid-"build": its lock file stays
    child.wait()

    def load(name, build_directory, **_):
        baton = FileBaton(str(Path(build_directory) / "lock"))
        deadline = time.monotonic() + 5
        while not baton.try_acquire():
            assert time.monotonic() < deadline, "waited on a dead build's lock"
            time.sleep(0.1)
        baton.release()
        return name

    monkeypatch.setattr(cpp_extension, "load", load)
    assert native.build("hearth_stale", [source], "a test", seconds=1, without="none") == folder.name


def test_importing_hearth_asks_huge_pages_for_large_cpu_tensors():
    """hearth/__init__.py sets torch's THP_MEM_ALLOC_ENABLE before torch's first allocation: in a fresh interpreter
    the mapping of a 64 MB tensor is eligible for transparent huge pages (smaps' THPeligible: torch asked by
    madvise) where the system gives them only to those who ask (`madvise`); a value the user set is kept (0: not)."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[madvise]" not in mode.read_text():
        pytest.skip("transparent huge pages here are not given on request (madvise)")
    code = ("import hearth, torch\n"
            "t = torch.ones(16 * 2**20)\n"
            "inside = False\n"
            "for line in open('/proc/self/smaps'):\n"
            "    head = line.split()[0]\n"
            "    if '-' in head and not head.endswith(':'):\n"
            "        low, high = (int(x, 16) for x in head.split('-'))\n"
            "        inside = low <= t.data_ptr() < high\n"
            "    elif inside and line.startswith('THPeligible'):\n"
            "        print(line.split()[1])")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}

    def eligible(extra: dict) -> str:
        done = subprocess.run([sys.executable, "-c", code], env=env | extra, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert eligible({}) == "1"
    assert eligible({"THP_MEM_ALLOC_ENABLE": "0"}) == "0"


@pytest.mark.parametrize("lens,kv_heads", [([200], 3), ([200], 4), ([40, 600], 3)])
def test_decode_kernel_threads_and_head_shares(lens, kv_heads):
    """With 2 threads and fewer splits than threads (one sequence under DECODE_SPLIT_LEN tokens) a work item
    takes a share of the KV heads (attention.cpp's plan_splits), otherwise all of them: either way every head
    sums in the same order, so the output is 1 thread's bit for bit, and SDPA's within float32 rounding.
    (The suite runs torch on 1 thread: conftest.py.)"""
    q, k_cache, v_cache, tables, meta = _case(lens, 3 * kv_heads, kv_heads)
    backend = _cpu_backend()
    one = backend.decode_attention(q, k_cache, v_cache, meta, 0.125)
    torch.set_num_threads(2)
    try:
        two = backend.decode_attention(q, k_cache, v_cache, meta, 0.125)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(one, two)
    torch.testing.assert_close(two.double(), _reference(q, k_cache, v_cache, tables, lens, 0.125), rtol=1e-5, atol=1e-5)
