// Quantized matmul on the CPU (docs/quantized-matmul.md).
//
//   packed_matmul: Q8_0 / Q4_0 repacked once (`repack`) into tiles of 32 rows; activations
//                  rounded to int8 per 32 values (llama.cpp's q8_0), AVX-512 VNNI dot products.
//                  Every batch size, decode included.
//   gemv:          the other formats in their GGUF layout, few rows: fp32 activations, weights
//                  decoded in registers; equals dequantize-then-matmul up to fp32 rounding.
//   gemm_q8:       the same formats, more rows: int8 activations against 32-row tiles repacked
//                  on the fly (never the whole weight).
//   dequantize_rows: the kernels' own decoding, tested bit-exact against hearth.quant.formats.
//
// Every format goes through one description, `unpack<QT>`: a block of BS values becomes
// unsigned codes q (uint8), and per sub-block of S values a scale s and (for formats with a
// minimum) an offset o, so that   w = s * (q - Z) + o   with Z a per-format zero point.
// AVX-512 paths are compiled when the build machine has them (-march=native); the plain C++
// loops are the portable path and the reference the fast paths are tested against.
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
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
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
// Q3_K: hmask[32] | qs[64] (as Q2_K) | scales[12] (6-bit, offset 32) | d f16.
// q = low + 4 * high, w = d (scale - 32) (q - 4); high bit of value i: (hmask[i % 32] >> (i / 32)) & 1
template <> void unpack<Q3_K>(const uint8_t* b, uint8_t* q, float* s, float*) {
  float d = h2f(b + 108);
  const uint8_t* raw = b + 96;
  for (int j = 0; j < 16; j++) {
    int low = j < 8 ? (raw[j] & 0x0F) : (raw[j - 8] >> 4);
    int high = (raw[8 + j % 4] >> (2 * (j / 4))) & 3;
    s[j] = d * float((low | (high << 4)) - 32);
  }
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

// ------------------------------------------------------------------ GEMV (exact)

// y[m, n] for rows [n0, n1) and all M (small): decode a block of R rows once, use it M times.
// Portable path: every format, any machine.
template <int QT>
void gemv_rows_generic(const uint8_t* w, int64_t row_bytes, int64_t K, const float* x, const float*, int64_t M,
                       float* y, int64_t N, int64_t n0, int64_t n1) {
  using F = Fmt<QT>;
  const int64_t nb = K / F::BS;
  std::vector<float> acc(M);
  alignas(64) float v[F::BS];
  for (int64_t n = n0; n < n1; n++) {
    std::fill(acc.begin(), acc.end(), 0.f);
    const uint8_t* row = w + n * row_bytes;
    for (int64_t b = 0; b < nb; b++) {
      decode<QT>(row + b * F::BYTES, v);
      for (int64_t m = 0; m < M; m++) {
        const float* xm = x + m * K + b * F::BS;
        float a = 0.f;
#pragma omp simd reduction(+ : a)
        for (int i = 0; i < F::BS; i++) a += v[i] * xm[i];
        acc[m] += a;
      }
    }
    for (int64_t m = 0; m < M; m++) y[m * N + n] = acc[m];
  }
}

// F16 / BF16 rows: plain half arrays
template <int QT>
void gemv_half_generic(const uint8_t* w, int64_t row_bytes, int64_t K, const float* x, const float*, int64_t M,
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

#ifdef HEARTH_AVX512
// Each thread walks its rows one after the other, so that every thread reads one sequential
// stream (the hardware prefetchers follow it; interleaving several rows defeats them).

inline __m512 i8x16_to_ps(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }

// nibbles of 16 bytes as int8: low nibbles - z, high nibbles - z
inline void nibbles_i8(const uint8_t* qs, int z, __m128i& lo, __m128i& hi) {
  const __m128i v = _mm_loadu_si128((const __m128i*)qs), m = _mm_set1_epi8(0x0F), zz = _mm_set1_epi8((char)z);
  lo = _mm_sub_epi8(_mm_and_si128(v, m), zz);
  hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), m), zz);
}
// Q5: the 5th bits from qh (bit j -> value j), as 16 in a byte
inline void high_bits(uint32_t qh, __m128i& lo, __m128i& hi) {
  const __m128i sixteen = _mm_set1_epi8(16);
  lo = _mm_maskz_mov_epi8((__mmask16)(qh & 0xFFFF), sixteen);
  hi = _mm_maskz_mov_epi8((__mmask16)(qh >> 16), sixteen);
}
// integer codes minus zero point as two fp32 vectors, and the block's scale (offset in m)
template <int QT> inline void codes32(const uint8_t* b, __m512& q0, __m512& q1, float& d, float& m);
template <> inline void codes32<Q8_0>(const uint8_t* b, __m512& q0, __m512& q1, float& d, float& m) {
  d = h2f(b); m = 0.f;
  q0 = i8x16_to_ps(_mm_loadu_si128((const __m128i*)(b + 2)));
  q1 = i8x16_to_ps(_mm_loadu_si128((const __m128i*)(b + 18)));
}
template <> inline void codes32<Q4_0>(const uint8_t* b, __m512& q0, __m512& q1, float& d, float& m) {
  d = h2f(b); m = 0.f;
  __m128i lo, hi;
  nibbles_i8(b + 2, 8, lo, hi);
  q0 = i8x16_to_ps(lo); q1 = i8x16_to_ps(hi);
}
template <> inline void codes32<Q4_1>(const uint8_t* b, __m512& q0, __m512& q1, float& d, float& m) {
  d = h2f(b); m = h2f(b + 2);
  __m128i lo, hi;
  nibbles_i8(b + 4, 0, lo, hi);
  q0 = i8x16_to_ps(lo); q1 = i8x16_to_ps(hi);
}
template <> inline void codes32<Q5_0>(const uint8_t* b, __m512& q0, __m512& q1, float& d, float& m) {
  d = h2f(b); m = 0.f;
  __m128i lo, hi, hl, hh;
  nibbles_i8(b + 6, 0, lo, hi);
  high_bits(u32(b + 2), hl, hh);
  const __m128i z = _mm_set1_epi8(16);
  q0 = i8x16_to_ps(_mm_sub_epi8(_mm_or_si128(lo, hl), z));
  q1 = i8x16_to_ps(_mm_sub_epi8(_mm_or_si128(hi, hh), z));
}
template <> inline void codes32<Q5_1>(const uint8_t* b, __m512& q0, __m512& q1, float& d, float& m) {
  d = h2f(b); m = h2f(b + 2);
  __m128i lo, hi, hl, hh;
  nibbles_i8(b + 8, 0, lo, hi);
  high_bits(u32(b + 4), hl, hh);
  q0 = i8x16_to_ps(_mm_or_si128(lo, hl));
  q1 = i8x16_to_ps(_mm_or_si128(hi, hh));
}

