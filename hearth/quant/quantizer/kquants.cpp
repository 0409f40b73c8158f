// Float rows -> GGUF blocks: the K-quants (Q2_K .. Q6_K), IQ4_NL and IQ4_XS (iq4.h), the grid i-quants IQ2_XXS,
// IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S (grid_quants.h), IQ1_S and IQ1_M (iq1.h) and, with an importance
// matrix, the 32-value formats (Q4_0 .. Q5_1), by the searches llama.cpp's quantizer runs (ggml-quants.c). Every block's
// arithmetic is float32 in the order ggml's reference C code does it, and this source is compiled
// with -ffp-contract=off (no fused multiply-adds), so that the bytes equal llama.cpp's
// `llama_model_quantize` output (ggml-base is built for plain x86-64, which has no FMA either).
// `qw` (llama.cpp's imatrix: the mean squared activation of each input column, for this row's
// columns) switches to the weighted searches, as ggml does when given quant_weights; null: none.
// Block layouts: hearth/quant/formats.py.
#include <pybind11/pybind11.h>

#include "grid_quants.h"
#include "iq1.h"
#include "iq4.h"
#include "searches.h"

namespace hearth {
namespace {

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20,
       IQ4_XS = 23 };

// four 2-bit codes of L (values l, l+32, l+64, l+96 of each 128) per byte
void pack_crumbs(const uint8_t* L, uint8_t* qs) {
  for (int j = 0; j < QK; j += 128)
    for (int l = 0; l < 32; ++l)
      qs[j / 4 + l] = uint8_t(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
}

// Q2_K (84 bytes): scales[16] (low nibble scale, high nibble min) | qs[64] | d | dmin
void q2_k(const float* x, uint8_t* y, const float* qw) {
  uint8_t L[QK], Ls[16], Lm[16];
  float scales[16], mins[16], weight[16], sw[16];
  uint8_t* sc = y;
  if (qw) {
    const float sigma2 = sum_of_squares(x, QK) / QK;
    for (int j = 0; j < 16; ++j) {
      sw[j] = 0;
      for (int l = 0; l < 16; ++l) weight[l] = qw[16 * j + l] * std::sqrt(sigma2 + x[16 * j + l] * x[16 * j + l]);
      for (int l = 0; l < 16; ++l) sw[j] += weight[l];
      scales[j] = affine_search(16, 3, x + 16 * j, weight, L + 16 * j, &mins[j], -0.9f, 0.05f, 36, false);
    }
    put_half(y + 80, positive_search(16, 15, scales, Ls, sw));
    put_half(y + 82, positive_search(16, 15, mins, Lm, sw));
    for (int j = 0; j < 16; ++j) sc[j] = uint8_t(Ls[j] | (Lm[j] << 4));
  } else {
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 16; ++j) {
      for (int l = 0; l < 16; ++l) weight[l] = std::fabs(x[16 * j + l]);
      scales[j] = affine_search(16, 3, x + 16 * j, weight, L + 16 * j, &mins[j], -0.5f, 0.1f, 15, true);
      max_scale = std::max(max_scale, scales[j]);
      max_min = std::max(max_min, mins[j]);
    }
    std::memset(sc, 0, 16);
    if (max_scale > 0) {
      const float iscale = 15.f / max_scale;
      for (int j = 0; j < 16; ++j) sc[j] = uint8_t(nearest(iscale * scales[j]));
    }
    put_half(y + 80, max_scale > 0 ? max_scale / 15.f : 0.f);
    if (max_min > 0) {
      const float iscale = 15.f / max_min;
      for (int j = 0; j < 16; ++j) sc[j] |= uint8_t(nearest(iscale * mins[j]) << 4);
    }
    put_half(y + 82, max_min > 0 ? max_min / 15.f : 0.f);
  }
  uint16_t h;
  std::memcpy(&h, y + 80, 2);
  const float d_all = from_half(h);
  std::memcpy(&h, y + 82, 2);
  const float m_all = from_half(h);
  for (int j = 0; j < 16; ++j) {
    const float d = d_all * (sc[j] & 0xF);
    if (!d) continue;
    const float dm = m_all * (sc[j] >> 4);
    for (int i = 0; i < 16; ++i) L[16 * j + i] = uint8_t(std::max(0, std::min(3, nearest((x[16 * j + i] + dm) / d))));
  }
  pack_crumbs(L, y + 16);
}

// Q3_K (110 bytes): hmask[32] | qs[64] | scales[12] (16 six-bit scales, offset 32) | d
void q3_k(const float* x, uint8_t* y, const float* qw) {
  int8_t L[QK], Ls[16];
  float scales[16], weight[16], sw[16];
  uint8_t* sc = y + 96;
  std::memset(sc, 0, 12);
  auto put_scale = [sc](int j, int l) {  // l in [0, 64)
    if (j < 8) sc[j] = uint8_t(l & 0xF);
    else sc[j - 8] |= uint8_t((l & 0xF) << 4);
    sc[j % 4 + 8] |= uint8_t((l >> 4) << (2 * (j / 4)));
  };
  if (qw) {
    const float sigma2 = 2 * sum_of_squares(x, QK) / QK;
    for (int j = 0; j < 16; ++j) {
      for (int l = 0; l < 16; ++l) weight[l] = qw[16 * j + l] * std::sqrt(sigma2 + x[16 * j + l] * x[16 * j + l]);
      float sumw = 0;
      for (int l = 0; l < 16; ++l) sumw += weight[l];
      sw[j] = sumw;
      scales[j] = symmetric_search(16, 4, x + 16 * j, L + 16 * j, weight);
    }
    const float d = symmetric_search(16, 32, scales, Ls, sw);
    for (int j = 0; j < 16; ++j) put_scale(j, Ls[j]);
    put_half(y + 108, d);
  } else {
    float max_scale = 0, amax = 0;
    for (int j = 0; j < 16; ++j) {
      scales[j] = q3_search(16, 4, x + 16 * j, L + 16 * j);
      if (std::fabs(scales[j]) > amax) { amax = std::fabs(scales[j]); max_scale = scales[j]; }
    }
    if (max_scale) {
      const float iscale = -32.f / max_scale;
      for (int j = 0; j < 16; ++j) {
        const int8_t l = int8_t(nearest(iscale * scales[j]));
        put_scale(j, std::max<int>(-32, std::min<int>(31, l)) + 32);
      }
      put_half(y + 108, 1 / iscale);
    } else {
      put_half(y + 108, 0.f);
    }
  }
  uint16_t h;
  std::memcpy(&h, y + 108, 2);
  const float d_all = from_half(h);
  for (int j = 0; j < 16; ++j) {
    const int s = ((j < 8 ? sc[j] & 0xF : sc[j - 8] >> 4) | (((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
    const float d = d_all * s;
    if (!d) continue;
    for (int i = 0; i < 16; ++i) L[16 * j + i] = int8_t(std::max(-4, std::min(3, nearest(x[16 * j + i] / d))) + 4);
  }
  uint8_t* hmask = y;
  std::memset(hmask, 0, 32);
  uint8_t codes[QK];
  for (int j = 0; j < QK; ++j) {
    int l = L[j];
    if (l > 3) {
      hmask[j % 32] |= uint8_t(1 << (j / 32));
      l -= 4;
    }
    codes[j] = uint8_t(l);
  }
  pack_crumbs(codes, y + 32);
}

// Q4_K (144 bytes): d | dmin | scales[12] (8 six-bit scales and mins) | qs[128];
// Q5_K (176 bytes): the same, then qh[32] before qs[128]. nmax: 15 or 31.
void q45_k(const float* x, uint8_t* y, const float* qw, int nmax) {
  uint8_t L[QK], Ls[8], Lm[8];
  float scales[8], mins[8], weights[32], sw[8];
  uint8_t* sc = y + 4;
  if (qw) {
    const float sigma2 = 2 * sum_of_squares(x, QK) / QK;
    for (int j = 0; j < 8; ++j) {
      for (int l = 0; l < 32; ++l)
        weights[l] = qw[32 * j + l] * std::sqrt(sigma2 + x[32 * j + l] * x[32 * j + l]);
      float sumw = 0;
      for (int l = 0; l < 32; ++l) sumw += weights[l];
      sw[j] = sumw;
      scales[j] = affine_search(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], -0.9f, 0.05f, 36, false);
    }
    put_half(y, positive_search(8, 63, scales, Ls, sw));
    put_half(y + 2, positive_search(8, 63, mins, Lm, sw));
  } else {
    float max_scale = 0, max_min = 0;
    const bool four = nmax == 15;
    for (int j = 0; j < 8; ++j) {
      const float av_x = std::sqrt(sum_of_squares(x + 32 * j, 32) / 32);
      for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(x[32 * j + l]);
      scales[j] = affine_search(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], four ? -1.f : -0.5f, 0.1f,
                                four ? 20 : 15, false);
      max_scale = std::max(max_scale, scales[j]);
      max_min = std::max(max_min, mins[j]);
    }
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f, inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    for (int j = 0; j < 8; ++j) {
      Ls[j] = std::min<uint8_t>(63, uint8_t(nearest(inv_scale * scales[j])));
      Lm[j] = std::min<uint8_t>(63, uint8_t(nearest(inv_min * mins[j])));
    }
    put_half(y, max_scale / 63.f);
    put_half(y + 2, max_min / 63.f);
  }
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      sc[j] = Ls[j];
      sc[j + 4] = Lm[j];
    } else {
      sc[j + 4] = uint8_t((Ls[j] & 0xF) | ((Lm[j] & 0xF) << 4));
      sc[j - 4] |= uint8_t((Ls[j] >> 4) << 6);
      sc[j] |= uint8_t((Lm[j] >> 4) << 6);
    }
  }
  uint16_t h;
  std::memcpy(&h, y, 2);
  const float d_all = from_half(h);
  std::memcpy(&h, y + 2, 2);
  const float m_all = from_half(h);
  for (int j = 0; j < 8; ++j) {
    const int s = j < 4 ? sc[j] & 63 : (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
    const int m = j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    const float d = d_all * s;
    if (!d) continue;
    const float dm = m_all * m;
    for (int i = 0; i < 32; ++i)
      L[32 * j + i] = uint8_t(std::max(0, std::min(nmax, nearest((x[32 * j + i] + dm) / d))));
  }
  uint8_t* qs = y + (nmax == 15 ? 16 : 48);
  if (nmax == 31) std::memset(y + 16, 0, 32);
  for (int n = 0, pair = 0; n < QK; n += 64, ++pair) {
    for (int j = 0; j < 32; ++j) {
      int l1 = L[n + j], l2 = L[n + j + 32];
      if (l1 > 15) { l1 -= 16; y[16 + j] |= uint8_t(1 << (2 * pair)); }
      if (l2 > 15) { l2 -= 16; y[16 + j] |= uint8_t(2 << (2 * pair)); }
      qs[32 * pair + j] = uint8_t(l1 | (l2 << 4));
    }
  }
}

// Q6_K (210 bytes): ql[128] | qh[64] | scales int8[16] | d
void q6_k(const float* x, uint8_t* y, const float* qw) {
  int8_t L[QK];
  float scales[16], max_scale = 0, max_abs = 0;
  for (int j = 0; j < 16; ++j) {
    scales[j] = symmetric_search(16, 32, x + 16 * j, L + 16 * j, qw ? qw + 16 * j : nullptr);
    if (std::fabs(scales[j]) > max_abs) { max_abs = std::fabs(scales[j]); max_scale = scales[j]; }
  }
  if (max_abs < MAX_EPS) {
    std::memset(y, 0, 210);
    return;
  }
  const float iscale = -128.f / max_scale, d_all = put_half(y + 208, 1 / iscale);
  int8_t* sc = reinterpret_cast<int8_t*>(y + 192);
  for (int j = 0; j < 16; ++j) sc[j] = int8_t(std::min(127, nearest(iscale * scales[j])));
  for (int j = 0; j < 16; ++j) {
    const float d = d_all * sc[j];
    if (!d) continue;
    for (int i = 0; i < 16; ++i) L[16 * j + i] = int8_t(std::max(-32, std::min(31, nearest(x[16 * j + i] / d))) + 32);
  }
  uint8_t *ql = y, *qh = y + 128;
  for (int j = 0; j < QK; j += 128, ql += 64, qh += 32) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t q1 = L[j + l] & 0xF, q2 = L[j + l + 32] & 0xF, q3 = L[j + l + 64] & 0xF, q4 = L[j + l + 96] & 0xF;
      ql[l] = uint8_t(q1 | (q3 << 4));
      ql[l + 32] = uint8_t(q2 | (q4 << 4));
      qh[l] = uint8_t((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4) |
                      ((L[j + l + 96] >> 4) << 6));
    }
  }
}

