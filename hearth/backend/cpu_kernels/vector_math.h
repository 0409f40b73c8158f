// Loops the kernels share, in forms the compiler vectorises: exp of non-positive numbers, SiLU, a row's
// argmax.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

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