// One row against MB activation rows, 32-value block formats:
//   sum_b d_b (q_b . x_b) + m_b sum(x_b)   (the offset term only for Q4_1 / Q5_1)
template <int QT, int MB>
inline void gemv_row32(const uint8_t* row, int64_t K, const float* x, const float* xsum, float* y, int64_t N) {
  using F = Fmt<QT>;
  constexpr int U = MB == 1 ? 4 : (MB == 2 ? 2 : 1);  // independent accumulators per activation row
  const int64_t nb = K / 32;
  __m512 acc[U][MB];
  float off[MB] = {};
  for (int u = 0; u < U; u++)
    for (int m = 0; m < MB; m++) acc[u][m] = _mm512_setzero_ps();
  auto step = [&](int64_t b, int u) __attribute__((always_inline)) {
    const uint8_t* blk = row + b * F::BYTES;
    __m512 q0, q1;
    float d, mn;
    codes32<QT>(blk, q0, q1, d, mn);
    const __m512 vd = _mm512_set1_ps(d);
    if constexpr (MB == 1) {
      const float* xb = x + b * 32;
      __m512 t = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(xb)));
      acc[u][0] = _mm512_fmadd_ps(t, vd, acc[u][0]);
    } else {
      q0 = _mm512_mul_ps(q0, vd);
      q1 = _mm512_mul_ps(q1, vd);
      for (int m = 0; m < MB; m++) {
        const float* xb = x + m * K + b * 32;
        acc[u][m] = _mm512_fmadd_ps(q0, _mm512_loadu_ps(xb), acc[u][m]);
        acc[u][m] = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xb + 16), acc[u][m]);
      }
    }
    if constexpr (F::OFF)
      for (int m = 0; m < MB; m++) off[m] += mn * xsum[m * nb + b];
  };
  int64_t b = 0;
  for (; b + U <= nb; b += U)
    for (int u = 0; u < U; u++) step(b + u, u);
  for (; b < nb; b++) step(b, 0);
  for (int m = 0; m < MB; m++) {
    __m512 a = acc[0][m];
    for (int u = 1; u < U; u++) a = _mm512_add_ps(a, acc[u][m]);
    y[m * N] = _mm512_reduce_add_ps(a) + off[m];
  }
}

// K-quant super-blocks decoded to 256 fp32 values with vector byte operations (the scalar
// `decode` is the reference; Q2_K / Q3_K keep it).
inline void store_codes32(__m256i codes_u8_or_i8, bool is_signed, __m512 scale0, __m512 off0, __m512 scale1, __m512 off1, float* w) {
  const __m128i lo = _mm256_castsi256_si128(codes_u8_or_i8), hi = _mm256_extracti128_si256(codes_u8_or_i8, 1);
  const __m512i a = is_signed ? _mm512_cvtepi8_epi32(lo) : _mm512_cvtepu8_epi32(lo);
  const __m512i b = is_signed ? _mm512_cvtepi8_epi32(hi) : _mm512_cvtepu8_epi32(hi);
  _mm512_store_ps(w, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), scale0, off0));
  _mm512_store_ps(w + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), scale1, off1));
}

template <int QT> inline bool decode_vec(const uint8_t* b, float* w) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  if constexpr (QT == Q4_K || QT == Q5_K) {
    // the 8 6-bit scales and mins, all at once (k_scale_min, byte-parallel)
    const uint32_t r0 = u32(b + 4), r1 = u32(b + 8), r2 = u32(b + 12);
    const uint64_t sc = uint64_t(r0 & 0x3F3F3F3Fu) | uint64_t((r2 & 0x0F0F0F0Fu) | ((r0 >> 2) & 0x30303030u)) << 32;
    const uint64_t mn = uint64_t(r1 & 0x3F3F3F3Fu) | uint64_t(((r2 >> 4) & 0x0F0F0F0Fu) | ((r1 >> 2) & 0x30303030u)) << 32;
    alignas(32) float scale[8], offset[8];
    _mm256_store_ps(scale, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc))),
                                         _mm256_set1_ps(h2f(b))));
    _mm256_store_ps(offset, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn))),
                                          _mm256_set1_ps(-h2f(b + 2))));
    const uint8_t* qs = b + (QT == Q4_K ? 16 : 48);
    __m256i qh = QT == Q5_K ? _mm256_loadu_si256((const __m256i*)(b + 16)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
      __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
      if constexpr (QT == Q5_K) {  // bit 2c / 2c+1 of qh[l]: the 5th bit of sub-block 2c / 2c+1
        const __m256i one = _mm256_set1_epi8(1);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 1), one), 4));
        qh = _mm256_srli_epi16(qh, 2);
      }
      for (int h = 0; h < 2; h++) {
        const __m512 vs = _mm512_set1_ps(scale[2 * c + h]), vo = _mm512_set1_ps(offset[2 * c + h]);
        store_codes32(h ? hi : lo, false, vs, vo, vs, vo, w + 64 * c + 32 * h);
      }
    }
    return true;
  } else if constexpr (QT == Q6_K) {
    alignas(64) float scale[16];
    _mm512_store_ps(scale, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 192)))),
                                         _mm512_set1_ps(h2f(b + 208))));
    const __m256i three = _mm256_set1_epi8(3), z = _mm256_set1_epi8(32);
    const __m512 zero = _mm512_setzero_ps();
    for (int h = 0; h < 2; h++) {
      const __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
      for (int sh = 0; sh < 4; sh++) {
        const __m256i ql = _mm256_loadu_si256((const __m256i*)(b + 64 * h + 32 * (sh & 1)));
        const __m256i low = sh < 2 ? _mm256_and_si256(ql, nib) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), nib);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * sh), three);
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), z);
        const int j = (128 * h + 32 * sh) / 16;  // two sub-blocks of 16
        store_codes32(q, true, _mm512_set1_ps(scale[j]), zero, _mm512_set1_ps(scale[j + 1]), zero, w + 128 * h + 32 * sh);
      }
    }
    return true;
  }
  return false;
}