// Q4_0 / Q4_1 / Q5_0 / Q5_1 with an importance matrix: one row of `cols` values
void legacy_weighted(const float* x, uint8_t* y, int64_t cols, const float* qw, int qtype) {
  const float sigma2 = sum_of_squares(x, int(cols)) / cols;
  const bool offset = qtype == Q4_1 || qtype == Q5_1, five = qtype == Q5_0 || qtype == Q5_1;
  const int bytes = (five ? 22 : 18) + (offset ? 2 : 0);
  for (int64_t b = 0; b < cols / 32; ++b, y += bytes) {
    const float *xb = x + 32 * b, *w = qw + 32 * b;
    float weight[32];
    uint8_t L[32];
    for (int j = 0; j < 32; ++j) weight[j] = w[j] * std::sqrt(sigma2 + xb[j] * xb[j]);
    if (offset) {
      float neg_min;
      const float d = affine_search(32, five ? 31 : 15, xb, weight, L, &neg_min, -0.9f, 0.05f, 36, false);
      put_half(y, d);
      put_half(y + 2, -neg_min);
    } else {
      put_half(y, symmetric_search(32, five ? 16 : 8, xb, reinterpret_cast<int8_t*>(L), weight));
    }
    uint8_t* qs = y + bytes - 16;
    uint32_t qh = 0;
    for (int j = 0; j < 16; ++j) {
      qs[j] = uint8_t((L[j] & 0xF) | ((L[j + 16] & 0xF) << 4));
      qh |= uint32_t((L[j] >> 4) & 1) << j;
      qh |= uint32_t((L[j + 16] >> 4) & 1) << (j + 16);
    }
    if (five) std::memcpy(y + (offset ? 4 : 2), &qh, 4);
  }
}

