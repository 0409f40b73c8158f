// Quantized matmul on the CPU (docs/quantized-matmul.md).
//
//   int8_matmul:   every block format, every batch size: activations rounded to int8 per block
//                  of the weight's format (llama.cpp's q8_K for K-quants, q8_0 otherwise) and
//                  integer dot products (AVX2 maddubs) against the GGUF blocks where they lie;
//                  or, on AVX-512 VNNI builds, every format but TQ2_0 repacked once into tiles
//                  of 32 rows at the format's own bits (`repack`, `packed_matmul`).
//   grouped_int8_matmul: a mixture-of-experts layer's chosen experts in one call, rows grouped
//                  by expert, each group through int8_matmul against its own expert's weight.
//   half_matmul:   F16 / BF16 arrays, every batch size, read as stored: weights widened to fp32
//                  in registers, fp32 FMA; fp32 or bf16 activations.
//   dequantize_rows: the kernels' own decoding, tested bit-exact against hearth.quant.formats.
//
// Every format goes through one description, `unpack<QT>`: a block of BS values becomes
// unsigned codes q (uint8), and per sub-block of S values a scale s and (for formats with a
// minimum) an offset o, so that   w = s * (q - Z) + o   with Z a per-format zero point.
// AVX2 / AVX-512 paths are compiled when the build machine has them (-march=native); the plain
// C++ loops are the portable path and the reference the fast paths are tested against.
// No torch headers (they cost half a minute of compile time): the Python side passes data
// pointers of tensors it has checked and allocated (hearth/quant/kernels/__init__.py), and the
// thread count torch uses; threads are OpenMP's, the runtime torch itself runs on.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HEARTH_AVX512 1
#endif
#if defined(HEARTH_AVX512) && defined(__AVX512VNNI__)
#define HEARTH_VNNI 1
#endif

namespace {

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
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30, TQ2_0 = 35,
};

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

// ------------------------------------------------------------------ matmul of half arrays

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

#ifdef __AVX2__
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

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
    default: throw std::invalid_argument("hearth qmatmul: unsupported type " + std::to_string(qtype)); \
  }

int64_t block_values(int qtype) {
  int64_t bs = 0;
  if (qtype == F16 || qtype == BF16) return 1;
  HEARTH_DISPATCH(qtype, bs = Fmt<QT>::BS);
  return bs;
}

// Threads: [0, n) split into `threads` contiguous ranges, fn(begin, end) on each.
template <typename Fn>
void parallel_ranges(int64_t n, int threads, int64_t min_per_thread, const Fn& fn) {
  int t = (int)std::max<int64_t>(1, std::min<int64_t>(threads, n / std::max<int64_t>(1, min_per_thread)));
  if (t <= 1) return fn(int64_t(0), n);
#ifdef _OPENMP
#pragma omp parallel num_threads(t)
  {
    const int i = omp_get_thread_num(), nt = omp_get_num_threads();
    fn(n * i / nt, n * (i + 1) / nt);
  }
#else
  fn(int64_t(0), n);
#endif
}

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

// ------------------------------------------------------------------ int8 activations

// x [M, K] fp32 -> int8 codes, per block of `block` values (32: llama.cpp's q8_0; 256: its
// q8_K) a scale d = amax / 127 kept in fp32, per 16 values the sum of the codes, and per block
// d * (sum of its codes) (q8_1's term: multiplies a weight block's offset).
struct QuantizedActivations {
  int64_t block = 32;
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> d;       // [M, K/block]
  std::vector<int16_t> s16;   // [M, K/16]
  std::vector<float> dsum;    // [M, K/block]
};

#ifdef HEARTH_AVX512
// One row x [K] as the portable loop below quantizes it: the same codes, sums and scales. The
// loop's per-16 sums ran one value at a time (9 rows of SmolLM2's four projections, 1 thread:
// 0.92 ns a value; this 0.24).
inline void quantize_row_avx512(const float* x, int64_t K, int64_t block, int8_t* q, float* d, int16_t* s16,
                                float* dsum) {
  for (int64_t b = 0; b < K / block; b++) {
    const float* xb = x + block * b;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < block; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xb + i)));
    d[b] = _mm512_reduce_max_ps(amax) / 127.f;
    const __m512 scale = _mm512_set1_ps(d[b] > 0.f ? 1.f / d[b] : 0.f);
    for (int64_t i = 0; i < block; i += 16) {  // rounded to nearest even (the default mode), as std::nearbyint
      const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), scale));
      _mm_storeu_si128((__m128i*)(q + block * b + i), _mm512_cvtepi32_epi8(codes));
    }
  }
  // the sums of 16 codes, 64 codes a vector: of pairs (maddubs), of fours (madd), then of each 128 bits' 4 lanes
  const __m512i ones8 = _mm512_set1_epi8(1), ones16 = _mm512_set1_epi16(1);
  for (int64_t i = 0; i < K; i += 64) {
    const bool whole = K - i >= 64;  // else 32 codes (K is a multiple of 32)
    const __m512i codes = _mm512_maskz_loadu_epi8(whole ? ~0ULL : (1ULL << (K - i)) - 1, q + i);
    const __m512i fours = _mm512_madd_epi16(_mm512_maddubs_epi16(ones8, codes), ones16);
    const __m512i pairs = _mm512_add_epi32(fours, _mm512_shuffle_epi32(fours, _MM_PERM_CDAB));
    const __m512i sums = _mm512_add_epi32(pairs, _mm512_shuffle_epi32(pairs, _MM_PERM_BADC));
    const __m256i sixteens = _mm512_cvtepi32_epi16(_mm512_maskz_compress_epi32(0x1111, sums));
    _mm_mask_storeu_epi16(s16 + i / 16, whole ? 0xF : 0x3, _mm256_castsi256_si128(sixteens));
  }
  for (int64_t b = 0; b < K / block; b++) {
    int32_t total = 0;
    for (int64_t h = 0; h < block / 16; h++) total += s16[b * (block / 16) + h];
    dsum[b] = d[b] * float(total);
  }
}
#endif