// Other formats (K-quants, half arrays): decode a block of the row to fp32, then FMA.
template <int QT, int MB>
inline void gemv_row_decoded(const uint8_t* row, int64_t K, const float* x, float* y, int64_t N) {
  constexpr int BS = Fmt<QT>::BS;
  constexpr int U = MB == 1 ? 4 : (MB == 2 ? 2 : 1);
  __m512 acc[U][MB];
  for (int u = 0; u < U; u++)
    for (int m = 0; m < MB; m++) acc[u][m] = _mm512_setzero_ps();
  alignas(64) float v[BS];
  for (int64_t b = 0; b < K / BS; b++) {
    const float* vp = v;
    if constexpr (is_half<QT>()) {
      const uint8_t* p = row + b * 64;
      for (int h = 0; h < 2; h++) {
        __m256i raw = _mm256_loadu_si256((const __m256i*)(p + 32 * h));
        __m512 f = QT == F16 ? _mm512_cvtph_ps(raw)
                             : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
        _mm512_store_ps(v + 16 * h, f);
      }
    } else {
      if (!decode_vec<QT>(row + b * Fmt<QT>::BYTES, v)) decode<QT>(row + b * Fmt<QT>::BYTES, v);
    }
    for (int i = 0; i < BS / 16; i++) {
      const __m512 wv = _mm512_load_ps(vp + 16 * i);
      for (int m = 0; m < MB; m++)
        acc[i % U][m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + b * BS + 16 * i), acc[i % U][m]);
    }
  }
  float tail[MB] = {};
  if constexpr (is_half<QT>())  // half arrays: K need not be a multiple of 32
    for (int64_t k = K / BS * BS; k < K; k++) {
      uint16_t h;
      std::memcpy(&h, row + 2 * k, 2);
      const float v1 = QT == F16 ? half_to_float(h) : bf16_to_float(h);
      for (int m = 0; m < MB; m++) tail[m] += v1 * x[m * K + k];
    }
  for (int m = 0; m < MB; m++) {
    __m512 a = acc[0][m];
    for (int u = 1; u < U; u++) a = _mm512_add_ps(a, acc[u][m]);
    y[m * N] = _mm512_reduce_add_ps(a) + tail[m];
  }
}

template <int QT, int MB>
inline void gemv_row(const uint8_t* row, int64_t K, const float* x, const float* xsum, float* y, int64_t N) {
  if constexpr (!is_half<QT>() && Fmt<QT>::BS == 32)
    gemv_row32<QT, MB>(row, K, x, xsum, y, N);
  else
    gemv_row_decoded<QT, MB>(row, K, x, y, N);
}

// rows [n0, n1) against all M activation rows, four at a time (a row is re-read from L1/L2)
template <int QT>
void gemv_rows_avx512(const uint8_t* w, int64_t row_bytes, int64_t K, const float* x, const float* xsum,
                      int64_t M, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nb = K / 32;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = w + n * row_bytes;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) gemv_row<QT, 4>(row, K, x + m * K, xsum + m * nb, y + m * N + n, N);
    switch (M - m) {
      case 3: gemv_row<QT, 3>(row, K, x + m * K, xsum + m * nb, y + m * N + n, N); break;
      case 2: gemv_row<QT, 2>(row, K, x + m * K, xsum + m * nb, y + m * N + n, N); break;
      case 1: gemv_row<QT, 1>(row, K, x + m * K, xsum + m * nb, y + m * N + n, N); break;
    }
  }
}
#endif  // HEARTH_AVX512

template <int QT>
void gemv_rows(bool portable, const uint8_t* w, int64_t row_bytes, int64_t K, const float* x, const float* xsum,
               int64_t M, float* y, int64_t N, int64_t n0, int64_t n1) {
#ifdef HEARTH_AVX512
  if (!portable) return gemv_rows_avx512<QT>(w, row_bytes, K, x, xsum, M, y, N, n0, n1);
#endif
  if constexpr (QT == F16 || QT == BF16)
    gemv_half_generic<QT>(w, row_bytes, K, x, xsum, M, y, N, n0, n1);
  else
    gemv_rows_generic<QT>(w, row_bytes, K, x, xsum, M, y, N, n0, n1);
}

#define HEARTH_DISPATCH(qtype, CALL)                                          \
  switch (qtype) {                                                            \
    case Q8_0: { constexpr int QT = Q8_0; CALL; break; }                      \
    case Q4_0: { constexpr int QT = Q4_0; CALL; break; }                      \
    case Q4_1: { constexpr int QT = Q4_1; CALL; break; }                      \
    case Q5_0: { constexpr int QT = Q5_0; CALL; break; }                      \
    case Q5_1: { constexpr int QT = Q5_1; CALL; break; }                      \
    case Q2_K: { constexpr int QT = Q2_K; CALL; break; }                      \
    case Q3_K: { constexpr int QT = Q3_K; CALL; break; }                      \
    case Q4_K: { constexpr int QT = Q4_K; CALL; break; }                      \
    case Q5_K: { constexpr int QT = Q5_K; CALL; break; }                      \
    case Q6_K: { constexpr int QT = Q6_K; CALL; break; }                      \
    default: throw std::invalid_argument("hearth qmatmul: unsupported type " + std::to_string(qtype)); \
  }

#define HEARTH_DISPATCH_HALF(qtype, CALL)                    \
  if (qtype == F16) { constexpr int QT = F16; CALL; }        \
  else if (qtype == BF16) { constexpr int QT = BF16; CALL; } \
  else HEARTH_DISPATCH(qtype, CALL)

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

