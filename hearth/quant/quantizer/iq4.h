// IQ4_NL and IQ4_XS: 4-bit codes into the non-linear table kIQ4Values, the search llama.cpp's
// quantizer runs for both (ggml-quants.c's quantize_row_iq4_nl_impl), float32 in its order of
// operations. IQ4_NL is one block of 32 with its own float16 scale; IQ4_XS a super-block of 256
// whose eight 32-value blocks get 6-bit scales of a float16 super-scale. kquants.cpp says why the bytes match.
#pragma once

#include "searches.h"

namespace hearth {
namespace {

constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr int kIQ4Tries = 7;  // trial inverse scales on each side of the first guess

// the index of the table value nearest to x (the lower one on a tie)
inline int nearest_iq4(float x) {
  if (x <= kIQ4Values[0]) return 0;
  if (x >= kIQ4Values[15]) return 15;
  int low = 0, high = 15;
  while (high - low > 1) {
    const int mid = (low + high) / 2;
    (x < kIQ4Values[mid] ? high : low) = mid;
  }
  return x - kIQ4Values[high - 1] < kIQ4Values[high] - x ? high - 1 : high;
}

// weighted sums over a block of codes for scale 1 / inverse: sum w q x and sum w q^2 (codes into L if given)
inline void iq4_sums(int n, const float* x, const float* weight, float inverse, uint8_t* L, float* qx, float* q2) {
  float sumqx = 0, sumq2 = 0;
  for (int j = 0; j < n; ++j) {
    const int l = nearest_iq4(inverse * x[j]);
    if (L) L[j] = uint8_t(l);
    const float q = kIQ4Values[l], w = weight[j];
    sumqx += w * q * x[j];
    sumq2 += w * q * q;
  }
  *qx = sumqx;
  *q2 = sumq2;
}

// the scale of one block of n values (codes into L): a first guess from the value of largest
// magnitude, then the best of 2 * kIQ4Tries + 1 trial inverse scales by weighted least squares
float iq4_block_scale(int n, const float* x, const float* weight, uint8_t* L) {
  const float max = largest_magnitude(n, x);
  if (std::fabs(max) < MAX_EPS) return 0;
  float sumqx, sumq2;
  iq4_sums(n, x, weight, 1 / (-max / kIQ4Values[0]), L, &sumqx, &sumq2);
  float d = sumqx / sumq2, best = d * sumqx;
  for (int t = -kIQ4Tries; t <= kIQ4Tries; ++t) {
    iq4_sums(n, x, weight, (t + kIQ4Values[0]) / max, nullptr, &sumqx, &sumq2);
    if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
      d = sumqx / sumq2;
      best = d * sumqx;
    }
  }
  return d;
}

// one IQ4_NL block (18 bytes: d | qs[16]) or IQ4_XS super-block (136 bytes: d | scales_h u16 |
// scales_l[4] | qs[128]) of n = 32 or 256 values; qw: the importance of each value, or null
void iq4(const float* x, uint8_t* y, const float* qw, int n) {
  float sigma2 = 0;
  for (int j = 0; j < n; ++j) sigma2 += x[j] * x[j];
  sigma2 *= 2.f / n;
  uint8_t L[QK];
  float scales[QK / 32], weight[32], max_scale = 0, amax_scale = 0;
  for (int b = 0; b < n / 32; ++b) {
    const float* xb = x + 32 * b;
    for (int j = 0; j < 32; ++j) weight[j] = qw ? qw[32 * b + j] * std::sqrt(sigma2 + xb[j] * xb[j]) : xb[j] * xb[j];
    scales[b] = iq4_block_scale(32, xb, weight, L + 32 * b);
    if (std::fabs(scales[b]) > amax_scale) {
      amax_scale = std::fabs(scales[b]);
      max_scale = scales[b];
    }
  }
  uint8_t* qs = y + (n == 32 ? 2 : 8);
  if (n == 32) {
    put_half(y, scales[0]);
    const float inverse = scales[0] ? 1 / scales[0] : 0;
    for (int j = 0; j < 32; ++j) L[j] = uint8_t(nearest_iq4(inverse * x[j]));
  } else {  // 6-bit block scales (offset 32) of the super-scale d = -max_scale / 32
    const float d = -max_scale / 32, inverse = d ? 1 / d : 0.f;
    put_half(y, d);
    uint16_t high = 0;
    for (int b = 0; b < n / 32; ++b) {
      const int l = std::max(-32, std::min(31, nearest(inverse * scales[b])));
      const float dl = d * l, idl = dl ? 1 / dl : 0.f;
      for (int j = 0; j < 32; ++j) L[32 * b + j] = uint8_t(nearest_iq4(idl * x[32 * b + j]));
      const int stored = l + 32;
      y[4 + b / 2] = uint8_t(b % 2 ? y[4 + b / 2] | ((stored & 0xF) << 4) : stored & 0xF);
      high |= uint16_t((stored >> 4) << (2 * (b % 8)));
    }
    std::memcpy(y + 2, &high, 2);
  }
  for (int b = 0; b < n / 32; ++b)
    for (int j = 0; j < 16; ++j) qs[16 * b + j] = uint8_t(L[32 * b + j] | (L[32 * b + 16 + j] << 4));
}

}  // namespace
}  // namespace hearth
