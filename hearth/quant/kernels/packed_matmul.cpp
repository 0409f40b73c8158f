// x W^T with W packed tiles (packed.h): the portable loops and the VNNI kernel.
#include "packed.h"

namespace hearth {
namespace {

// A chunk of 32 values of a tile unpacked (unpack_tile): bytes as Q8_0's codes, [8 groups][32 rows][4]
constexpr int64_t UNPACKED_CHUNK = 8 * NR * 4;

// Activation terms per row and sub-block j of S values: dx (the row's block scale) and the sum of
// the sub-block's codes, as the zero point's integer term -Z sum (a dot product's start) and as
// int16 (|sum| <= 32 x 128: pairs of them are one vpdpwssd word against two sub-blocks' minima).
struct PackedActivations {
  QuantizedActivations a;
  std::vector<int32_t> zsum;  // [M, K/S]
  std::vector<int16_t> sum;   // [M, K/S]
};

template <int QT>
void packed_activations(const float* x, int64_t M, int64_t K, PackedActivations& p, bool portable, int threads) {
  using F = Fmt<QT>;
  quantize_activations(x, M, K, p.a, threads, F::BS, portable);
  const int64_t ns = K / F::S;
  p.zsum.resize(M * ns);
  p.sum.resize(M * ns);
  for (int64_t m = 0; m < M; m++)
    for (int64_t j = 0; j < ns; j++) {
      int32_t sum = 0;
      for (int h = 0; h < F::S / 16; h++) sum += p.a.s16[m * (K / 16) + j * (F::S / 16) + h];
      p.zsum[m * ns + j] = -F::Z * sum;
      p.sum[m * ns + j] = int16_t(sum);
    }
}

// Portable: rows [m0, m0 + mr) against one tile, the terms as tile_block_terms reads them
template <int QT>
void packed_tile_generic(int mr, const uint8_t* codes, const uint8_t* terms, int64_t K, const PackedActivations& p,
                         int64_t m0, float* y, int64_t N, int64_t nvalid) {
  using F = Fmt<QT>;
  using P = Packed<QT>;
  const int64_t nb = K / F::BS, ns = K / F::S;
  alignas(64) uint8_t v[8 * 128];
  float s[P::NS][NR], o[P::NS][NR];
  for (int r = 0; r < mr; r++) {
    const int64_t m = m0 + r;
    double acc[NR] = {};
    for (int64_t b = 0; b < nb; b++) {
      tile_block_terms<QT>(terms + b * P::TERMS, s, o);
      float block[NR] = {};
      for (int c = 0; c < F::BS / 32; c++) {
        unpack_chunk<QT>(codes + (b * (F::BS / 32) + c) * P::CHUNK, v);
        for (int k = 0; k < 32 / F::S; k++) {  // sub-blocks in the chunk
          const int64_t sub = (b * F::BS + 32 * c) / F::S + k;
          for (int j = 0; j < NR; j++) {
            int32_t dot = p.zsum[m * ns + sub];
            for (int i = 0; i < F::S; i++) {
              const int at = 32 * c + k * F::S + i;  // in the block
              dot += int(v[((at % 32) / 4 * NR + j) * 4 + at % 4]) * int(p.a.q[m * K + b * F::BS + at]);
            }
            block[j] += s[sub % P::NS][j] * float(dot) + o[sub % P::NS][j] * float(p.sum[m * ns + sub]);
          }
        }
      }
      for (int j = 0; j < NR; j++) acc[j] += double(block[j] * p.a.d[m * nb + b]);
    }
    for (int j = 0; j < nvalid; j++) y[r * N + j] = float(acc[j]);
  }
}

#ifdef HEARTH_VNNI
// group g (4 values) of a packed chunk, rows 16h..16h+15: 64 unsigned byte codes
template <int QT>
inline __m512i packed_codes(const uint8_t* chunk, int g, int h) {
  using P = Packed<QT>;
  __m512i v;
  if constexpr (P::BITS == 8) {
    v = _mm512_loadu_si512((const void*)(chunk + (2 * g + h) * 64));
  } else if constexpr (P::BITS == 4) {
    const __m512i raw = _mm512_loadu_si512((const void*)(chunk + (2 * (g % 4) + h) * 64));
    v = _mm512_and_si512(g < 4 ? raw : _mm512_srli_epi16(raw, 4), _mm512_set1_epi8(0x0F));
  } else {
    const __m512i raw = _mm512_loadu_si512((const void*)(chunk + (2 * (g % 2) + h) * 64));
    v = _mm512_and_si512(_mm512_srli_epi16(raw, 2 * (g / 2)), _mm512_set1_epi8(3));
  }
  if constexpr (P::HIGH_PLANE) {  // bits 2 (g / 2), + 1 of the plane's bytes moved to bits 4, 5 (what an
    // epi16 shift brings across from the neighbouring byte lands outside them), then v | (high & 0x30)
    const __m512i raw = _mm512_loadu_si512((const void*)(chunk + P::PLANE + (2 * (g % 2) + h) * 64));
    const int shift = 2 * (g / 2);
    const __m512i high = shift < 4 ? _mm512_slli_epi16(raw, 4 - shift) : shift > 4 ? _mm512_srli_epi16(raw, shift - 4) : raw;
    v = _mm512_ternarylogic_epi32(v, high, _mm512_set1_epi8(0x30), 0xF8);  // a | (b & c)
  }
  for (int e = 0; e < P::MASKS; e++) {
    uint64_t m;
    std::memcpy(&m, chunk + P::PLANE + (e * 16 + 2 * g + h) * 8, 8);
    v = _mm512_mask_add_epi8(v, _cvtu64_mask64(m), v, _mm512_set1_epi8((char)(1 << (P::BITS + e))));
  }
  if constexpr (table_packed<QT>())  // indices -> values + 128
    v = _mm512_shuffle_epi8(_mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)table_values<QT>())),
                                             _mm512_set1_epi8(char(0x80))), v);
  return v;
}