// y [M, N] = x [M, K] W^T, fp32, exact up to summation order; W uint8 [N, row_bytes]
void gemv(uintptr_t x_, uintptr_t w_, uintptr_t y_, int64_t M, int64_t N, int64_t K, int64_t rb, int qtype,
          bool portable, int threads) {
  const float* xp = (const float*)x_;
  const uint8_t* wp = (const uint8_t*)w_;
  float* yp = (float*)y_;
  // sums of x per 32 values: the offset term of Q4_1 / Q5_1
  std::vector<float> xsum(M * (K / 32));
  if (qtype == Q4_1 || qtype == Q5_1)
    for (int64_t i = 0; i < M * (K / 32); i++) {
      float a = 0.f;
      for (int j = 0; j < 32; j++) a += xp[32 * i + j];
      xsum[i] = a;
    }
  // contiguous row ranges, one per thread: each thread reads one sequential stream
  parallel_ranges(N, threads, 16, [&](int64_t n0, int64_t n1) {
    HEARTH_DISPATCH_HALF(qtype, gemv_rows<QT>(portable, wp, rb, K, xp, xsum.data(), M, yp, N, n0, n1));
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

// ------------------------------------------------------------------ GEMM (q8 activations)

// x [M, K] fp32 -> int8 codes, per 32 values a scale d = amax / 127 (as llama.cpp's q8_0,
// with the scale kept in fp32), and per 16 values the sum of the codes.
struct QuantizedActivations {
  std::vector<int8_t> q;   // [M, K]
  std::vector<float> d;    // [M, K/32]
  std::vector<int32_t> s16;  // [M, K/16]
};

void quantize_activations(const float* x, int64_t M, int64_t K, QuantizedActivations& a, int threads) {
  a.q.resize(M * K);
  a.d.resize(M * K / 32);
  a.s16.resize(M * K / 16);
  parallel_ranges(M, threads, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++)
      for (int64_t b = 0; b < K / 32; b++) {
        const float* xb = x + m * K + 32 * b;
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = std::max(amax, std::abs(xb[i]));
        float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        a.d[m * (K / 32) + b] = d;
        int8_t* qb = a.q.data() + m * K + 32 * b;
        for (int h = 0; h < 2; h++) {
          int32_t sum = 0;
          for (int i = 16 * h; i < 16 * h + 16; i++) {
            int v = (int)std::nearbyint(xb[i] * id);
            qb[i] = (int8_t)v;
            sum += v;
          }
          a.s16[m * (K / 16) + 2 * b + h] = sum;
        }
      }
  });
}

constexpr int NR = 32;  // weight rows per tile (two 16-lane vectors)

// A tile of NR weight rows in the layout the micro-kernel reads:
//   q  [K/4][NR][4] uint8: for each group of 4 values, the 4 codes of each row side by side
//   s, o [K/S][NR] fp32: scale and offset of each sub-block of each row
template <int QT>
void pack_tile(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0, int64_t rows,
               uint8_t* q, float* s, float* o) {
  using F = Fmt<QT>;
  constexpr int NS = F::BS / F::S;
  const int64_t nsub = K / F::S;
  alignas(64) uint8_t qb[F::BS];
  float sb[NS], ob[NS];
  for (int64_t j = 0; j < NR; j++) {
    if (j >= rows) {  // padding rows: zero codes and scales
      for (int64_t g = 0; g < K / 4; g++) std::memset(q + (g * NR + j) * 4, 0, 4);
      for (int64_t t = 0; t < nsub; t++) { s[t * NR + j] = 0.f; o[t * NR + j] = 0.f; }
      continue;
    }
    const uint8_t* row = w + (n0 + j) * row_bytes;
    for (int64_t b = 0; b < K / F::BS; b++) {
      for (int t = 0; t < NS; t++) ob[t] = 0.f;
      unpack<QT>(row + b * F::BYTES, qb, sb, ob);
      for (int g = 0; g < F::BS / 4; g++) std::memcpy(q + ((b * F::BS / 4 + g) * NR + j) * 4, qb + 4 * g, 4);
      for (int t = 0; t < NS; t++) { s[(b * NS + t) * NR + j] = sb[t]; o[(b * NS + t) * NR + j] = ob[t]; }
    }
  }
}

#ifdef HEARTH_AVX512
// The same tile for 32-value formats, 16 rows at a time with gathers (one dword of 16 rows).
inline __m512i spread_bits4(__m512i x4) {  // 4 bits -> bit 4 of each of 4 bytes
  x4 = _mm512_mullo_epi32(_mm512_and_si512(x4, _mm512_set1_epi32(0xF)), _mm512_set1_epi32(0x00204081));
  return _mm512_slli_epi32(_mm512_and_si512(x4, _mm512_set1_epi32(0x01010101)), 4);
}

template <int QT>
void pack_tile32(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0, int64_t rows,
                 uint8_t* q, float* s, float* o) {
  using F = Fmt<QT>;
  const uint8_t* base = w + n0 * row_bytes;
  const __m512i nib = _mm512_set1_epi32(0x0F0F0F0F);
  auto store = [&](int64_t group, int h, __m512i v) {
    _mm512_store_si512((void*)(q + (group * NR + 16 * h) * 4), v);
  };
  for (int h = 0; h < 2; h++) {
    const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(16, rows - 16 * h));
    const __mmask16 k = (__mmask16)((1u << valid) - 1);
    const __m512i rowoff = _mm512_mullo_epi32(
        _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(16 * h)),
        _mm512_set1_epi32((int)row_bytes));
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t b = 0; b < K / 32; b++) {
      const __m512i off = _mm512_add_epi32(rowoff, _mm512_set1_epi32((int)(b * F::BYTES)));
      auto gather = [&](int at) {
        return _mm512_mask_i32gather_epi32(zero, k, _mm512_add_epi32(off, _mm512_set1_epi32(at)), base, 1);
      };
      const __m512i dm = gather(0);  // d, and m for Q4_1 / Q5_1
      _mm512_store_ps(s + b * NR + 16 * h, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)));
      _mm512_store_ps(o + b * NR + 16 * h,
                      F::OFF ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))) : _mm512_setzero_ps());
      if constexpr (QT == Q8_0) {
        for (int g = 0; g < 8; g++) store(b * 8 + g, h, _mm512_xor_si512(gather(2 + 4 * g), _mm512_set1_epi32((int)0x80808080)));
      } else {
        constexpr int QS = QT == Q4_0 ? 2 : QT == Q4_1 ? 4 : QT == Q5_0 ? 6 : 8;
        __m512i qh = zero;
        if constexpr (QT == Q5_0 || QT == Q5_1) qh = gather(QT == Q5_0 ? 2 : 4);
        for (int g = 0; g < 4; g++) {
          __m512i v = gather(QS + 4 * g);
          __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), nib);
          if constexpr (QT == Q5_0 || QT == Q5_1) {
            lo = _mm512_or_si512(lo, spread_bits4(_mm512_srli_epi32(qh, 4 * g)));
            hi = _mm512_or_si512(hi, spread_bits4(_mm512_srli_epi32(qh, 16 + 4 * g)));
          }
          store(b * 8 + g, h, lo);
          store(b * 8 + 4 + g, h, hi);
        }
      }
    }
  }
}
#endif

