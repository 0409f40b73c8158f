// The searches behind llama.cpp's quantizer (ggml-quants.c's make_qx_quants, make_q3_quants,
// make_qkx2/3_quants, make_qp_quants), float32 in ggml's order of operations; kquants.cpp says why.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>

namespace hearth {
namespace {

constexpr int QK = 256;             // values per K-quant super-block
constexpr float MAX_EPS = 1e-15f;   // a group below this is all zero

// round half to even (fval well inside int range), as ggml's nearest_int
inline int nearest(float fval) {
  float val = fval + 12582912.f;
  int32_t i;
  std::memcpy(&i, &val, 4);
  return (i & 0x007fffff) - 0x00400000;
}

inline uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// fp32 -> fp16, round to nearest even (what F16C and ggml's software path both give)
uint16_t to_half(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = bits(f), shl1 = w + w, sign = w & 0x80000000u;
  uint32_t bias = std::max(shl1 & 0xFF000000u, 0x71000000u);
  base = from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t b = bits(base);
  const uint32_t nonsign = ((b >> 13) & 0x7C00u) + (b & 0x0FFFu);
  return uint16_t((sign >> 16) | (shl1 > 0xFF000000u ? 0x7E00u : nonsign));
}

float from_half(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  if (exp == 0x1F) return from_bits(sign | 0x7F800000u | (mant << 13));
  if (exp != 0) return from_bits(sign | ((exp + 112) << 23) | (mant << 13));
  return (sign ? -1.f : 1.f) * float(mant) * 0x1.0p-24f;  // subnormal (exact)
}

// store a half and return the float it holds
float put_half(uint8_t* at, float f) {
  const uint16_t h = to_half(f);
  std::memcpy(at, &h, 2);
  return from_half(h);
}

// x^2 into `out` (returned)
const float* squares_of(const float* x, int n, float* out) {
  for (int i = 0; i < n; ++i) out[i] = x[i] * x[i];
  return out;
}

// the x of largest magnitude (the first of them)
float largest_magnitude(int n, const float* x) {
  float max = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) { amax = ax; max = x[i]; }
  }
  return max;
}

// Symmetric codes L in [0, 2 nmax) for x ~ scale * (L - nmax), weighted least squares over 19 trial
// inverse scales around -nmax / max (weights: qw, else x^2); returns the scale.
float symmetric_search(int n, int nmax, const float* x, int8_t* L, const float* qw) {
  const float max = largest_magnitude(n, x);
  if (std::fabs(max) < MAX_EPS) {
    std::memset(L, 0, n);
    return 0.f;
  }
  float squares[32];  // the default weights, once (n <= 32)
  if (!qw) qw = squares_of(x, n, squares);
  auto weight = [qw](int i) { return qw[i]; };
  float iscale = -nmax / max, sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    const int l = std::max(-nmax, std::min(nmax - 1, nearest(iscale * x[i])));
    L[i] = int8_t(l + nmax);
    const float w = weight(i);
    sumlx += w * x[i] * l;
    suml2 += w * l * l;
  }
  float scale = suml2 ? sumlx / suml2 : 0.0f, best = scale * sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(nmax + 0.1f * is) / max;
    sumlx = suml2 = 0;
    for (int i = 0; i < n; ++i) {
      const int l = std::max(-nmax, std::min(nmax - 1, nearest(iscale * x[i])));
      const float w = weight(i);
      sumlx += w * x[i] * l;
      suml2 += w * l * l;
    }
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      for (int i = 0; i < n; ++i) L[i] = int8_t(nmax + std::max(-nmax, std::min(nmax - 1, nearest(iscale * x[i]))));
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

// Q3_K's unweighted search: codes from -nmax / max, then up to 5 passes moving single codes while
// the x^2-weighted fit improves. L in [0, 2 nmax); returns the scale.
float q3_search(int n, int nmax, const float* x, int8_t* L) {
  const float max = largest_magnitude(n, x);
  if (std::fabs(max) < MAX_EPS) {
    std::memset(L, 0, n);
    return 0.f;
  }
  const float iscale = -nmax / max;
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    const int l = std::max(-nmax, std::min(nmax - 1, nearest(iscale * x[i])));
    L[i] = int8_t(l);
    const float w = x[i] * x[i];
    sumlx += w * x[i] * l;
    suml2 += w * l * l;
  }
  for (int pass = 0; pass < 5; ++pass) {
    int changed = 0;
    for (int i = 0; i < n; ++i) {
      const float w = x[i] * x[i];
      float slx = sumlx - w * x[i] * L[i];
      if (slx <= 0) continue;
      float sl2 = suml2 - w * L[i] * L[i];
      const int l = std::max(-nmax, std::min(nmax - 1, nearest(x[i] * sl2 / slx)));
      if (l == L[i]) continue;
      slx += w * x[i] * l;
      sl2 += w * l * l;
      if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
        L[i] = int8_t(l); sumlx = slx; suml2 = sl2;
        ++changed;
      }
    }
    if (!changed) break;
  }
  for (int i = 0; i < n; ++i) L[i] = int8_t(L[i] + nmax);
  return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

