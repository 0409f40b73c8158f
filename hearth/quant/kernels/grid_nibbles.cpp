// The grid formats (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) rewritten once at load
// into nibble blocks (formats.h's Nibbles), which the int8 kernels read as they read Q4_K: each
// grid's signed values number at most 16, so a value is a 4-bit code (IQ2_* and IQ1_*: 6 values, a
// 3-bit code), and the block keeps the same d, scales and values (lossless: w = d scale v as gguf
// dequantizes it). In place, a block's 4 or 8 grid entries per 32 values were loaded one by one,
// 3-5x Q4_K's time per matrix; the nibble blocks cost 148 bytes per 256 values with 4-bit codes, 116
// with 3-bit ones (IQ2_XXS's file 66, IQ3_S's 110: more bytes, read faster).
#include "qmatmul.h"

namespace hearth {
namespace {

// value -> its 4-bit code in Nibbles<NT>::values (values out of the grid cannot occur)
template <int NT>
struct NibbleCodes {
  uint8_t of[256] = {};
  NibbleCodes() {
    for (int i = 0; i < 16; i++) of[uint8_t(Nibbles<NT>::values[i])] = uint8_t(i);
  }
};

template <int QT>
void nibble_block(const uint8_t* b, uint8_t* out, const NibbleCodes<nibble_type<QT>()>& codes) {
  GridValues g;
  grid_block<QT>(b, g);
  constexpr int NT = nibble_type<QT>();
  std::memcpy(out, &g.d, 4);
  std::memcpy(out + 4, g.scale, 16);
  std::memset(out + 20, 0, Fmt<NT>::BYTES - 20);
  for (int c = 0; c < 8; c++)
    for (int i = 0; i < 32; i++) {
      const int code = codes.of[uint8_t(g.v[32 * c + i])];
      if (code_bits<NT>() == 4 || c < 6) {
        out[20 + 32 * (c / 2) + i] |= uint8_t(code << (4 * (c % 2)));
      } else {  // 3-bit codes of chunks 6 and 7: a bit in each row (formats.h's code3)
        for (int j = 0; j < 3; j++) out[20 + 32 * (2 - j) + i] |= uint8_t(((code >> j) & 1) << (c == 6 ? 3 : 7));
      }
    }
}

}  // namespace

// the nibble format a grid format's blocks become (throws for any other type)
int nibble_type_of(int qtype) {
  int nt = 0;
  HEARTH_DISPATCH(qtype, {
    if constexpr (grid_format<QT>()) nt = nibble_type<QT>();
    else throw std::invalid_argument("grid_nibbles: not a grid format: type " + std::to_string(qtype));
  });
  return nt;
}

// Blocks [N, rb] of a grid format -> nibble blocks [N, K / 256 * 148]
void grid_nibbles(uintptr_t w_, uintptr_t out_, int64_t N, int64_t K, int64_t rb, int qtype, int threads) {
  const uint8_t* w = (const uint8_t*)w_;
  uint8_t* out = (uint8_t*)out_;
  HEARTH_DISPATCH(qtype, {
    if constexpr (grid_format<QT>()) {
      using NT = Fmt<nibble_type<QT>()>;
      const NibbleCodes<nibble_type<QT>()> codes;
      const int64_t nb = K / 256;
      parallel_ranges(N, threads, 16, [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; n++)
          for (int64_t b = 0; b < nb; b++)
            nibble_block<QT>(w + n * rb + b * Fmt<QT>::BYTES, out + (n * nb + b) * NT::BYTES, codes);
      });
    } else {
      throw std::invalid_argument("grid_nibbles: not a grid format: type " + std::to_string(qtype));
    }
  });
}

}  // namespace hearth
