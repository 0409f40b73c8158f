// The 32-value codebook formats (IQ4_NL, MXFP4) repacked once at load into groups of 8 weight rows
// (AVX2 builds). In place, each row pays per 32-value block a horizontal step: its products summed
// in one vector, converted, scaled by its own d and added (and a horizontal sum per row at the end).
// In groups, each 32-bit lane of a vector holds 4 indices of one of the 8 rows, so that one maddubs
// multiplies 4 values of every row by the same 4 activations, broadcast: each lane sums one row's
// products, and a block costs one convert and one multiply-add for all 8 rows (llama.cpp's CPU
// repacking of IQ4_NL does the same for its AVX2 GEMV).
//
// Layout, per group g of rows 8g..8g+7 (rows past N: zeros) and block b, ROWS8_BYTES bytes:
//   d float32[8], the rows' scales (MXFP4's e8m0 halved: the table holds the e2m1 values doubled);
//   codes uint8[4][32]: chunk k, byte 4r + t: row r's index of value 8k + t in its low nibble, of
//   value 8k + 4 + t in its high one.
#include "avx2_blocks.h"

namespace hearth {

namespace {

constexpr int64_t ROWS8_BYTES = 32 + 128;

const int8_t* rows8_table(int qtype) {
  if (qtype == IQ4_NL) return IQ4_NL_VALUES;
  if (qtype == MXFP4) return MXFP4_VALUES;
  throw std::invalid_argument("rows of 8: IQ4_NL or MXFP4 only, got type " + std::to_string(qtype));
}

// a GGUF block's scale and 4-bit index of value v (both formats: indices as Q4_0's nibbles)
inline float block_scale(const uint8_t* b, int qtype) { return qtype == IQ4_NL ? h2f(b) : e8m0_half(b[0]); }
inline int block_index(const uint8_t* b, int qtype, int v) {
  const uint8_t* qs = b + (qtype == IQ4_NL ? 2 : 1);
  return v < 16 ? qs[v] & 0x0F : qs[v - 16] >> 4;
}

#ifdef __AVX2__
// MR activation rows against one group: out[r][i] = row 8g + i . activation row m0 + r
template <int MR>
void rows8_dot(const uint8_t* group, int64_t nb, __m256i table, const QuantizedActivations& a, int64_t m0,
               int64_t K, float out[][8]) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MR];
  for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* p = group + b * ROWS8_BYTES;
    if constexpr (MR == 1) _mm_prefetch((const char*)(p + INT8_PREFETCH), _MM_HINT_T0);
    __m256i sum[MR];
    for (int r = 0; r < MR; r++) sum[r] = _mm256_setzero_si256();
    for (int k = 0; k < 4; k++) {
      const __m256i raw = _mm256_loadu_si256((const __m256i*)(p + 32 + 32 * k));
      const __m256i wl = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, low));
      const __m256i wh = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
      const __m256i al = _mm256_sign_epi8(wl, wl), ah = _mm256_sign_epi8(wh, wh);  // |w|; w's sign onto x
      for (int r = 0; r < MR; r++) {
        const int8_t* xb = a.q.data() + (m0 + r) * K + b * 32 + 8 * k;
        int32_t xl, xh;
        std::memcpy(&xl, xb, 4);
        std::memcpy(&xh, xb + 4, 4);
        // (a maddubs pair sums to at most 2 x 127 x 127: two of them would overflow int16, so each is widened)
        const __m256i pl = _mm256_maddubs_epi16(al, _mm256_sign_epi8(_mm256_set1_epi32(xl), wl));
        const __m256i ph = _mm256_maddubs_epi16(ah, _mm256_sign_epi8(_mm256_set1_epi32(xh), wh));
        sum[r] = _mm256_add_epi32(sum[r], _mm256_add_epi32(_mm256_madd_epi16(pl, ones), _mm256_madd_epi16(ph, ones)));
      }
    }
    const __m256 d = _mm256_loadu_ps((const float*)p);
    for (int r = 0; r < MR; r++)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_mul_ps(d, _mm256_set1_ps(a.d[(m0 + r) * nb + b])), acc[r]);
  }
  for (int r = 0; r < MR; r++) _mm256_storeu_ps(out[r], acc[r]);
}
#endif  // __AVX2__

}  // namespace

