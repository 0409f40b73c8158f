// A layer's small operations, each one call where torch would run several ops: RMSNorm (after the
// residual add), RoPE with the K/V cache write, SiLU and multiply.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#include "cpu_kernels.h"
#include "kv_rows.h"
#include "vector_math.h"

namespace hearth {
namespace {

// out [D] = rotate-half RoPE of x [D] with cos, sin [D/2]
inline void rope_head(const float* x, const float* cos, const float* sin, float* out, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    out[i] = x[i] * cos[i] - x[i + half] * sin[i];
    out[i + half] = x[i + half] * cos[i] + x[i] * sin[i];
  }
}

}  // namespace

// x, out [rows, dim]; add [rows, dim] or null; w [dim]
void rms_norm(uintptr_t x_, uintptr_t add_, uintptr_t w_, uintptr_t out_, int64_t rows, int64_t dim, double eps,
              double offset, int threads) {
  float* x = reinterpret_cast<float*>(x_);
  const float* add = reinterpret_cast<const float*>(add_);
  const float* w = reinterpret_cast<const float*>(w_);
  float* out = reinterpret_cast<float*>(out_);
  const float foffset = (float)offset;
  threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, rows * dim / 16384));
#pragma omp parallel for num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * dim;
    float* o = out + r * dim;
    if (add) {
      const float* a = add + r * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) xr[i] += a[i];
    }
    float sq = 0.f;
#pragma omp simd reduction(+ : sq)
    for (int64_t i = 0; i < dim; ++i) sq += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(sq / (float)dim + (float)eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) o[i] = (xr[i] * inv) * (w[i] + foffset);
  }
}

// q [T, H, D], k and v [T, KH, D], each with its own token stride (heads contiguous); cos, sin
// [T, D/2]; slots int64 [T]; q_out [T, H, D]; k_cache, v_cache [slots, KH, D] in kv_format
// (KVFormat; q8_0: int8 codes with float16 scales k_scales, v_scales [slots, KH, D/32])
void rope_and_store_kv(uintptr_t q_, uintptr_t k_, uintptr_t v_, int64_t q_stride, int64_t k_stride,
                       int64_t v_stride, uintptr_t cos_, uintptr_t sin_, uintptr_t slots_, uintptr_t q_out_,
                       uintptr_t k_cache_, uintptr_t v_cache_, uintptr_t k_scales_, uintptr_t v_scales_,
                       int kv_format, int64_t tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int threads) {
  const float* q = reinterpret_cast<const float*>(q_);
  const float* k = reinterpret_cast<const float*>(k_);
  const float* v = reinterpret_cast<const float*>(v_);
  const float* cos = reinterpret_cast<const float*>(cos_);
  const float* sin = reinterpret_cast<const float*>(sin_);
  const int64_t* slots = reinterpret_cast<const int64_t*>(slots_);
  float* q_out = reinterpret_cast<float*>(q_out_);
  void* k_cache = reinterpret_cast<void*>(k_cache_);
  void* v_cache = reinterpret_cast<void*>(v_cache_);
  _Float16* k_scales = reinterpret_cast<_Float16*>(k_scales_);
  _Float16* v_scales = reinterpret_cast<_Float16*>(v_scales_);
  const int64_t half = head_dim / 2;
  threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, tokens * (num_heads + num_kv_heads) * head_dim / 65536));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> k_rotated(head_dim);
#pragma omp for
    for (int64_t t = 0; t < tokens; ++t) {
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      for (int64_t h = 0; h < num_heads; ++h)
        rope_head(q + t * q_stride + h * head_dim, c, s, q_out + (t * num_heads + h) * head_dim, half);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t row = slots[t] * num_kv_heads + h;
        rope_head(k + t * k_stride + h * head_dim, c, s, k_rotated.data(), half);
        store_row(k_cache, k_scales, kv_format, row, k_rotated.data(), head_dim);
        store_row(v_cache, v_scales, kv_format, row, v + t * v_stride + h * head_dim, head_dim);
      }
    }
  }
}

// out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:] (vector_math.h's silu)
void silu_and_mul(const float* gate_up, float* out, int64_t tokens, int64_t inter, int threads) {
  threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, tokens * inter / 65536));
#pragma omp parallel for num_threads(threads)
  for (int64_t t = 0; t < tokens; ++t) {
    silu_times(gate_up + t * 2 * inter, gate_up + t * 2 * inter + inter, out + t * inter, inter);
  }
}

}  // namespace hearth