void quantize_activations(const float* x, int64_t M, int64_t K, QuantizedActivations& a, int threads,
                          int64_t block, bool portable) {
  const int64_t nb = K / block;
  a.block = block;
  a.q.resize(M * K);
  a.d.resize(M * nb);
  a.s16.resize(M * K / 16);
  a.dsum.resize(M * nb);
  parallel_ranges(M, threads, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) {
#ifdef HEARTH_AVX512
      if (!portable) {
        quantize_row_avx512(x + m * K, K, block, a.q.data() + m * K, a.d.data() + m * nb, a.s16.data() + m * (K / 16),
                            a.dsum.data() + m * nb);
        continue;
      }
#endif
      for (int64_t b = 0; b < nb; b++) {
        const float* xb = x + m * K + block * b;
        float amax = 0.f;
#pragma omp simd reduction(max : amax)
        for (int64_t i = 0; i < block; i++) amax = std::max(amax, std::abs(xb[i]));
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        a.d[m * nb + b] = d;
        int8_t* qb = a.q.data() + m * K + block * b;
#pragma omp simd
        for (int64_t i = 0; i < block; i++) qb[i] = (int8_t)std::nearbyint(xb[i] * id);
        int32_t total = 0;
        for (int64_t h = 0; h < block / 16; h++) {
          int32_t sum = 0;
          for (int i = 0; i < 16; i++) sum += qb[16 * h + i];
          a.s16[m * (K / 16) + b * (block / 16) + h] = (int16_t)sum;
          total += sum;
        }
        a.dsum[m * nb + b] = d * float(total);
      }
    }
  });
}

constexpr int NR = 32;  // weight rows per packed tile (two 16-lane vectors)

// ------------------------------------------------------------------ int8 dot products, blocks in place
// Every block format, read where it lies:
// the GGUF layout already keeps 32 codes of one sub-block in 16 or 32 consecutive bytes, so one
// 256-bit load feeds one `maddubs` (unsigned codes x int8 activations) with no repacking, and a
// thread walking its rows reads one sequential stream (what decode at batch 1 is bound by).
// Activations are quantized per block of the weight's format: 256 values for K-quants
// (llama.cpp's q8_K), 32 for the others (q8_0, with q8_1's d * sum term).
//
// A block of BS values is, per 16 values j, w = d sc_j q - f c_j / Zc: written for the dot with
// x = dx xq as
//   w . x = dx (d sum_j sc_j (q_j . xq_j) - f sum_j c_j sum(xq_j))
// with integer sc_j and c_j: for a zero point Z (Q6_K, Q3_K) c_j = Z sc_j and f = d; for a
// minimum (Q4_K, Q5_K, Q2_K: w = d sc q - dmin mn) c_j = mn_j and f = dmin. The integer sums run
// in int32 over the whole block, then two fp32 multiply-adds per block and activation row.
// 32-value blocks (one sub-block, sc = 1): the second term is the block's offset o times
// dx sum(xq): o = m (Q4_1, Q5_1) or -Z d (Q4_0, Q5_0).

// Portable: the block as unpack<QT> describes it, the same sums in the same integer/fp32 split.
template <int QT>
void int8_dot_rows_generic(const uint8_t* row, int64_t K, const QuantizedActivations& a, int64_t m0, int mr,
                           float* y, int64_t N) {
  using F = Fmt<QT>;
  constexpr int NS = F::BS / F::S;
  const int64_t nb = K / F::BS;
  uint8_t q[F::BS];
  float s[NS], o[NS];
  for (int r = 0; r < mr; r++) {
    const int64_t m = m0 + r;
    const int8_t* xq = a.q.data() + m * K;
    double acc = 0.;
    for (int64_t b = 0; b < nb; b++) {
      for (int j = 0; j < NS; j++) o[j] = 0.f;
      unpack<QT>(row + b * F::BYTES, q, s, o);
      float block = 0.f;
      for (int j = 0; j < NS; j++) {
        int32_t dot = 0, sum = 0;
        for (int i = 0; i < F::S; i++) {
          const int v = xq[b * F::BS + j * F::S + i];
          dot += int(q[j * F::S + i]) * v;
          sum += v;
        }
        // the zero point taken off after the loop: gcc 12 at -O3 on VNNI machines vectorizes
        // sum((q - Z) * v) into vpdpbusd wrongly (results off by far more than rounding)
        block += s[j] * float(dot - F::Z * sum) + o[j] * float(sum);
      }
      acc += double(block * a.d[m * nb + b]);
    }
    y[r * N] = float(acc);
  }
}

