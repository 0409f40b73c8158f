"""How K and V are stored in the paged cache: in the compute dtype, in float16, as llama.cpp's q8_0
blocks, or as fp8 e4m3.

float16 (`--kv-cache-dtype float16`): llama.cpp's default cache (its f16 K and V), each value
rounded to the nearest float16 when it is written (ties to even, torch's cast) and widened when it
is read; half the bytes of a float32 cache, which the CPU backend computes in: a decode step's
attention reads every cached row of its sequences, and at 32 sequences of 150 tokens those rows
are a third of the bytes of a 1B model's Q4_K_M weights.

q8_0 (`--kv-cache-dtype q8_0`): each token's head row of head_dim values is cut into blocks of 32;
a block keeps one float16 scale d = max|x| / 127 and 32 int8 codes round(x / d) (halves away from
zero), exactly as llama.cpp's quantize_row_q8_0_ref and gguf-py's Q8_0 compute them; a value reads
back as d * code. The codes and the scales live in two tensors (`Q8Cache`) so that every kernel
reads a row's codes as one contiguous run and its scales beside them: 34 bytes per 32 values, about
a quarter of a float32 cache and half of a bfloat16 one. Rows are quantized when they are written
(each backend's RoPE + cache write) and dequantized inside the attention kernels, tile by tile.

fp8 (`--kv-cache-dtype fp8`, or `fp8_e4m3`: vLLM's names): each value is stored as one
torch.float8_e4m3fn byte (4 exponent bits, 3 mantissa bits, largest finite value 448) with one
float32 scale per layer for all of K and one for all of V (`Fp8Cache`, vLLM's per-tensor k_scale
and v_scale): a value x is stored as x / scale rounded to the nearest e4m3 value (ties to even),
saturated to +-448, and reads back as scale * stored. The scales are 1.0, vLLM's default for a
checkpoint that carries no calibrated scales (hearth loads none): a K/V value keeps about 2
significant digits (a relative rounding error of at most 2^-4) from 2^-6 up to 448, and values
below 2^-6 keep an absolute error of at most 2^-10. One byte per value: half a 16-bit cache, so the
same budget holds twice the tokens. The gpu backend's Triton kernels write and read it (their
hardware conversions need an sm_89 GPU or newer: Ada, Hopper); the reference path here reads it
on any device; the cpu backend's C++ kernels do not (q8_0 is their 8-bit cache).

The functions below are the reference path's (plain torch, any device) and the tests' definition;
`allocate_kv_caches` lays out a model's whole cache in one of these formats (the runner's).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from typing import NamedTuple

import numpy as np
import torch

KV_CACHE_DTYPES = ("auto", "float16", "q8_0", "fp8_e4m3")
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's names: fp8 is e4m3 on NVIDIA GPUs
Q8_BLOCK = 32  # values per q8_0 block (one scale each)
FP8_MAX = 448.0  # e4m3's largest finite value: larger ones saturate to it
KV_VALUES, KV_Q8_0, KV_FP8 = 0, 1, 2  # what a cache holds, as the Triton kernels' KV_FORMAT


class Q8Cache(NamedTuple):
    """One layer's K (or V) cache in q8_0."""

    codes: torch.Tensor  # int8 [num_slots, kv_heads, head_dim]
    scales: torch.Tensor  # float16 [num_slots, kv_heads, head_dim // 32]

    @property
    def shape(self) -> torch.Size:  # [num_slots, kv_heads, head_dim], as a cache of values
        return self.codes.shape


class Fp8Cache(NamedTuple):
    """One layer's K (or V) cache in fp8 e4m3."""

    values: torch.Tensor  # float8_e4m3fn [num_slots, kv_heads, head_dim]: x / scale, rounded, saturated
    scale: float  # per tensor (vLLM's k_scale / v_scale): a stored value reads back as scale * value

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


KVCache = torch.Tensor | Q8Cache | Fp8Cache  # one layer's K or V: [num_slots, kv_heads, head_dim] of values, or quantized
KVCaches = list[tuple[KVCache, ...]]  # per layer (K, V), each [slots, kv_heads, head_dim]; or (latent,)


