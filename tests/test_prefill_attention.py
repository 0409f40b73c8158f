"""The CPU backend's prompt attention (hearth/backend/cpu_kernels/prefill_attention.cpp): each prompt's rows
over its context, read from a paged cache through shuffled slots, against torch's attention written out in
float64 over the same rows gathered densely, with the causal (and sliding-window) mask."""

import pytest
import torch
import torch.nn.functional as F

from hearth.backend.base import PrefillSequence
from hearth.backend.cpu import CpuBackend, cpu_kernels
from hearth.kv_format import Q8Cache, dequantize_q8_0, quantize_q8_0


def _backend() -> CpuBackend:
    if cpu_kernels() is None:
        pytest.skip("the C++ kernels cannot be built here")
    return CpuBackend()


def _prompt(new, context, heads, kv_heads, head_dim, value_dim, seed=0, images=()):
    """q for the last `new` of `context` positions, K/V caches with the context at shuffled slots, and the
    prompt's PrefillSequence (causal, or with images: [first, end) position ranges seen both ways)."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(context + 40, generator=g)[:context]
    k_cache = torch.randn(context + 40, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(context + 40, kv_heads, value_dim, generator=g)
    q = torch.randn(new, heads, head_dim, generator=g)
    rows = torch.arange(context - new, context)[:, None]
    columns = torch.arange(context)[None, :]
    sees = columns <= rows
    for low, high in images:
        sees |= (rows >= low) & (rows < high) & (columns >= low) & (columns < high)
    return q, k_cache, v_cache, PrefillSequence(0, new, slots, sees, causal=not images)


def _reference(q, k_cache, v_cache, seq, scale, window=None, softcap=None, sinks=None):
    """Written out in float64: scores (soft-capped), the mask, a softmax (with each head's sink logit), values."""
    keys = k_cache[seq.context_slots].transpose(0, 1).double()  # [kv_heads, L, D]
    values = v_cache[seq.context_slots].transpose(0, 1).double()
    groups = q.shape[1] // keys.shape[0]
    scores = q.transpose(0, 1).double() @ keys.repeat_interleave(groups, 0).transpose(1, 2) * scale  # [H, T, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~seq.mask(window), float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)], -1)
    weights = torch.softmax(scores, -1)[..., : keys.shape[1]]
    return (weights @ values.repeat_interleave(groups, 0)).transpose(0, 1)


@pytest.mark.parametrize("new, context, heads, kv_heads, head_dim, value_dim, window", [
    (128, 128, 32, 4, 64, 64, None),    # TinyLlama's shape, a whole prompt
    (200, 517, 9, 3, 64, 64, None),     # a chunk after cached positions; keys past a whole block
    (1 + 64 * 2, 131, 8, 8, 80, 80, None),  # no GQA, a head dim of 5 vectors
    (70, 90, 12, 2, 128, 128, 33),      # a sliding window shorter than the chunk
    (5, 300, 4, 1, 64, 64, 100),        # a few rows, the window's start inside a later block
    (17, 17, 16, 1, 192, 128, None),    # values narrower than keys (multi-head latent attention's shape)
    (9, 9, 64, 2, 32, 32, None),        # 32 query heads a KV head: one position a work item
])
def test_prefill_kernel_matches_sdpa(new, context, heads, kv_heads, head_dim, value_dim, window):
    q, k_cache, v_cache, seq = _prompt(new, context, heads, kv_heads, head_dim, value_dim)
    scale = head_dim ** -0.5
    out = _backend().prefill_attention(q, k_cache, v_cache, seq, scale, window=window)
    assert out.shape == (new, heads, value_dim)
    torch.testing.assert_close(out.double(), _reference(q, k_cache, v_cache, seq, scale, window), atol=2e-6, rtol=1e-5)


def test_prefill_kernel_reads_a_q8_0_cache_as_its_values():
    q, k_cache, v_cache, seq = _prompt(40, 60, 8, 2, 64, 64, seed=1)
    k8, v8 = Q8Cache(*quantize_q8_0(k_cache)), Q8Cache(*quantize_q8_0(v_cache))
    out = _backend().prefill_attention(q, k8, v8, seq, 0.125)
    widened = [dequantize_q8_0(cache.codes, cache.scales) for cache in (k8, v8)]
    torch.testing.assert_close(out.double(), _reference(q, *widened, seq, 0.125), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("options", [{"sinks": torch.randn(8, generator=torch.Generator().manual_seed(5)) * 3},
                                     {"softcap": 5.0}])
def test_prefill_kernel_with_sinks_and_soft_capping(window, options):
    """gpt-oss's sinks (a logit per query head in each row's softmax, no value) and gemma2's soft-capped scores,
    each with a sliding window too."""
    q, k_cache, v_cache, seq = _prompt(50, 70, 8, 2, 64, 64, seed=4)
    scale = 0.5  # scores of several units: the cap bends them
    out = _backend().prefill_attention(q, k_cache, v_cache, seq, scale, window=window, **options)
    torch.testing.assert_close(out.double(), _reference(q, k_cache, v_cache, seq, scale, window, **options),
                               atol=4e-6, rtol=1e-5)


def test_images_take_the_reference_path():
    """Rows that see an image both ways: causal elsewhere, the image's tokens each other (the reference path's)."""
    q, k_cache, v_cache, seq = _prompt(30, 30, 8, 2, 64, 64, seed=2, images=[(4, 12)])
    torch.testing.assert_close(_backend().prefill_attention(q, k_cache, v_cache, seq, 0.125).double(),
                               _reference(q, k_cache, v_cache, seq, 0.125), atol=2e-6, rtol=1e-5)