#ifdef __AVX2__

// 32 bits -> 32 bytes, byte i = 16 where bit i is set (the 5th bit of Q5_0 / Q5_1 codes)
inline __m256i bits_to_sixteens(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

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

constexpr int INT8_PREFETCH = 4096;  // bytes ahead of the block being read

// One weight row against MR activation rows from m0: y[r * N] for r < MR.
template <int QT, int MR, bool VNNI>
void int8_dot_rows_avx2(const uint8_t* row, int64_t K, const QuantizedActivations& a, int64_t m0, float* y, int64_t N) {
  using F = Fmt<QT>;
  // one or two rows: the products' sum is one chain per row, and vpdpwssd's latency (5 cycles
  // where add's is 1) would set the pace (Q4_K at one row 0.49 -> 0.76 ms per 5632 x 2048)
  using D = I8Dot<VNNI && MR >= 3>;
  constexpr int BS = F::BS;
  const int64_t nb = K / BS;
  const int8_t* xq = a.q.data() + m0 * K;
  __m256 acc[MR];
  for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();
  float off[MR] = {};
  for (int64_t b = 0; b < nb; b++) {
    const Block<QT> blk(row + b * F::BYTES);
    const int8_t* xb = xq + b * BS;
    if constexpr (MR <= 2)  // decode: the stream of rows runs from DRAM, so ask for it ahead
      for (int off = 0; off < F::BYTES; off += 64) _mm_prefetch((const char*)(row + b * F::BYTES + off + INT8_PREFETCH), _MM_HINT_T0);
    if constexpr (BS == 256) {
      __m256i dot[MR];
      for (int r = 0; r < MR; r++) dot[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int c = 0; c < 8; c++) {
        const __m256i codes = blk.codes(c), scales = blk.scales(c);
        for (int r = 0; r < MR; r++) {
          const __m256i x = _mm256_loadu_si256((const __m256i*)(xb + r * K + 32 * c));
          dot[r] = D::scaled(dot[r], codes, x, scales);
          // keeps the sum in this order: left free, gcc computes all 8 x MR products first and
          // adds them as a tree, spilling most of them to the stack
          asm("" : "+x"(dot[r]));
        }
      }
      for (int r = 0; r < MR; r++) {
        const int64_t m = m0 + r;
        const float dx = a.d[m * nb + b];
        const __m256i sums = _mm256_loadu_si256((const __m256i*)(a.s16.data() + m * (K / 16) + b * 16));
        const __m256i corr = _mm256_madd_epi16(sums, blk.c16);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_set1_ps(blk.d * dx), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(corr), _mm256_set1_ps(-blk.f * dx), acc[r]);
      }
    } else {
      constexpr bool SIGNED = requires { Block<QT>::SIGNED; };
      const __m256i q = blk.codes(0);
      const __m256i codes = SIGNED ? _mm256_sign_epi8(q, q) : q;
      for (int r = 0; r < MR; r++) {
        const int64_t m = m0 + r;
        __m256i x = _mm256_loadu_si256((const __m256i*)(xb + r * K));
        if constexpr (SIGNED) x = _mm256_sign_epi8(x, q);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(D::plain(codes, x)), _mm256_set1_ps(blk.d * a.d[m * nb + b]), acc[r]);
        off[r] += blk.o * a.dsum[m * nb + b];
      }
    }
  }
  for (int r = 0; r < MR; r++) y[r * N] = hsum8(acc[r]) + off[r];
}

template <int QT, bool VNNI>
void int8_dot_rows_simd(int mr, const uint8_t* row, int64_t K, const QuantizedActivations& a, int64_t m0, float* y,
                        int64_t N) {
  switch (mr) {
    case 4: return int8_dot_rows_avx2<QT, 4, VNNI>(row, K, a, m0, y, N);
    case 3: return int8_dot_rows_avx2<QT, 3, VNNI>(row, K, a, m0, y, N);
    case 2: return int8_dot_rows_avx2<QT, 2, VNNI>(row, K, a, m0, y, N);
    default: return int8_dot_rows_avx2<QT, 1, VNNI>(row, K, a, m0, y, N);
  }
}
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

#ifdef HEARTH_VNNI
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
constexpr int64_t INT8_TILE_MIN_ROWS = 24;  // below, the in-place kernel (the tile decoding costs ~2-5 rows of it)
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
#endif  // HEARTH_VNNI

