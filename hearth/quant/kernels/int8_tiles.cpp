// int8_matmul's prefill and batches on AVX-512 VNNI builds: tiles of 32 rows decoded per call.
#include "avx2_blocks.h"

#ifdef HEARTH_VNNI
namespace hearth {
namespace {

// ------------------------------------------------------------------ tiles decoded per call (VNNI)
// Prefill and batches (M >= INT8_TILE_MIN_ROWS) on AVX-512 VNNI builds, every sub-block format
// (the K-quants, Q4_1, Q5_0, Q5_1, TQ2_0): each thread decodes 32 weight rows at a time
// (Block<QT>, the blocks as the in-place kernels read them) into a tile laid out as the packed
// Q8_0 tiles are, unsigned byte codes [K/4][32 rows][4], with per sub-block j of S values and row
// the fp32 scale s_j and offset c_j (w = s_j q + c_j); then every activation row passes over
// it: per sub-block S/4 vpdpbusd per 16 rows, then
//   y += cvt(dot) (s_j dx) + c_j (dx sum_j xq).
// The decoding (~K ops per row) is paid once per call and spread over all M activation rows; the
// dot products take one instruction per 64 multiply-adds against ~3 in place.
constexpr int TILE_MR = 5;  // activation rows per pass over a tile

struct DecodedTile {
  std::vector<uint8_t> codes;  // [K/4][NR][4]
  std::vector<float> scale;    // [K/S][NR]
  std::vector<float> offset;   // [K/S][NR]
};

// One block as the tile holds it: BS unsigned codes (block_codes) and per sub-block of S values
// the scale s and offset c of w = s q + c.
template <int QT>
inline void block_terms(const uint8_t* p, uint8_t* codes, float* s, float* c) {
  using F = Fmt<QT>;
  const Block<QT> blk(p);
  constexpr bool SIGNED = requires { Block<QT>::SIGNED; };
  block_codes<QT>(p, codes);
  if constexpr (F::BS == 256) {  // per 16 values j: w = d sc_j q - f c_j
    alignas(32) int16_t c16[16];
    _mm256_store_si256((__m256i*)c16, blk.c16);
    for (int j = 0; j < F::BS / F::S; j++) {
      const int k = j * F::S / 16;
      if constexpr (requires { blk.sc; }) s[j] = blk.d * float(blk.sc.s[k]);
      else s[j] = blk.d;  // TQ2_0: no sub-block scales
      c[j] = -blk.f * float(c16[k]);
    }
  } else {
    s[0] = blk.d;
    c[0] = SIGNED ? -128.f * blk.d : blk.o;  // Q8_0's codes moved to unsigned
  }
}

template <int QT>
void decode_tile(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0, int64_t rows, DecodedTile& t) {
  using F = Fmt<QT>;
  constexpr int NS = F::BS / F::S;
  const int64_t nb = K / F::BS;
  t.codes.resize(NR * K);
  t.scale.resize(K / F::S * NR);
  t.offset.resize(K / F::S * NR);
  alignas(64) uint32_t q[NR][F::BS / 4];  // one block of every row, 4 codes a word
  float s[NS], c[NS];
  for (int64_t b = 0; b < nb; b++) {
    for (int64_t j = 0; j < NR; j++) {
      if (j < rows) {
        block_terms<QT>(w + (n0 + j) * row_bytes + b * F::BYTES, (uint8_t*)q[j], s, c);
      } else {  // rows past N: zero
        std::memset(q[j], 0, sizeof q[j]);
        for (int i = 0; i < NS; i++) s[i] = c[i] = 0.f;
      }
      for (int i = 0; i < NS; i++) {
        t.scale[(b * NS + i) * NR + j] = s[i];
        t.offset[(b * NS + i) * NR + j] = c[i];
      }
    }
    uint32_t* dst = (uint32_t*)t.codes.data() + b * (F::BS / 4) * NR;  // [BS/4][NR] words, written in order
    for (int g = 0; g < F::BS / 4; g++)
      for (int j = 0; j < NR; j++) dst[g * NR + j] = q[j][g];
  }
}

// MR activation rows against one decoded tile; xd / xs [MR][K/S]: dx and dx sum(xq) per sub-block
template <int S, int MR>
void tile_vnni(const DecodedTile& t, int64_t K, const int8_t* xq, const float* xd, const float* xs, float* y,
               int64_t N, int64_t nvalid) {
  const int64_t ns = K / S;
  __m512 acc[MR][2];
  for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t j = 0; j < ns; j++) {
    __m512i dot[MR][2];
    for (int r = 0; r < MR; r++) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
    const uint8_t* cb = t.codes.data() + j * (S / 4) * NR * 4;
#pragma GCC unroll 8
    for (int g = 0; g < S / 4; g++) {
      const __m512i w0 = _mm512_loadu_si512((const void*)(cb + g * NR * 4));
      const __m512i w1 = _mm512_loadu_si512((const void*)(cb + g * NR * 4 + 64));
      for (int r = 0; r < MR; r++) {
        int32_t v;
        std::memcpy(&v, xq + r * K + j * S + 4 * g, 4);
        const __m512i xb = _mm512_set1_epi32(v);
        dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], w0, xb);
        dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], w1, xb);
      }
    }
    const __m512 s0 = _mm512_loadu_ps(t.scale.data() + j * NR), s1 = _mm512_loadu_ps(t.scale.data() + j * NR + 16);
    const __m512 c0 = _mm512_loadu_ps(t.offset.data() + j * NR), c1 = _mm512_loadu_ps(t.offset.data() + j * NR + 16);
    for (int r = 0; r < MR; r++) {
      const __m512 d = _mm512_set1_ps(xd[r * ns + j]), sum = _mm512_set1_ps(xs[r * ns + j]);
      acc[r][0] = _mm512_fmadd_ps(c0, sum, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][0]), _mm512_mul_ps(s0, d), acc[r][0]));
      acc[r][1] = _mm512_fmadd_ps(c1, sum, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][1]), _mm512_mul_ps(s1, d), acc[r][1]));
    }
  }
  const __mmask16 k0 = nvalid >= 16 ? 0xFFFF : (__mmask16)((1u << nvalid) - 1);
  const __mmask16 k1 = nvalid >= 32 ? 0xFFFF : nvalid <= 16 ? 0 : (__mmask16)((1u << (nvalid - 16)) - 1);
  for (int r = 0; r < MR; r++) {
    _mm512_mask_storeu_ps(y + r * N, k0, acc[r][0]);
    _mm512_mask_storeu_ps(y + r * N + 16, k1, acc[r][1]);
  }
}