inline bool software_prefetch() {
  static const bool on = !__builtin_cpu_is("amd");
  return on;
}

// The minima of a K-quant block's sub-blocks 2q, 2q + 1 for rows 16h..16h+15 as int16 pairs, one
// vpdpwssd against a row's two sub-block sums
template <int QT>
inline __m512i minima_pair(const uint8_t* tt, int q, int h) {
  using P = Packed<QT>;
  const __m128i even = _mm_loadu_si128((const __m128i*)(tt + P::MN_AT + 2 * q * NR + 16 * h));
  const __m128i odd = _mm_loadu_si128((const __m128i*)(tt + P::MN_AT + (2 * q + 1) * NR + 16 * h));
  return _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(even, odd), _mm_unpacklo_epi8(even, odd)));
}

// MR activation rows from m0 against one tile. Per sub-block j and 16 rows: S/4 vpdpbusd from the
// zero point's -Z sum(xq_j), then t += cvt(dot) (d sc_j); per block t -= f cvt(sum_j mn_j sum(xq_j)),
// the minima's integer dot (vpdpwssd, exact), and y += t dx. The minima went as one FMA a sub-block
// and row, on the vector pipes the vpdpbusd are bound by (Q4_K / Q5_K +4-6%, Q2_K +15% at 128 rows);
// the scales the same way in int32 (vpmulld) cost Q6_K and Q3_K 20-23% on an AVX-512 EPYC.
// stream: the call's first pass over the tile, with few rows (M <= 2 PACKED_MR: decode, a verification's).
// UNPACKED: the codes are the tile's as unpack_tile left them (bytes, Q8_0's layout), not the format's.
template <int QT, int MR, bool UNPACKED = false>
void packed_tile_vnni(const uint8_t* codes, const uint8_t* terms, int64_t K, const PackedActivations& p, int64_t m0,
                      float* y, int64_t N, int64_t nvalid, bool stream) {
  using F = Fmt<QT>;
  using P = Packed<QT>;
  constexpr int64_t CHUNK = UNPACKED ? UNPACKED_CHUNK : P::CHUNK;
  const int64_t nb = K / F::BS, ns = K / F::S;
  const int8_t* xq = p.a.q.data() + m0 * K;
  // in L1, not registers: those hold 4 x MR x 16 lanes of sums. Zeroed by vector stores: as `= {}` the compiler
  // called memset, 1 KB a tile and pass (2% of a prefill's samples; Q8_0 at 512 rows 20% slower)
  alignas(64) float acc[MR][NR];
  for (int r = 0; r < MR; r++)
    for (int h = 0; h < 2; h++) _mm512_store_ps(acc[r] + 16 * h, _mm512_setzero_ps());
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* tt = terms + b * P::TERMS;
    const uint8_t* cb = codes + b * (F::BS / 32) * CHUNK;
    // the tile streams from memory (L3 at best), so ask for both arrays as far ahead: at 3-8 rows too,
    // where the dot products would otherwise wait for it (SmolLM2 Q4_1, 1 thread: 5 rows 7.2 -> 6.1 ms, on the
    // Xeon). Not on AMD: an AVX-512 EPYC's own prefetchers stream the tiles faster alone (TinyLlama Q4_K_M
    // decode at 2 threads 32-35 -> 44-47 tok/s)
    if (stream && software_prefetch()) {
      constexpr int64_t CODES = (F::BS / 32) * P::CHUNK, AHEAD = (INT8_PREFETCH + CODES - 1) / CODES;  // blocks
      for (int64_t at = 0; at < CODES; at += 64) _mm_prefetch((const char*)(cb + at + AHEAD * CODES), _MM_HINT_T0);
      for (int64_t at = 0; at < P::TERMS; at += 64) _mm_prefetch((const char*)(tt + at + AHEAD * P::TERMS), _MM_HINT_T0);
    }
    __m512 d[2], t[MR][2];  // t: sum_j d sc_j dot_j
    for (int h = 0; h < 2; h++)
      d[h] = P::D_BYTES == 4 ? _mm512_loadu_ps((const float*)(tt + 64 * h))
             : P::D_BF16     ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                   _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(tt + 32 * h))), 16))
                             : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(tt + 32 * h)));