// ------------------------------------------------------------------ packed tiles
// Every block format but TQ2_0, repacked once at load on AVX-512 VNNI builds (`repack`; the file's
// pages are then released: one copy): tiles of NR rows (the last one padded with zero rows), each
// tile two arrays that run block after block along K, so a thread reads each as one stream.
//
//   codes, per chunk of 32 values: the codes of the tiles decoded per call, unsigned bytes laid out
//     [8 groups of 4 values][32 rows][4] (one 64-byte vector: 4 codes of 16 rows, what one vpdpbusd
//     multiplies by 4 activation codes), kept at the format's bits:
//       8 bits (Q8_0): the bytes themselves (code + 128), 1024 bytes;
//       4 bits (Q4_*, Q5_*, Q6_K): [4][32][4] bytes, low nibble group g, high nibble group g + 4, 512;
//       2 bits (Q2_K, Q3_K): [2][32][4] bytes, bits 2s, 2s + 1 group g + 2s, 256;
//     then the bits above those: Q5_*, Q3_K's one as [8 groups][2 halves of 16 rows] uint64 masks,
//     bit i = that bit of byte i of the group's vector, 128 bytes (AVX-512BW adds it back with one
//     masked add); Q6_K's two as a 2-bit plane of their own laid out as Q2_K's, 256 bytes (a shift
//     and a vpternlog put them above the nibble: fewer operations on the two vector ports, which
//     the batched kernel is bound by, than two mask moves and masked adds; 2-3% at 32 rows).
//   terms, per block: d [32 rows] float16 | f [32] float16 (formats with an offset) | sc [NS][32]
//     int8 (K-quants) | mn [NS][32] int8 (K-quants with a minimum), the block's own numbers, so that
//       w = d sc_j (q - Z) - f mn_j     (sc, mn = 1 where the format has none; Q4_1 / Q5_1: f = -m)
//
// The same bits as the file per weight (Q2_K and Q3_K keep 8-bit scales: 0.5 and 0.125 bits more
// per weight; Q4_K / Q5_K 0.125 more), rearranged so that the batched kernel reads tiles with no
// decoding (the tiles decoded per call cost as much as their dot products at 32 rows) and decode
// at batch 1 reads one vector per 16 rows x 4 values (in place: one per 32 values of one row).
template <int QT> struct Packed {
  using F = Fmt<QT>;
  static constexpr int BITS = QT == Q8_0 ? 8 : (QT == Q2_K || QT == Q3_K) ? 2 : 4;
  static constexpr int EXTRA = QT == Q6_K ? 2 : (QT == Q5_0 || QT == Q5_1 || QT == Q5_K || QT == Q3_K) ? 1 : 0;
  static constexpr bool HIGH_PLANE = EXTRA == 2;  // the extra bits as a 2-bit plane, not masks
  static constexpr int MASKS = HIGH_PLANE ? 0 : EXTRA;
  static constexpr int NS = F::BS / F::S;
  static constexpr bool SC = F::BS == 256, MIN = F::OFF;
  static constexpr int64_t PLANE = 32 * NR * BITS / 8, CHUNK = PLANE + EXTRA * 16 * 8;  // bytes per chunk
  static constexpr int64_t F_AT = 2 * NR, SC_AT = 2 * NR * (1 + MIN), MN_AT = SC_AT + NR * NS;  // in a block's terms
  static constexpr int64_t TERMS = SC_AT + (SC ? NR * NS * (1 + MIN) : 0);                          // bytes per block
};
template <int QT> constexpr bool packable() { return QT != TQ2_0; }

// bytes of one tile's codes and terms for K values a row
std::pair<int64_t, int64_t> packed_bytes(int qtype, int64_t K) {
  std::pair<int64_t, int64_t> bytes;
  HEARTH_DISPATCH(qtype, {
    if constexpr (!packable<QT>()) throw std::invalid_argument("packed tiles: not for type " + std::to_string(qtype));
    else bytes = {K / 32 * Packed<QT>::CHUNK, K / Fmt<QT>::BS * Packed<QT>::TERMS};
  });
  return bytes;
}

