"""How K and V are stored in the paged cache: in the compute dtype, or as llama.cpp's q8_0 blocks.

q8_0 (`--kv-cache-dtype q8_0`): each token's head row of head_dim values is cut into blocks of 32;
a block keeps one float16 scale d = max|x| / 127 and 32 int8 codes round(x / d) (halves away from
zero), exactly as llama.cpp's quantize_row_q8_0_ref and gguf-py's Q8_0 compute them; a value reads
back as d * code. The codes and the scales live in two tensors (`Q8Cache`) so that every kernel
reads a row's codes as one contiguous run and its scales beside them: 34 bytes per 32 values, about
a quarter of a float32 cache and half of a bfloat16 one. Rows are quantized when they are written
(each backend's RoPE + cache write) and dequantized inside the attention kernels, tile by tile.

fp8_e4m3 is refused by name: Triton's interpreter, which tests the GPU kernels on machines
without a GPU, cannot cast to fp8, so no kernel path for it could be checked here.

The functions below are the reference path's (plain torch, any device) and the tests' definition.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

KV_CACHE_DTYPES = ("auto", "q8_0")
Q8_BLOCK = 32  # values per q8_0 block (one scale each)


class Q8Cache(NamedTuple):
    """One layer's K (or V) cache in q8_0."""

    codes: torch.Tensor  # int8 [num_slots, kv_heads, head_dim]
    scales: torch.Tensor  # float16 [num_slots, kv_heads, head_dim // 32]

    @property
    def shape(self) -> torch.Size:  # [num_slots, kv_heads, head_dim], as a cache of values
        return self.codes.shape


KVCache = torch.Tensor | Q8Cache  # one layer's K or V: [num_slots, kv_heads, head_dim] of values, or q8_0


def check_kv_cache_dtype(kv_cache_dtype: str, config) -> None:
    """Raises ValueError where `kv_cache_dtype` cannot store the caches of the model of `config`."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or q8_0 (fp8_e4m3 is not implemented), got {kv_cache_dtype!r}")
    if kv_cache_dtype == "q8_0" and config.kv_lora_rank:
        raise ValueError("kv_cache_dtype q8_0 is not implemented for multi-head latent attention (its keys and "
                         "values are views of one latent cache)")
    if kv_cache_dtype == "q8_0" and config.head_dim % Q8_BLOCK:
        raise ValueError(f"kv_cache_dtype q8_0 needs a head_dim that is a multiple of {Q8_BLOCK} (q8_0 blocks); "
                         f"this model's is {config.head_dim}")


def kv_bytes_per_element(kv_cache_dtype: str, itemsize: int) -> float:
    """Bytes the cache spends per K or V value: the compute dtype's `itemsize` ("auto"), 34 / 32 (q8_0)."""
    return itemsize if kv_cache_dtype == "auto" else (Q8_BLOCK + 2) / Q8_BLOCK


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] (n a multiple of 32) -> (int8 codes [..., n], float16 scales [..., n // 32]), as gguf's Q8_0."""
    blocks = x.float().unflatten(-1, (-1, Q8_BLOCK))
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d == 0, 0.0, 1.0 / d)
    y = blocks * inverse
    # round half away from zero, as numpy's floor(a) + floor(2 (a - floor(a))) in gguf-py (torch.round is half-even)
    a = y.abs()
    whole = a.floor()
    codes = torch.copysign(whole + (2 * (a - whole)).floor(), y)
    return codes.to(torch.int8).flatten(-2), d.squeeze(-1).to(torch.float16)


def dequantize_q8_0(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(int8 [..., n], float16 [..., n // 32]) -> float32 [..., n]: scale * code, as gguf's dequantizer."""
    return (codes.float().unflatten(-1, (-1, Q8_BLOCK)) * scales.float()[..., None]).flatten(-2)


def cache_operands(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """What a kernel takes for one cache: (values or codes, scales (for a cache of values the values
    again, never read), quantized?)."""
    if isinstance(cache, Q8Cache):
        return cache.codes, cache.scales, True
    return cache, cache, False


def data_pointers(cache: KVCache) -> tuple[int, int]:
    """(values or codes, scales or 0): what the C++ kernels take for one cache (contiguous)."""
    values, scales, quantized = cache_operands(cache)
    return values.data_ptr(), scales.data_ptr() if quantized else 0


def read_rows(cache: KVCache, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache's rows at `slots` (any shape S) as values [*S, kv_heads, head_dim] in `dtype`."""
    if isinstance(cache, Q8Cache):
        return dequantize_q8_0(cache.codes[slots], cache.scales[slots]).to(dtype)
    return cache[slots].to(dtype)


def write_rows(cache: KVCache, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Store rows [T, kv_heads, head_dim] at `slots` [T], quantized where the cache is."""
    if isinstance(cache, Q8Cache):
        codes, scales = quantize_q8_0(rows)
        cache.codes.index_copy_(0, slots, codes)
        cache.scales.index_copy_(0, slots, scales)
    else:
        cache.index_copy_(0, slots, rows.to(cache.dtype))


def move_rows(cache: KVCache, sources: torch.Tensor, targets: torch.Tensor) -> None:
    """Copy the rows at `sources` [N] to `targets` [N] as they are stored (q8_0 codes and scales as
    they are: nothing quantized again)."""
    for tensor in (cache.codes, cache.scales) if isinstance(cache, Q8Cache) else (cache,):
        tensor.index_copy_(0, targets, tensor[sources])