def kv_cache_dtype_name(kv_cache_dtype: str) -> str:
    """The name hearth keeps for a kv_cache_dtype option (fp8 -> fp8_e4m3); ValueError for one it cannot store."""
    name = KV_CACHE_DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto, float16, q8_0, fp8 or fp8_e4m3 (fp8_e5m2 is not implemented), "
                         f"got {kv_cache_dtype!r}")
    return name


def check_kv_cache_dtype(kv_cache_dtype: str, config, backend) -> None:
    """Raises ValueError where `kv_cache_dtype` cannot store the caches of the model of `config`, or
    `backend`'s kernels cannot read them (Backend.check_kv_cache_dtype)."""
    name = kv_cache_dtype_name(kv_cache_dtype)
    if name != "auto" and config.kv_lora_rank:
        raise ValueError(f"kv_cache_dtype {name} is not implemented for multi-head latent attention (its keys and "
                         "values are views of one latent cache)")
    odd = [config.head_dim_of(layer) for layer in range(config.num_layers) if config.head_dim_of(layer) % Q8_BLOCK]
    if name == "q8_0" and odd:
        raise ValueError(f"kv_cache_dtype q8_0 needs a head_dim that is a multiple of {Q8_BLOCK} (q8_0 blocks); "
                         f"this model's is {odd[0]}")
    backend.check_kv_cache_dtype(name)


def kv_bytes_per_element(kv_cache_dtype: str, itemsize: int) -> float:
    """Bytes the cache spends per K or V value: the compute dtype's `itemsize` ("auto"), 2 (float16),
    34 / 32 (q8_0), 1 (fp8: its per-tensor scales are two floats a layer, not counted)."""
    name = kv_cache_dtype_name(kv_cache_dtype)
    return {"auto": itemsize, "float16": 2, "q8_0": (Q8_BLOCK + 2) / Q8_BLOCK, "fp8_e4m3": 1}[name]


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


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x [...] -> float8_e4m3fn [...]: x / scale (as x times 1 / scale in float32, which the kernels
    compute alike) saturated to +-448, then torch's cast (round to nearest, ties to even)."""
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


Q8_PACKABLE = (torch.float16, torch.bfloat16, torch.float32)  # caches the KV tiers may store as q8_0
Payload = bytes | memoryview  # one block's K/V for the KV tiers (block_payloads): its bytes, in a buffer of its own


def stored_tensors(caches: KVCaches, block_size: int) -> list[tuple[torch.Tensor, bool]]:
    """Every tensor of a KV cache, each [slots, ...]: per layer its K and V (or latent); a quantized
    cache's codes and scales, fp8 bytes. With each, whether pack_rows may store a block of it as q8_0:
    a cache of 16- or 32-bit values whose block holds whole q8_0 blocks."""
    return [(t, isinstance(cache, torch.Tensor) and t.dtype in Q8_PACKABLE
             and t.shape[1:].numel() * block_size % Q8_BLOCK == 0)  # (no view: a sleeping cache has no storage)
            for layer in caches for cache in layer
            for t in ((cache,) if isinstance(cache, torch.Tensor) else cache if isinstance(cache, Q8Cache)
                      else (cache.values,))]


def pack_rows(rows: torch.Tensor, q8_0: bool) -> torch.Tensor:
    """A cache tensor's rows [n, m] as bytes uint8 [n, packed_width(...)]: as stored, or (q8_0, a float
    tensor with m a multiple of 32) as q8_0 blocks, the codes then the float16 scales (the KV tiers' payload)."""
    if not q8_0:
        return rows.view(torch.uint8)
    codes, scales = quantize_q8_0(rows)
    return torch.cat((codes.view(torch.uint8), scales.view(torch.uint8)), 1)