// A block's terms as the tiles keep them: d, f as float16 bits, sc and mn per sub-block.
template <int QT>
void block_ints(const uint8_t* b, uint16_t& d, uint16_t& f, int8_t* sc, int8_t* mn) {
  auto bits = [](const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return h; };
  f = 0;
  if constexpr (QT == Q2_K) {
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
  } else if constexpr (QT == Q6_K) {
    d = bits(b + 208);
    for (int j = 0; j < 16; j++) sc[j] = int8_t(b[192 + j]);
  } else {  // 32-value blocks: d first; Q4_1 / Q5_1's m after it, kept negated (w = d q - f)
    d = bits(b);
    if constexpr (Fmt<QT>::OFF) f = bits(b + 2) ^ 0x8000;
  }
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

// ... and back: chunk `in` -> byte codes [8][32 rows][4]
template <int QT>
void unpack_chunk(const uint8_t* in, uint8_t* v) {
  using P = Packed<QT>;
  for (int g = 0; g < 8; g++)
    for (int i = 0; i < 128; i++) {  // rows 0..31 x 4 values of group g
      uint8_t q;
      if constexpr (P::BITS == 8) q = in[g * 128 + i];
      else if constexpr (P::BITS == 4) q = (in[(g % 4) * 128 + i] >> (4 * (g / 4))) & 0x0F;
      else q = (in[(g % 2) * 128 + i] >> (2 * (g / 2))) & 3;
      if constexpr (P::HIGH_PLANE) q |= uint8_t(((in[P::PLANE + (g % 2) * 128 + i] >> (2 * (g / 2))) & 3) << P::BITS);
      for (int e = 0; e < P::MASKS; e++) {
        uint64_t m;
        std::memcpy(&m, in + P::PLANE + (e * 16 + g * 2 + i / 64) * 8, 8);
        q |= uint8_t(((m >> (i % 64)) & 1) << (P::BITS + e));
      }
      v[g * 128 + i] = q;
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
          uint16_t d = 0, f = 0;
          int8_t sc[P::NS] = {}, mn[P::NS] = {};
          if (n < N) {
            block_codes<QT>(w + n * rb + b * F::BYTES, q[j]);
            block_ints<QT>(w + n * rb + b * F::BYTES, d, f, sc, mn);
          } else {
            std::memset(q[j], 0, F::BS);
          }
          std::memcpy(tt + 2 * j, &d, 2);
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

// Blocks [N, rb] -> tiles: codes [tiles, code bytes], terms [tiles, term bytes] (packed_bytes)
void repack(uintptr_t w_, uintptr_t codes_, uintptr_t terms_, int64_t N, int64_t K, int64_t rb, int qtype, int threads) {
  HEARTH_DISPATCH(qtype, {
    if constexpr (packable<QT>())
      repack_impl<QT>((const uint8_t*)w_, (uint8_t*)codes_, (uint8_t*)terms_, N, K, rb, threads);
    else
      throw std::invalid_argument("repack: not for type " + std::to_string(qtype));
  });
}

// One tile's block b, read back: row j's w = s[sub-block][j] (q - Z) + o[sub-block][j], fp32 as decode<QT>
template <int QT>
void tile_block_terms(const uint8_t* tt, float (*s)[NR], float (*o)[NR]) {
  using P = Packed<QT>;
  for (int j = 0; j < NR; j++) {
    const float d = h2f(tt + 2 * j), f = P::MIN ? h2f(tt + P::F_AT + 2 * j) : 0.f;
    for (int i = 0; i < P::NS; i++) {
      s[i][j] = P::SC ? d * float(int8_t(tt[P::SC_AT + i * NR + j])) : d;
      o[i][j] = P::MIN ? -(f * (P::SC ? float(int8_t(tt[P::MN_AT + i * NR + j])) : 1.f)) : 0.f;
    }
  }
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

// Activation terms per row and sub-block j of S values: dx (the row's block scale) and the sum of
// the sub-block's codes, as the zero point's integer term -Z sum (a dot product's start) and in fp32.
struct PackedActivations {
  QuantizedActivations a;
  std::vector<int32_t> zsum;  // [M, K/S]
  std::vector<float> sum;     // [M, K/S]
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
      p.sum[m * ns + j] = float(sum);
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
            block[j] += s[sub % P::NS][j] * float(dot) + o[sub % P::NS][j] * p.sum[m * ns + sub];
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
  return v;
}

// MR activation rows from m0 against one tile. Per sub-block j and 16 rows: S/4 vpdpbusd from the
// zero point's -Z sum(xq_j), then t += cvt(dot) (d sc_j) - (f mn_j) sum(xq_j); per block y += t dx.
// stream: the call's first pass over the tile, with few rows (M <= 2 PACKED_MR: decode, a verification's).
template <int QT, int MR>
void packed_tile_vnni(const uint8_t* codes, const uint8_t* terms, int64_t K, const PackedActivations& p, int64_t m0,
                      float* y, int64_t N, int64_t nvalid, bool stream) {
  using F = Fmt<QT>;
  using P = Packed<QT>;
  const int64_t nb = K / F::BS, ns = K / F::S;
  const int8_t* xq = p.a.q.data() + m0 * K;
  alignas(64) float acc[MR][NR] = {};  // in L1, not registers: those hold 4 x MR x 16 lanes of sums
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* tt = terms + b * P::TERMS;
    const uint8_t* cb = codes + b * (F::BS / 32) * P::CHUNK;
    // the tile streams from memory (L3 at best), so ask for both arrays as far ahead: at 3-8 rows too,
    // where the dot products would otherwise wait for it (SmolLM2 Q4_1, 1 thread: 5 rows 7.2 -> 6.1 ms)
    if (stream) {
      constexpr int64_t CODES = (F::BS / 32) * P::CHUNK, AHEAD = (INT8_PREFETCH + CODES - 1) / CODES;  // blocks
      for (int64_t at = 0; at < CODES; at += 64) _mm_prefetch((const char*)(cb + at + AHEAD * CODES), _MM_HINT_T0);
      for (int64_t at = 0; at < P::TERMS; at += 64) _mm_prefetch((const char*)(tt + at + AHEAD * P::TERMS), _MM_HINT_T0);
    }
    __m512 d[2], f[2], t[MR][2];
    for (int h = 0; h < 2; h++) {
      d[h] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(tt + 32 * h)));
      f[h] = P::MIN ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(tt + P::F_AT + 32 * h))) : _mm512_setzero_ps();
      for (int r = 0; r < MR; r++) t[r][h] = _mm512_setzero_ps();
    }
#pragma GCC unroll 16
    for (int j = 0; j < P::NS; j++) {
      const int64_t sub = b * P::NS + j;
      const uint8_t* chunk = cb + (j * F::S / 32) * P::CHUNK;
      const int g0 = (j * F::S % 32) / 4;  // the sub-block's first group in its chunk
      __m512i dot[MR][2];
      for (int r = 0; r < MR; r++) dot[r][0] = dot[r][1] = _mm512_set1_epi32(p.zsum[(m0 + r) * ns + sub]);
#pragma GCC unroll 8
      for (int g = g0; g < g0 + F::S / 4; g++) {
        const __m512i w0 = packed_codes<QT>(chunk, g, 0), w1 = packed_codes<QT>(chunk, g, 1);
        for (int r = 0; r < MR; r++) {
          int32_t word;
          std::memcpy(&word, xq + r * K + b * F::BS + j * F::S + 4 * (g - g0), 4);
          const __m512i xb = _mm512_set1_epi32(word);
          dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], w0, xb);
          dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], w1, xb);
        }
      }
      for (int h = 0; h < 2; h++) {
        auto int8s = [&](int64_t at) {  // 16 int8 terms of this half as fp32
          return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(tt + at + j * NR + 16 * h))));
        };
        const __m512 s = P::SC ? _mm512_mul_ps(d[h], int8s(P::SC_AT)) : d[h];
        const __m512 c = P::MIN ? (P::SC ? _mm512_mul_ps(f[h], int8s(P::MN_AT)) : f[h]) : _mm512_setzero_ps();
        for (int r = 0; r < MR; r++) {
          t[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][h]), s, t[r][h]);
          if constexpr (P::MIN) t[r][h] = _mm512_fnmadd_ps(c, _mm512_set1_ps(p.sum[(m0 + r) * ns + sub]), t[r][h]);
        }
      }
    }
    for (int r = 0; r < MR; r++) {
      const __m512 dx = _mm512_set1_ps(p.a.d[(m0 + r) * nb + b]);
      for (int h = 0; h < 2; h++) _mm512_store_ps(acc[r] + 16 * h, _mm512_fmadd_ps(t[r][h], dx, _mm512_load_ps(acc[r] + 16 * h)));
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

#ifdef HEARTH_VNNI
template <int QT, int MR = PACKED_MR>
void packed_tile_vnni_mr(int mr, const uint8_t* codes, const uint8_t* terms, int64_t K, const PackedActivations& p,
                         int64_t m0, float* y, int64_t N, int64_t nvalid, bool stream) {
  if constexpr (MR > 1)
    if (mr < MR) return packed_tile_vnni_mr<QT, MR - 1>(mr, codes, terms, K, p, m0, y, N, nvalid, stream);
  packed_tile_vnni<QT, MR>(codes, terms, K, p, m0, y, N, nvalid, stream);
}
#endif

template <int QT>
void packed_tile(bool portable, int mr, const uint8_t* codes, const uint8_t* terms, int64_t K,
                 const PackedActivations& p, int64_t m0, float* y, int64_t N, int64_t nvalid, bool stream) {
#ifdef HEARTH_VNNI
  if (!portable) return packed_tile_vnni_mr<QT>(mr, codes, terms, K, p, m0, y, N, nvalid, stream);
#endif
  packed_tile_generic<QT>(mr, codes, terms, K, p, m0, y, N, nvalid);
}

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
      parallel_ranges((N + NR - 1) / NR, threads, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; t++)
          for (int64_t m = 0; m < M; m += PACKED_MR)
            packed_tile<QT>(portable, (int)std::min<int64_t>(PACKED_MR, M - m), codes + t * code_bytes,
                            terms + t * term_bytes, K, p, m, y + m * N + t * NR, N, std::min<int64_t>(NR, N - t * NR),
                            m == 0 && M <= 2 * PACKED_MR);
      });
    }
  });
}