#pragma GCC unroll 16
    for (int j = 0; j < P::NS; j++) {
      const int64_t sub = b * P::NS + j;
      const uint8_t* chunk = cb + (j * F::S / 32) * CHUNK;
      const int g0 = (j * F::S % 32) / 4;  // the sub-block's first group in its chunk
      __m512i dot[MR][2];
      for (int r = 0; r < MR; r++) dot[r][0] = dot[r][1] = _mm512_set1_epi32(p.zsum[(m0 + r) * ns + sub]);
#pragma GCC unroll 8
      for (int g = g0; g < g0 + F::S / 4; g++) {
        const __m512i w0 = UNPACKED ? _mm512_loadu_si512((const void*)(chunk + 128 * g)) : packed_codes<QT>(chunk, g, 0);
        const __m512i w1 = UNPACKED ? _mm512_loadu_si512((const void*)(chunk + 128 * g + 64)) : packed_codes<QT>(chunk, g, 1);
        for (int r = 0; r < MR; r++) {
          int32_t word;
          std::memcpy(&word, xq + r * K + b * F::BS + j * F::S + 4 * (g - g0), 4);
          const __m512i xb = _mm512_set1_epi32(word);
          dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], w0, xb);
          dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], w1, xb);
        }
      }
      for (int h = 0; h < 2; h++) {
        const __m512 s = P::SC ? _mm512_mul_ps(d[h], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                     _mm_loadu_si128((const __m128i*)(tt + P::SC_AT + j * NR + 16 * h)))))
                               : d[h];
        for (int r = 0; r < MR; r++)
          t[r][h] = j == 0 ? _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][h]), s)
                           : _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][h]), s, t[r][h]);
      }
    }
    for (int h = 0; h < 2; h++) {
      const __m512 f = P::MIN ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(tt + P::F_AT + 32 * h))) : d[h];
      constexpr int PAIRS = P::SC && P::MIN ? P::NS / 2 : 0;
      __m512i minima[PAIRS > 0 ? PAIRS : 1];
      for (int q = 0; q < PAIRS; q++) minima[q] = minima_pair<QT>(tt, q, h);
      for (int r = 0; r < MR; r++) {
        if constexpr (P::MIN) {
          const int16_t* sums = p.sum.data() + (m0 + r) * ns + b * P::NS;
          __m512 offset;  // sum_j mn_j sum(xq_j)
          if constexpr (P::SC) {
            __m512i im = _mm512_setzero_si512();
            for (int q = 0; q < PAIRS; q++) {
              int32_t pair;
              std::memcpy(&pair, sums + 2 * q, 4);
              im = _mm512_dpwssd_epi32(im, minima[q], _mm512_set1_epi32(pair));
            }
            offset = _mm512_cvtepi32_ps(im);
          } else {
            offset = _mm512_set1_ps(float(sums[0]));
          }
          t[r][h] = _mm512_fnmadd_ps(f, offset, t[r][h]);
        }
        _mm512_store_ps(acc[r] + 16 * h, _mm512_fmadd_ps(t[r][h], _mm512_set1_ps(p.a.d[(m0 + r) * nb + b]),
                                                         _mm512_load_ps(acc[r] + 16 * h)));
      }
    }
  }
  const __mmask16 k0 = nvalid >= 16 ? 0xFFFF : (__mmask16)((1u << nvalid) - 1);
  const __mmask16 k1 = nvalid >= 32 ? 0xFFFF : nvalid <= 16 ? 0 : (__mmask16)((1u << (nvalid - 16)) - 1);
  for (int r = 0; r < MR; r++) {
    _mm512_mask_storeu_ps(y + r * N, k0, _mm512_load_ps(acc[r]));
    _mm512_mask_storeu_ps(y + r * N + 16, k1, _mm512_load_ps(acc[r] + 16));
  }
}
#endif  // HEARTH_VNNI