int64_t rows8_bytes(int64_t K) { return K / 32 * ROWS8_BYTES; }

// GGUF blocks uint8 [N, K / 32 * block bytes] -> groups uint8 [ceil(N / 8), rows8_bytes(K)]
void rows8_repack(uintptr_t w_, uintptr_t out_, int64_t N, int64_t K, int qtype, int threads) {
  rows8_table(qtype);
  const uint8_t* w = (const uint8_t*)w_;
  uint8_t* out = (uint8_t*)out_;
  const int64_t nb = K / 32, row_bytes = nb * block_bytes(qtype);
  parallel_ranges((N + 7) / 8, threads, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++)
      for (int64_t b = 0; b < nb; b++) {
        uint8_t* p = out + (g * nb + b) * ROWS8_BYTES;
        std::memset(p, 0, ROWS8_BYTES);
        for (int i = 0; i < 8 && 8 * g + i < N; i++) {
          const uint8_t* blk = w + (8 * g + i) * row_bytes + b * block_bytes(qtype);
          const float d = block_scale(blk, qtype);
          std::memcpy(p + 4 * i, &d, 4);
          for (int k = 0; k < 4; k++)
            for (int t = 0; t < 4; t++)
              p[32 + 32 * k + 4 * i + t] = uint8_t(block_index(blk, qtype, 8 * k + t) |
                                                   (block_index(blk, qtype, 8 * k + 4 + t) << 4));
        }
      }
  });
}

// groups -> fp32 [8 x groups, K] (rows past N: zeros), bit-exact as dequantize_rows of the blocks
void rows8_dequantize(uintptr_t w_, uintptr_t out_, int64_t groups, int64_t K, int qtype, int threads) {
  const int8_t* table = rows8_table(qtype);
  const uint8_t* w = (const uint8_t*)w_;
  float* out = (float*)out_;
  const int64_t nb = K / 32;
  parallel_ranges(groups, threads, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++)
      for (int64_t b = 0; b < nb; b++) {
        const uint8_t* p = w + (g * nb + b) * ROWS8_BYTES;
        for (int i = 0; i < 8; i++) {
          float d;
          std::memcpy(&d, p + 4 * i, 4);
          for (int v = 0; v < 32; v++) {
            const uint8_t byte = p[32 + 32 * (v / 8) + 4 * i + v % 4];
            out[(8 * g + i) * K + 32 * b + v] = d * float(table[v % 8 < 4 ? byte & 0x0F : byte >> 4]);
          }
        }
      }
  });
}

// y [M, N] = x [M, K] W^T, W in groups of 8 rows; x rounded to int8 per 32 values (q8_0). AVX2 builds only.
void rows8_matmul(uintptr_t x_, uintptr_t w_, uintptr_t y_, int64_t M, int64_t N, int64_t K, int qtype, int threads) {
#ifdef __AVX2__
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)rows8_table(qtype)));
  QuantizedActivations a;
  quantize_activations((const float*)x_, M, K, a, threads, 32, false);
  const uint8_t* w = (const uint8_t*)w_;
  float* y = (float*)y_;
  const int64_t nb = K / 32, group_bytes = rows8_bytes(K);
  parallel_ranges((N + 7) / 8, threads, 2, [&](int64_t g0, int64_t g1) {
    alignas(32) float out[4][8];
    for (int64_t g = g0; g < g1; g++)
      for (int64_t m = 0; m < M; m += 4) {
        const int mr = (int)std::min<int64_t>(4, M - m);
        const uint8_t* group = w + g * group_bytes;
        switch (mr) {
          case 4: rows8_dot<4>(group, nb, table, a, m, K, out); break;
          case 3: rows8_dot<3>(group, nb, table, a, m, K, out); break;
          case 2: rows8_dot<2>(group, nb, table, a, m, K, out); break;
          default: rows8_dot<1>(group, nb, table, a, m, K, out);
        }
        const int rows = (int)std::min<int64_t>(8, N - 8 * g);
        for (int r = 0; r < mr; r++)
          for (int i = 0; i < rows; i++) y[(m + r) * N + 8 * g + i] = out[r][i];
      }
  });
#else
  throw std::invalid_argument("rows8_matmul: an AVX2 build only");
#endif
}

}  // namespace hearth