def unpack_rows(data: torch.Tensor, dtype: torch.dtype, m: int, q8_0: bool) -> torch.Tensor:
    """pack_rows' bytes uint8 [n, width] back to rows [n, m] of dtype (q8_0: dequantized)."""
    if not q8_0:
        return data.contiguous().view(dtype)
    codes = data[:, :m].contiguous().view(torch.int8)
    scales = data[:, m:].contiguous().view(torch.float16)
    return dequantize_q8_0(codes, scales).to(dtype)


def block_payloads(tensors: list[tuple[torch.Tensor, bool]], slots: torch.Tensor, num_blocks: int,
                   q8_0: bool) -> list[Payload]:
    """Each of num_blocks blocks' K/V as bytes (the KV tiers' payload) from stored_tensors' `tensors` at
    `slots` (every slot of the blocks, in order: each block's consecutive): every tensor's rows of the block
    (a q8_0 cache's codes and scales), raw, in order; with q8_0, a 16- or 32-bit cache's values as q8_0 blocks
    (pack_rows), quantized on the device, before the copy. Where the tensors are one allocation's
    (allocate_kv_caches lays each layout's so) and stay as stored, a block's rows of every layer are one
    strided slice, copied once into a buffer of its own (its payload, a memoryview): for SmolLM2's 60 tensors,
    a sixth of the time of a gather and a copy to bytes (the tiers copy every evicted block in the engine's step)."""
    stacked = None if q8_0 and any(packable for _, packable in tensors) else _one_allocation([t for t, _ in tensors])
    if stacked is not None:  # (a block's slice [tensors, block_size, ...] is its payload's layout)
        block_size = len(slots) // num_blocks
        return [_copied(stacked[:, start:start + block_size]) for start in slots[::block_size].tolist()]
    rows = torch.cat([pack_rows(t[slots].reshape(num_blocks, -1), q8_0 and packable) for t, packable in tensors], 1)
    return [row.numpy().tobytes() for row in rows.cpu()]


def _copied(rows: torch.Tensor) -> memoryview:
    """The rows' bytes, copied (from any device) into a host buffer of their own."""
    buffer = torch.empty(rows.shape, dtype=rows.dtype)
    buffer.copy_(rows)
    return memoryview(buffer.view(-1).view(torch.uint8).numpy())