int block_bytes(int qtype) {
  switch (qtype) {
    case Q2_K: return 84;
    case Q3_K: return 110;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    case IQ4_NL: return 18;
    case IQ4_XS: return 136;
    case IQ1_S: return 50;
    case IQ1_M: return 56;
    default: return grid_slot(qtype) >= 0 ? grid_rule(qtype).bytes : 0;
  }
}

// rows x cols float32 -> rows of blocks; `importance`: cols floats or 0
void quantize_rows(uintptr_t x_ptr, uintptr_t y_ptr, int64_t rows, int64_t cols, int qtype, uintptr_t importance,
                   int threads) {
  const float* x = reinterpret_cast<const float*>(x_ptr);
  uint8_t* y = reinterpret_cast<uint8_t*>(y_ptr);
  const float* qw = reinterpret_cast<const float*>(importance);
  const bool legacy = qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q5_1;
  const int block = legacy || qtype == IQ4_NL ? 32 : QK;  // values a block
  if (legacy ? !qw || cols % 32 : !block_bytes(qtype) || cols % block)
    throw std::invalid_argument("unsupported type, row length or missing importance for this quantizer");
  const bool iq1 = qtype == IQ1_S || qtype == IQ1_M, grid = grid_slot(qtype) >= 0 || iq1;
  if (grid && (!(iq1 ? iq1_grid : grids[grid_slot(qtype)]).size ||
               (!qw && (qtype == IQ2_XXS || qtype == IQ2_XS || qtype == IQ1_S))))
    throw std::invalid_argument("a grid i-quant without its grid (set_grid) or without the importance it needs");
  const int64_t row_bytes = legacy ? cols / 32 * ((qtype == Q4_0 ? 18 : qtype == Q5_1 ? 24 : qtype == Q4_1 ? 20 : 22))
                                   : cols / block * block_bytes(qtype);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 16)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    uint8_t* yr = y + r * row_bytes;
    if (legacy) {
      legacy_weighted(xr, yr, cols, qw, qtype);
      continue;
    }
    for (int64_t b = 0; b < cols / block; ++b) {
      const float *xb = xr + b * block, *w = qw ? qw + b * block : nullptr;
      uint8_t* yb = yr + b * block_bytes(qtype);
      switch (qtype) {
        case IQ4_NL: case IQ4_XS: iq4(xb, yb, w, block); break;
        case IQ2_XXS: case IQ2_XS: case IQ2_S: case IQ3_XXS: case IQ3_S: grid_block(qtype, xb, yb, w); break;
        case IQ1_S: iq1_s(xb, yb, w); break;
        case IQ1_M: iq1_m(xb, yb, w); break;
        case Q2_K: q2_k(xb, yb, w); break;
        case Q3_K: q3_k(xb, yb, w); break;
        case Q4_K: q45_k(xb, yb, w, 15); break;
        case Q5_K: q45_k(xb, yb, w, 31); break;
        default: q6_k(xb, yb, w); break;
      }
    }
  }
}

}  // namespace
}  // namespace hearth

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_rows", &hearth::quantize_rows, "float32 rows -> GGUF blocks (llama.cpp's searches)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("set_grid", [](int qtype, uintptr_t levels, int size) {
    const int8_t* points = reinterpret_cast<const int8_t*>(levels);
    if (qtype == hearth::IQ1_S || qtype == hearth::IQ1_M) return hearth::build_grid(hearth::iq1_grid, points, size, 8, 2, 2, 3);
    if (hearth::grid_slot(qtype) < 0) throw std::invalid_argument("not a grid i-quant");
    hearth::set_grid(qtype, points, size);
  }, "a grid i-quant's points (int8 levels [size, 8 or 4]), before its first quantize_rows");
}
