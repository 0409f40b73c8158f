// A block's codes and terms in AVX2 registers (Block<QT>), the integer dot products over them
// (I8Dot), and block_codes: what the in-place dot products (int8_dots.cpp), the tiles decoded
// per call (int8_tiles.cpp) and the repacking (repack.cpp) read blocks with.
#pragma once

#include "qmatmul.h"

namespace hearth {
namespace {  // this source's own copies, internal as when the kernels were one file

#ifdef __AVX2__

// 32 bits -> 32 bytes, byte i = 0xFF where bit i is set, else 0
inline __m256i bits_to_bytes(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}
// byte i = 16 where bit i is set (the 5th bit of Q5_0 / Q5_1 codes)
inline __m256i bits_to_sixteens(uint32_t bits) { return _mm256_and_si256(bits_to_bytes(bits), _mm256_set1_epi8(16)); }

// bit `from` of every byte moved to bit `to`, the other bits cleared (a 16-bit shift: what crosses
// into the neighbouring byte is masked off)
inline __m256i byte_bit(__m256i v, int from, int to) {
  const __m256i moved = from < to ? _mm256_slli_epi16(v, to - from) : _mm256_srli_epi16(v, from - to);
  return _mm256_and_si256(moved, _mm256_set1_epi8((char)(1 << to)));
}

// nibbles of 16 bytes: [low nibbles | high nibbles], values 0..15 then 16..31 of a 32-value block
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i v = _mm_loadu_si128((const __m128i*)qs), m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

// One block's codes as 32-value chunks of unsigned bytes, and its terms (see the section's note):
//   codes(c): uint8 [32], values 32c..32c+31;  scales(c): int16 [16], the scale of each int16 lane
//   of maddubs(codes(c), x) (values 2i, 2i + 1);  c16: int16 [16], c_j per 16 values;  d, f: fp32.
//   32-value formats: offset o instead of scales and c16.
template <int QT> struct Block;

// Q8_0's codes are signed: maddubs takes |q| and moves q's sign onto x (|q| <= 128, |x| <= 127:
// a pair's sum stays below 2^15)
template <> struct Block<Q8_0> {
  static constexpr bool SIGNED = true;
  const uint8_t* b; float d, o = 0.f;
  explicit Block(const uint8_t* p) : b(p), d(h2f(p)) {}
  __m256i codes(int) const { return _mm256_loadu_si256((const __m256i*)(b + 2)); }
};
template <> struct Block<Q4_0> {
  const uint8_t* b; float d, o;
  explicit Block(const uint8_t* p) : b(p), d(h2f(p)), o(-8.f * d) {}
  __m256i codes(int) const { return nibbles32(b + 2); }
};
template <> struct Block<Q4_1> {
  const uint8_t* b; float d, o;
  explicit Block(const uint8_t* p) : b(p), d(h2f(p)), o(h2f(p + 2)) {}
  __m256i codes(int) const { return nibbles32(b + 4); }
};
template <> struct Block<Q5_0> {
  const uint8_t* b; float d, o;
  explicit Block(const uint8_t* p) : b(p), d(h2f(p)), o(-16.f * d) {}
  __m256i codes(int) const { return _mm256_or_si256(nibbles32(b + 6), bits_to_sixteens(u32(b + 2))); }
};
template <> struct Block<Q5_1> {
  const uint8_t* b; float d, o;
  explicit Block(const uint8_t* p) : b(p), d(h2f(p)), o(h2f(p + 2)) {}
  __m256i codes(int) const { return _mm256_or_si256(nibbles32(b + 8), bits_to_sixteens(u32(b + 4))); }
};

// The codebook formats: 4-bit indices (Q4_0's nibbles) looked up in a 16-entry table by one
// shuffle, giving signed int8 codes read as Q8_0's.
inline __m256i lookup16(const int8_t* table, __m256i nibbles) {
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)table)), nibbles);
}
template <> struct Block<IQ4_NL> {
  static constexpr bool SIGNED = true;
  const uint8_t* b; float d, o = 0.f;
  explicit Block(const uint8_t* p) : b(p), d(h2f(p)) {}
  __m256i codes(int) const { return lookup16(IQ4_NL_VALUES, nibbles32(b + 2)); }
};
template <> struct Block<MXFP4> {
  static constexpr bool SIGNED = true;
  const uint8_t* b; float d, o = 0.f;
  explicit Block(const uint8_t* p) : b(p), d(e8m0_half(p[0])) {}
  __m256i codes(int) const { return lookup16(MXFP4_VALUES, nibbles32(b + 1)); }
};

