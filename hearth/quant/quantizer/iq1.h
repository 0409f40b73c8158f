// IQ1_S and IQ1_M: the searches llama.cpp's quantizer runs for them (ggml-quants.c's
// quantize_row_iq1_s_impl, quantize_row_iq1_m_impl), float32 in its order of operations (kquants.cpp
// says why the bytes match). IQ1_S, per sub-block of 32:
// the values sorted, every split into three groups (levels -1, 0, 1, shifted by +-1/8) scored by
// weighted least squares from prefix sums, each 8 levels snapped to the 2048-point grid (grids.h:
// the neighbours at the 3 smallest distances, by weighted error), a 3-bit scale of a float16
// super-scale. Needs an importance matrix, as ggml_quantize_chunk does. IQ1_M, per sub-block of 16:
// the same split, but each half of 8 with its own shift (4 choices), prefix sums per half; a 3-bit
// scale per 16, the float16 super-scale refitted over the block and spread over the scales' top
// nibbles. Works without an importance matrix (weights x^2), as ggml_quantize_chunk does; llama.cpp's
// model quantizer asks for one (hearth/loading/quantize.py). Layouts: hearth/quant/formats.py.
#pragma once

#include <numeric>

#include "grid_quants.h"

namespace hearth {
namespace {

constexpr int IQ1_S = 19, IQ1_M = 29;
constexpr float kIQ1Delta = 0.125f;
// the levels -1, 0, 1 shifted up (x_p) or down (x_m) by the delta
constexpr float kIQ1Plus[3] = {-1 + kIQ1Delta, kIQ1Delta, 1 + kIQ1Delta}, kIQ1Minus[3] = {-1 - kIQ1Delta, -kIQ1Delta, 1 - kIQ1Delta};
Grid iq1_grid;  // IQ1_S's and IQ1_M's

// the best split of the sorted values into levels 0 / 1 / 2 and its shift (+1: x_p, -1: x_m); false if none
bool iq1_split(const float* xb, const float* weight, const int* idx, int8_t* L, float* scale, int* shift) {
  const float *x_p = kIQ1Plus, *x_m = kIQ1Minus;
  float sumx[33], sumw[33], best = -3.4028235e38f;
  sumx[0] = sumw[0] = 0;
  for (int j = 0; j < 32; ++j) {
    sumx[j + 1] = sumx[j] + weight[idx[j]] * xb[idx[j]];
    sumw[j + 1] = sumw[j] + weight[idx[j]];
  }
  int b1 = -1, b2 = -1;
  for (int i1 = 0; i1 <= 32; ++i1)
    for (int i2 = i1; i2 <= 32; ++i2)
      for (int s = 0; s < 2; ++s) {
        const float* v = s ? x_m : x_p;
        const float sumqx = (sumx[i1] - sumx[0]) * v[0] + (sumx[i2] - sumx[i1]) * v[1] + (sumx[32] - sumx[i2]) * v[2];
        const float sumq2 = (sumw[i1] - sumw[0]) * v[0] * v[0] + (sumw[i2] - sumw[i1]) * v[1] * v[1] +
                            (sumw[32] - sumw[i2]) * v[2] * v[2];
        if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
          *scale = sumqx / sumq2;
          best = *scale * sumqx;
          b1 = i1; b2 = i2; *shift = s ? -1 : 1;
        }
      }
  if (b1 < 0 || b2 < 0) return false;
  for (int j = 0; j < 32; ++j) L[idx[j]] = int8_t(j < b1 ? 0 : j < b2 ? 1 : 2);
  return true;
}

// the largest |x| of n values, and their order by value (stable, as llama.cpp's qsort sorts here)
inline float iq1_sort(const float* xb, int n, int* idx) {
  float max = std::fabs(xb[0]);
  for (int i = 1; i < n; ++i) max = std::max(max, std::fabs(xb[i]));
  std::iota(idx, idx + n, 0);
  std::stable_sort(idx, idx + n, [xb](int a, int b) { return xb[a] < xb[b]; });
  return max;
}

// a negative scale: the levels mirrored (l -> 2 - l) and the scale made positive (true), else nothing
inline bool iq1_mirror(int8_t* L, int n, float* scale) {
  if (*scale >= 0) return false;
  for (int j = 0; j < n; ++j) L[j] = int8_t(2 - L[j]);
  *scale = -*scale;
  return true;
}

// a sub-block's groups of 8 levels snapped to the grid (one off it: its best neighbour by weighted
// error) into index[groups], and where any was off the scale refitted by weighted least squares;
// levels[k]: what group k's levels stand for (its shift)
void iq1_snap(const float* xb, const float* weight, int8_t* L, int groups, const float* const* levels, float* scale,
              uint16_t* index) {
  bool all_on_grid = true;
  for (int k = 0; k < groups; ++k) {
    const int u = iq1_grid.pack(L + 8 * k);
    int gi = iq1_grid.map[u];
    if (gi < 0) {
      all_on_grid = false;
      gi = best_neighbour(iq1_grid, u, xb + 8 * k, weight + 8 * k, *scale, L + 8 * k, levels[k]);
    }
    index[k] = uint16_t(gi);
  }
  if (all_on_grid) return;
  float sumqx = 0, sumq2 = 0;
  for (int k = 0; k < groups; ++k)
    for (int j = 0; j < 8; ++j) {
      const float w = weight[8 * k + j], q = levels[k][(iq1_grid.point(index[k])[j] - 1) / 2];
      sumqx += w * q * xb[8 * k + j];
      sumq2 += w * q * q;
    }
  if (sumqx > 0 && sumq2 > 0) *scale = sumqx / sumq2;
}

// one sub-block of 32: false if zero (nothing written); else its scale, shift and 4 grid indices
bool iq1_s_sub_block(const float* xb, const float* weight, float* scale, int* shift, uint16_t* index) {
  int idx[32];
  int8_t L[32];
  const float max = iq1_sort(xb, 32, idx);
  *scale = 0;
  *shift = 1;
  if (max < 1e-12f) return false;
  *scale = max;
  if (!iq1_split(xb, weight, idx, L, scale, shift)) { *scale = 0; *shift = 1; return false; }
  if (iq1_mirror(L, 32, scale)) *shift = -*shift;
  const float* xx = *shift == 1 ? kIQ1Plus : kIQ1Minus;
  const float* levels[4] = {xx, xx, xx, xx};
  iq1_snap(xb, weight, L, 4, levels, scale, index);
  return true;
}

// one IQ1_S block (50 bytes: d | qs[32]: low 8 bits of the grid indices | qh u16[8]: their top 3
// bits per group of 8, a 3-bit scale at bit 12, the shift's sign at 15) of 256 values
void iq1_s(const float* x, uint8_t* y, const float* qw) {
  std::memset(y, 0, 50);
  const float sigma2 = 2 * sum_of_squares(x, QK) / QK;
  float scales[8], weight[32], max_scale = 0;
  int shifts[8];
  for (int ib = 0; ib < 8; ++ib) {
    const float* xb = x + 32 * ib;
    for (int i = 0; i < 32; ++i) weight[i] = qw[32 * ib + i] * std::sqrt(sigma2 + xb[i] * xb[i]);
    uint16_t index[4];
    if (!iq1_s_sub_block(xb, weight, &scales[ib], &shifts[ib], index)) continue;
    uint16_t h = 0;
    for (int k = 0; k < 4; ++k) {
      y[2 + 4 * ib + k] = uint8_t(index[k]);
      h |= uint16_t((index[k] >> 8) << (3 * k));
    }
    std::memcpy(y + 34 + 2 * ib, &h, 2);
    max_scale = std::max(max_scale, scales[ib]);
  }
  if (!max_scale) return;
  const float d = max_scale / 15, id = 1 / d;
  put_half(y, d * 1.125f);
  for (int ib = 0; ib < 8; ++ib) {
    int l = std::max(0, std::min(7, nearest(0.5f * (id * scales[ib] - 1))));
    if (shifts[ib] == -1) l |= 8;
    y[35 + 2 * ib] |= uint8_t(l << 4);  // bits 12..15 of qh[ib]
  }
}

// ---------------------------------------------------------------- IQ1_M
// the best split of a sub-block of 16 (idx: sorted) into levels 0 / 1 / 2 and its shifts, k = 2 a + b
// for the first half's (a) and second half's (b) shift, 0: x_p, 1: x_m; false if none. Per half the
// prefix sums of w x and w, as llama.cpp keeps them (v0 - v1 = v1 - v2 = -1 for both shifts)
bool iq1_m_split(const float* xb, const float* weight, const int* idx, int8_t* L, float* scale, int* best_k) {
  float px[2][17], pw[2][17];
  px[0][0] = px[1][0] = pw[0][0] = pw[1][0] = 0;
  for (int j = 0; j < 16; ++j) {
    const int i = idx[j], h = i < 8 ? 0 : 1;
    px[h][j + 1] = px[h][j] + weight[i] * xb[i];
    px[1 - h][j + 1] = px[1 - h][j];
    pw[h][j + 1] = pw[h][j] + weight[i];
    pw[1 - h][j + 1] = pw[1 - h][j];
  }
  const float txs[2] = {px[0][16], px[1][16]}, tws[2] = {pw[0][16], pw[1][16]};
  const float p2 = kIQ1Plus[2], m2 = kIQ1Minus[2];
  const float cp1 = kIQ1Plus[0] * kIQ1Plus[0] - kIQ1Plus[1] * kIQ1Plus[1], cp2 = kIQ1Plus[1] * kIQ1Plus[1] - kIQ1Plus[2] * kIQ1Plus[2];
  const float cm1 = kIQ1Minus[0] * kIQ1Minus[0] - kIQ1Minus[1] * kIQ1Minus[1];
  const float cm2 = kIQ1Minus[1] * kIQ1Minus[1] - kIQ1Minus[2] * kIQ1Minus[2];
  float best = -3.4028235e38f;
  int b1 = -1, b2 = -1;
  *best_k = -1;
  for (int i1 = 0; i1 <= 16; ++i1)
    for (int i2 = i1; i2 <= 16; ++i2) {
      float qx_p[2], qx_m[2], q2_p[2], q2_m[2];
      for (int h = 0; h < 2; ++h) {
        const float sx = px[h][i1] + px[h][i2];
        qx_p[h] = txs[h] * p2 - sx;
        qx_m[h] = txs[h] * m2 - sx;
        q2_p[h] = tws[h] * p2 * p2 + pw[h][i1] * cp1 + pw[h][i2] * cp2;
        q2_m[h] = tws[h] * m2 * m2 + pw[h][i1] * cm1 + pw[h][i2] * cm2;
      }
      const float sumqx[4] = {qx_p[0] + qx_p[1], qx_p[0] + qx_m[1], qx_m[0] + qx_p[1], qx_m[0] + qx_m[1]};
      const float sumq2[4] = {q2_p[0] + q2_p[1], q2_p[0] + q2_m[1], q2_m[0] + q2_p[1], q2_m[0] + q2_m[1]};
      for (int k = 0; k < 4; ++k)
        if (sumq2[k] > 0 && sumqx[k] * sumqx[k] > best * sumq2[k]) {
          *scale = sumqx[k] / sumq2[k];
          best = *scale * sumqx[k];
          b1 = i1; b2 = i2; *best_k = k;
        }
    }
  if (b1 < 0 || b2 < 0 || *best_k < 0) return false;
  for (int j = 0; j < 16; ++j) L[idx[j]] = int8_t(j < b1 ? 0 : j < b2 ? 1 : 2);
  return true;
}

// the shifted levels of half h of a sub-block with shifts k
inline const float* iq1_m_levels(int k, int h) { return (h == 0 ? k < 2 : k % 2 == 0) ? kIQ1Plus : kIQ1Minus; }

// one sub-block of 16: false if ~zero or no split (scale 0, shifts 0, nothing written); else its
// scale, shifts and 2 grid indices
bool iq1_m_sub_block(const float* xb, const float* weight, float* scale, int* shifts, uint16_t* index) {
  int idx[16];
  int8_t L[16];
  const float max = iq1_sort(xb, 16, idx);
  *scale = 0;
  *shifts = 0;
  if (max < 1e-7f) return false;
  if (!iq1_m_split(xb, weight, idx, L, scale, shifts)) { *scale = 0; *shifts = 0; return false; }
  if (iq1_mirror(L, 16, scale)) *shifts = 3 - *shifts;  // each half's shift turned
  const float* levels[2] = {iq1_m_levels(*shifts, 0), iq1_m_levels(*shifts, 1)};
  iq1_snap(xb, weight, L, 2, levels, scale, index);
  return true;
}

// a sub-block's search weights: the importance times sqrt(sigma2 + x^2), or x^2 without one
inline void iq1_m_weights(const float* xb, const float* qw, float sigma2, float* weight) {
  for (int i = 0; i < 16; ++i) weight[i] = qw ? qw[i] * std::sqrt(sigma2 + xb[i] * xb[i]) : xb[i] * xb[i];
}

// the 3-bit scales and shift bits of every sub-block, and the super-scale refitted over the block
// with the grid points written (llama.cpp reads them back from y, indices of empty sub-blocks 0)
void iq1_m_scales(const float* x, uint8_t* y, const float* qw, float sigma2, const float* scales, const int* shifts,
                  float max_scale) {
  const uint8_t masks[4] = {0x00, 0x80, 0x08, 0x88};
  uint16_t sc[4] = {};
  float d = max_scale / 15, weight[16], sumqx = 0, sumq2 = 0;
  const float id = 1 / d;
  for (int ib = 0; ib < 16; ++ib) {
    const int l = std::max(0, std::min(7, nearest(0.5f * (id * scales[ib] - 1))));
    sc[ib / 4] |= uint16_t(l << (3 * (ib % 4)));
    y[32 + ib] |= masks[shifts[ib]];
    const float* xb = x + 16 * ib;
    iq1_m_weights(xb, qw ? qw + 16 * ib : nullptr, sigma2, weight);
    for (int k = 0; k < 2; ++k) {
      const int8_t* pg = iq1_grid.point(y[2 * ib + k] + ((y[32 + ib] << (8 - 4 * k)) & 0x700));
      for (int j = 0; j < 8; ++j) {
        const float w = weight[8 * k + j], q = iq1_m_levels(shifts[ib], k)[(pg[j] - 1) / 2] * float(2 * l + 1);
        sumqx += w * q * xb[8 * k + j];
        sumq2 += w * q * q;
      }
    }
  }
  if (sumq2 > 0) d = sumqx / sumq2;
  uint8_t half[2];
  put_half(half, d * 1.1125f);
  const uint16_t h = uint16_t(half[0] | (half[1] << 8));
  sc[0] |= uint16_t((h & 0x000f) << 12);
  sc[1] |= uint16_t((h & 0x00f0) << 8);
  sc[2] |= uint16_t((h & 0x0f00) << 4);
  sc[3] |= uint16_t(h & 0xf000);
  std::memcpy(y + 48, sc, 8);
}

// one IQ1_M block (56 bytes: qs[32]: low 8 bits of the grid indices | qh[16]: per group of 8 a
// nibble, the index's top 3 bits and the shift's sign | scales u16[4]) of 256 values
void iq1_m(const float* x, uint8_t* y, const float* qw) {
  std::memset(y, 0, 56);
  const float sigma2 = 2 * sum_of_squares(x, QK) / QK;
  float scales[16], weight[16], max_scale = 0;
  int shifts[16];
  for (int ib = 0; ib < 16; ++ib) {
    const float* xb = x + 16 * ib;
    iq1_m_weights(xb, qw ? qw + 16 * ib : nullptr, sigma2, weight);
    uint16_t index[2];
    if (!iq1_m_sub_block(xb, weight, &scales[ib], &shifts[ib], index)) continue;
    y[2 * ib] = uint8_t(index[0]);
    y[2 * ib + 1] = uint8_t(index[1]);
    y[32 + ib] = uint8_t((index[0] >> 8) | ((index[1] >> 8) << 4));
    max_scale = std::max(max_scale, scales[ib]);
  }
  if (max_scale) iq1_m_scales(x, y, qw, sigma2, scales, shifts, max_scale);
}

}  // namespace
}  // namespace hearth
