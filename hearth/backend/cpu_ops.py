"""What the cpu backend's modules share: the kernels of cpu_kernels/ built, and the operands its kernels take
(KV cache formats, token trees, the decode attention's split length)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from hearth.backend.base import AttentionMetadata
from hearth.kv_format import KVCache, Q8Cache
from hearth.native import build

# decode_attention's splits (flash-decoding): the context cut at the multiples of this, whatever the
# batch, so that a row's result does not depend on the rows and sequences beside it (a verification's
# rows are those of single-row steps: greedy speculation keeps plain decoding's tokens). Fixed splits
# measured as fast as whole contexts or faster at batch 1 to 32 and contexts of 512 to 8192
# (docs/benchmarks.md, 2026-11-25: "Fixed splits cost nothing").
DECODE_SPLIT_LEN = 256


@functools.cache
def cpu_kernels():
    """The sources in cpu_kernels/ compiled, or None (no compiler, HEARTH_KERNELS=0): then no CpuBackend."""
    return build("hearth_cpu_kernels", sorted((Path(__file__).parent / "cpu_kernels").glob("*.cpp")),
                 "attention and norm", seconds=20,
                 without="float32 models run on the reference backend's torch ops instead (slower)")


def tree_pointers(meta: AttentionMetadata) -> tuple[int, int]:
    """The decodes' token trees for the kernels: tree_start's and tree_masks' data (0, 0: causal)."""
    if meta.decode_tree_masks is None:
        return 0, 0
    return meta.decode_tree_start.data_ptr(), meta.decode_tree_masks.data_ptr()


def kv_format(cache: KVCache) -> int | None:
    """cpu_kernels/'s KVFormat of a cache the kernels read: float32, float16 or q8_0, in
    contiguous tensors; None for another (bfloat16, fp8, a strided view)."""
    if isinstance(cache, Q8Cache):
        name = "q8_0" if cache.codes.is_contiguous() and cache.scales.is_contiguous() else None
    elif isinstance(cache, torch.Tensor) and cache.is_contiguous():
        name = str(cache.dtype).removeprefix("torch.")
    else:
        name = None
    formats = cpu_kernels().KV_FORMATS
    return formats.index(name) if name in formats else None


def whole_caches_format(k_cache: KVCache, v_cache: KVCache) -> int | None:
    """The KVFormat of K and V caches the kernels read: each its own contiguous tensor, both of one
    format and width; None otherwise. Multi-head latent attention's views of its one latent cache
    (hearth/model/latent_attention.py) take the reference path."""
    k_format = kv_format(k_cache)
    if k_format is None or kv_format(v_cache) != k_format or k_cache.shape != v_cache.shape:
        return None
    return k_format


def float32_contiguous(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() and t.is_cpu for t in tensors)