// Scales per 16 values, int16, kept in memory: a chunk's scale vector is then built by broadcasts
// from it (constants to permute registers would take the registers the accumulators need).
struct Scales16 {
  alignas(32) int16_t s[16];
  void set(__m256i sc16) { _mm256_store_si256((__m256i*)s, sc16); }
  // chunk c's two halves of 16, each scale repeated over its 8 int16 lanes of a maddubs result
  __m256i halves(int c) const {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16(s[2 * c])), _mm_set1_epi16(s[2 * c + 1]), 1);
  }
  __m256i whole(int c) const { return _mm256_set1_epi16(s[2 * c]); }  // one scale for all 32 values
};

// Q4_K / Q5_K: d | dmin | 12 bytes of 8 6-bit scales and mins (k_scale_min, all at once, each
// repeated for its two halves of 16) | codes
struct ScaleMinBlock {
  const uint8_t* b; float d, f; Scales16 sc; __m256i c16;
  explicit ScaleMinBlock(const uint8_t* p) : b(p), d(h2f(p)), f(h2f(p + 2)) {
    const uint32_t r0 = u32(p + 4), r1 = u32(p + 8), r2 = u32(p + 12);
    const uint64_t sc = uint64_t(r0 & 0x3F3F3F3Fu) | uint64_t((r2 & 0x0F0F0F0Fu) | ((r0 >> 2) & 0x30303030u)) << 32;
    const uint64_t mn = uint64_t(r1 & 0x3F3F3F3Fu) | uint64_t(((r2 >> 4) & 0x0F0F0F0Fu) | ((r1 >> 2) & 0x30303030u)) << 32;
    const __m128i pairs = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    this->sc.set(_mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_cvtsi64_si128((long long)sc), pairs)));
    c16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_cvtsi64_si128((long long)mn), pairs));
  }
  __m256i scales(int c) const { return sc.whole(c); }  // one scale per chunk of 32
  // 32 bytes of nibbles per two chunks at `qs`: low nibbles chunk 2i, high 2i + 1
  static __m256i nibbles(const uint8_t* qs, int c) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * (c / 2)));
    return _mm256_and_si256(c % 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
  }
};
template <> struct Block<Q4_K> : ScaleMinBlock {
  using ScaleMinBlock::ScaleMinBlock;
  __m256i codes(int c) const { return nibbles(b + 16, c); }
};
template <> struct Block<Q5_K> : ScaleMinBlock {
  using ScaleMinBlock::ScaleMinBlock;
  __m256i codes(int c) const {  // the 5th bit of value l of chunk c: bit c of qh[l]
    return _mm256_or_si256(nibbles(b + 48, c), byte_bit(_mm256_loadu_si256((const __m256i*)(b + 16)), c, 4));
  }
};
template <> struct Block<Q6_K> {
  const uint8_t* b; float d, f; Scales16 sc; __m256i c16;
  explicit Block(const uint8_t* p) : b(p), d(h2f(p + 208)), f(d) {
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + 192)));
    sc.set(sc16);
    c16 = _mm256_slli_epi16(sc16, 5);  // Z = 32
  }
  __m256i scales(int c) const { return sc.halves(c); }
  __m256i codes(int c) const {  // chunk c = 4h + s: low 4 bits from ql, high 2 from qh (unpack<Q6_K>)
    const int h = c / 4, s = c % 4;
    const __m256i ql = _mm256_loadu_si256((const __m256i*)(b + 64 * h + 32 * (s & 1)));
    const __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
    const __m256i low = _mm256_and_si256(s < 2 ? ql : _mm256_srli_epi16(ql, 4), _mm256_set1_epi8(0x0F));
    const __m256i high = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * s), 4), _mm256_set1_epi8(0x30));
    return _mm256_or_si256(low, high);
  }
};
template <> struct Block<Q3_K> {
  const uint8_t* b; float d, f; Scales16 sc; __m256i c16;
  explicit Block(const uint8_t* p) : b(p), d(h2f(p + 108)), f(d) {
    for (int j = 0; j < 16; j++) sc.s[j] = (int16_t)q3_k_scale(p + 96, j);
    c16 = _mm256_slli_epi16(_mm256_load_si256((const __m256i*)sc.s), 2);  // Z = 4
  }
  __m256i scales(int c) const { return sc.halves(c); }
  __m256i codes(int c) const {  // chunk c = 4h + s: 2 bits from qs, the 3rd from bit c of hmask[l]
    const int h = c / 4, s = c % 4;
    const __m256i qs = _mm256_loadu_si256((const __m256i*)(b + 32 + 32 * h));
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * s), _mm256_set1_epi8(3));
    return _mm256_or_si256(low, byte_bit(_mm256_loadu_si256((const __m256i*)b), c, 2));
  }
};
template <> struct Block<Q2_K> {
  const uint8_t* b; float d, f; Scales16 sc; __m256i c16;
  explicit Block(const uint8_t* p) : b(p), d(h2f(p + 80)), f(h2f(p + 82)) {
    const __m256i raw = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
    sc.set(_mm256_and_si256(raw, _mm256_set1_epi16(0x0F)));
    c16 = _mm256_srli_epi16(raw, 4);
  }
  __m256i scales(int c) const { return sc.halves(c); }
  __m256i codes(int c) const {  // chunk c = 4h + s: (qs[32h + l] >> 2s) & 3
    const __m256i qs = _mm256_loadu_si256((const __m256i*)(b + 16 + 32 * (c / 4)));
    return _mm256_and_si256(_mm256_srli_epi16(qs, 2 * (c % 4)), _mm256_set1_epi8(3));
  }
};

