// F16 / BF16 arrays times fp32 or bf16 activations, weights widened to fp32 in registers.
#include "qmatmul.h"

#include <type_traits>

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
// with F16C and FMA (8 lanes); NR weight rows per tile. (BF16 weights where AVX512_BF16's pairs pay take a
// layout of their own, made once at load: BF16_PAIRS below.)
#if defined(HEARTH_AVX512)
#define HEARTH_HALF_SIMD 1
template <int QT> struct Fp32Lanes {
  using V = __m512; using W = __m512; using X = __m512;
  static constexpr int STEP = 16, NR = 4, MR = 6;  // 24 accumulators, 4 weights, 1 activation
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
#if defined(__AVX512BF16__)
#define HEARTH_BF16_DOTS 1  // AVX512_BF16's vdpbf16ps: the BF16 pairs layout below
#endif
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define HEARTH_HALF_SIMD 1
template <int QT> struct Fp32Lanes {
  using V = __m256; using W = __m256; using X = __m256;
  static constexpr int STEP = 8, NR = 2, MR = 6;  // 16 registers: 12 accumulators, 2 weights, 1 activation
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
// Six rows a tile (Fp32Lanes): a verification of up to 5 guesses is one pass over the weights (each
// weight widened once), where 4 rows a tile made 5 rows cost 1.33x 4 (the built-in model's layers).
constexpr int64_t HALF_KC = 2048, HALF_BLOCK_BYTES = 1 << 19;

// fn(std::integral_constant<int, R>) for R = mr <= MR: the last mr < MR activation rows take a tile of
// mr rows, not MR (a tile computes all its rows: 7 rows would cost 12 where they cost 6 + 1)
template <int MR, class Fn>
inline void with_tile_rows(int mr, const Fn& fn) {
  if constexpr (MR > 1)
    if (mr < MR) return with_tile_rows<MR - 1>(mr, fn);
  fn(std::integral_constant<int, MR>{});
}

// rows [n0, n1) against all M activation rows (fp32). One activation
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
      for (int64_t m = 0; m < M; m += L::MR)
        for (int64_t n = b0; n < b1; n += L::NR)
          with_tile_rows<L::MR>((int)std::min<int64_t>(L::MR, M - m), [&](auto rows) {
            half_tile<L, QT, L::NR, rows.value, 1>(w + n * row_bytes + 2 * k0, row_bytes, x + m * K + k0, K, kc,
                                                   (int)std::min<int64_t>(L::NR, b1 - n), rows.value, y + m * N + n,
                                                   N, k0 > 0);
          });
    }
    if (kc != HALF_KC) break;
  }
}
#endif  // HEARTH_HALF_SIMD

// BF16_PAIRS: BF16 weights laid out once at load (hearth/quant/kernels/bf16_pairs.py) as pairs of 16 rows,
// [groups of 16 rows][Kp / 2 pairs][16 rows] uint32 (one 64-byte vector holds 16 rows' values 2p and 2p + 1;
// Kp: K, odd K padded with a zero value; rows past N zero), where AVX512_BF16's pairs pay (bf16_dots_pay).
// One activation row (decode) stays fp32 (each pair's two values widened, two FMAs: exact products) and
// reads each group as one sequential stream; from HALF_BF16_MIN_ROWS rows the activations are rounded to
// bf16 and vdpbf16ps multiplies a pair of 16 rows by an activation pair, broadcast (twice the fp32 FMA's
// FLOPs; fp32 sums). The layout made per call by gathers, as before, cost 10-30% at 8-128 rows.
constexpr int64_t HALF_BF16_MIN_ROWS = 2, BF16_BLOCK_GROUPS = 8;  // a block: 128 rows x HALF_KC values (L2)
constexpr int BF16_MR = 6;

// Whether bf16 pairs beat widening to fp32: on AMD's AVX512_BF16 (Zen 4) vdpbf16ps issues at the
// fp32 FMA's rate with twice its FLOPs (torch's bf16 GEMM there: ~420 GFLOP/s at 512 rows against
// ~170 for the widening, 2 threads); on the Intel Xeon measured it issued at a quarter of vfmadd's
// rate (docs/quantized-matmul.md), so Intel keeps the widening.
bool bf16_dots_pay() {
#ifdef HEARTH_BF16_DOTS
  static const bool pays = __builtin_cpu_is("amd");
  return pays;
#else
  return false;
#endif
}

// A BF16_PAIRS weight's value (n, k)
inline float pairs_value(const uint32_t* packed, int64_t pairs, int64_t n, int64_t k) {
  const uint32_t word = packed[((n / 16) * pairs + k / 2) * 16 + n % 16];
  return bf16_to_float(uint16_t(k % 2 ? word >> 16 : word & 0xFFFF));
}