// Which code runs int8_matmul: the fastest this build has (VNNI: tiles from INT8_TILE_MIN_ROWS
// rows, in place with vpdpwssd below), the AVX2 one, or the plain loops (the tests run each one
// this build has, `int8_paths`).
enum Int8Path : int { FASTEST = 0, AVX2 = 1, PORTABLE = 2 };

// Activation rows handled per pass over a weight row: its codes are decoded once for all of them.
constexpr int INT8_MR = 4;

template <int QT>
void int8_dot_rows(int path, int mr, const uint8_t* row, int64_t K, const QuantizedActivations& a, int64_t m0,
                   float* y, int64_t N) {
#ifdef HEARTH_VNNI
  if (path == FASTEST) return int8_dot_rows_simd<QT, true>(mr, row, K, a, m0, y, N);
#endif
#ifdef __AVX2__
  if (path != PORTABLE) return int8_dot_rows_simd<QT, false>(mr, row, K, a, m0, y, N);
#endif
  int8_dot_rows_generic<QT>(row, K, a, m0, mr, y, N);
}

// Weight rows per group: their blocks stay in L1 while every INT8_MR activation rows pass over them.
constexpr int64_t INT8_ROW_GROUP = 16;

template <int QT>
void int8_matmul_impl(int path, const uint8_t* w, int64_t K, const QuantizedActivations& a, int64_t M, float* y,
                      int64_t N, int threads) {
#ifdef HEARTH_VNNI
  if (path == FASTEST && M >= INT8_TILE_MIN_ROWS) return int8_matmul_tiles<QT>(w, K, a, M, y, N, threads);
#endif
  const int64_t row_bytes = K / Fmt<QT>::BS * Fmt<QT>::BYTES;
  parallel_ranges(N, threads, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t g = n0; g < n1; g += INT8_ROW_GROUP)
      for (int64_t m = 0; m < M; m += INT8_MR) {
        const int mr = (int)std::min<int64_t>(INT8_MR, M - m);
        for (int64_t n = g; n < std::min(n1, g + INT8_ROW_GROUP); n++)
          int8_dot_rows<QT>(path, mr, w + n * row_bytes, K, a, m, y + m * N + n, N);
      }
  });
}

