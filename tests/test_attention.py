"""Paged decode attention (hearth/model/attention.py, paged_attention.cpp) against torch's SDPA
over each sequence's context gathered densely."""

import pytest
import torch
import torch.nn.functional as F

from hearth.model.attention import (
    AttentionMetadata, _decode_kernel, decode_attention, decode_attention_sdpa, decode_split_len,
)

BLOCK = 16


def _case(lens, heads, kv_heads, head_dim=64, dtype=torch.float32, seed=0):
    """Caches with blocks handed out in a shuffled order, so tables are not contiguous."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in blocks_per_seq:
        tables.append(order[used : used + n])
        used += n
    k_cache = torch.randn(num_blocks * BLOCK, kv_heads, head_dim, generator=g, dtype=dtype)
    v_cache = torch.randn(num_blocks * BLOCK, kv_heads, head_dim, generator=g, dtype=dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=g, dtype=dtype)
    width = max(blocks_per_seq)
    padded = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), prefills=[],
        decode_token_index=torch.arange(len(lens)), decode_block_tables=padded,
        decode_context_lens=torch.tensor(lens, dtype=torch.int32), decode_max_len=max(lens), block_size=BLOCK,
    )
    return q, k_cache, v_cache, tables, meta


def _reference(q, k_cache, v_cache, tables, lens, scale):
    out = []
    for i, n in enumerate(lens):
        slots = torch.tensor([tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
        k = k_cache[slots].transpose(0, 1).double()  # [kv_heads, n, head_dim]
        v = v_cache[slots].transpose(0, 1).double()
        o = F.scaled_dot_product_attention(q[i].double()[:, None], k, v, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[0])
        out.append(o[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("split_len", [None, 1, 7, 256, 4096])
def test_decode_kernel_matches_sdpa(heads, kv_heads, split_len):
    if _decode_kernel() is None:
        pytest.skip("the C++ kernels cannot be built here")
    lens = [1, 5, 16, 17, 300, 1000]
    q, k_cache, v_cache, tables, meta = _case(lens, heads, kv_heads)
    out = decode_attention(q, k_cache, v_cache, meta, 0.125, split_len)
    torch.testing.assert_close(out.double(), _reference(q, k_cache, v_cache, tables, lens, 0.125),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decode_sdpa_path_matches(dtype):
    # the batched SDPA path over padded gathers (CUDA, dtypes other than float32, no compiler);
    # float64 goes there through decode_attention itself
    lens = [3, 40, 17]
    q, k_cache, v_cache, tables, meta = _case(lens, 8, 2, head_dim=32, dtype=dtype)
    ref = _reference(q, k_cache, v_cache, tables, lens, 0.2).to(dtype)
    torch.testing.assert_close(decode_attention_sdpa(q, k_cache, v_cache, meta, 0.2), ref)
    torch.testing.assert_close(decode_attention(q, k_cache, v_cache, meta, 0.2), ref)


def test_split_len_policy():
    # enough sequences x KV heads for every thread: whole contexts
    assert decode_split_len(8, 4, 5000, threads=2) == 5000
    # one sequence, one KV head, 2 threads: 4 splits of a long context, never below 256 tokens
    assert decode_split_len(1, 1, 4096, threads=2) == 1024
    assert decode_split_len(1, 1, 300, threads=2) == 256