// Portable: rows [g0 * 16, g1 * 16) (those under N) against all M activation rows (rows of Kp values), fp32 products
void pairs_generic(const uint32_t* packed, int64_t K, int64_t Kp, const float* x, int64_t M, float* y, int64_t N,
                   int64_t g0, int64_t g1) {
  const int64_t pairs = Kp / 2;
  std::vector<float> v(K);
  for (int64_t n = 16 * g0; n < std::min(N, 16 * g1); n++) {
    for (int64_t k = 0; k < K; k++) v[k] = pairs_value(packed, pairs, n, k);
    for (int64_t m = 0; m < M; m++) {
      float a = 0.f;
#pragma omp simd reduction(+ : a)
      for (int64_t k = 0; k < K; k++) a += v[k] * x[m * Kp + k];
      y[m * N + n] = a;
    }
  }
}

#ifdef HEARTH_BF16_DOTS
// x [M, K] (fp32, or bf16 bits) -> bf16 [M, Kp], rounded to nearest even as torch's .bfloat16(), a zero past K;
// the rows split between threads where there are many (a prefill chunk's: ~8% of its matmul on one thread)
std::vector<uint16_t> bf16_rows(const void* x, bool x_bf16, int64_t M, int64_t K, int64_t Kp, int threads) {
  std::vector<uint16_t> out(M * Kp, 0);
  parallel_ranges(M, threads, std::max<int64_t>(1, (1 << 16) / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) {
      uint16_t* o = out.data() + m * Kp;
      if (x_bf16) {
        std::memcpy(o, (const uint16_t*)x + m * K, 2 * K);
        continue;
      }
      const float* r = (const float*)x + m * K;
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) _mm256_storeu_si256((__m256i*)(o + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(r + k)));
      for (; k < K; k++) {
        uint32_t bits;
        std::memcpy(&bits, r + k, 4);
        o[k] = uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
      }
    }
  });
  return out;
}

// MR activation rows (bf16 [., Kp]; mr of them real) against up to 4 groups (`cols` real columns), `pairs`
// pairs from each group's start (groups `stride` uint32 apart): y [mr, cols] (+)= x W^T over that range
// (not inlined: inside with_tile_rows' lambda GCC kept the accumulators in memory, 2.5x slower)
template <int MR>
__attribute__((noinline)) void pairs_tile(const uint32_t* packed, int64_t stride, int64_t pairs, const uint16_t* x,
                                          int64_t Kp, int mr, float* y, int64_t N, int cols, bool accumulate) {
  __m512 acc[MR][4];
  for (int i = 0; i < MR; i++)
    for (int v = 0; v < 4; v++) acc[i][v] = _mm512_setzero_ps();
  const int32_t* xs[MR];
  for (int i = 0; i < MR; i++) xs[i] = (const int32_t*)(x + std::min(i, mr - 1) * Kp);
  const int groups = (cols + 15) / 16;
  const uint32_t* wg[4];
  for (int v = 0; v < 4; v++) wg[v] = packed + std::min(v, groups - 1) * stride;
  for (int64_t p = 0; p < pairs; p++) {
    __m512bh wv[4];
    for (int v = 0; v < 4; v++) wv[v] = (__m512bh)_mm512_loadu_si512(wg[v] + p * 16);
    for (int i = 0; i < MR; i++) {
      const __m512bh xp = (__m512bh)_mm512_set1_epi32(xs[i][p]);
      for (int v = 0; v < 4; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], wv[v], xp);
    }
  }
  for (int i = 0; i < mr; i++)
    for (int v = 0; v < groups; v++) {
      const int c = std::min(16, cols - 16 * v);
      const __mmask16 lanes = c >= 16 ? 0xFFFF : (__mmask16)((1u << c) - 1);
      float* out = y + i * N + 16 * v;
      _mm512_mask_storeu_ps(out, lanes, accumulate ? _mm512_add_ps(acc[i][v], _mm512_maskz_loadu_ps(lanes, out)) : acc[i][v]);
    }
}

// groups [g0, g1) of y [M, N] = x W^T, x bf16 [M, Kp]: per range of HALF_KC values, blocks of
// BF16_BLOCK_GROUPS groups that every MR activation rows pass over, 4 groups a tile
void pairs_rows(const uint32_t* packed, int64_t Kp, const uint16_t* x, int64_t M, float* y, int64_t N, int64_t g0,
                int64_t g1) {
  const int64_t pairs = Kp / 2;
  for (int64_t k0 = 0; k0 < Kp; k0 += HALF_KC) {
    const int64_t range = std::min(HALF_KC, Kp - k0) / 2;
    for (int64_t b0 = g0; b0 < g1; b0 += BF16_BLOCK_GROUPS) {
      const int64_t b1 = std::min(g1, b0 + BF16_BLOCK_GROUPS);
      for (int64_t m = 0; m < M; m += BF16_MR)
        for (int64_t g = b0; g < b1; g += 4)
          with_tile_rows<BF16_MR>((int)std::min<int64_t>(BF16_MR, M - m), [&](auto tile_rows) {
            pairs_tile<tile_rows.value>(packed + (g * pairs + k0 / 2) * 16, pairs * 16, range, x + m * Kp + k0, Kp,
                                        tile_rows.value, y + m * N + 16 * g, N,
                                        (int)std::min<int64_t>(64, std::min(N, 16 * b1) - 16 * g), k0 > 0);
          });
    }
  }
}