// IQ4_XS: signed codes (the IQ4_NL table) with a signed 6-bit scale per 32 values and no offset
// (f = 0, c16 = 0: the dot products need no correction term).
template <> struct Block<IQ4_XS> {
  static constexpr bool SIGNED = true;
  const uint8_t* b; float d, f = 0.f; Scales16 sc; __m256i c16 = _mm256_setzero_si256();
  explicit Block(const uint8_t* p) : b(p), d(h2f(p)) {
    for (int j = 0; j < 8; j++) sc.s[2 * j] = sc.s[2 * j + 1] = (int16_t)iq4_xs_scale(p, j);
  }
  __m256i scales(int c) const { return sc.whole(c); }
  __m256i codes(int c) const { return lookup16(IQ4_NL_VALUES, nibbles32(b + 8 + 16 * c)); }
};

// The nibble blocks (the grid formats rewritten at load, formats.h's Nibbles): 4-bit codes looked
// up by one shuffle in the grid's values moved up by their largest Z, unsigned codes read as
// Q4_K's (one load per 64 values), per 16 values the scale 2 l + 1; the zero point taken off per
// block by the sums of activations (f = d, c16 = Z scale): no sign operations, unlike IQ4_XS.
template <int QT> struct NibbleBlock {
  const uint8_t* b; float d, f; Scales16 sc; __m256i c16, table;
  static constexpr int Z = Nibbles<QT>::values[15] ? Nibbles<QT>::values[15] : Nibbles<QT>::values[5];
  explicit NibbleBlock(const uint8_t* p) : b(p) {
    std::memcpy(&d, p, 4);
    f = d;
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + 4)));
    sc.set(sc16);
    c16 = _mm256_mullo_epi16(sc16, _mm256_set1_epi16(Z));
    // 3-bit codes: the 8 values twice (an index's fourth bit is another code's)
    const __m128i values = code_bits<QT>() == 4 ? _mm_loadu_si128((const __m128i*)Nibbles<QT>::values)
                                                : _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)Nibbles<QT>::values),
                                                                     _mm_loadl_epi64((const __m128i*)Nibbles<QT>::values));
    table = _mm256_add_epi8(_mm256_broadcastsi128_si256(values), _mm256_set1_epi8(Z));
  }
  __m256i scales(int c) const { return sc.halves(c); }
  __m256i codes(int c) const {
    if (code_bits<QT>() == 4 || c < 6) return _mm256_shuffle_epi8(table, ScaleMinBlock::nibbles(b + 20, c));
    // 3-bit codes of chunks 6 and 7 (formats.h's code3): bits 3 and 7 of the three rows gathered
    // into bits 3, 2, 1 (chunk 6) and 7, 6, 5 (chunk 7); the shift leaves zeros in bits 3 and 7
    const __m256i m = _mm256_set1_epi8((char)0x88);
    const auto bits = [&](int row) { return _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(b + 20 + 32 * row)), m); };
    const __m256i t = _mm256_or_si256(bits(0), _mm256_or_si256(_mm256_srli_epi16(bits(1), 1), _mm256_srli_epi16(bits(2), 2)));
    return _mm256_shuffle_epi8(table, _mm256_srli_epi16(t, c == 6 ? 1 : 5));
  }
};
template <> struct Block<NIB_IQ3_XXS> : NibbleBlock<NIB_IQ3_XXS> { using NibbleBlock::NibbleBlock; };
template <> struct Block<NIB_IQ3_S> : NibbleBlock<NIB_IQ3_S> { using NibbleBlock::NibbleBlock; };
template <> struct Block<NIB3_IQ2> : NibbleBlock<NIB3_IQ2> { using NibbleBlock::NibbleBlock; };
template <> struct Block<NIB3_IQ1> : NibbleBlock<NIB3_IQ1> { using NibbleBlock::NibbleBlock; };

