// The kernels' own decodings to fp32, of blocks in place and of packed tiles (tested bit-exact
// against hearth.quant.formats).
#include "packed.h"

namespace hearth {

// rows of W as fp32 [rows, K] (bit-exact against hearth.quant.formats)
void dequantize_rows(uintptr_t w_, uintptr_t out_, int64_t rows, int64_t K, int64_t rb, int qtype, int threads) {
  const uint8_t* wp = (const uint8_t*)w_;
  float* op = (float*)out_;
  parallel_ranges(rows, threads, 8, [&](int64_t a, int64_t b) {
    for (int64_t n = a; n < b; n++) {
      const uint8_t* row = wp + n * rb;
      float* dst = op + n * K;
      if (qtype == F16 || qtype == BF16) {
        for (int64_t k = 0; k < K; k++) {
          uint16_t h;
          std::memcpy(&h, row + 2 * k, 2);
          dst[k] = qtype == F16 ? half_to_float(h) : bf16_to_float(h);
        }
      } else {
        HEARTH_DISPATCH(qtype, {
          for (int64_t b2 = 0; b2 < K / Fmt<QT>::BS; b2++) decode<QT>(row + b2 * Fmt<QT>::BYTES, dst + b2 * Fmt<QT>::BS);
        });
      }
    }
  });
}

// tiles -> fp32 [tiles x NR, K], bit-exact as dequantize_rows
void dequantize_packed(uintptr_t codes_, uintptr_t terms_, uintptr_t out_, int64_t tiles, int64_t K, int qtype,
                       int threads) {
  HEARTH_DISPATCH(qtype, {
    if constexpr (!packable<QT>()) throw std::invalid_argument("packed tiles: not for type " + std::to_string(qtype));
    else {
      using F = Fmt<QT>;
      using P = Packed<QT>;
      const auto [code_bytes, term_bytes] = packed_bytes(QT, K);
      parallel_ranges(tiles, threads, 1, [&](int64_t t0, int64_t t1) {
        alignas(64) uint8_t v[8 * 128];
        float s[P::NS][NR], o[P::NS][NR];
        for (int64_t t = t0; t < t1; t++)
          for (int64_t b = 0; b < K / F::BS; b++) {
            tile_block_terms<QT>((const uint8_t*)terms_ + t * term_bytes + b * P::TERMS, s, o);
            for (int c = 0; c < F::BS / 32; c++) {
              unpack_chunk<QT>((const uint8_t*)codes_ + t * code_bytes + (b * (F::BS / 32) + c) * P::CHUNK, v);
              for (int g = 0; g < 8; g++)
                for (int j = 0; j < NR; j++)
                  for (int i = 0; i < 4; i++) {
                    const int at = 32 * c + 4 * g + i, sub = at / F::S;  // value in the block, its sub-block
                    ((float*)out_)[(t * NR + j) * K + b * F::BS + at] =
                        s[sub][j] * float(int(v[(g * NR + j) * 4 + i]) - F::Z) + o[sub][j];
                  }
            }
          }
      });
    }
  });
}

}  // namespace hearth
