// Activations rounded to int8 per block of the weight's format (llama.cpp's q8_K / q8_0).
#include "qmatmul.h"

namespace hearth {
namespace {

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

}  // namespace

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

}  // namespace hearth
