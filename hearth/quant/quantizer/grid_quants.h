// IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S: the search llama.cpp's quantizer runs for each
// (ggml-quants.c's quantize_row_iq2_xxs_impl .. quantize_row_iq3_s_impl), float32 in its order of
// operations (kquants.cpp says why the bytes match). Per sub-block of 16 or 32 values: the signs
// apart (with IQ2_XXS, IQ2_XS and IQ3_XXS an even number of them in each 8, the least important value
// flipped to make it so), then trial scales: each group of 8 (IQ2) or 4 (IQ3) magnitudes rounded to
// levels, snapped to the nearest grid point by weighted error where off the grid (grids.h), and the
// best scale by weighted least squares; the sub-block scales become 4-bit multiples of a float16
// super-scale. Block layouts: hearth/quant/formats.py.
#pragma once

#include <limits>

#include "grids.h"
#include "searches.h"

namespace hearth {
namespace {

enum GridType { IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ3_S = 21, IQ2_S = 22 };
enum Refit { OFF_GRID, ALL_IF_ANY_OFF, ALWAYS };

struct GridRule {
  int sub;             // values a sub-block (16 or 32)
  int kmaxq;           // levels 0 .. kmaxq - 1
  int trials;          // trial inverse scales on each side of the first guess
  float step;          // between trials
  float eps;           // a sub-block whose largest magnitude is below this is zero
  float fudge;         // the stored super-scale is max_scale / 31 times this
  bool from_qp;        // trials around make_qp_quants's scale (IQ2_XXS), else around the largest magnitude
  Refit refit;         // with the best trial's scale, redo the groups off the grid, all if any is, or all
  bool parity;         // an even number of negative signs in each 8 (7 bits stored), else 8 sign bits
  bool start_on_grid;  // whether the groups count as on the grid where no trial wins
  float sigma_times;   // the weights' sigma2: sigma_times * mean x^2 over the super-block
  float plain_sigma;   // without an importance matrix: weight = plain_sigma * sigma2 + x^2
  int bytes;           // a block of 256 values
};

constexpr float kDenormMin = std::numeric_limits<float>::denorm_min();  // IQ3_S: zero only when all are
const GridRule kIQ2XXS{32, 3, 6, 0.1f, 1e-15f, 1.f, true, ALWAYS, true, true, 1, 0, 66};
const GridRule kIQ2XS{16, 3, 9, 0.1f, 1e-15f, 1.f, false, OFF_GRID, true, true, 1, 0, 74};
const GridRule kIQ2S{16, 3, 9, 0.1f, 1e-8f, 0.9875f, false, OFF_GRID, false, true, 2, 0.25f, 82};
const GridRule kIQ3XXS{32, 8, 15, 0.2f, 1e-8f, 1.0125f, false, OFF_GRID, true, true, 2, 0, 98};
const GridRule kIQ3S{32, 8, 9, 0.2f, kDenormMin, 1.033f, false, ALL_IF_ANY_OFF, false, false, 2, 0, 110};

Grid grids[5];  // IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S: filled by set_grid before any quantization

int grid_slot(int qtype) {
  switch (qtype) {
    case IQ2_XXS: return 0;
    case IQ2_XS: return 1;
    case IQ2_S: return 2;
    case IQ3_XXS: return 3;
    case IQ3_S: return 4;
    default: return -1;
  }
}

const GridRule& grid_rule(int qtype) {
  static const GridRule* rules[5] = {&kIQ2XXS, &kIQ2XS, &kIQ2S, &kIQ3XXS, &kIQ3S};
  return *rules[grid_slot(qtype)];
}

// one sub-block's result: its scale, each group's grid index, each 8 values' sign bits
struct SubBlock {
  float scale;
  uint16_t index[8];
  uint8_t signs[4];
};

// magnitudes of one sub-block into xval (with parity: the least important value of an odd 8 keeps
// its sign, negative here) and their sign bits
void split_signs(const GridRule& r, const float* xb, const float* weight, float* xval, uint8_t* signs) {
  for (int k = 0; k < r.sub / 8; ++k) {
    int flips = 0;
    uint8_t s = 0;
    for (int i = 0; i < 8; ++i) {
      const float v = xb[8 * k + i];
      xval[8 * k + i] = v >= 0 ? v : -v;
      if (v < 0) { ++flips; s |= uint8_t(1 << i); }
    }
    if (r.parity && flips % 2) {
      int imin = 0;
      float min = weight[8 * k] * xb[8 * k] * xb[8 * k];
      for (int i = 1; i < 8; ++i) {
        const float ax = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i];
        if (ax < min) { min = ax; imin = i; }
      }
      xval[8 * k + imin] = -xval[8 * k + imin];
      s ^= uint8_t(1 << imin);
    }
    signs[k] = r.parity ? s & 127 : s;
  }
}

// one group's levels nearest to id * xval (clamped), snapped to the grid's nearest point at `scale`
// where off it; true if already on it
bool place_group(const Grid& g, int kmaxq, const float* xval, const float* waux, float id, float scale, int8_t* L) {
  for (int i = 0; i < g.dim; ++i) L[i] = int8_t(std::max(0, std::min(kmaxq - 1, nearest(0.5f * (id * xval[i] - 1)))));
  const int u = g.pack(L);
  if (g.map[u] >= 0) return true;
  best_neighbour(g, u, xval, waux, scale, L);
  return false;
}

// weighted sums over levels L (values 2 l + 1): sum w x q and sum w q^2
void level_sums(int n, const float* xval, const float* weight, const int8_t* L, float* qx, float* q2) {
  float sumqx = 0, sumq2 = 0;
  for (int i = 0; i < n; ++i) {
    const float w = weight[i], q = 2 * L[i] + 1;
    sumqx += w * xval[i] * q;
    sumq2 += w * q * q;
  }
  *qx = sumqx;
  *q2 = sumq2;
}

// the best of the trial scales (levels into L, which groups were on the grid into on_grid); base:
// the value the trials divide (the largest magnitude, or make_qp_quants's scale times kmaxq)
float trial_scales(const Grid& g, const GridRule& r, const float* xval, const float* weight, const float* waux,
                   float base, float scale, int8_t* L, bool* on_grid) {
  const int groups = r.sub / g.dim;
  int8_t Laux[32];
  bool aux_on[8];
  float best = 0, sumqx, sumq2;
  for (int k = 0; k < groups; ++k) on_grid[k] = r.start_on_grid;
  for (int is = -r.trials; is <= r.trials; ++is) {
    const float id = (2 * r.kmaxq - 1 + is * r.step) / base, this_scale = 1 / id;
    for (int k = 0; k < groups; ++k)
      aux_on[k] = place_group(g, r.kmaxq, xval + g.dim * k, waux + g.dim * k, id, this_scale, Laux + g.dim * k);
    level_sums(r.sub, xval, weight, Laux, &sumqx, &sumq2);
    if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
      scale = sumqx / sumq2;
      best = scale * sumqx;
      std::memcpy(L, Laux, r.sub);
      std::copy(aux_on, aux_on + groups, on_grid);
    }
  }
  return scale;
}

