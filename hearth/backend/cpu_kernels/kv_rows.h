// A layer's K or V cache rows in their format (float32, float16 or q8_0): read widened, written
// rounded or quantized, prefetched. decode_attention reads them, rope_and_store_kv writes them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "../../quant/kernels/formats.h"

namespace hearth {
namespace {  // each source's own copies, internal as when the kernels were one file

// Cache rows read ahead (KVRows::touch): after a step's matmuls have streamed the weights through
// the caches every K/V row comes from DRAM, and read where the multiply-adds need them the kernel
// runs at DRAM's latency (the out-of-order window full of multiply-adds holds few loads). A loop of
// loads alone keeps many in flight: decode_attention reads a work item's rows so before its passes,
// every KV head of the item's tokens at once (contiguous in a slot). Software prefetches of the
// same rows did not help on an AVX-512 EPYC (SmolLM2's shape at 1,024 tokens, 30 layers' caches:
// ~300 us a layer either way; read by loads first, ~120 us). Beside the loads, prefetches into L2 of
// the rows a few slots ahead keep more lines in flight than the loads alone (the loop ~25% faster).

// One load from each 64-byte line that [p, p + bytes) touches, into a value the compiler must keep
inline void touch_bytes(const void* p, int64_t bytes) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + bytes;
  uint64_t any = 0;
  for (uintptr_t line = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(63); line < end; line += 64)
    any |= *reinterpret_cast<const volatile uint64_t*>(line);
  asm volatile("" : : "r"(any));
}

// [p, p + bytes) asked for into L2 (a T1 prefetch of each line it touches)
inline void prefetch_bytes_l2(const void* p, int64_t bytes) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + bytes;
  for (uintptr_t line = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(63); line < end; line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
}

constexpr int64_t Q8_BLOCK = Fmt<Q8_0>::BS;  // llama.cpp's q8_0, as the weights' Q8_0

// How a KV cache stores its values (the Python side's cpu.kv_format)
enum KVFormat { KV_F32 = 0, KV_Q8_0 = 1, KV_F16 = 2 };

// float16 <-> float32, n values, 16 (8) at a time through the conversion instructions (F16C, or
// AVX-512's): GCC turns a loop of _Float16 casts into one scalar conversion per value
inline void widen_f16(const _Float16* x, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i))));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
#endif
  for (; i < n; ++i) out[i] = (float)x[i];
}

// rounded to nearest even, as torch's cast
inline void narrow_f16(const float* x, _Float16* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) out[i] = (_Float16)x[i];
}

// One layer's K or V cache: float32 or float16 rows, or q8_0 codes and scales.
struct KVRows {
  const void* data;
  const _Float16* scales;  // q8_0's
  int64_t D;
  int format;  // KVFormat

  // the row's values: in place (float32), or widened into buf [D]
  const float* get(int64_t row, float* buf) const {
    if (format == KV_F32) return static_cast<const float*>(data) + row * D;
    if (format == KV_F16) {
      widen_f16(static_cast<const _Float16*>(data) + row * D, buf, D);
      return buf;
    }
    const int8_t* codes = static_cast<const int8_t*>(data) + row * D;
    const _Float16* d = scales + row * (D / Q8_BLOCK);
    for (int64_t b = 0; b < D / Q8_BLOCK; ++b) {
      const float scale = (float)d[b];
#pragma omp simd
      for (int64_t i = 0; i < Q8_BLOCK; ++i) buf[b * Q8_BLOCK + i] = scale * (float)codes[b * Q8_BLOCK + i];
    }
    return buf;
  }

  // rows [row, row + count) read into the caches (touch_bytes)
  void touch(int64_t row, int64_t count) const { for_bytes(row, count, touch_bytes); }
  // ... asked for into L2 (prefetch_bytes_l2)
  void prefetch_l2(int64_t row, int64_t count) const { for_bytes(row, count, prefetch_bytes_l2); }

  // f(pointer, bytes) of the values (and q8_0's scales) of rows [row, row + count)
  template <typename F>
  void for_bytes(int64_t row, int64_t count, F f) const {
    if (format == KV_F32) return f(static_cast<const float*>(data) + row * D, count * D * (int64_t)sizeof(float));
    if (format == KV_F16) return f(static_cast<const _Float16*>(data) + row * D, count * D * (int64_t)sizeof(_Float16));
    f(static_cast<const int8_t*>(data) + row * D, count * D);
    f(scales + row * (D / Q8_BLOCK), count * (D / Q8_BLOCK) * (int64_t)sizeof(_Float16));
  }
};

// x [D] -> codes [D], scales [D/32]: llama.cpp's quantize_row_q8_0_ref (and gguf-py's Q8_0), bit for bit
inline void quantize_row_q8_0(const float* x, int8_t* codes, _Float16* scales, int64_t D) {
  for (int64_t b = 0; b < D / Q8_BLOCK; ++b) {
    const float* xb = x + b * Q8_BLOCK;
    float amax = 0.f;
    for (int64_t i = 0; i < Q8_BLOCK; ++i) amax = std::max(amax, std::abs(xb[i]));
    const float d = amax / 127.f, inverse = d != 0.f ? 1.f / d : 0.f;
    for (int64_t i = 0; i < Q8_BLOCK; ++i) codes[b * Q8_BLOCK + i] = (int8_t)std::round(xb[i] * inverse);
    scales[b] = (_Float16)d;
  }
}

// Store a head row x [D] at `row` of a cache of `format`.
inline void store_row(void* cache, _Float16* scales, int format, int64_t row, const float* x, int64_t D) {
  if (format == KV_F32) {
    std::memcpy(static_cast<float*>(cache) + row * D, x, D * sizeof(float));
    return;
  }
  if (format == KV_F16) {
    narrow_f16(x, static_cast<_Float16*>(cache) + row * D, D);
    return;
  }
  quantize_row_q8_0(x, static_cast<int8_t*>(cache) + row * D, scales + row * (D / Q8_BLOCK), D);
}

}  // namespace
}  // namespace hearth