// activation rows per pass over a tile: the codes' unpacking and the terms' conversion are shared
// by them (Q4_K at 32 rows, one 5632 x 2048 and one 2048 x 5632 matrix, 1 thread: 4.8 ms at 4 rows,
// 4.4 at 6, 4.1 at 8; Q6_K 6.9 / 6.4 / 5.8)
constexpr int PACKED_MR = 8;

// Rows from which a call unpacks each tile once (unpack_tile) rather than decoding it in every pass of PACKED_MR
// rows: where the decoding costs more than a load (the extra bits' masks, 2-bit codes; Q6_K's plane only from
// ~100 rows). 1 thread, EPYC-512, against decoding in every pass: Q5_K +5% at 24 rows, +11% at 256; Q3_K +10%,
// Q5_0 +7% at 256; Q6_K -12% at 24, +6% at 128, +11% at 512; Q4_K +2%, IQ4_XS +1%, Q4_0 / Q8_0 / MXFP4 -3% (never)
template <int QT>
constexpr int64_t unpack_rows() {
  using P = Packed<QT>;
  return QT == Q6_K ? 12 * PACKED_MR : (P::MASKS > 0 || P::BITS == 2) ? 3 * PACKED_MR : INT64_MAX;
}

#ifdef HEARTH_VNNI
// A tile's codes -> bytes in Q8_0's layout (UNPACKED_CHUNK a chunk, the table formats' values + 128): the passes
// over it then load them where each would decode them again (the decoding costs about what its dot products do)
template <int QT>
void unpack_tile(const uint8_t* codes, int64_t K, uint8_t* out) {
  for (int64_t c = 0; c < K / 32; c++)
    for (int g = 0; g < 8; g++)
      for (int h = 0; h < 2; h++)
        _mm512_storeu_si512((void*)(out + c * UNPACKED_CHUNK + 128 * g + 64 * h),
                            packed_codes<QT>(codes + c * Packed<QT>::CHUNK, g, h));
}

