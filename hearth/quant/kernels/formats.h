// The GGUF block formats as the kernels read them (docs/quantized-matmul.md): GGMLQuantizationType
// values, each format's block geometry (Fmt), `unpack<QT>` (a block as unsigned codes q, per
// sub-block of S values a scale s and (for formats with a minimum) an offset o, so that
// w = s * (q - Z) + o with Z a per-format zero point), `decode<QT>` and the dispatch from a
// runtime type to a template. The layouts are hearth/quant/formats.py's, which is bit-exact
// against gguf. Shared by both extensions (hearth/backend/cpu_kernels/ reads its q8_0 KV
// blocks' size from it).
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace hearth {
namespace {  // this source's own copies, internal as when the kernels were one file

// fp16 -> fp32 without F16C
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: renormalize
    int e = -1;
    uint32_t m = mant;
    do { m <<= 1; e++; } while (!(m & 0x400));
    bits = sign | (uint32_t(112 - e) << 23) | ((m & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// GGMLQuantizationType values
enum QType : int {
  F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19,
  IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23, IQ1_M = 29, BF16 = 30, TQ2_0 = 35, MXFP4 = 39,
  // hearth's own: the grid formats as 4-bit codes (grid_nibbles.cpp), one per set of grid values; the
  // 6-value grids (IQ2_*, IQ1_*) as 3-bit codes
  NIB_IQ3_XXS = 218, NIB_IQ3_S = 221, NIB3_IQ2 = 316, NIB3_IQ1 = 319,
  // BF16 weights as pairs of 16 rows, laid out once at load where AVX512_BF16's pairs pay (half_matmul.cpp)
  BF16_PAIRS = 900,
  // the 32-value formats, IQ4_XS, Q4_K and Q5_K in groups of 8 rows (rows8.cpp): ROWS8 + the format's type
  ROWS8 = 1000,
};

// The codebook formats, read as signed codes like Q8_0's: a 4-bit index into 16 int8 values
// (gguf.quants' IQ4_NL.kvalues and MXFP4.kvalues, the e2m1 values doubled).
template <int QT> constexpr bool codebook() { return QT == IQ4_NL || QT == IQ4_XS || QT == MXFP4; }
// The grid formats: per 8 (IQ2_*, IQ1_*) or 4 (IQ3_*) values an index into a grid (grid_values()),
// a sign per value (IQ1_*: a shift by +-1/8 per 8 or 32 values). The int8 kernels read them only as
// nibble blocks, rewritten once at load (grid_nibbles): the signed values of each grid, at most 16,
// are a 4-bit code into a table, as IQ4_XS's are.
template <int QT> constexpr bool grid_format() {
  return QT == IQ2_XXS || QT == IQ2_XS || QT == IQ2_S || QT == IQ3_XXS || QT == IQ3_S || QT == IQ1_S || QT == IQ1_M;
}
template <int QT> constexpr bool nibble_format() { return QT == NIB_IQ3_XXS || QT == NIB_IQ3_S || QT == NIB3_IQ2 || QT == NIB3_IQ1; }
template <int QT> constexpr int code_bits() { return QT == NIB3_IQ2 || QT == NIB3_IQ1 ? 3 : 4; }  // of a nibble format
alignas(16) constexpr int8_t IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
alignas(16) constexpr int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// MXFP4's scale: an e8m0 exponent e as 2^(e - 128), half the OCP scale (its values are doubled);
// ggml's e8m0_to_fp32_half, subnormal for e < 2
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : uint32_t(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

// The grids of the grid formats as int8 values (gguf.quants' grids; set from Python when the module
// loads, Kernels.__init__, before any such block is read) and ggml's sign patterns: 7 sign bits
// and an eighth that makes their count even. One copy per extension (an inline variable).
struct GridTables {
  uint64_t iq2xxs[256], iq2xs[512], iq2s[1024];
  uint32_t iq3xxs[256], iq3s[512];
  uint64_t iq1s[2048];  // IQ1_S's and IQ1_M's
  uint8_t ksigns[128];
};
inline GridTables grid_tables;

namespace {

inline const GridTables& grid_values() { return grid_tables; }

inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  return half_to_float(h);
#endif
}

inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

template <int QT> struct Fmt;
//                                   values/block  bytes/block  sub-block  zero point  offset
template <> struct Fmt<Q8_0> { static constexpr int BS = 32,  BYTES = 34,  S = 32, Z = 128; static constexpr bool OFF = false; };
template <> struct Fmt<Q4_0> { static constexpr int BS = 32,  BYTES = 18,  S = 32, Z = 8;   static constexpr bool OFF = false; };
template <> struct Fmt<Q4_1> { static constexpr int BS = 32,  BYTES = 20,  S = 32, Z = 0;   static constexpr bool OFF = true; };
template <> struct Fmt<Q5_0> { static constexpr int BS = 32,  BYTES = 22,  S = 32, Z = 16;  static constexpr bool OFF = false; };
template <> struct Fmt<Q5_1> { static constexpr int BS = 32,  BYTES = 24,  S = 32, Z = 0;   static constexpr bool OFF = true; };
template <> struct Fmt<Q2_K> { static constexpr int BS = 256, BYTES = 84,  S = 16, Z = 0;   static constexpr bool OFF = true; };
template <> struct Fmt<Q3_K> { static constexpr int BS = 256, BYTES = 110, S = 16, Z = 4;   static constexpr bool OFF = false; };
template <> struct Fmt<Q4_K> { static constexpr int BS = 256, BYTES = 144, S = 32, Z = 0;   static constexpr bool OFF = true; };
template <> struct Fmt<Q5_K> { static constexpr int BS = 256, BYTES = 176, S = 32, Z = 0;   static constexpr bool OFF = true; };
template <> struct Fmt<Q6_K> { static constexpr int BS = 256, BYTES = 210, S = 16, Z = 32;  static constexpr bool OFF = false; };
template <> struct Fmt<TQ2_0> { static constexpr int BS = 256, BYTES = 66, S = 32, Z = 1;   static constexpr bool OFF = false; };
// codebook formats: q = the int8 value + 128, as Q8_0's
template <> struct Fmt<IQ4_NL> { static constexpr int BS = 32, BYTES = 18, S = 32, Z = 128; static constexpr bool OFF = false; };
template <> struct Fmt<IQ4_XS> { static constexpr int BS = 256, BYTES = 136, S = 32, Z = 128; static constexpr bool OFF = false; };
template <> struct Fmt<MXFP4> { static constexpr int BS = 32, BYTES = 17, S = 32, Z = 128; static constexpr bool OFF = false; };
// grid formats: q = the signed value + 128 as above, per 16 values a scale (grid_block)
template <> struct Fmt<IQ2_XXS> { static constexpr int BS = 256, BYTES = 66, S = 16, Z = 128; static constexpr bool OFF = false; };
template <> struct Fmt<IQ2_XS> { static constexpr int BS = 256, BYTES = 74, S = 16, Z = 128; static constexpr bool OFF = false; };
template <> struct Fmt<IQ2_S> { static constexpr int BS = 256, BYTES = 82, S = 16, Z = 128; static constexpr bool OFF = false; };
template <> struct Fmt<IQ3_XXS> { static constexpr int BS = 256, BYTES = 98, S = 16, Z = 128; static constexpr bool OFF = false; };
template <> struct Fmt<IQ3_S> { static constexpr int BS = 256, BYTES = 110, S = 16, Z = 128; static constexpr bool OFF = false; };
template <> struct Fmt<IQ1_S> { static constexpr int BS = 256, BYTES = 50, S = 16, Z = 128; static constexpr bool OFF = false; };
template <> struct Fmt<IQ1_M> { static constexpr int BS = 256, BYTES = 56, S = 16, Z = 128; static constexpr bool OFF = false; };
// nibble blocks (grid_nibbles): d fp32 | scale int8[16] | 4-bit codes qs[128] or 3-bit hmask[32] qs[64] (below)
template <> struct Fmt<NIB_IQ3_XXS> { static constexpr int BS = 256, BYTES = 148, S = 16, Z = 128; static constexpr bool OFF = false; };
template <> struct Fmt<NIB_IQ3_S> { static constexpr int BS = 256, BYTES = 148, S = 16, Z = 128; static constexpr bool OFF = false; };
template <> struct Fmt<NIB3_IQ2> { static constexpr int BS = 256, BYTES = 116, S = 16, Z = 128; static constexpr bool OFF = false; };
template <> struct Fmt<NIB3_IQ1> { static constexpr int BS = 256, BYTES = 116, S = 16, Z = 128; static constexpr bool OFF = false; };
// half arrays: 32 values taken as one "block"
template <> struct Fmt<F16>  { static constexpr int BS = 32,  BYTES = 64,  S = 32, Z = 0;   static constexpr bool OFF = false; };
template <> struct Fmt<BF16> { static constexpr int BS = 32,  BYTES = 64,  S = 32, Z = 0;   static constexpr bool OFF = false; };
template <int QT> constexpr bool is_half() { return QT == F16 || QT == BF16; }

// ------------------------------------------------------------------ block layouts
// (the same layouts as hearth/quant/formats.py, which is bit-exact against gguf)

template <int QT> void unpack(const uint8_t* b, uint8_t* q, float* s, float* o);

// Q8_0: d f16 | qs int8[32]; q = qs + 128 (unsigned), Z = 128
template <> void unpack<Q8_0>(const uint8_t* b, uint8_t* q, float* s, float*) {
  s[0] = h2f(b);
  for (int i = 0; i < 32; i++) q[i] = b[2 + i] ^ 0x80;
}
// Q4_0: d f16 | qs[16]: value j low nibble of qs[j], value j+16 high nibble
template <> void unpack<Q4_0>(const uint8_t* b, uint8_t* q, float* s, float*) {
  s[0] = h2f(b);
  for (int j = 0; j < 16; j++) { q[j] = b[2 + j] & 0x0F; q[j + 16] = b[2 + j] >> 4; }
}
// Q4_1: d f16 | m f16 | qs[16] as Q4_0; w = d q + m
template <> void unpack<Q4_1>(const uint8_t* b, uint8_t* q, float* s, float* o) {
  s[0] = h2f(b); o[0] = h2f(b + 2);
  for (int j = 0; j < 16; j++) { q[j] = b[4 + j] & 0x0F; q[j + 16] = b[4 + j] >> 4; }
}
// Q5_0: d f16 | qh u32 (bit j: 5th bit of value j) | qs[16] as Q4_0
template <> void unpack<Q5_0>(const uint8_t* b, uint8_t* q, float* s, float*) {
  s[0] = h2f(b);
  uint32_t qh = u32(b + 2);
  for (int j = 0; j < 16; j++) {
    q[j] = (b[6 + j] & 0x0F) | (((qh >> j) & 1) << 4);
    q[j + 16] = (b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
  }
}
// Q5_1: d f16 | m f16 | qh u32 | qs[16]
template <> void unpack<Q5_1>(const uint8_t* b, uint8_t* q, float* s, float* o) {
  s[0] = h2f(b); o[0] = h2f(b + 2);
  uint32_t qh = u32(b + 4);
  for (int j = 0; j < 16; j++) {
    q[j] = (b[8 + j] & 0x0F) | (((qh >> j) & 1) << 4);
    q[j + 16] = (b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
  }
}
// IQ4_NL: d f16 | qs[16] as Q4_0's nibbles; w = d kvalues[nibble]
template <> void unpack<IQ4_NL>(const uint8_t* b, uint8_t* q, float* s, float*) {
  s[0] = h2f(b);
  for (int j = 0; j < 16; j++) { q[j] = uint8_t(IQ4_NL_VALUES[b[2 + j] & 0x0F] + 128); q[j + 16] = uint8_t(IQ4_NL_VALUES[b[2 + j] >> 4] + 128); }
}
// MXFP4: e u8 | qs[16] as Q4_0's nibbles; w = e8m0_half(e) kvalues[nibble]
template <> void unpack<MXFP4>(const uint8_t* b, uint8_t* q, float* s, float*) {
  s[0] = e8m0_half(b[0]);
  for (int j = 0; j < 16; j++) { q[j] = uint8_t(MXFP4_VALUES[b[1 + j] & 0x0F] + 128); q[j + 16] = uint8_t(MXFP4_VALUES[b[1 + j] >> 4] + 128); }
}
// IQ4_XS: d f16 | scales_h u16 | scales_l[4] | qs[128], sub-block j of 32: 6-bit scale (low nibble
// j of scales_l, bits 2j, 2j + 1 of scales_h), codes in qs[16j..] as Q4_0's; w = d (scale - 32) kvalues[nibble]
inline int iq4_xs_scale(const uint8_t* b, int j) {
  const int low = (b[4 + j / 2] >> (4 * (j % 2))) & 0x0F, high = ((b[2] | (b[3] << 8)) >> (2 * j)) & 3;
  return (low | (high << 4)) - 32;
}
template <> void unpack<IQ4_XS>(const uint8_t* b, uint8_t* q, float* s, float*) {
  const float d = h2f(b);
  for (int j = 0; j < 8; j++) {
    s[j] = d * float(iq4_xs_scale(b, j));
    for (int i = 0; i < 16; i++) {
      q[32 * j + i] = uint8_t(IQ4_NL_VALUES[b[8 + 16 * j + i] & 0x0F] + 128);
      q[32 * j + 16 + i] = uint8_t(IQ4_NL_VALUES[b[8 + 16 * j + i] >> 4] + 128);
    }
  }
}
// The grid formats: per group of 8 (IQ2_*, IQ1_*) or 4 (IQ3_*) values a grid index, per value a
// sign (IQ1_*: none, but a shift of +-1/8 per 8 or 32 values). sign_bits: the 32 signs of values
// 32c..32c+31 (bit i: value 32c + i).
inline uint32_t ksign_bits(uint32_t aux) {  // four 7-bit sign pattern indices -> 32 sign bits
  const uint8_t* ks = grid_values().ksigns;
  return ks[aux & 127] | (ks[(aux >> 7) & 127] << 8) | (ks[(aux >> 14) & 127] << 16) | (uint32_t(ks[(aux >> 21) & 127]) << 24);
}
// chunk c's sign bits and the grid value of its value 32c + i
template <int QT> uint32_t grid_sign_bits(const uint8_t* b, int c);
template <int QT> int grid_value(const uint8_t* b, int c, int i);
template <> uint32_t grid_sign_bits<IQ2_XXS>(const uint8_t* b, int c) { return ksign_bits(u32(b + 6 + 8 * c)); }
template <> int grid_value<IQ2_XXS>(const uint8_t* b, int c, int i) { return uint8_t(grid_values().iq2xxs[b[2 + 8 * c + i / 8]] >> (8 * (i % 8))); }
template <> uint32_t grid_sign_bits<IQ3_XXS>(const uint8_t* b, int c) { return ksign_bits(u32(b + 66 + 4 * c)); }
template <> int grid_value<IQ3_XXS>(const uint8_t* b, int c, int i) { return uint8_t(grid_values().iq3xxs[b[2 + 8 * c + i / 4]] >> (8 * (i % 4))); }
template <> uint32_t grid_sign_bits<IQ2_XS>(const uint8_t* b, int c) {
  uint32_t bits = 0;
  for (int k = 0; k < 4; k++) bits |= uint32_t(grid_values().ksigns[(b[3 + 8 * c + 2 * k] >> 1) & 127]) << (8 * k);
  return bits;
}
template <> int grid_value<IQ2_XS>(const uint8_t* b, int c, int i) {
  const int index = (b[2 + 8 * c + 2 * (i / 8)] | (b[3 + 8 * c + 2 * (i / 8)] << 8)) & 511;
  return uint8_t(grid_values().iq2xs[index] >> (8 * (i % 8)));
}
template <> uint32_t grid_sign_bits<IQ2_S>(const uint8_t* b, int c) { return u32(b + 34 + 4 * c); }
template <> int grid_value<IQ2_S>(const uint8_t* b, int c, int i) {
  const int index = b[2 + 4 * c + i / 8] | (((b[66 + c] >> (2 * (i / 8))) & 3) << 8);
  return uint8_t(grid_values().iq2s[index] >> (8 * (i % 8)));
}
template <> uint32_t grid_sign_bits<IQ3_S>(const uint8_t* b, int c) { return u32(b + 74 + 4 * c); }
template <> int grid_value<IQ3_S>(const uint8_t* b, int c, int i) {
  const int index = b[2 + 8 * c + i / 4] | (((b[66 + c] >> (i / 4)) & 1) << 8);
  return uint8_t(grid_values().iq3s[index] >> (8 * (i % 4)));
}
// A grid block's signed values: w = d scale[j] v for value i of sub-block j = i / 16 (gguf's
// dequantization exactly: d scale v fits fp32's mantissa). IQ2_*: v = +-(8, 25, 43), d = d16 / 8;
// IQ3_XXS: v = +-(4 .. 62), d16 / 4; IQ3_S: +-(1 .. 15), d16; IQ1_*: v = 8 g +- 1 (g in -1, 0, 1
// shifted by -+1/8), d16 / 8. scale: 2 l + 1 of the format's 4-bit (IQ1_*: 3-bit) l.
struct GridValues {
  float d;
  int8_t scale[16], v[256];
};
template <int QT> constexpr float grid_step() { return QT == IQ3_S ? 1.f : QT == IQ3_XXS ? 0.25f : 0.125f; }
// IQ2_*, IQ3_*: l per 32 values (IQ2_XXS, IQ3_*) or 16 (IQ2_XS, IQ2_S)
template <int QT> int grid_scale(const uint8_t* b, int j16) {
  if constexpr (QT == IQ2_XXS) return int(u32(b + 6 + 4 * (j16 & ~1)) >> 28);
  if constexpr (QT == IQ3_XXS) return int(u32(b + 66 + 2 * (j16 & ~1)) >> 28);
  const int j = QT == IQ3_S ? j16 / 2 : j16, at = QT == IQ2_XS ? 66 : QT == IQ2_S ? 74 : 106;
  return (b[at + j / 2] >> (4 * (j % 2))) & 15;
}
template <int QT> void grid_block(const uint8_t* b, GridValues& g) {
  g.d = h2f(b) * grid_step<QT>();
  for (int j = 0; j < 16; j++) g.scale[j] = int8_t(2 * grid_scale<QT>(b, j) + 1);
  for (int c = 0; c < 8; c++) {
    const uint32_t signs = grid_sign_bits<QT>(b, c);
    for (int i = 0; i < 32; i++) g.v[32 * c + i] = int8_t(((signs >> i) & 1 ? -1 : 1) * grid_value<QT>(b, c, i));
  }
}
// the 8 values 8 g +- 1 of IQ1's grid entry `index`
inline void iq1_group(int index, bool minus, int8_t* v) {
  const uint64_t e = grid_values().iq1s[index];
  for (int j = 0; j < 8; j++) v[j] = int8_t(8 * int8_t(e >> (8 * j)) + (minus ? -1 : 1));
}
// IQ1_S (50 bytes): d f16 | qs[32] | qh u16[8], per 32 values: bits 0-11 the grid indices' high 3
// bits (3 a group of 8), 12-14 l, 15 the shift's sign
template <> void grid_block<IQ1_S>(const uint8_t* b, GridValues& g) {
  g.d = h2f(b) * 0.125f;
  for (int c = 0; c < 8; c++) {
    const int qh = b[34 + 2 * c] | (b[35 + 2 * c] << 8);
    g.scale[2 * c] = g.scale[2 * c + 1] = int8_t(2 * ((qh >> 12) & 7) + 1);
    for (int k = 0; k < 4; k++) iq1_group(b[2 + 4 * c + k] | (((qh >> (3 * k)) & 7) << 8), qh & 0x8000, g.v + 32 * c + 8 * k);
  }
}
// IQ1_M (56 bytes): qs[32] | qh[16] (a nibble per group of 8: the index's high 3 bits, the shift's
// sign) | scales u16[4] (per 16 values a 3-bit l, 4 a word; d16's 4 bits in each word's top nibble)
template <> void grid_block<IQ1_M>(const uint8_t* b, GridValues& g) {
  uint16_t sc[4];
  std::memcpy(sc, b + 48, 8);
  const uint16_t d16 = (sc[0] >> 12) | ((sc[1] >> 8) & 0xF0) | ((sc[2] >> 4) & 0xF00) | (sc[3] & 0xF000);
  uint8_t d_bytes[2];
  std::memcpy(d_bytes, &d16, 2);
  g.d = h2f(d_bytes) * 0.125f;
  for (int j = 0; j < 16; j++) g.scale[j] = int8_t(2 * ((sc[j / 4] >> (3 * (j % 4))) & 7) + 1);
  for (int k = 0; k < 32; k++) {
    const int h = (b[32 + k / 2] >> (4 * (k % 2))) & 15;
    iq1_group(b[k] | ((h & 7) << 8), h & 8, g.v + 8 * k);
  }
}

// The nibble blocks (NIB_*, NIB3_*, grid_nibbles.cpp writes them): the grid formats' GridValues with
// each v a code into its grid's signed values (Nibbles<QT>::values; 6 or 16 of them); w = d scale v:
//   4-bit codes (16 values): d fp32 | scale int8[16] (per 16 values) | qs[128]: value i of chunk c
//     of 32 in byte 32 (c / 2) + i, the low nibble for an even c, the high one for an odd c (Q4_K's);
//   3-bit codes (6 values): d fp32 | scale int8[16] | qs[96], three rows of 32 bytes: value i of chunk
//     c < 6 at bits 4 (c % 2) .. 4 (c % 2) + 2 of byte i of row c / 2 (read as Q4_K's nibbles, their
//     fourth bit ignored); of chunk 6 (7), bit j of the code at bit 3 (7) of byte i of row 2 - j.
template <int QT> struct Nibbles;
template <> struct Nibbles<NIB3_IQ2> { static constexpr int8_t values[16] = {-43, -25, -8, 8, 25, 43}; };
template <> struct Nibbles<NIB_IQ3_XXS> {
  static constexpr int8_t values[16] = {-62, -52, -44, -36, -28, -20, -12, -4, 4, 12, 20, 28, 36, 44, 52, 62};
};
template <> struct Nibbles<NIB_IQ3_S> { static constexpr int8_t values[16] = {-15, -13, -11, -9, -7, -5, -3, -1, 1, 3, 5, 7, 9, 11, 13, 15}; };
template <> struct Nibbles<NIB3_IQ1> { static constexpr int8_t values[16] = {-9, -7, -1, 1, 7, 9}; };
// the nibble format a grid format is rewritten to
template <int QT> constexpr int nibble_type() {
  return QT == IQ3_XXS ? NIB_IQ3_XXS : QT == IQ3_S ? NIB_IQ3_S : QT == IQ1_S || QT == IQ1_M ? NIB3_IQ1 : NIB3_IQ2;
}
inline int code3(const uint8_t* qs, int c, int i) {  // a 3-bit code (above)
  if (c < 6) return (qs[32 * (c / 2) + i] >> (4 * (c % 2))) & 7;
  const int at = c == 6 ? 3 : 7;
  return ((qs[64 + i] >> at) & 1) | (((qs[32 + i] >> at) & 1) << 1) | (((qs[i] >> at) & 1) << 2);
}
template <int QT> void unpack_nibbles(const uint8_t* b, uint8_t* q, float* s) {
  float d;
  std::memcpy(&d, b, 4);
  for (int j = 0; j < 16; j++) s[j] = d * float(int8_t(b[4 + j]));
  for (int c = 0; c < 8; c++)
    for (int i = 0; i < 32; i++) {
      const int code = code_bits<QT>() == 4 ? (b[20 + 32 * (c / 2) + i] >> (4 * (c % 2))) & 15 : code3(b + 20, c, i);
      q[32 * c + i] = uint8_t(Nibbles<QT>::values[code] + 128);
    }
}
template <int QT> void unpack_grid(const uint8_t* b, uint8_t* q, float* s) {
  if constexpr (nibble_format<QT>()) return unpack_nibbles<QT>(b, q, s);
  else {
    GridValues g;
    grid_block<QT>(b, g);
    for (int j = 0; j < 16; j++) s[j] = g.d * float(g.scale[j]);
    for (int i = 0; i < 256; i++) q[i] = uint8_t(g.v[i] + 128);
  }
}
template <> void unpack<IQ2_XXS>(const uint8_t* b, uint8_t* q, float* s, float*) { unpack_grid<IQ2_XXS>(b, q, s); }
template <> void unpack<IQ2_XS>(const uint8_t* b, uint8_t* q, float* s, float*) { unpack_grid<IQ2_XS>(b, q, s); }
template <> void unpack<IQ2_S>(const uint8_t* b, uint8_t* q, float* s, float*) { unpack_grid<IQ2_S>(b, q, s); }
template <> void unpack<IQ3_XXS>(const uint8_t* b, uint8_t* q, float* s, float*) { unpack_grid<IQ3_XXS>(b, q, s); }
template <> void unpack<IQ3_S>(const uint8_t* b, uint8_t* q, float* s, float*) { unpack_grid<IQ3_S>(b, q, s); }
template <> void unpack<IQ1_S>(const uint8_t* b, uint8_t* q, float* s, float*) { unpack_grid<IQ1_S>(b, q, s); }
template <> void unpack<IQ1_M>(const uint8_t* b, uint8_t* q, float* s, float*) { unpack_grid<IQ1_M>(b, q, s); }
template <> void unpack<NIB_IQ3_XXS>(const uint8_t* b, uint8_t* q, float* s, float*) { unpack_grid<NIB_IQ3_XXS>(b, q, s); }
template <> void unpack<NIB_IQ3_S>(const uint8_t* b, uint8_t* q, float* s, float*) { unpack_grid<NIB_IQ3_S>(b, q, s); }
template <> void unpack<NIB3_IQ2>(const uint8_t* b, uint8_t* q, float* s, float*) { unpack_grid<NIB3_IQ2>(b, q, s); }
template <> void unpack<NIB3_IQ1>(const uint8_t* b, uint8_t* q, float* s, float*) { unpack_grid<NIB3_IQ1>(b, q, s); }

// Q2_K: scales[16] (low nibble scale, high nibble min) | qs[64] | d f16 | dmin f16.
// value 128h + 32s + l = (qs[32h + l] >> 2s) & 3; sub-blocks of 16
template <> void unpack<Q2_K>(const uint8_t* b, uint8_t* q, float* s, float* o) {
  float d = h2f(b + 80), dmin = h2f(b + 82);
  for (int j = 0; j < 16; j++) { s[j] = d * float(b[j] & 0x0F); o[j] = -(dmin * float(b[j] >> 4)); }
  for (int h = 0; h < 2; h++)
    for (int sh = 0; sh < 4; sh++)
      for (int l = 0; l < 32; l++) q[128 * h + 32 * sh + l] = (b[16 + 32 * h + l] >> (2 * sh)) & 3;
}
// TQ2_0 (ternary): qs[64] (as Q2_K's) | d f16; w = d (q - 1), q in {0, 1, 2}. (TQ1_0, five
// trits a byte, is repacked to this at load: hearth/quant/formats.py tq1_0_to_tq2_0.)
template <> void unpack<TQ2_0>(const uint8_t* b, uint8_t* q, float* s, float*) {
  const float d = h2f(b + 64);
  for (int j = 0; j < 8; j++) s[j] = d;
  for (int h = 0; h < 2; h++)
    for (int sh = 0; sh < 4; sh++)
      for (int l = 0; l < 32; l++) q[128 * h + 32 * sh + l] = (b[32 * h + l] >> (2 * sh)) & 3;
}
// Q3_K: hmask[32] | qs[64] (as Q2_K) | scales[12] (6-bit, offset 32) | d f16.
// q = low + 4 * high, w = d (scale - 32) (q - 4); high bit of value i: (hmask[i % 32] >> (i / 32)) & 1
// the scale of sub-block j (-32..31) from the 12 bytes at `raw`
inline int q3_k_scale(const uint8_t* raw, int j) {
  const int low = j < 8 ? (raw[j] & 0x0F) : (raw[j - 8] >> 4), high = (raw[8 + j % 4] >> (2 * (j / 4))) & 3;
  return (low | (high << 4)) - 32;
}
template <> void unpack<Q3_K>(const uint8_t* b, uint8_t* q, float* s, float*) {
  float d = h2f(b + 108);
  for (int j = 0; j < 16; j++) s[j] = d * float(q3_k_scale(b + 96, j));
  for (int h = 0; h < 2; h++)
    for (int sh = 0; sh < 4; sh++)
      for (int l = 0; l < 32; l++) {
        int i = 128 * h + 32 * sh + l;
        q[i] = ((b[32 + 32 * h + l] >> (2 * sh)) & 3) | (((b[l] >> (i / 32)) & 1) << 2);
      }
}
// Q4_K / Q5_K scales: 12 bytes -> 8 6-bit scales and mins
inline void k_scale_min(const uint8_t* r, int j, int& sc, int& mn) {
  if (j < 4) { sc = r[j] & 63; mn = r[j + 4] & 63; }
  else { sc = (r[j + 4] & 0x0F) | ((r[j - 4] >> 6) << 4); mn = (r[j + 4] >> 4) | ((r[j] >> 6) << 4); }
}
// Q4_K: d f16 | dmin f16 | scales[12] | qs[128]: chunk c of 32 bytes, low nibbles = sub-block 2c,
// high = 2c+1; w = d sc q - dmin mn
template <> void unpack<Q4_K>(const uint8_t* b, uint8_t* q, float* s, float* o) {
  float d = h2f(b), dmin = h2f(b + 2);
  for (int j = 0; j < 8; j++) { int sc, mn; k_scale_min(b + 4, j, sc, mn); s[j] = d * float(sc); o[j] = -(dmin * float(mn)); }
  for (int c = 0; c < 4; c++)
    for (int l = 0; l < 32; l++) { q[64 * c + l] = b[16 + 32 * c + l] & 0x0F; q[64 * c + 32 + l] = b[16 + 32 * c + l] >> 4; }
}
// Q5_K: d | dmin | scales[12] | qh[32] (bit j: 5th bit of sub-block j) | qs[128] as Q4_K
template <> void unpack<Q5_K>(const uint8_t* b, uint8_t* q, float* s, float* o) {
  float d = h2f(b), dmin = h2f(b + 2);
  for (int j = 0; j < 8; j++) { int sc, mn; k_scale_min(b + 4, j, sc, mn); s[j] = d * float(sc); o[j] = -(dmin * float(mn)); }
  const uint8_t* qh = b + 16;
  for (int c = 0; c < 4; c++)
    for (int l = 0; l < 32; l++) {
      q[64 * c + l] = (b[48 + 32 * c + l] & 0x0F) | (((qh[l] >> (2 * c)) & 1) << 4);
      q[64 * c + 32 + l] = (b[48 + 32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
    }
}
// Q6_K: ql[128] | qh[64] | scales int8[16] | d f16. value 128h + 32s + l:
// low 4 bits from ql[64h + 32(s&1) + l] (s < 2: low nibble, else high), high 2 bits (qh[32h + l] >> 2s) & 3
template <> void unpack<Q6_K>(const uint8_t* b, uint8_t* q, float* s, float*) {
  float d = h2f(b + 208);
  for (int j = 0; j < 16; j++) s[j] = d * float(int8_t(b[192 + j]));
  for (int h = 0; h < 2; h++)
    for (int sh = 0; sh < 4; sh++)
      for (int l = 0; l < 32; l++) {
        uint8_t lo = b[64 * h + 32 * (sh & 1) + l];
        lo = sh < 2 ? (lo & 0x0F) : (lo >> 4);
        q[128 * h + 32 * sh + l] = lo | (((b[128 + 32 * h + l] >> (2 * sh)) & 3) << 4);
      }
}

// One block -> BS fp32 values, w = s (q - Z) + o.
template <int QT>
inline void decode(const uint8_t* b, float* w) {
  using F = Fmt<QT>;
  uint8_t q[F::BS];
  float s[F::BS / F::S], o[F::BS / F::S] = {};
  unpack<QT>(b, q, s, o);
  for (int j = 0; j < F::BS / F::S; j++)
    for (int i = 0; i < F::S; i++) w[j * F::S + i] = s[j] * float(int(q[j * F::S + i]) - F::Z) + o[j];
}

#define HEARTH_DISPATCH(qtype, ...)                                           \
  switch (qtype) {                                                            \
    case Q8_0: { constexpr int QT = Q8_0; __VA_ARGS__; break; }               \
    case Q4_0: { constexpr int QT = Q4_0; __VA_ARGS__; break; }               \
    case Q4_1: { constexpr int QT = Q4_1; __VA_ARGS__; break; }               \
    case Q5_0: { constexpr int QT = Q5_0; __VA_ARGS__; break; }               \
    case Q5_1: { constexpr int QT = Q5_1; __VA_ARGS__; break; }               \
    case Q2_K: { constexpr int QT = Q2_K; __VA_ARGS__; break; }               \
    case Q3_K: { constexpr int QT = Q3_K; __VA_ARGS__; break; }               \
    case Q4_K: { constexpr int QT = Q4_K; __VA_ARGS__; break; }               \
    case Q5_K: { constexpr int QT = Q5_K; __VA_ARGS__; break; }               \
    case Q6_K: { constexpr int QT = Q6_K; __VA_ARGS__; break; }               \
    case TQ2_0: { constexpr int QT = TQ2_0; __VA_ARGS__; break; }             \
    case IQ4_NL: { constexpr int QT = IQ4_NL; __VA_ARGS__; break; }           \
    case IQ4_XS: { constexpr int QT = IQ4_XS; __VA_ARGS__; break; }           \
    case MXFP4: { constexpr int QT = MXFP4; __VA_ARGS__; break; }             \
    case IQ2_XXS: { constexpr int QT = IQ2_XXS; __VA_ARGS__; break; }         \
    case IQ2_XS: { constexpr int QT = IQ2_XS; __VA_ARGS__; break; }           \
    case IQ2_S: { constexpr int QT = IQ2_S; __VA_ARGS__; break; }             \
    case IQ3_XXS: { constexpr int QT = IQ3_XXS; __VA_ARGS__; break; }         \
    case IQ3_S: { constexpr int QT = IQ3_S; __VA_ARGS__; break; }             \
    case IQ1_S: { constexpr int QT = IQ1_S; __VA_ARGS__; break; }             \
    case IQ1_M: { constexpr int QT = IQ1_M; __VA_ARGS__; break; }             \
    case NIB_IQ3_XXS: { constexpr int QT = NIB_IQ3_XXS; __VA_ARGS__; break; } \
    case NIB_IQ3_S: { constexpr int QT = NIB_IQ3_S; __VA_ARGS__; break; }     \
    case NIB3_IQ2: { constexpr int QT = NIB3_IQ2; __VA_ARGS__; break; }       \
    case NIB3_IQ1: { constexpr int QT = NIB3_IQ1; __VA_ARGS__; break; }       \
    default: throw std::invalid_argument("hearth qmatmul: unsupported type " + std::to_string(qtype)); \
  }

int64_t block_values(int qtype) {
  int64_t bs = 0;
  if (qtype == F16 || qtype == BF16 || qtype == BF16_PAIRS) return 1;
  if (qtype > ROWS8) return block_values(qtype - ROWS8);  // groups of 8 rows of a format's blocks (rows8.cpp)
  HEARTH_DISPATCH(qtype, bs = Fmt<QT>::BS);
  return bs;
}
int64_t block_bytes(int qtype) {  // of a block format's block (block_values of them)
  int64_t bytes = 0;
  HEARTH_DISPATCH(qtype, bytes = Fmt<QT>::BYTES);
  return bytes;
}

}  // namespace
}  // namespace hearth