// one sub-block of r.sub values: false if it is zero (nothing of `out` set but its scale, 0)
bool grid_sub_block(const Grid& g, const GridRule& r, const float* xb, const float* weight, SubBlock& out) {
  float xval[32], waux[32];
  int8_t L[32] = {0};
  bool on_grid[8];
  out.scale = 0;
  for (int i = 0; i < r.sub; ++i) waux[i] = std::sqrt(weight[i]);
  split_signs(r, xb, weight, xval, out.signs);
  float max = xval[0];
  for (int i = 1; i < r.sub; ++i) max = std::max(max, xval[i]);
  if (max < r.eps) return false;
  float base = max, scale = max / (2 * r.kmaxq - 1);
  if (r.from_qp) {
    uint8_t Lqp[32];
    scale = positive_search(r.sub, r.kmaxq + 1, xval, Lqp, weight);
    base = scale * r.kmaxq;
    if (base <= 0) return false;
  }
  scale = trial_scales(g, r, xval, weight, waux, base, scale, L, on_grid);
  const int groups = r.sub / g.dim;
  const bool any_off = std::find(on_grid, on_grid + groups, false) != on_grid + groups;
  if (scale > 0 && (r.refit == ALWAYS || any_off)) {
    const float id = 1 / scale;
    for (int k = 0; k < groups; ++k)
      if (r.refit != OFF_GRID || !on_grid[k]) place_group(g, r.kmaxq, xval + g.dim * k, waux + g.dim * k, id, scale, L + g.dim * k);
    float sumqx, sumq2;
    level_sums(r.sub, xval, weight, L, &sumqx, &sumq2);
    if (sumq2 > 0) scale = sumqx / sumq2;
  }
  if (scale < 0) {  // "should never happen" (llama.cpp): a positive scale, every sign flipped
    scale = -scale;
    for (int k = 0; k < r.sub / 8; ++k) out.signs[k] = uint8_t(r.parity ? ~out.signs[k] & 127 : ~out.signs[k]);
  }
  for (int k = 0; k < groups; ++k) out.index[k] = uint16_t(g.map[g.pack(L + g.dim * k)]);
  out.scale = scale;
  return true;
}