def _one_allocation(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as one strided view [len(tensors), *shape] where they are alike and evenly spaced in one
    storage, in order; else None."""
    first = tensors[0]
    step = tensors[1].data_ptr() - first.data_ptr() if len(tensors) > 1 else 0
    if step <= 0 or step % first.element_size() or any(
            t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype
            or t.data_ptr() != first.data_ptr() + i * step
            or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for i, t in enumerate(tensors)):
        return None
    return first.as_strided((len(tensors), *first.shape), (step // first.element_size(), *first.stride()))


def write_block_payloads(tensors: list[tuple[torch.Tensor, bool]], slots: torch.Tensor, payloads: list[Payload],
                         block_size: int, q8_0: bool) -> None:
    """block_payloads' payloads written back into `tensors` at `slots` (q8_0: as packed with q8_0)."""
    rows = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
    rows, start = rows.view(len(payloads), -1).to(slots.device), 0
    for t, packable in tensors:
        m = t[0].numel() * block_size
        width = packed_width(m, t.element_size(), q8_0 and packable)
        values = unpack_rows(rows[:, start:start + width], t.dtype, m, q8_0 and packable)
        t[slots] = values.view(len(slots), *t.shape[1:])
        start += width


def block_payload_bytes(tensors: list[tuple[torch.Tensor, bool]], block_size: int, q8_0: bool) -> int:
    """The bytes of one block's payload (block_payloads)."""
    return sum(packed_width(t[0].numel() * block_size, t.element_size(), q8_0 and packable) for t, packable in tensors)


def packed_width(m: int, itemsize: int, q8_0: bool) -> int:
    """Bytes of one row of m values in pack_rows' payload."""
    return m + m // Q8_BLOCK * 2 if q8_0 else m * itemsize


class CacheOperands(NamedTuple):
    """What a kernel takes for one cache."""

    values: torch.Tensor  # the values, q8_0's codes or fp8's values
    block_scales: torch.Tensor  # q8_0's float16 scales (otherwise the values again, never read)
    scale: float  # fp8's per-tensor scale (otherwise 1.0)
    format: int  # KV_VALUES, KV_Q8_0 or KV_FP8


def cache_operands(cache: KVCache) -> CacheOperands:
    if isinstance(cache, Q8Cache):
        return CacheOperands(cache.codes, cache.scales, 1.0, KV_Q8_0)
    if isinstance(cache, Fp8Cache):
        return CacheOperands(cache.values, cache.values, cache.scale, KV_FP8)
    return CacheOperands(cache, cache, 1.0, KV_VALUES)


def data_pointers(cache: KVCache) -> tuple[int, int]:
    """(values or codes, scales or 0): what the C++ kernels take for one cache (contiguous; not fp8,
    which the cpu backend refuses)."""
    operands = cache_operands(cache)
    return operands.values.data_ptr(), operands.block_scales.data_ptr() if operands.format == KV_Q8_0 else 0


def read_rows(cache: KVCache, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache's rows at `slots` (any shape S) as values [*S, kv_heads, head_dim] in `dtype`."""
    if isinstance(cache, Q8Cache):
        return dequantize_q8_0(cache.codes[slots], cache.scales[slots]).to(dtype)
    if isinstance(cache, Fp8Cache):  # (gathered as bytes: torch indexes float8 on few devices)
        return (cache.values.view(torch.uint8)[slots].view(torch.float8_e4m3fn).float() * cache.scale).to(dtype)
    return cache[slots].to(dtype)


def write_rows(cache: KVCache, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Store rows [T, kv_heads, head_dim] at `slots` [T], quantized where the cache is."""
    if isinstance(cache, Q8Cache):
        codes, scales = quantize_q8_0(rows)
        cache.codes.index_copy_(0, slots, codes)
        cache.scales.index_copy_(0, slots, scales)
    elif isinstance(cache, Fp8Cache):  # (torch has no index_copy_ for float8: the bytes are copied)
        cache.values.view(torch.uint8).index_copy_(0, slots, quantize_fp8(rows, cache.scale).view(torch.uint8))
    else:
        cache.index_copy_(0, slots, rows.to(cache.dtype))


def move_rows(cache: KVCache, sources: torch.Tensor, targets: torch.Tensor) -> None:
    """Copy the rows at `sources` [N] to `targets` [N] as they are stored (q8_0 codes and scales,
    fp8 bytes, as they are: nothing quantized again)."""
    stored = ((cache.codes, cache.scales) if isinstance(cache, Q8Cache) else
              (cache.values.view(torch.uint8),) if isinstance(cache, Fp8Cache) else (cache,))
    for tensor in stored:
        tensor.index_copy_(0, targets, tensor[sources])


def allocate_kv_caches(config, num_layers: int, num_slots: int, kv_cache_dtype: str, dtype: torch.dtype,
                       device: torch.device) -> KVCaches:
    """Per layer of the first num_layers (a pipeline stage holds its own), the cache of a layer that keeps
    K/V (ModelConfig.keeps_kv_cache): (K, V), each [num_slots, its kv_heads, its head_dim] in `dtype`
    (float16 for kv_cache_dtype float16), q8_0 codes and scales, or fp8 with its scale (1.0: no checkpoint
    hearth loads carries calibrated ones); with multi-head latent attention (one latent), [num_slots, 1,
    latent width] (ModelConfig.kv_cache_layout). () for a layer that keeps none: a hybrid model's state
    layer (with_state_caches adds its states), a layer that reads another's K/V (ModelConfig.kv_sources)."""
    keeping = [layer for layer in range(num_layers) if config.keeps_kv_cache(layer)]
    caches = {}
    for layout in dict.fromkeys(config.kv_cache_layout(layer) for layer in keeping):  # one allocation per shape
        layers = [layer for layer in keeping if config.kv_cache_layout(layer) == layout]
        caches.update(zip(layers, _caches_of_layout(layout, len(layers), num_slots, kv_cache_dtype, dtype, device)))
    return [caches.get(layer, ()) for layer in range(num_layers)]


def _caches_of_layout(layout: tuple[int, int, int], num_layers: int, num_slots: int, kv_cache_dtype: str,
                      dtype: torch.dtype, device: torch.device) -> KVCaches:
    """The caches of num_layers layers of one layout (tensors, heads, width), in one allocation."""
    tensors, heads, width = layout
    shape = (tensors * num_layers, num_slots, heads, width)
    if kv_cache_dtype == "q8_0":  # (not with a latent: check_kv_cache_dtype)
        codes = zeroed(shape, torch.int8, device)
        scales = zeroed((*shape[:-1], width // Q8_BLOCK), torch.float16, device)
        caches = [Q8Cache(c, s) for c, s in zip(codes, scales)]
    elif kv_cache_dtype == "fp8_e4m3":
        caches = [Fp8Cache(values, 1.0) for values in zeroed(shape, torch.float8_e4m3fn, device)]
    else:
        caches = list(zeroed(shape, torch.float16 if kv_cache_dtype == "float16" else dtype, device))
    return [tuple(caches[tensors * i : tensors * (i + 1)]) for i in range(num_layers)]


def with_state_caches(config, kv_caches: KVCaches, num_slots: int, dtype: torch.dtype,
                      device: torch.device) -> KVCaches:
    """A hybrid model's caches, per layer: an attention layer's from kv_caches (allocate_kv_caches' of every
    layer), a state layer's states of num_slots sequences (ModelConfig.state_shapes: a convolution's window
    in `dtype`, a delta rule's or a scan's state in float32; an MLP layer's: none)."""
    return [cache if config.layer_type(layer) == "attention" else  # (config.ATTENTION: config is above)
            tuple(zeroed((num_slots, *shape), dtype if i == 0 else torch.float32, device)
                  for i, shape in enumerate(config.state_shapes(layer)))
            for layer, cache in enumerate(kv_caches)]


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor whose pages are not touched up front. On a CPU: an anonymous memory map,
    which the OS fills with zeros page by page on first use, so a KV cache sized for a long context
    costs nothing until tokens are written (torch.zeros would write every page at start-up). On a
    GPU: torch.zeros (a device memset, milliseconds). Unused slots read as zeros either way, so a
    masked attention weight of 0 never meets a NaN left in memory."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = max(1, int(np.prod(shape)) * dtype.itemsize)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=int(np.prod(shape))).view(shape)


def free_storages(tensors: list[torch.Tensor]) -> list[tuple[torch.UntypedStorage, int]]:
    """Free the memory of tensors torch allocated (a GPU's KV cache: torch.zeros), the tensor objects kept,
    each storage resized to 0 bytes; (storage, its bytes) for restore_storages, which gives the memory
    back. Kernels take the tensors anew each step; CUDA graphs, which hold the old addresses, must be
    dropped (the weights' move does: Transformer._apply)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}  # (before any is freed)
    freed = [(storage, storage.nbytes()) for storage in storages.values() if storage.nbytes()]
    for storage, _ in freed:
        storage.resize_(0)
    return freed


def restore_storages(freed: list[tuple[torch.UntypedStorage, int]]) -> None:
    """free_storages' storages given their memory again, zero-filled (unused slots must read as zeros)."""
    for storage, nbytes in freed:
        storage.resize_(nbytes)
        storage.fill_(0)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def release_pages(tensors: list[torch.Tensor]) -> int:
    """Give the pages of `zeroed` CPU tensors back to the OS, the tensors kept where they are (kernels
    and CUDA graphs hold their addresses): each storage is an anonymous shared map, whose pages are
    removed and read as zeros again, costing nothing until written. Returns the bytes released."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    for address, nbytes in storages.items():
        if _libc().madvise(address, nbytes, mmap.MADV_REMOVE) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_REMOVE) failed on the KV cache")
    return sum(storages.values())