// Q8_0 / Q4_0 / Q4_1 tiles by register transposition (gathers are slow on some CPUs): the 8
// dwords of a block of 16 rows, loaded as rows, become 8 vectors of one dword from each row.
inline void transpose_16x8(__m512i z[8]) {
  // z[i]: row i (lanes 0-7) and row i + 8 (lanes 8-15), 8 dwords each
  __m512i w[8];
  for (int h = 0; h < 2; h++) {  // 4x4 transposes within 128-bit lanes, rows 4h..4h+3
    __m512i* a = z + 4 * h;
    __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
    __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
    w[4 * h + 0] = _mm512_unpacklo_epi64(t0, t2);
    w[4 * h + 1] = _mm512_unpackhi_epi64(t0, t2);
    w[4 * h + 2] = _mm512_unpacklo_epi64(t1, t3);
    w[4 * h + 3] = _mm512_unpackhi_epi64(t1, t3);
  }
  const __m512i even = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), odd = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int c = 0; c < 4; c++) {
    z[c] = _mm512_permutex2var_epi64(w[c], even, w[4 + c]);
    z[4 + c] = _mm512_permutex2var_epi64(w[c], odd, w[4 + c]);
  }
}

template <int QT>
void pack_tile_transpose(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0, uint8_t* q, float* s, float* o) {
  using F = Fmt<QT>;
  constexpr int QS = QT == Q8_0 ? 2 : QT == Q4_0 ? 2 : 4;
  const uint8_t* base = w + n0 * row_bytes;
  const __m512i iota = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32((int)row_bytes));
  const __m512i nib = _mm512_set1_epi32(0x0F0F0F0F);
  const __m512i shifts = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4);
  for (int h = 0; h < 2; h++) {
    const uint8_t* rows16 = base + 16 * h * row_bytes;
    const __m512i rowoff = iota;
    for (int64_t b = 0; b < K / 32; b++) {
      const int64_t at = b * F::BYTES;
      __m512i dm = _mm512_i32gather_epi32(_mm512_add_epi32(rowoff, _mm512_set1_epi32((int)at)), rows16, 1);
      _mm512_store_ps(s + b * NR + 16 * h, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)));
      _mm512_store_ps(o + b * NR + 16 * h,
                      F::OFF ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))) : _mm512_setzero_ps());
      __m512i z[8];
      for (int i = 0; i < 8; i++) {
        const uint8_t* r0 = rows16 + i * row_bytes + at + QS;
        const uint8_t* r1 = rows16 + (i + 8) * row_bytes + at + QS;
        if constexpr (QT == Q8_0) {
          z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)r0)),
                                    _mm256_loadu_si256((const __m256i*)r1), 1);
          z[i] = _mm512_xor_si512(z[i], _mm512_set1_epi32((int)0x80808080));
        } else {  // 16 bytes of nibbles -> [low nibbles | high nibbles] of each row
          __m256i u = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)r0)),
                                              _mm_loadu_si128((const __m128i*)r1), 1);
          __m512i t = _mm512_shuffle_i64x2(_mm512_castsi256_si512(u), _mm512_castsi256_si512(u), 0x50);  // lanes 0,0,1,1
          z[i] = _mm512_and_si512(_mm512_srlv_epi32(t, shifts), nib);
        }
      }
      transpose_16x8(z);
      for (int g = 0; g < 8; g++) _mm512_store_si512((void*)(q + ((b * 8 + g) * NR + 16 * h) * 4), z[g]);
    }
  }
}

template <int QT>
void pack(bool portable, const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0, int64_t rows,
          uint8_t* q, float* s, float* o) {
#ifdef HEARTH_AVX512
  if constexpr (QT == Q8_0 || QT == Q4_0 || QT == Q4_1)
    if (!portable && rows == NR) return pack_tile_transpose<QT>(w, row_bytes, K, n0, q, s, o);
  if constexpr (Fmt<QT>::BS == 32)
    if (!portable) return pack_tile32<QT>(w, row_bytes, K, n0, rows, q, s, o);
#endif
  pack_tile<QT>(w, row_bytes, K, n0, rows, q, s, o);
}

// Per activation row and sub-block: c0 = -Z * sum(codes) (int, starts the integer dot),
// dx = the activation scale, cx = dx * sum(codes) (multiplies the weight offsets).
template <int S, int Z>
void activation_terms(const QuantizedActivations& a, int64_t M, int64_t K,
                      std::vector<int32_t>& c0, std::vector<float>& dx, std::vector<float>& cx) {
  const int64_t nsub = K / S;
  c0.resize(M * nsub); dx.resize(M * nsub); cx.resize(M * nsub);
  for (int64_t m = 0; m < M; m++)
    for (int64_t t = 0; t < nsub; t++) {
      int32_t sum = S == 16 ? a.s16[m * (K / 16) + t] : a.s16[m * (K / 16) + 2 * t] + a.s16[m * (K / 16) + 2 * t + 1];
      float d = a.d[m * (K / 32) + t * S / 32];
      c0[m * nsub + t] = -Z * sum;
      dx[m * nsub + t] = d;
      cx[m * nsub + t] = d * float(sum);
    }
}

