// IQ1_S: the search llama.cpp's quantizer runs for it (ggml-quants.c's quantize_row_iq1_s_impl),
// float32 in its order of operations (kquants.cpp says why the bytes match). Per sub-block of 32:
// the values sorted, every split into three groups (levels -1, 0, 1, shifted by +-1/8) scored by
// weighted least squares from prefix sums, each 8 levels snapped to the 2048-point grid (grids.h:
// the neighbours at the 3 smallest distances, by weighted error), a 3-bit scale of a float16
// super-scale. Needs an importance matrix, as ggml_quantize_chunk does. Layout: hearth/quant/formats.py.
#pragma once

#include <numeric>

#include "grid_quants.h"

namespace hearth {
namespace {

constexpr int IQ1_S = 19;
constexpr float kIQ1Delta = 0.125f;
Grid iq1_grid;

// the best split of the sorted values into levels 0 / 1 / 2 and its shift (+1: x_p, -1: x_m); false if none
bool iq1_split(const float* xb, const float* weight, const int* idx, int8_t* L, float* scale, int* shift) {
  const float x_p[3] = {-1 + kIQ1Delta, kIQ1Delta, 1 + kIQ1Delta}, x_m[3] = {-1 - kIQ1Delta, -kIQ1Delta, 1 - kIQ1Delta};
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

// one sub-block of 32: false if zero (nothing written); else its scale, shift and 4 grid indices
bool iq1_s_sub_block(const float* xb, const float* weight, float* scale, int* shift, uint16_t* index) {
  float max = std::fabs(xb[0]);
  for (int i = 1; i < 32; ++i) max = std::max(max, std::fabs(xb[i]));
  *scale = 0;
  *shift = 1;
  if (max < 1e-12f) return false;
  int idx[32];
  int8_t L[32];
  std::iota(idx, idx + 32, 0);
  std::stable_sort(idx, idx + 32, [xb](int a, int b) { return xb[a] < xb[b]; });
  *scale = max;
  if (!iq1_split(xb, weight, idx, L, scale, shift)) { *scale = 0; *shift = 1; return false; }
  if (*scale < 0) {
    for (int j = 0; j < 32; ++j) L[j] = int8_t(2 - L[j]);
    *scale = -*scale;
    *shift = -*shift;
  }
  const float x_p[3] = {-1 + kIQ1Delta, kIQ1Delta, 1 + kIQ1Delta}, x_m[3] = {-1 - kIQ1Delta, -kIQ1Delta, 1 - kIQ1Delta};
  const float* xx = *shift == 1 ? x_p : x_m;
  bool all_on_grid = true;
  for (int k = 0; k < 4; ++k) {
    const int u = iq1_grid.pack(L + 8 * k);
    int gi = iq1_grid.map[u];
    if (gi < 0) { all_on_grid = false; gi = best_neighbour(iq1_grid, u, xb + 8 * k, weight + 8 * k, *scale, L + 8 * k, xx); }
    index[k] = uint16_t(gi);
  }
  if (!all_on_grid) {
    float sumqx = 0, sumq2 = 0;
    for (int k = 0; k < 4; ++k)
      for (int j = 0; j < 8; ++j) {
        const float w = weight[8 * k + j], q = xx[(iq1_grid.point(index[k])[j] - 1) / 2];
        sumqx += w * q * xb[8 * k + j];
        sumq2 += w * q * q;
      }
    if (sumqx > 0 && sumq2 > 0) *scale = sumqx / sumq2;
  }
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

}  // namespace
}  // namespace hearth