// TQ2_0: the ternary codes as Q2_K lays them out, with no scales: a weight times an activation is
// the activation, zero or its negative, which is what the integer sums add up (maddubs by codes
// 0..2, less the block's sum of activations for the zero point 1).
template <> struct Block<TQ2_0> {
  const uint8_t* b; float d, f; __m256i c16;
  explicit Block(const uint8_t* p) : b(p), d(h2f(p + 64)), f(d), c16(_mm256_set1_epi16(1)) {}
  __m256i scales(int) const { return _mm256_set1_epi16(1); }
  __m256i codes(int c) const {
    const __m256i qs = _mm256_loadu_si256((const __m256i*)(b + 32 * (c / 4)));
    return _mm256_and_si256(_mm256_srli_epi16(qs, 2 * (c % 4)), _mm256_set1_epi8(3));
  }
};

// The integer dot products: AVX2's maddubs + madd + add, or, on AVX-512 VNNI builds, vpdpwssd /
// vpdpbusd doing the madd and the add in one (on 256-bit vectors: in place, 512-bit vectors made
// of two 32-value chunks measured 10-25% slower at one activation row, the joining costing more
// than the wider multiply saves; prefill and batches take the VNNI tiles instead).
template <bool VNNI>
struct I8Dot {
  // acc + per int16 lane pair (codes . x) * scale: unsigned codes, int8 x, int16 scales
  static __m256i scaled(__m256i acc, __m256i codes, __m256i x, __m256i scales) {
#ifdef HEARTH_VNNI
    if constexpr (VNNI) return _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(codes, x), scales);
#endif
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), scales));
  }
  // codes . x per 4 values
  static __m256i plain(__m256i codes, __m256i x) {
#ifdef HEARTH_VNNI
    if constexpr (VNNI) return _mm256_dpbusd_epi32(_mm256_setzero_si256(), codes, x);
#endif
    return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1));
  }
};
#endif  // __AVX2__

// A block's BS unsigned codes, unpack<QT>'s q (w = s (q - Z) + o): 32 at a time where the build has
// AVX2 (Block<QT>; Q8_0's signed codes moved up by 128), else unpack's loops.
template <int QT>
inline void block_codes(const uint8_t* p, uint8_t* codes) {
#ifdef __AVX2__
  const Block<QT> blk(p);
  constexpr bool SIGNED = requires { Block<QT>::SIGNED; };
  for (int ch = 0; ch < Fmt<QT>::BS / 32; ch++) {
    const __m256i v = blk.codes(ch);
    _mm256_storeu_si256((__m256i*)(codes + 32 * ch), SIGNED ? _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)) : v);
  }
#else
  float s[Fmt<QT>::BS / Fmt<QT>::S], o[Fmt<QT>::BS / Fmt<QT>::S];
  unpack<QT>(p, codes, s, o);
#endif
}

}  // namespace
}  // namespace hearth
