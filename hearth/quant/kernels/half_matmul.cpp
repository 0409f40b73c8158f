// F16 / BF16 arrays times fp32 or bf16 activations, weights widened to fp32 in registers.
#include "qmatmul.h"

namespace hearth {
namespace {

// F16 / BF16 rows [n0, n1) against all M activation rows, fp32. Portable path.
template <int QT>
void half_matmul_generic(const uint8_t* w, int64_t row_bytes, int64_t K, const float* x, int64_t M,
                         float* y, int64_t N, int64_t n0, int64_t n1) {
  std::vector<float> v(K);
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t k = 0; k < K; k++) {
      uint16_t h;
      std::memcpy(&h, row + 2 * k, 2);
      v[k] = QT == F16 ? half_to_float(h) : bf16_to_float(h);
    }
    for (int64_t m = 0; m < M; m++) {
      float a = 0.f;
#pragma omp simd reduction(+ : a)
      for (int64_t k = 0; k < K; k++) a += v[k] * x[m * K + k];
      y[m * N + n] = a;
    }
  }
}

inline float half_value(int qt, const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return qt == F16 ? half_to_float(h) : bf16_to_float(h);
}

// The SIMD products of half-array matmuls: F16 / BF16 weights widened to fp32 in registers, STEP
// values at a time, and fp32 FMA (exact up to summation order), on AVX-512 (16 lanes) or AVX2
// with F16C and FMA (8 lanes); NR weight rows per tile. (bf16 pairs by AVX512_BF16's vdpbf16ps
// were measured and lost: on this project's machine they ran at half the FLOP rate of fp32 FMA,
// docs/quantized-matmul.md.)
#if defined(HEARTH_AVX512)
#define HEARTH_HALF_SIMD 1
template <int QT> struct Fp32Lanes {
  using V = __m512; using W = __m512; using X = __m512;
  static constexpr int STEP = 16, NR = 4;  // 24 accumulators (4 x HALF_MR), 4 weights, 1 activation
  static V zero() { return _mm512_setzero_ps(); }
  static W w(const uint8_t* p) {
    const __m256i raw = _mm256_loadu_si256((const __m256i*)p);
    return QT == F16 ? _mm512_cvtph_ps(raw) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static X x(const float* p) { return _mm512_loadu_ps(p); }
  static V madd(W a, X b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static float sum(V a) { return _mm512_reduce_add_ps(a); }
};
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define HEARTH_HALF_SIMD 1
template <int QT> struct Fp32Lanes {
  using V = __m256; using W = __m256; using X = __m256;
  static constexpr int STEP = 8, NR = 2;  // 16 registers: 2 x HALF_MR accumulators, 2 weights, 1 activation
  static V zero() { return _mm256_setzero_ps(); }
  static W w(const uint8_t* p) {
    const __m128i raw = _mm_loadu_si128((const __m128i*)p);
    return QT == F16 ? _mm256_cvtph_ps(raw) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static X x(const float* p) { return _mm256_loadu_ps(p); }
  static V madd(W a, X b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static float sum(V a) { return hsum8(a); }
};
#endif

#ifdef HEARTH_HALF_SIMD
// One tile: NR weight rows against MR activation rows, every product of the tile in registers
// (a weight vector is loaded once for MR rows, an activation vector once for NR rows). Rows past
// `nr` / `mr` repeat the last one (computed, not stored), so one instantiation serves the edges.
// U > 1 (decode, one activation row): U accumulator sets over alternate steps, to hide latency.
template <class L, int QT, int NR, int MR, int U>
inline void half_tile(const uint8_t* w, int64_t row_bytes, const float* x, int64_t x_stride, int64_t K, int nr, int mr,
                      float* y, int64_t N, bool accumulate) {
  const uint8_t* rows[NR];
  const float* xs[MR];
  for (int j = 0; j < NR; j++) rows[j] = w + std::min(j, nr - 1) * row_bytes;
  for (int i = 0; i < MR; i++) xs[i] = x + std::min(i, mr - 1) * x_stride;
  typename L::V acc[U][MR][NR];
  for (int u = 0; u < U; u++)
    for (int i = 0; i < MR; i++)
      for (int j = 0; j < NR; j++) acc[u][i][j] = L::zero();
  int64_t k = 0;
  for (; k + U * L::STEP <= K; k += U * L::STEP)
    for (int u = 0; u < U; u++) {
      typename L::W wv[NR];
      for (int j = 0; j < NR; j++) wv[j] = L::w(rows[j] + 2 * (k + u * L::STEP));
      for (int i = 0; i < MR; i++) {
        const typename L::X xv = L::x(xs[i] + k + u * L::STEP);
        for (int j = 0; j < NR; j++) acc[u][i][j] = L::madd(wv[j], xv, acc[u][i][j]);
      }
    }
  for (; k + L::STEP <= K; k += L::STEP) {
    for (int i = 0; i < MR; i++) {
      const typename L::X xv = L::x(xs[i] + k);
      for (int j = 0; j < NR; j++) acc[0][i][j] = L::madd(L::w(rows[j] + 2 * k), xv, acc[0][i][j]);
    }
  }
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) {
      typename L::V a = acc[0][i][j];
      for (int u = 1; u < U; u++) a = L::add(a, acc[u][i][j]);
      float tail = 0.f;  // K need not be a multiple of STEP
      for (int64_t t = k; t < K; t++) tail += half_value(QT, rows[j] + 2 * t) * xs[i][t];
      y[i * N + j] = (accumulate ? y[i * N + j] : 0.f) + L::sum(a) + tail;
    }
}

// Blocking for M > 1: a range of K of at most HALF_KC values, and of the thread's weight rows as
// many as fill about HALF_BLOCK_BYTES (they stay in L2); every MR activation rows (in L1 for
// that range of K) pass over the block's rows, NR at a time. Partial sums over K add up in y.
// Six rows a tile: a verification of up to 5 guesses is one pass over the weights (each weight
// widened once), where 4 rows a tile made 5 rows cost 1.33x 4 (the built-in model's layers).
constexpr int HALF_MR = 6;
constexpr int64_t HALF_KC = 2048, HALF_BLOCK_BYTES = 1 << 20;

// half_tile for the last mr < MR activation rows with a tile of mr rows, not MR (a tile computes
// all its rows: 7 rows would cost 12 where they cost 6 + 1)
template <class L, int QT, int MR = HALF_MR>
inline void half_tile_rows(int mr, const uint8_t* w, int64_t row_bytes, const float* x, int64_t x_stride, int64_t K,
                           int nr, float* y, int64_t N, bool accumulate) {
  if constexpr (MR > 1)
    if (mr < MR) return half_tile_rows<L, QT, MR - 1>(mr, w, row_bytes, x, x_stride, K, nr, y, N, accumulate);
  half_tile<L, QT, L::NR, MR, 1>(w, row_bytes, x, x_stride, K, nr, MR, y, N, accumulate);
}

// rows [n0, n1) against all M activation rows (fp32, laid out as L reads them). One activation
// row (decode): one weight row at a time, each thread reading one sequential stream (the
// hardware prefetchers follow it).
template <class L, int QT>
void half_matmul_simd(const uint8_t* w, int64_t row_bytes, int64_t K, const float* x, int64_t M, float* y, int64_t N,
                      int64_t n0, int64_t n1) {
  if (M == 1) {
    for (int64_t n = n0; n < n1; n++)
      half_tile<L, QT, 1, 1, 4>(w + n * row_bytes, row_bytes, x, K, K, 1, 1, y + n, N, false);
    return;
  }
  for (int64_t k0 = 0; k0 < K; k0 += HALF_KC) {
    const int64_t kc = K - k0 <= HALF_KC + L::STEP ? K - k0 : HALF_KC;  // the last range takes the tail
    const int64_t block = std::max<int64_t>(L::NR, HALF_BLOCK_BYTES / (2 * kc) / L::NR * L::NR);
    for (int64_t b0 = n0; b0 < n1; b0 += block) {
      const int64_t b1 = std::min(n1, b0 + block);
      for (int64_t m = 0; m < M; m += HALF_MR)
        for (int64_t n = b0; n < b1; n += L::NR)
          half_tile_rows<L, QT>((int)std::min<int64_t>(HALF_MR, M - m), w + n * row_bytes + 2 * k0, row_bytes,
                                x + m * K + k0, K, kc, (int)std::min<int64_t>(L::NR, b1 - n), y + m * N + n, N,
                                k0 > 0);
    }
    if (kc != HALF_KC) break;
  }
}
#endif  // HEARTH_HALF_SIMD

}  // namespace

// y [M, N] = x [M, K] W^T for F16 / BF16 W [N, K] as uint8 [N, row_bytes], any M, fp32 products
// (exact up to summation order). x fp32, or bf16 bits (x_bf16: bf16 compute), widened once.
void half_matmul(uintptr_t x_, uintptr_t w_, uintptr_t y_, int64_t M, int64_t N, int64_t K, int64_t rb, int qtype,
                 bool x_bf16, bool portable, int threads) {
  if (qtype != F16 && qtype != BF16) throw std::invalid_argument("half_matmul: F16 and BF16 only");
  const uint8_t* wp = (const uint8_t*)w_;
  float* yp = (float*)y_;
  std::vector<float> widened;
  if (x_bf16) {
    widened.resize(M * K);
    const uint16_t* xb = (const uint16_t*)x_;
    for (int64_t i = 0; i < M * K; i++) widened[i] = bf16_to_float(xb[i]);
  }
  const float* xp = x_bf16 ? widened.data() : (const float*)x_;
  // contiguous row ranges, one per thread
  parallel_ranges(N, threads, 16, [&](int64_t n0, int64_t n1) {
#ifdef HEARTH_HALF_SIMD
    if (!portable) {
      if (qtype == F16) half_matmul_simd<Fp32Lanes<F16>, F16>(wp, rb, K, xp, M, yp, N, n0, n1);
      else half_matmul_simd<Fp32Lanes<BF16>, BF16>(wp, rb, K, xp, M, yp, N, n0, n1);
      return;
    }
#endif
    if (qtype == F16) half_matmul_generic<F16>(wp, rb, K, xp, M, yp, N, n0, n1);
    else half_matmul_generic<BF16>(wp, rb, K, xp, M, yp, N, n0, n1);
  });
}

}  // namespace hearth