// y [M, N] = x [M, K] W^T, W uint8 [N, K / BS * BYTES] GGUF blocks as stored; x quantized to int8
// per block of the format (q8_K for K-quants, q8_0 for the others).
void int8_matmul_blocks(uintptr_t x_, uintptr_t w_, uintptr_t y_, int64_t M, int64_t N, int64_t K, int qtype,
                        int path, int threads) {
  QuantizedActivations a;
  HEARTH_DISPATCH(qtype, {
    quantize_activations((const float*)x_, M, K, a, threads, Fmt<QT>::BS, path == PORTABLE);
    int8_matmul_impl<QT>(path, (const uint8_t*)w_, K, a, M, (float*)y_, N, threads);
  });
}

// The one entry for int8-activation matmuls (QuantLinear, cpu_kernels.cpp's decode_layers):
// `terms` non-zero: `w` is packed tiles' codes and `terms` their terms (packed_matmul, VNNI
// builds); zero: `w` is the GGUF blocks as stored (int8_matmul_blocks). F16 / BF16 arrays
// (decode_layers' projections in those formats; QuantLinear calls half_matmul itself):
// half_matmul, fp32 activations unrounded.
void int8_matmul(uintptr_t x, uintptr_t w, uintptr_t terms, uintptr_t y, int64_t M, int64_t N, int64_t K, int qtype,
                 int path, int threads) {
  if (terms) return packed_matmul(x, w, terms, y, M, N, K, qtype, path == PORTABLE, threads);
  if (qtype == F16 || qtype == BF16) return half_matmul(x, w, y, M, N, K, 2 * K, qtype, false, path == PORTABLE, threads);
  int8_matmul_blocks(x, w, y, M, N, K, qtype, path, threads);
}

// ------------------------------------------------------------------ grouped int8 matmul (mixtures of experts)
// A layer's chosen experts in one call: activation rows grouped by expert (rows of expert e are
// counts[e] consecutive rows of x, experts in order), each group times its expert's weight.
// The threads share out the chosen experts' weight rows end to end, in ranges of whole 32-row tiles
// (a range may cover several experts, or part of one) of about equal cost, a tile of an expert
// with r rows costing r + GROUPED_READ_COST: one fork and join per projection of the layer, not
// one per expert, and each thread reads long runs of weights; experts no row chose are not read.
// Each piece runs int8_matmul on one thread (its own activation rows quantized per piece: a few
// rows of K values, against the piece's weight rows).
constexpr int64_t GROUPED_READ_COST = 2;  // reading a tile, in rows' worth of its dot products

// Where rows [n0, ...) of a weight start: GGUF rows in place, or (terms non-zero) packed 32-row
// tiles' codes and terms (repack's layout), n0 a multiple of NR.
struct WeightRows {
  uintptr_t w, terms;
  int qtype;
  int64_t row_bytes, term_bytes;  // in place: bytes per row; packed: code and term bytes per tile

  WeightRows(const int64_t* expert, int64_t K) : w((uintptr_t)expert[0]), terms((uintptr_t)expert[1]), qtype((int)expert[2]) {
    if (terms) {
      std::tie(row_bytes, term_bytes) = packed_bytes(qtype, K);
    } else {
      term_bytes = 0;
      HEARTH_DISPATCH(qtype, row_bytes = K / Fmt<QT>::BS * Fmt<QT>::BYTES);
    }
  }
  uintptr_t weight_at(int64_t n0) const { return terms ? w + n0 / NR * row_bytes : w + n0 * row_bytes; }
  uintptr_t terms_at(int64_t n0) const { return terms ? terms + n0 / NR * term_bytes : 0; }
};