template <int QT, bool UNPACKED, int MR = PACKED_MR>
void packed_tile_vnni_mr(int mr, const uint8_t* codes, const uint8_t* terms, int64_t K, const PackedActivations& p,
                         int64_t m0, float* y, int64_t N, int64_t nvalid, bool stream) {
  if constexpr (MR > 1)
    if (mr < MR) return packed_tile_vnni_mr<QT, UNPACKED, MR - 1>(mr, codes, terms, K, p, m0, y, N, nvalid, stream);
  packed_tile_vnni<QT, MR, UNPACKED>(codes, terms, K, p, m0, y, N, nvalid, stream);
}
#endif

// unpacked: the tile's codes as unpack_tile left them, or null
template <int QT>
void packed_tile(bool portable, int mr, const uint8_t* codes, const uint8_t* unpacked, const uint8_t* terms, int64_t K,
                 const PackedActivations& p, int64_t m0, float* y, int64_t N, int64_t nvalid, bool stream) {
#ifdef HEARTH_VNNI
  if (!portable && unpacked) return packed_tile_vnni_mr<QT, true>(mr, unpacked, terms, K, p, m0, y, N, nvalid, stream);
  if (!portable) return packed_tile_vnni_mr<QT, false>(mr, codes, terms, K, p, m0, y, N, nvalid, stream);
#endif
  packed_tile_generic<QT>(mr, codes, terms, K, p, m0, y, N, nvalid);
}

}  // namespace

// y [M, N] = x [M, K] W^T, W packed; x rounded to int8 per block of the format (q8_K / q8_0)
void packed_matmul(uintptr_t x_, uintptr_t codes_, uintptr_t terms_, uintptr_t y_, int64_t M, int64_t N, int64_t K,
                   int qtype, bool portable, int threads) {
  HEARTH_DISPATCH(qtype, {
    if constexpr (!packable<QT>()) throw std::invalid_argument("packed_matmul: not for type " + std::to_string(qtype));
    else {
      PackedActivations p;
      packed_activations<QT>((const float*)x_, M, K, p, portable, threads);
      const auto [code_bytes, term_bytes] = packed_bytes(QT, K);
      const uint8_t* codes = (const uint8_t*)codes_;
      const uint8_t* terms = (const uint8_t*)terms_;
      float* y = (float*)y_;
#ifdef HEARTH_VNNI
      const bool unpack = !portable && M >= unpack_rows<QT>();
#else
      const bool unpack = false;
#endif
      parallel_ranges((N + NR - 1) / NR, threads, 1, [&](int64_t t0, int64_t t1) {
        std::vector<uint8_t> unpacked(unpack ? K / 32 * UNPACKED_CHUNK : 0);
        for (int64_t t = t0; t < t1; t++) {
          const uint8_t* tile = codes + t * code_bytes;
#ifdef HEARTH_VNNI
          if (unpack) unpack_tile<QT>(tile, K, unpacked.data());
#endif
          for (int64_t m = 0; m < M; m += PACKED_MR)
            packed_tile<QT>(portable, (int)std::min<int64_t>(PACKED_MR, M - m), tile, unpack ? unpacked.data() : nullptr,
                            terms + t * term_bytes, K, p, m, y + m * N + t * NR, N, std::min<int64_t>(NR, N - t * NR),
                            m == 0 && M <= 2 * PACKED_MR);
        }
      });
    }
  });
}

}  // namespace hearth
