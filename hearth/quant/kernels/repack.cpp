// Blocks repacked once at load into the packed tiles (packed.h's layout) on AVX-512 VNNI builds.
#include "avx2_blocks.h"
#include "packed.h"

#include <array>

namespace hearth {
namespace {

// A block's terms as the tiles keep them: d as float16 bits (the nibble blocks': float32; MXFP4's: bfloat16), f as float16
// bits, sc and mn per sub-block.
template <int QT>
void block_ints(const uint8_t* b, uint32_t& d, uint16_t& f, int8_t* sc, int8_t* mn) {
  auto bits = [](const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return h; };
  f = 0;
  if constexpr (nibble_format<QT>()) {  // d float32 | scale int8[16]
    std::memcpy(&d, b, 4);
    for (int j = 0; j < 16; j++) sc[j] = int8_t(b[4 + j]);
  } else if constexpr (QT == Q2_K) {
    d = bits(b + 80), f = bits(b + 82);
    for (int j = 0; j < 16; j++) sc[j] = int8_t(b[j] & 0x0F), mn[j] = int8_t(b[j] >> 4);
  } else if constexpr (QT == Q3_K) {
    d = bits(b + 108);
    for (int j = 0; j < 16; j++) sc[j] = int8_t(q3_k_scale(b + 96, j));
  } else if constexpr (QT == Q4_K || QT == Q5_K) {
    d = bits(b), f = bits(b + 2);
    for (int j = 0; j < 8; j++) {
      int s, m;
      k_scale_min(b + 4, j, s, m);
      sc[j] = int8_t(s), mn[j] = int8_t(m);
    }
  } else if constexpr (QT == IQ4_XS) {  // d | scales_h u16 | scales_l[4] | qs: 6-bit scales less 32
    d = bits(b);
    const int high = b[2] | (b[3] << 8);
    for (int j = 0; j < 8; j++) sc[j] = int8_t((((b[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((high >> (2 * j)) & 3) << 4)) - 32);
  } else if constexpr (QT == Q6_K) {
    d = bits(b + 208);
    for (int j = 0; j < 16; j++) sc[j] = int8_t(b[192 + j]);
  } else if constexpr (QT == MXFP4) {  // e8m0 | qs: d bfloat16 bits (a float32's top half: its low one is 0)
    const float e = e8m0_half(b[0]);
    std::memcpy(&d, &e, 4);
    d >>= 16;
  } else {  // 32-value blocks: d first; Q4_1 / Q5_1's m after it, kept negated (w = d q - f)
    d = bits(b);
    if constexpr (Fmt<QT>::OFF) f = bits(b + 2) ^ 0x8000;
  }
}

// A table format's values + 128 (block_codes, unpack) back to their indices, in place
template <int QT>
void table_indices(uint8_t* q, int n) {
  static const auto index = [] {
    std::array<uint8_t, 256> at{};
    for (int i = 15; i >= 0; i--) at[uint8_t(table_values<QT>()[i] + 128)] = uint8_t(i);  // (6-value tables: zeros after)
    return at;
  }();
  for (int i = 0; i < n; i++) q[i] = index[q[i]];
}

// bit `bit` of each of 64 bytes
inline uint64_t byte_bits(const uint8_t* v, int bit) {
#ifdef HEARTH_AVX512
  return _mm512_test_epi8_mask(_mm512_loadu_si512((const void*)v), _mm512_set1_epi8((char)(1 << bit)));
#else
  uint64_t m = 0;
  for (int i = 0; i < 64; i++) m |= uint64_t((v[i] >> bit) & 1) << i;
  return m;
#endif
}

// bits `bit`, `bit` + 1 of the bytes at src of groups g, g + 2, g + 4, g + 6 (src in group g < 2 of
// byte codes [8][32 rows][4]) in one byte: a 2-bit plane's
inline uint8_t two_bits(const uint8_t* src, int bit) {
  uint8_t out = 0;
  for (int s = 0; s < 4; s++) out |= uint8_t(((src[2 * s * 128] >> bit) & 3) << (2 * s));
  return out;
}

// One chunk of byte codes [8][32 rows][4] -> its packed codes (the layout above)
template <int QT>
void pack_chunk(const uint8_t* v, uint8_t* out) {
  using P = Packed<QT>;
  for (int i = 0; i < P::PLANE; i++) {  // byte i of the plane
    const int vec = i / 64, at = i % 64;  // vector (g, h) of the plane, byte in it
    const uint8_t* src = v + vec * 64 + at;
    if constexpr (P::BITS == 8) out[i] = src[0];
    else if constexpr (P::BITS == 4) out[i] = uint8_t((src[0] & 0x0F) | (src[4 * 128] << 4));
    else out[i] = two_bits(src, 0);
  }
  if constexpr (P::HIGH_PLANE)
    for (int i = 0; i < 2 * 128; i++) out[P::PLANE + i] = two_bits(v + i, P::BITS);
  for (int e = 0; e < P::MASKS; e++)
    for (int gh = 0; gh < 16; gh++) {
      const uint64_t m = byte_bits(v + gh * 64, P::BITS + e);
      std::memcpy(out + P::PLANE + (e * 16 + gh) * 8, &m, 8);
    }
}

template <int QT>
void repack_impl(const uint8_t* w, uint8_t* codes, uint8_t* terms, int64_t N, int64_t K, int64_t rb, int threads) {
  using F = Fmt<QT>;
  using P = Packed<QT>;
  const int64_t nb = K / F::BS, tiles = (N + NR - 1) / NR;
  const auto [code_bytes, term_bytes] = packed_bytes(QT, K);
  parallel_ranges(tiles, threads, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) uint8_t q[NR][F::BS];      // one block of every row
    alignas(64) uint32_t v[F::BS / 4][NR];  // the same as [group][row][4 codes]
    for (int64_t t = t0; t < t1; t++)
      for (int64_t b = 0; b < nb; b++) {
        uint8_t* tt = terms + t * term_bytes + b * P::TERMS;
        for (int j = 0; j < NR; j++) {
          const int64_t n = t * NR + j;
          uint32_t d = 0;
          uint16_t f = 0;
          int8_t sc[P::NS] = {}, mn[P::NS] = {};
          if (n < N) {
            if constexpr (nibble_format<QT>()) {  // (read in place by their own kernel: no Block<QT>)
              float s[P::NS], o[P::NS];
              unpack<QT>(w + n * rb + b * F::BYTES, q[j], s, o);
            } else {
              block_codes<QT>(w + n * rb + b * F::BYTES, q[j]);
            }
            if constexpr (table_packed<QT>()) table_indices<QT>(q[j], F::BS);
            block_ints<QT>(w + n * rb + b * F::BYTES, d, f, sc, mn);
          } else {
            std::memset(q[j], 0, F::BS);
          }
          std::memcpy(tt + P::D_BYTES * j, &d, P::D_BYTES);  // (little-endian: float16 bits in d's low bytes)
          if constexpr (P::MIN) std::memcpy(tt + P::F_AT + 2 * j, &f, 2);
          if constexpr (P::SC)
            for (int s = 0; s < P::NS; s++) {
              tt[P::SC_AT + s * NR + j] = uint8_t(sc[s]);
              if constexpr (P::MIN) tt[P::MN_AT + s * NR + j] = uint8_t(mn[s]);
            }
        }
        for (int g = 0; g < F::BS / 4; g++)
          for (int j = 0; j < NR; j++) std::memcpy(&v[g][j], q[j] + 4 * g, 4);
        for (int c = 0; c < F::BS / 32; c++)
          pack_chunk<QT>((const uint8_t*)v[8 * c], codes + t * code_bytes + (b * (F::BS / 32) + c) * P::CHUNK);
      }
  });
}

}  // namespace

// bytes of one tile's codes and terms for K values a row
std::pair<int64_t, int64_t> packed_bytes(int qtype, int64_t K) {
  std::pair<int64_t, int64_t> bytes;
  HEARTH_DISPATCH(qtype, {
    if constexpr (!packable<QT>()) throw std::invalid_argument("packed tiles: not for type " + std::to_string(qtype));
    else bytes = {K / 32 * Packed<QT>::CHUNK, K / Fmt<QT>::BS * Packed<QT>::TERMS};
  });
  return bytes;
}

// Blocks [N, rb] -> tiles: codes [tiles, code bytes], terms [tiles, term bytes] (packed_bytes)
void repack(uintptr_t w_, uintptr_t codes_, uintptr_t terms_, int64_t N, int64_t K, int64_t rb, int qtype, int threads) {
  HEARTH_DISPATCH(qtype, {
    if constexpr (packable<QT>())
      repack_impl<QT>((const uint8_t*)w_, (uint8_t*)codes_, (uint8_t*)terms_, N, K, rb, threads);
    else
      throw std::invalid_argument("repack: not for type " + std::to_string(qtype));
  });
}

}  // namespace hearth