template <int S, int MR = TILE_MR>
void tile_vnni_mr(int mr, const DecodedTile& t, int64_t K, const int8_t* xq, const float* xd, const float* xs,
                  float* y, int64_t N, int64_t nvalid) {
  if constexpr (MR > 1)
    if (mr < MR) return tile_vnni_mr<S, MR - 1>(mr, t, K, xq, xd, xs, y, N, nvalid);
  tile_vnni<S, MR>(t, K, xq, xd, xs, y, N, nvalid);
}

template <int QT>
void int8_matmul_tiles(const uint8_t* w, int64_t K, const QuantizedActivations& a, int64_t M, float* y, int64_t N,
                       int threads) {
  using F = Fmt<QT>;
  const int64_t row_bytes = K / F::BS * F::BYTES, ns = K / F::S, per_block = F::BS / F::S, nb = K / F::BS;
  // per activation row and sub-block: dx and dx * (sum of the sub-block's codes)
  std::vector<float> xd(M * ns), xs(M * ns);
  for (int64_t m = 0; m < M; m++)
    for (int64_t j = 0; j < ns; j++) {
      const float d = a.d[m * nb + j / per_block];
      int32_t sum = 0;
      for (int h = 0; h < F::S / 16; h++) sum += a.s16[m * (K / 16) + j * (F::S / 16) + h];
      xd[m * ns + j] = d;
      xs[m * ns + j] = d * float(sum);
    }
  const int64_t tiles = (N + NR - 1) / NR;
  parallel_ranges(tiles, threads, 1, [&](int64_t t0, int64_t t1) {
    DecodedTile tile;
    for (int64_t t = t0; t < t1; t++) {
      const int64_t n0 = t * NR, rows = std::min<int64_t>(NR, N - n0);
      decode_tile<QT>(w, row_bytes, K, n0, rows, tile);
      for (int64_t m = 0; m < M; m += TILE_MR)
        tile_vnni_mr<F::S>((int)std::min<int64_t>(TILE_MR, M - m), tile, K, a.q.data() + m * K, xd.data() + m * ns,
                           xs.data() + m * ns, y + m * N + n0, N, rows);
    }
  });
}

}  // namespace

void int8_tiles_matmul(int qtype, const uint8_t* w, int64_t K, const QuantizedActivations& a, int64_t M, float* y,
                       int64_t N, int threads) {
  HEARTH_DISPATCH(qtype, {  // the codebook formats are read in place (int8_matmul_impl), the grid ones as nibble blocks
    if constexpr (codebook<QT>() || grid_format<QT>()) throw std::invalid_argument("decoded tiles: not for type " + std::to_string(qtype));
    else int8_matmul_tiles<QT>(w, K, a, M, y, N, threads);
  });
}

}  // namespace hearth
#endif  // HEARTH_VNNI