// experts int64 [E, 3]: weight or packed codes, packed terms or 0, qtype (int8_matmul's arguments); counts int64 [E];
// x [R, K] fp32, R = sum of counts; y [R, N] fp32.
void grouped_int8_matmul(uintptr_t x_, uintptr_t experts_, uintptr_t counts_, int64_t num_experts, uintptr_t y_,
                         int64_t N, int64_t K, int threads) {
  const int64_t* experts = (const int64_t*)experts_;
  const int64_t* counts = (const int64_t*)counts_;
  struct Group { WeightRows weight; int64_t row0, rows; };
  std::vector<Group> groups;
  for (int64_t e = 0, row = 0; e < num_experts; row += counts[e], e++)
    if (counts[e] > 0) {
      if (K % block_values((int)experts[3 * e + 2])) throw std::invalid_argument("grouped_int8_matmul: K is not a multiple of the block size");
      groups.push_back({WeightRows(experts + 3 * e, K), row, counts[e]});
    }
  const float* x = (const float*)x_;
  float* y = (float*)y_;
  const int64_t tiles = (N + NR - 1) / NR, units = (int64_t)groups.size() * tiles;  // units: (expert, tile)
  // thread i's units: [bounds[i], bounds[i + 1]), the cumulative cost split evenly
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(threads, units));
  std::vector<int64_t> bounds(nt + 1, units);
  int64_t total = 0;
  for (const Group& g : groups) total += tiles * (g.rows + GROUPED_READ_COST);
  bounds[0] = 0;
  for (int64_t gi = 0, cost = 0, i = 1; gi < (int64_t)groups.size() && i < nt; gi++) {
    const int64_t per_tile = groups[gi].rows + GROUPED_READ_COST;
    for (; i < nt && total * i / nt < cost + tiles * per_tile; i++)  // boundary i falls in this expert
      bounds[i] = gi * tiles + (total * i / nt - cost) / per_tile;
    cost += tiles * per_tile;
  }
  const auto run = [&](int64_t u0, int64_t u1) {
    std::vector<float> piece;
    for (int64_t u = u0; u < u1;) {
      const Group& g = groups[u / tiles];
      const int64_t t0 = u % tiles, t1 = std::min(tiles, t0 + (u1 - u));
      const int64_t n0 = t0 * NR, n = std::min(N, t1 * NR) - n0;
      const uintptr_t xg = (uintptr_t)(x + g.row0 * K);
      if (n == N) {  // the whole weight: straight into y's rows
        int8_matmul(xg, g.weight.weight_at(0), g.weight.terms_at(0), (uintptr_t)(y + g.row0 * N), g.rows, N, K,
                    g.weight.qtype, FASTEST, 1);
      } else {  // part of its rows: [rows, n], then into y's columns
        piece.resize(g.rows * n);
        int8_matmul(xg, g.weight.weight_at(n0), g.weight.terms_at(n0), (uintptr_t)piece.data(), g.rows, n, K,
                    g.weight.qtype, FASTEST, 1);
        for (int64_t r = 0; r < g.rows; r++) std::memcpy(y + (g.row0 + r) * N + n0, piece.data() + r * n, n * sizeof(float));
      }
      u += t1 - t0;
    }
  };
  if (nt == 1) return run(0, units);
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
  for (int i = omp_get_thread_num(); i < nt; i += omp_get_num_threads()) run(bounds[i], bounds[i + 1]);  // fewer threads given: several ranges each
#else
  run(0, units);
#endif
}

// name -> path for int8_matmul's `path`, the ones this build has (fastest first)
std::vector<std::pair<std::string, int>> int8_paths() {
  std::vector<std::pair<std::string, int>> paths;
#ifdef HEARTH_VNNI
  paths.emplace_back("avx512-vnni", FASTEST);
#endif
#ifdef __AVX2__
  paths.emplace_back("avx2", AVX2);
#endif
  paths.emplace_back("portable", PORTABLE);
  return paths;
}

bool has_avx512() {
#ifdef HEARTH_AVX512
  return true;
#else
  return false;
#endif
}

bool has_vnni() {
#ifdef HEARTH_VNNI
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("half_matmul", &half_matmul, "y = x W^T, F16 / BF16 weights, fp32 or bf16 activations", nogil);
  m.def("dequantize_rows", &dequantize_rows, "W as fp32", nogil);
  m.def("repack", &repack, "blocks -> packed tiles (codes, terms)", nogil);
  m.def("packed_bytes", [](int qtype, int64_t k) { const auto [c, t] = packed_bytes(qtype, k); return py::make_tuple(c, t); },
        "bytes of one tile's codes and terms");
  m.def("packed_matmul", &packed_matmul, "y = x W^T, W packed tiles, x rounded to int8 per block", nogil);
  m.def("dequantize_packed", &dequantize_packed, "packed tiles as fp32", nogil);
  m.def("int8_matmul", &int8_matmul, "y = x W^T, x rounded to int8 per block; W packed or GGUF blocks in place", nogil);
  // for hearth/backend/cpu_kernels.cpp's decode_layers, which calls it between its own kernels
  m.def("grouped_int8_matmul", &grouped_int8_matmul,
        "rows grouped by expert, each group times its expert's W^T (int8_matmul's weights), one call", nogil);
  m.def("int8_matmul_address", [] { return reinterpret_cast<uintptr_t>(&int8_matmul); });
  m.def("dequantize_rows_address", [] { return reinterpret_cast<uintptr_t>(&dequantize_rows); });
  m.def("block_values", &block_values);
  m.def("int8_paths", [] {
    py::dict paths;
    for (const auto& [name, path] : int8_paths()) paths[py::str(name)] = path;
    return paths;
  });
  m.def("has_avx512", &has_avx512);
  m.def("has_vnni", &has_vnni);
}