// Codes L in [0, nmax] for x ~ scale * L - min: weighted least squares of scale and min over
// nstep + 1 trial inverse scales (rmin + rdelta * step + nmax) / (max - min); weights null: x^2.
// `mad`: judge by weighted absolute error. Returns the scale; *neg_min = -min (>= 0).
float affine_search(int n, int nmax, const float* x, const float* weights, uint8_t* L, float* neg_min,
                    float rmin, float rdelta, int nstep, bool mad) {
  float squares[32];
  if (!weights) weights = squares_of(x, n, squares);
  auto weight = [weights](int i) { return weights[i]; };
  float min = x[0], max = x[0], sum_w = weight(0), sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    const float w = weight(i);
    sum_w += w;
    sum_x += w * x[i];
  }
  if (min > 0) min = 0;
  if (max <= min) {  // every x equal and <= 0
    std::memset(L, 0, n);
    *neg_min = -min;
    return 0.f;
  }
  auto error = [&](float scale, float offset, const uint8_t* codes) {
    float total = 0;
    for (int i = 0; i < n; ++i) {
      float diff = scale * codes[i] + offset - x[i];
      diff = mad ? std::fabs(diff) : diff * diff;
      total += weight(i) * diff;
    }
    return total;
  };
  float iscale = nmax / (max - min), scale = 1 / iscale;
  for (int i = 0; i < n; ++i) L[i] = uint8_t(std::max(0, std::min(nmax, nearest(iscale * (x[i] - min)))));
  float best = error(scale, min, L);
  uint8_t aux[32];
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * is + nmax) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      const int l = std::max(0, std::min(nmax, nearest(iscale * (x[i] - min))));
      aux[i] = uint8_t(l);
      const float w = weight(i);
      sum_l += w * l;
      sum_l2 += w * l * l;
      sum_xl += w * l * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D <= 0) continue;
    float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
    float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
    if (this_min > 0) {
      this_min = 0;
      this_scale = sum_xl / sum_l2;
    }
    const float e = error(this_scale, this_min, aux);
    if (e < best) {
      std::memcpy(L, aux, n);
      best = e;
      scale = this_scale;
      min = this_min;
    }
  }
  *neg_min = -min;
  return scale;
}

// Non-negative x (sub-block scales or mins) as codes in [0, nmax] times one scale, weighted by
// quant_weights: 9 trial inverse scales, then up to 5 passes moving single codes. Returns the scale.
float positive_search(int n, int nmax, const float* x, uint8_t* L, const float* qw) {
  float max = 0;
  for (int i = 0; i < n; ++i) max = std::max(max, x[i]);
  if (max < MAX_EPS) {
    std::memset(L, 0, n);
    return 0.f;
  }
  float iscale = nmax / max;
  for (int i = 0; i < n; ++i) L[i] = uint8_t(nearest(iscale * x[i]));
  const float scale = 1 / iscale;
  float best = 0;
  for (int i = 0; i < n; ++i) {
    const float diff = x[i] - scale * L[i];
    best += qw[i] * diff * diff;
  }
  for (int is = -4; is <= 4; ++is) {
    if (is == 0) continue;
    const float iscale_is = (0.1f * is + nmax) / max, scale_is = 1 / iscale_is;
    float mse = 0;
    for (int i = 0; i < n; ++i) {
      const int l = std::min(nmax, nearest(iscale_is * x[i]));
      const float diff = x[i] - scale_is * l;
      mse += qw[i] * diff * diff;
    }
    if (mse < best) { best = mse; iscale = iscale_is; }
  }
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    const int l = std::min(nmax, nearest(iscale * x[i]));
    L[i] = uint8_t(l);
    sumlx += qw[i] * x[i] * l;
    suml2 += qw[i] * l * l;
  }
  for (int pass = 0; pass < 5; ++pass) {
    int changed = 0;
    for (int i = 0; i < n; ++i) {
      const float w = qw[i];
      float slx = sumlx - w * x[i] * L[i], sl2 = suml2 - w * L[i] * L[i];
      if (!(slx > 0 && sl2 > 0)) continue;
      const int l = std::min(nmax, nearest(x[i] * sl2 / slx));
      if (l == L[i]) continue;
      slx += w * x[i] * l;
      sl2 += w * l * l;
      if (slx * slx * suml2 > sumlx * sumlx * sl2) {
        L[i] = uint8_t(l); sumlx = slx; suml2 = sl2;
        ++changed;
      }
    }
    if (!changed) break;
  }
  return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

float sum_of_squares(const float* x, int n) {
  float s = 0;
  for (int i = 0; i < n; ++i) s += x[i] * x[i];
  return s;
}

}  // namespace
}  // namespace hearth