// G groups from g of y [1, N] = x W^T, x fp32 [Kp]: each pair's values widened (the low half by a shift, the high
// by a mask), two FMAs by the broadcast activations
template <int G>
void pairs_row_groups(const uint32_t* packed, int64_t pairs, const float* x, float* y, int64_t N, int64_t g) {
  const __m512i high = _mm512_set1_epi32(int(0xFFFF0000u));
  __m512 a[G][2];
  for (int j = 0; j < G; j++) a[j][0] = a[j][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; p++) {
    const __m512 x0 = _mm512_set1_ps(x[2 * p]), x1 = _mm512_set1_ps(x[2 * p + 1]);
    for (int j = 0; j < G; j++) {
      const __m512i v = _mm512_loadu_si512(packed + ((g + j) * pairs + p) * 16);
      a[j][0] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), x0, a[j][0]);
      a[j][1] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v, high)), x1, a[j][1]);
    }
  }
  for (int j = 0; j < G; j++) {
    const int c = (int)std::min<int64_t>(16, N - 16 * (g + j));
    _mm512_mask_storeu_ps(y + 16 * (g + j), c >= 16 ? 0xFFFF : (__mmask16)((1u << c) - 1), _mm512_add_ps(a[j][0], a[j][1]));
  }
}

// groups [g0, g1) of y [1, N] = x W^T: 4 groups at a time, 4 streams from memory (a row's weights stream from
// DRAM: 33-36 GB/s at 2 threads on EPYC-512 against 29-30 for one group at a time, 31-35 for 8)
void pairs_row(const uint32_t* packed, int64_t Kp, const float* x, float* y, int64_t N, int64_t g0, int64_t g1) {
  int64_t g = g0;
  for (; g + 4 <= g1; g += 4) pairs_row_groups<4>(packed, Kp / 2, x, y, N, g);
  for (; g < g1; g++) pairs_row_groups<1>(packed, Kp / 2, x, y, N, g);
}
#endif  // HEARTH_BF16_DOTS

// y [M, N] = x W^T, W BF16_PAIRS (groups of 16 rows split between threads)
void pairs_matmul(const void* x, bool x_bf16, const uint32_t* packed, float* y, int64_t M, int64_t N, int64_t K,
                  bool portable, int threads) {
  const int64_t groups = (N + 15) / 16, Kp = K + K % 2;
  if (M == 0) return;
  [[maybe_unused]] const bool pairs = !portable && bf16_dots_pay();
#ifdef HEARTH_BF16_DOTS
  if (pairs && M >= HALF_BF16_MIN_ROWS) {
    const std::vector<uint16_t> xb = bf16_rows(x, x_bf16, M, K, Kp, threads);
    return parallel_ranges(groups, threads, 1, [&](int64_t g0, int64_t g1) { pairs_rows(packed, Kp, xb.data(), M, y, N, g0, g1); });
  }
#endif
  std::vector<float> widened;  // fp32 activations [M, Kp]: bf16 ones widened, a zero past an odd K
  if (x_bf16 || Kp != K) {
    widened.assign(M * Kp, 0.f);
    for (int64_t m = 0; m < M; m++)
      for (int64_t k = 0; k < K; k++)
        widened[m * Kp + k] = x_bf16 ? bf16_to_float(((const uint16_t*)x)[m * K + k]) : ((const float*)x)[m * K + k];
  }
  const float* xf = widened.empty() ? (const float*)x : widened.data();  // rows of Kp values
#ifdef HEARTH_BF16_DOTS
  if (pairs) return parallel_ranges(groups, threads, 1, [&](int64_t g0, int64_t g1) { pairs_row(packed, Kp, xf, y, N, g0, g1); });
#endif
  parallel_ranges(groups, threads, 1, [&](int64_t g0, int64_t g1) { pairs_generic(packed, K, Kp, xf, M, y, N, g0, g1); });
}

}  // namespace

int64_t half_bf16_min_rows() { return bf16_dots_pay() ? HALF_BF16_MIN_ROWS : 0; }

// y [M, N] = x [M, K] W^T for F16 / BF16 W [N, K] as uint8 [N, row_bytes], any M, fp32 products
// (exact up to summation order) of x fp32, or bf16 bits (x_bf16: bf16 compute) widened once; for
// BF16_PAIRS W (the layout above, where half_bf16_min_rows() is not 0) from that many rows, x rounded
// to bf16 and bf16 pairs (vdpbf16ps: exact products, fp32 sums).
void half_matmul(uintptr_t x_, uintptr_t w_, uintptr_t y_, int64_t M, int64_t N, int64_t K, int64_t rb, int qtype,
                 bool x_bf16, bool portable, int threads) {
  if (qtype == BF16_PAIRS) return pairs_matmul((const void*)x_, x_bf16, (const uint32_t*)w_, (float*)y_, M, N, K, portable, threads);
  if (qtype != F16 && qtype != BF16) throw std::invalid_argument("half_matmul: F16, BF16 and BF16_PAIRS only");
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