// a sub-block's codes into block y (sub-block ib; `written`: the nonzero sub-blocks before it)
void put_sub_block(int qtype, uint8_t* y, int ib, int written, const SubBlock& s) {
  uint32_t signs = 0;  // IQ2_XXS, IQ3_XXS: four 7-bit signs in a word (the scale goes in its top 4 bits)
  for (int k = 0; k < 4; ++k) signs |= uint32_t(s.signs[k]) << (7 * k);
  switch (qtype) {
    case IQ2_XXS:  // d | per sub-block of 32: four 8-bit grid indices, the signs word
      for (int k = 0; k < 4; ++k) y[2 + 8 * ib + k] = uint8_t(s.index[k]);
      std::memcpy(y + 6 + 8 * ib, &signs, 4);
      break;
    case IQ3_XXS:  // d | qs[64]: eight 8-bit grid indices a sub-block of 32 | the signs words
      for (int k = 0; k < 8; ++k) y[2 + 8 * ib + k] = uint8_t(s.index[k]);
      std::memcpy(y + 66 + 4 * ib, &signs, 4);
      break;
    case IQ2_XS:  // d | u16[32]: 9-bit grid index | 7 sign bits << 9 | scales[8]
      for (int k = 0; k < 2; ++k) {
        const uint16_t v = uint16_t(s.index[k] | (s.signs[k] << 9));
        std::memcpy(y + 2 + 2 * (2 * ib + k), &v, 2);
      }
      break;
    case IQ2_S:  // d | qs[32]: low 8 bits of the grid indices | signs[32] | qh[8]: their top 2 bits | scales[8]
      for (int k = 0, i8 = 2 * ib; k < 2; ++k, ++i8) {
        y[2 + i8] = uint8_t(s.index[k]);
        y[34 + i8] = s.signs[k];
        y[66 + i8 / 4] |= uint8_t((s.index[k] >> 8) << (2 * (i8 % 4)));
      }
      break;
    default:  // IQ3_S: d | qs[64]: low 8 bits of the grid indices | qh[8]: their 9th bits | signs[32] | scales[4]
      for (int k = 0; k < 8; ++k) {
        y[2 + 8 * written + k] = uint8_t(s.index[k]);
        y[66 + ib] |= uint8_t((s.index[k] >> 8) << k);
      }
      for (int k = 0; k < 4; ++k) y[74 + 4 * written + k] = s.signs[k];
  }
}

// sub-block ib's 4-bit scale code l into block y
void put_scale(int qtype, uint8_t* y, int ib, int l) {
  switch (qtype) {
    case IQ2_XXS: y[9 + 8 * ib] |= uint8_t(l << 4); break;  // the top 4 bits of its signs word
    case IQ3_XXS: y[69 + 4 * ib] |= uint8_t(l << 4); break;
    case IQ2_XS: y[66 + ib / 2] |= uint8_t(l << (4 * (ib % 2))); break;
    case IQ2_S: y[74 + ib / 2] |= uint8_t(l << (4 * (ib % 2))); break;
    default: y[106 + ib / 2] |= uint8_t(l << (4 * (ib % 2)));  // IQ3_S
  }
}

// one block of 256 values of a grid type into y; qw: the importance of each value, or null
void grid_block(int qtype, const float* x, uint8_t* y, const float* qw) {
  const Grid& g = grids[grid_slot(qtype)];
  const GridRule& r = grid_rule(qtype);
  std::memset(y, 0, r.bytes);
  const float sigma2 = r.sigma_times * sum_of_squares(x, QK) / QK;
  SubBlock sb[16];
  float max_scale = 0, weight[32];
  // IQ3_S: llama.cpp's qs and signs pointers do not move past a zero sub-block (its qh index does)
  int written = 0;
  for (int ib = 0; ib < QK / r.sub; ++ib) {
    const float* xb = x + r.sub * ib;
    for (int i = 0; i < r.sub; ++i)
      weight[i] = qw ? qw[r.sub * ib + i] * std::sqrt(sigma2 + xb[i] * xb[i]) : r.plain_sigma * sigma2 + xb[i] * xb[i];
    if (!grid_sub_block(g, r, xb, weight, sb[ib])) continue;
    put_sub_block(qtype, y, ib, written++, sb[ib]);
    max_scale = std::max(max_scale, sb[ib].scale);
  }
  if (!max_scale) {  // d = 0; the formats with sign parity also clear their codes (llama.cpp does)
    if (r.parity) std::memset(y, 0, r.bytes);
    return;
  }
  const float d = max_scale / 31, id = 1 / d;
  put_half(y, d * r.fudge);
  for (int ib = 0; ib < QK / r.sub; ++ib)
    put_scale(qtype, y, ib, std::max(0, std::min(15, nearest(0.5f * (id * sb[ib].scale - 1)))));
}

// the grid of qtype from its points' levels (size x dim, gguf-py's grid as indices into its values)
void set_grid(int qtype, const int8_t* levels, int size) {
  const bool three = qtype == IQ3_XXS || qtype == IQ3_S;
  const int nwant = qtype == IQ2_S ? 1 : qtype == IQ3_S ? 3 : 2;
  build_grid(grids[grid_slot(qtype)], levels, size, three ? 4 : 8, three ? 3 : 2, grid_rule(qtype).kmaxq - 1, nwant);
}

}  // namespace
}  // namespace hearth