// Portable micro-kernel: MR activation rows x NR weight rows of a packed tile.
template <int S, bool OFF>
void ukernel_generic(int MR, const uint8_t* q, const float* s, const float* o, int64_t K,
                     const int8_t* xq, const int32_t* c0, const float* dx, const float* cx,
                     float* y, int64_t N, int64_t nvalid) {
  const int64_t nsub = K / S;
  for (int r = 0; r < MR; r++) {
    float acc[NR] = {};
    for (int64_t t = 0; t < nsub; t++) {
      int32_t dot[NR];
      for (int j = 0; j < NR; j++) dot[j] = c0[r * nsub + t];
      for (int g = 0; g < S / 4; g++) {
        const uint8_t* qg = q + ((t * S / 4 + g) * NR) * 4;
        const int8_t* xg = xq + r * K + t * S + 4 * g;
        for (int j = 0; j < NR; j++)
          for (int i = 0; i < 4; i++) dot[j] += int32_t(qg[4 * j + i]) * int32_t(xg[i]);
      }
      for (int j = 0; j < NR; j++) {
        acc[j] += float(dot[j]) * (s[t * NR + j] * dx[r * nsub + t]);
        if (OFF) acc[j] += o[t * NR + j] * cx[r * nsub + t];
      }
    }
    for (int j = 0; j < nvalid; j++) y[r * N + j] = acc[j];
  }
}

#ifdef HEARTH_VNNI
template <int MR, int S, bool OFF>
inline void ukernel_vnni(const uint8_t* q, const float* s, const float* o, int64_t K,
                         const int8_t* xq, const int32_t* c0, const float* dx, const float* cx,
                         float* y, int64_t N, int64_t nvalid) {
  const int64_t nsub = K / S;
  __m512 acc[MR][2];
  for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t t = 0; t < nsub; t++) {
    __m512i dot[MR][2];
    for (int r = 0; r < MR; r++) dot[r][0] = dot[r][1] = _mm512_set1_epi32(c0[r * nsub + t]);
    const uint8_t* qt = q + t * S * NR;
#pragma GCC unroll 8
    for (int g = 0; g < S / 4; g++) {
      __m512i w0 = _mm512_load_si512((const void*)(qt + g * NR * 4));
      __m512i w1 = _mm512_load_si512((const void*)(qt + g * NR * 4 + 64));
      for (int r = 0; r < MR; r++) {
        int32_t xv;
        std::memcpy(&xv, xq + r * K + t * S + 4 * g, 4);
        __m512i xb = _mm512_set1_epi32(xv);
        dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], w0, xb);
        dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], w1, xb);
      }
    }
    __m512 s0 = _mm512_load_ps(s + t * NR), s1 = _mm512_load_ps(s + t * NR + 16);
    for (int r = 0; r < MR; r++) {
      __m512 d = _mm512_set1_ps(dx[r * nsub + t]);
      acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][0]), _mm512_mul_ps(s0, d), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][1]), _mm512_mul_ps(s1, d), acc[r][1]);
    }
    if constexpr (OFF) {
      __m512 o0 = _mm512_load_ps(o + t * NR), o1 = _mm512_load_ps(o + t * NR + 16);
      for (int r = 0; r < MR; r++) {
        __m512 c = _mm512_set1_ps(cx[r * nsub + t]);
        acc[r][0] = _mm512_fmadd_ps(o0, c, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(o1, c, acc[r][1]);
      }
    }
  }
  __mmask16 k0 = nvalid >= 16 ? 0xFFFF : (__mmask16)((1u << nvalid) - 1);
  __mmask16 k1 = nvalid >= 32 ? 0xFFFF : nvalid <= 16 ? 0 : (__mmask16)((1u << (nvalid - 16)) - 1);
  for (int r = 0; r < MR; r++) {
    _mm512_mask_storeu_ps(y + r * N, k0, acc[r][0]);
    _mm512_mask_storeu_ps(y + r * N + 16, k1, acc[r][1]);
  }
}
#endif

constexpr int MR_MAX = 4;

template <int S, bool OFF>
void ukernel(bool portable, int MR, const uint8_t* q, const float* s, const float* o, int64_t K,
             const int8_t* xq, const int32_t* c0, const float* dx, const float* cx, float* y, int64_t N, int64_t nvalid) {
#ifdef HEARTH_VNNI
  if (!portable) {
    switch (MR) {
      case 4: return ukernel_vnni<4, S, OFF>(q, s, o, K, xq, c0, dx, cx, y, N, nvalid);
      case 3: return ukernel_vnni<3, S, OFF>(q, s, o, K, xq, c0, dx, cx, y, N, nvalid);
      case 2: return ukernel_vnni<2, S, OFF>(q, s, o, K, xq, c0, dx, cx, y, N, nvalid);
      default: return ukernel_vnni<1, S, OFF>(q, s, o, K, xq, c0, dx, cx, y, N, nvalid);
    }
  }
#endif
  ukernel_generic<S, OFF>(MR, q, s, o, K, xq, c0, dx, cx, y, N, nvalid);
}

template <int QT>
void gemm_q8_impl(bool portable, const uint8_t* w, int64_t row_bytes, int64_t K, const QuantizedActivations& a,
                  int64_t M, float* y, int64_t N, int threads) {
  using F = Fmt<QT>;
  const int64_t nsub = K / F::S;
  std::vector<int32_t> c0;
  std::vector<float> dx, cx;
  activation_terms<F::S, F::Z>(a, M, K, c0, dx, cx);
  const int64_t tiles = (N + NR - 1) / NR;
  parallel_ranges(tiles, threads, 1, [&](int64_t t0, int64_t t1) {
    // one packed tile per thread: codes K * NR bytes, scales and offsets 2 * nsub * NR floats
    auto q = (uint8_t*)std::aligned_alloc(64, ((K * NR + 63) / 64) * 64);
    auto so = (float*)std::aligned_alloc(64, ((2 * nsub * NR * 4 + 63) / 64) * 64);
    float* s = so;
    float* o = so + nsub * NR;
    for (int64_t tile = t0; tile < t1; tile++) {
      const int64_t n0 = tile * NR, rows = std::min<int64_t>(NR, N - n0);
      pack<QT>(portable, w, row_bytes, K, n0, rows, q, s, o);
      for (int64_t m = 0; m < M; m += MR_MAX) {
        int mr = (int)std::min<int64_t>(MR_MAX, M - m);
        ukernel<F::S, F::OFF>(portable, mr, q, s, o, K, a.q.data() + m * K, c0.data() + m * nsub,
                              dx.data() + m * nsub, cx.data() + m * nsub, y + m * N + n0, N, rows);
      }
    }
    std::free(q);
    std::free(so);
  });
}

