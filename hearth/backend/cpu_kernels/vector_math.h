// Loops the kernels share, in forms the compiler vectorises: exp of non-positive numbers, SiLU, a row's
// argmax.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace hearth {
namespace {  // each source's own copies, internal as when the kernels were one file

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (scores minus their maximum), in a form the compiler vectorises (std::exp
// is a scalar call): 2^(x log2 e) = 2^i 2^f with i = round(.), |f| <= 1/2, 2^f by its degree-7
// Taylor polynomial in f ln 2 (relative error < 1e-8, below float32's rounding).
inline float exp_nonpositive(float x) {
  const float t = std::max(x * 1.44269504088896341f, -126.f);  // below: 2^-126, as good as 0 here
  const float i = std::nearbyint(t);
  const float y = (t - i) * 0.693147180559945309f;
  float p = 1.f / 5040;
  p = p * y + 1.f / 720;
  p = p * y + 1.f / 120;
  p = p * y + 1.f / 24;
  p = p * y + 1.f / 6;
  p = p * y + 0.5f;
  p = p * y + 1.f;
  p = p * y + 1.f;
  const int32_t bits = ((int32_t)i + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// silu(x) = x / (1 + exp(-x)) with the exp of -|x| (so never of a positive number): x >= 0: x / (1 + e),
// x < 0: x e / (1 + e)
inline float silu(float x) {
  const float e = exp_nonpositive(-std::abs(x));
  return (x >= 0.f ? x : x * e) / (1.f + e);
}

#ifdef __AVX2__
// exp_nonpositive of 8 values with the same operations (its multiply-adds contracted, as GCC does the
// scalar form's): GCC leaves loops of the scalar form unvectorised (its clamp and rounding make
// control flow), one value at a time
inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 t = _mm256_max_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(-126.f));
  const __m256 i = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 y = _mm256_mul_ps(_mm256_sub_ps(t, i), _mm256_set1_ps(0.693147180559945309f));
  __m256 p = _mm256_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(i), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// silu of 8 values, as silu's
inline __m256 silu8(__m256 x) {
  const __m256 e = exp_nonpositive8(_mm256_or_ps(x, _mm256_set1_ps(-0.f)));  // exp(-|x|)
  const __m256 num = _mm256_blendv_ps(_mm256_mul_ps(x, e), x, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
  return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}
#endif

// x[k] = exp(x[k] - shift[k]), 0 where x[k] is -inf, and sum[k] += that, for k < n
inline void exp_shifted(float* x, const float* shift, float* sum, int64_t n) {
  int64_t k = 0;
#ifdef __AVX512F__
  for (; k + 16 <= n; k += 16) {
    const __m512 xk = _mm512_loadu_ps(x + k);
    const __mmask16 finite = _mm512_cmp_ps_mask(xk, _mm512_set1_ps(NEG_INF), _CMP_NEQ_OQ);
    const __m512 y = _mm512_sub_ps(xk, _mm512_loadu_ps(shift + k));  // exp of each half: 8 values' operations
    const __m256 low = exp_nonpositive8(_mm512_castps512_ps256(y));
    const __m256 high = exp_nonpositive8(_mm512_extractf32x8_ps(y, 1));
    const __m512 w = _mm512_maskz_mov_ps(finite, _mm512_insertf32x8(_mm512_castps256_ps512(low), high, 1));
    _mm512_storeu_ps(x + k, w);
    _mm512_storeu_ps(sum + k, _mm512_add_ps(_mm512_loadu_ps(sum + k), w));
  }
#endif
#ifdef __AVX2__
  for (; k + 8 <= n; k += 8) {
    const __m256 xk = _mm256_loadu_ps(x + k);
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(xk, _mm256_loadu_ps(shift + k)));
    const __m256 w = _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps(xk, _mm256_set1_ps(NEG_INF), _CMP_EQ_OQ));
    _mm256_storeu_ps(x + k, w);
    _mm256_storeu_ps(sum + k, _mm256_add_ps(_mm256_loadu_ps(sum + k), w));
  }
#endif
  for (; k < n; ++k) {
    const float e = x[k] == NEG_INF ? 0.f : exp_nonpositive(x[k] - shift[k]);
    x[k] = e;
    sum[k] += e;
  }
}

// x[k] = cap tanh(x[k] / cap), k < n (gemma2's soft-capped scores; -inf, a masked score, stays): tanh(y) =
// sign(y) (1 - e) / (1 + e), e = exp(-2 |y|) (an exp of a non-positive number)
inline float soft_cap(float x, float cap) {
  if (x == NEG_INF) return x;
  const float e = exp_nonpositive(std::abs(x) * (-2.f / cap));
  return std::copysign(cap * (1.f - e) / (1.f + e), x);
}

inline void soft_cap_all(float* x, int64_t n, float cap) {
  int64_t k = 0;
#ifdef __AVX2__
  const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
  for (; k + 8 <= n; k += 8) {
    const __m256 xk = _mm256_loadu_ps(x + k);
    const __m256 e = exp_nonpositive8(_mm256_mul_ps(_mm256_andnot_ps(sign, xk), _mm256_set1_ps(-2.f / cap)));
    const __m256 t = _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(cap), _mm256_sub_ps(one, e)), _mm256_add_ps(one, e));
    const __m256 masked = _mm256_cmp_ps(xk, _mm256_set1_ps(NEG_INF), _CMP_EQ_OQ);
    _mm256_storeu_ps(x + k, _mm256_blendv_ps(_mm256_or_ps(t, _mm256_and_ps(sign, xk)), xk, masked));
  }
#endif
  for (; k < n; ++k) x[k] = soft_cap(x[k], cap);
}

// out[i] = silu(gate[i]) * up[i], i < n
inline void silu_times(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
#ifdef __AVX2__
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(gate + i)), _mm256_loadu_ps(up + i)));
#endif
  for (; i < n; ++i) out[i] = silu(gate[i]) * up[i];
}

// A row's argmax as torch's: the first of equal maxima, or the first NaN where there is one (a
// NaN counts as the largest); `max` is the largest number, NaNs passed over. 16 running maxima
// side by side, each with the first index it was seen at.
struct RowArgmax {
  int64_t at;
  float max;
  bool nans;
};

inline RowArgmax row_argmax(const float* x, int64_t n) {
  float lane_max[16];
  int32_t lane_at[16], lane_nans[16];
  std::fill_n(lane_max, 16, NEG_INF);
  std::fill_n(lane_at, 16, 0);
  std::fill_n(lane_nans, 16, 0);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
#pragma omp simd
    for (int j = 0; j < 16; ++j) {
      const float v = x[i + j];
      const bool larger = v > lane_max[j];
      lane_max[j] = larger ? v : lane_max[j];
      lane_at[j] = larger ? (int32_t)(i + j) : lane_at[j];
      lane_nans[j] |= v != v;
    }
  for (; i < n; ++i) {
    const bool larger = x[i] > lane_max[0];
    lane_max[0] = larger ? x[i] : lane_max[0];
    lane_at[0] = larger ? (int32_t)i : lane_at[0];
    lane_nans[0] |= x[i] != x[i];
  }
  const float m = *std::max_element(lane_max, lane_max + 16);
  if (std::any_of(lane_nans, lane_nans + 16, [](int32_t flag) { return flag != 0; }))
    return {std::find_if(x, x + n, [](float v) { return v != v; }) - x, m, true};
  int64_t best = n;
  for (int j = 0; j < 16; ++j)
    if (lane_max[j] == m) best = std::min<int64_t>(best, lane_at[j]);
  return {best, m, false};
}

}  // namespace
}  // namespace hearth