// y [M, N] = x [M, K] W^T with x quantized to int8 per 32 values (llama.cpp's numerics)
void gemm_q8(uintptr_t x_, uintptr_t w_, uintptr_t y_, int64_t M, int64_t N, int64_t K, int64_t rb, int qtype,
             bool portable, int threads) {
  if (qtype == F16 || qtype == BF16) throw std::invalid_argument("gemm_q8: block-quantized weights only");
  QuantizedActivations a;
  quantize_activations((const float*)x_, M, K, a, threads);
  HEARTH_DISPATCH(qtype, gemm_q8_impl<QT>(portable, (const uint8_t*)w_, rb, K, a, M, (float*)y_, N, threads));
}

// ------------------------------------------------------------------ packed Q8_0 / Q4_0
// Repacked once at load: the same bytes as the GGUF blocks, rearranged so that one 64-byte vector
// holds 4 codes of each of 16 rows, which one VNNI instruction multiplies with 4 activation codes.
// Per tile of 32 rows (the last one padded with zero-scale rows), tiles one after another:
//   Q8_0 codes:  [K/4][32 rows][4] uint8, the int8 code + 128
//   Q4_0 codes:  [K/32][4][32 rows][4], bytes 4g..4g+3 of the block's qs: low nibbles are values
//                4g..4g+3, high nibbles values 16+4g..16+4g+3
//   scales:      [K/32][32 rows] float16, the block's d
// One kernel serves every M: for M = 1 it reads each weight byte once with ~2 instructions per
// 32 weights (the GGUF layout needs ~10 in fp32), for large M the tile stays in L1/L2.

constexpr int PACKED_MR = 5;  // activation rows per pass over a tile (4..6 measured within 5%)

constexpr int64_t packed_code_bytes(int qtype, int64_t K) { return qtype == Q8_0 ? NR * K : NR * K / 2; }

void repack(uintptr_t w_, uintptr_t codes_, uintptr_t scales_, int64_t N, int64_t K, int64_t rb, int qtype, int threads) {
  if (qtype != Q8_0 && qtype != Q4_0) throw std::invalid_argument("repack: Q8_0 and Q4_0 only");
  const uint8_t* w = (const uint8_t*)w_;
  uint8_t* codes = (uint8_t*)codes_;
  uint16_t* scales = (uint16_t*)scales_;
  const int64_t tiles = (N + NR - 1) / NR, nb = K / 32, tile_bytes = packed_code_bytes(qtype, K);
  const int bytes = qtype == Q8_0 ? 34 : 18, groups = qtype == Q8_0 ? 8 : 4;
  parallel_ranges(tiles, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      uint8_t* tc = codes + t * tile_bytes;
      uint16_t* ts = scales + t * nb * NR;
      for (int64_t j = 0; j < NR; j++) {
        const int64_t n = t * NR + j;
        for (int64_t b = 0; b < nb; b++) {
          const uint8_t* blk = w + n * rb + b * bytes;
          uint16_t d = 0;
          if (n < N) std::memcpy(&d, blk, 2);
          ts[b * NR + j] = d;
          for (int g = 0; g < groups; g++) {
            uint32_t v = 0;
            if (n < N) std::memcpy(&v, blk + 2 + 4 * g, 4);
            if (qtype == Q8_0) v ^= 0x80808080u;
            std::memcpy(tc + ((b * groups + g) * NR + j) * 4, &v, 4);
          }
        }
      }
    }
  });
}

// activation terms per row and block of 32: c0 = -Z * sum(codes), dx = scale
void packed_terms(const QuantizedActivations& a, int64_t M, int64_t K, int Z, std::vector<int32_t>& c0, std::vector<float>& dx) {
  const int64_t nb = K / 32;
  c0.resize(M * nb);
  dx.resize(M * nb);
  for (int64_t m = 0; m < M; m++)
    for (int64_t b = 0; b < nb; b++) {
      c0[m * nb + b] = -Z * (a.s16[m * (K / 16) + 2 * b] + a.s16[m * (K / 16) + 2 * b + 1]);
      dx[m * nb + b] = a.d[m * nb + b];
    }
}

// Portable: MR rows against one packed tile
template <int QT>
void packed_tile_generic(int MR, const uint8_t* codes, const uint16_t* scales, int64_t K, const int8_t* xq,
                         const int32_t* c0, const float* dx, float* y, int64_t N, int64_t nvalid) {
  const int64_t nb = K / 32;
  for (int r = 0; r < MR; r++) {
    float acc[NR] = {};
    for (int64_t b = 0; b < nb; b++) {
      const int8_t* xb = xq + r * K + b * 32;
      for (int j = 0; j < NR; j++) {
        int32_t dot = c0[r * nb + b];
        for (int i = 0; i < 32; i++) {
          int code;
          if (QT == Q8_0) {
            code = codes[((b * 8 + i / 4) * NR + j) * 4 + i % 4];
          } else {
            const int g = (i % 16) / 4;
            const uint8_t byte = codes[((b * 4 + g) * NR + j) * 4 + i % 4];
            code = i < 16 ? (byte & 0x0F) : (byte >> 4);
          }
          dot += code * int32_t(xb[i]);
        }
        uint16_t h = scales[b * NR + j];
        acc[j] += float(dot) * (half_to_float(h) * dx[r * nb + b]);
      }
    }
    for (int j = 0; j < nvalid; j++) y[r * N + j] = acc[j];
  }
}

#ifdef HEARTH_VNNI
template <int QT, int MR>
inline void packed_tile_vnni(const uint8_t* codes, const uint16_t* scales, int64_t K, const int8_t* xq,
                             const int32_t* c0, const float* dx, float* y, int64_t N, int64_t nvalid) {
  const int64_t nb = K / 32;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512 acc[MR][2];
  for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  auto xword = [&](int r, int64_t at) {
    int32_t v;
    std::memcpy(&v, xq + r * K + at, 4);
    return _mm512_set1_epi32(v);
  };
  for (int64_t b = 0; b < nb; b++) {
    __m512i dot[MR][2];
    for (int r = 0; r < MR; r++) dot[r][0] = dot[r][1] = _mm512_set1_epi32(c0[r * nb + b]);
    if constexpr (QT == Q8_0) {
      const uint8_t* cb = codes + b * 8 * NR * 4;
#pragma GCC unroll 8
      for (int g = 0; g < 8; g++) {
        const __m512i w0 = _mm512_loadu_si512((const void*)(cb + g * NR * 4));
        const __m512i w1 = _mm512_loadu_si512((const void*)(cb + g * NR * 4 + 64));
        for (int r = 0; r < MR; r++) {
          const __m512i xb = xword(r, b * 32 + 4 * g);
          dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], w0, xb);
          dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], w1, xb);
        }
      }
    } else {
      const uint8_t* cb = codes + b * 4 * NR * 4;
#pragma GCC unroll 4
      for (int g = 0; g < 4; g++) {
        const __m512i v0 = _mm512_loadu_si512((const void*)(cb + g * NR * 4));
        const __m512i v1 = _mm512_loadu_si512((const void*)(cb + g * NR * 4 + 64));
        const __m512i lo0 = _mm512_and_si512(v0, nib), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), nib);
        const __m512i lo1 = _mm512_and_si512(v1, nib), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), nib);
        for (int r = 0; r < MR; r++) {
          const __m512i xl = xword(r, b * 32 + 4 * g), xh = xword(r, b * 32 + 16 + 4 * g);
          dot[r][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[r][0], lo0, xl), hi0, xh);
          dot[r][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[r][1], lo1, xl), hi1, xh);
        }
      }
    }
    const __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(scales + b * NR)));
    const __m512 s1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(scales + b * NR + 16)));
    for (int r = 0; r < MR; r++) {
      const __m512 d = _mm512_set1_ps(dx[r * nb + b]);
      acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][0]), _mm512_mul_ps(s0, d), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][1]), _mm512_mul_ps(s1, d), acc[r][1]);
    }
  }
  const __mmask16 k0 = nvalid >= 16 ? 0xFFFF : (__mmask16)((1u << nvalid) - 1);
  const __mmask16 k1 = nvalid >= 32 ? 0xFFFF : nvalid <= 16 ? 0 : (__mmask16)((1u << (nvalid - 16)) - 1);
  for (int r = 0; r < MR; r++) {
    _mm512_mask_storeu_ps(y + r * N, k0, acc[r][0]);
    _mm512_mask_storeu_ps(y + r * N + 16, k1, acc[r][1]);
  }
}
#endif

template <int QT>
void packed_tile(bool portable, int MR, const uint8_t* codes, const uint16_t* scales, int64_t K, const int8_t* xq,
                 const int32_t* c0, const float* dx, float* y, int64_t N, int64_t nvalid) {
#ifdef HEARTH_VNNI
  if (!portable) {
    switch (MR) {
      case 5: return packed_tile_vnni<QT, 5>(codes, scales, K, xq, c0, dx, y, N, nvalid);
      case 4: return packed_tile_vnni<QT, 4>(codes, scales, K, xq, c0, dx, y, N, nvalid);
      case 3: return packed_tile_vnni<QT, 3>(codes, scales, K, xq, c0, dx, y, N, nvalid);
      case 2: return packed_tile_vnni<QT, 2>(codes, scales, K, xq, c0, dx, y, N, nvalid);
      default: return packed_tile_vnni<QT, 1>(codes, scales, K, xq, c0, dx, y, N, nvalid);
    }
  }
#endif
  packed_tile_generic<QT>(MR, codes, scales, K, xq, c0, dx, y, N, nvalid);
}

// y [M, N] = x [M, K] W^T, W packed; x rounded to int8 per 32 values (llama.cpp's numerics)
void packed_matmul(uintptr_t x_, uintptr_t codes_, uintptr_t scales_, uintptr_t y_, int64_t M, int64_t N, int64_t K,
                   int qtype, bool portable, int threads) {
  if (qtype != Q8_0 && qtype != Q4_0) throw std::invalid_argument("packed_matmul: Q8_0 and Q4_0 only");
  QuantizedActivations a;
  quantize_activations((const float*)x_, M, K, a, threads);
  std::vector<int32_t> c0;
  std::vector<float> dx;
  packed_terms(a, M, K, qtype == Q8_0 ? 128 : 8, c0, dx);
  const uint8_t* codes = (const uint8_t*)codes_;
  const uint16_t* scales = (const uint16_t*)scales_;
  float* y = (float*)y_;
  const int64_t tiles = (N + NR - 1) / NR, nb = K / 32, tile_bytes = packed_code_bytes(qtype, K);
  parallel_ranges(tiles, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      const int64_t n0 = t * NR, rows = std::min<int64_t>(NR, N - n0);
      for (int64_t m = 0; m < M; m += PACKED_MR) {
        const int mr = (int)std::min<int64_t>(PACKED_MR, M - m);
        if (qtype == Q8_0)
          packed_tile<Q8_0>(portable, mr, codes + t * tile_bytes, scales + t * nb * NR, K, a.q.data() + m * K,
                            c0.data() + m * nb, dx.data() + m * nb, y + m * N + n0, N, rows);
        else
          packed_tile<Q4_0>(portable, mr, codes + t * tile_bytes, scales + t * nb * NR, K, a.q.data() + m * K,
                            c0.data() + m * nb, dx.data() + m * nb, y + m * N + n0, N, rows);
      }
    }
  });
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
  m.def("gemv", &gemv, "y = x W^T, fp32 activations (small M)", nogil);
  m.def("gemm_q8", &gemm_q8, "y = x W^T, activations quantized to int8 per 32 (large M)", nogil);
  m.def("dequantize_rows", &dequantize_rows, "W as fp32", nogil);
  m.def("repack", &repack, "Q8_0 / Q4_0 blocks -> the packed layout", nogil);
  m.def("packed_matmul", &packed_matmul, "y = x W^T, W packed, x rounded to int8 per 32", nogil);
  // for hearth/backend/cpu_kernels.cpp's decode_layers, which calls it between its own kernels
  m.def("packed_matmul_address", [] { return reinterpret_cast<uintptr_t>(&packed_matmul); });
  m.def("block_values", &block_values);
  m.def("has_avx512", &has_avx512);
  m.def("has_vnni", &has_vnni);
}
