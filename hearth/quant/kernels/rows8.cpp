// The 32-value formats IQ4_NL, MXFP4, Q4_0, Q4_1 and Q8_0 repacked once at load into groups of 8
// weight rows (AVX2 builds). In place, each row pays per 32-value block a horizontal step: its products summed
// in one vector, converted, scaled by its own d and added (and a horizontal sum per row at the end).
// In groups, each 32-bit lane of a vector holds 4 indices of one of the 8 rows, so that one maddubs
// multiplies 4 values of every row by the same 4 activations, broadcast: each lane sums one row's
// products, and a block costs one convert and one multiply-add for all 8 rows (llama.cpp's CPU
// repacking of IQ4_NL does the same for its AVX2 GEMV).
//
// Layout, per group g of rows 8g..8g+7 (rows past N: zeros) and block b, rows8_group_bytes(qtype) bytes:
//   d float16[8], the rows' scales as the blocks hold them (MXFP4: float32[8], its e8m0 halved, which
//   float16 cannot hold: the table holds the e2m1 values doubled);
//   Q4_1 only: m float16[8], the rows' minimums (w = d q + m; Q4_0's offset is -8 d, computed);
//   codes uint8[4][32]: chunk k, byte 4r + t: row r's code (IQ4_NL, MXFP4: its index into the
//   format's 16 values; Q4_0, Q4_1: its unsigned value) of value 8k + t in its low nibble, of value
//   8k + 4 + t in its high one; Q8_0: int8 [8][32], chunk k, byte 4r + t: row r's code of value 4k + t.
#include "avx2_blocks.h"

namespace hearth {

namespace {

bool rows8_format(int qtype) { return qtype == IQ4_NL || qtype == MXFP4 || qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0; }

// bytes of a group's terms before its codes: the scales (float16, MXFP4's float32), and Q4_1's minimums;
// but for MXFP4 as many bytes a row as its GGUF blocks hold
constexpr int64_t rows8_terms(int qtype) { return qtype == Q4_1 || qtype == MXFP4 ? 32 : 16; }

// the terms, then the codes: 4 bits (Q8_0: 8) for 8 rows x 32 values
int64_t rows8_group_bytes(int qtype) {
  if (!rows8_format(qtype)) throw std::invalid_argument("rows of 8: IQ4_NL, MXFP4, Q4_0, Q4_1 or Q8_0, got type " + std::to_string(qtype));
  return rows8_terms(qtype) + (qtype == Q8_0 ? 256 : 128);
}

// the 16 values an index stands for (IQ4_NL, MXFP4), or nullptr: the code is the value (Q4_0, Q4_1, Q8_0)
const int8_t* rows8_table(int qtype) { return qtype == IQ4_NL ? IQ4_NL_VALUES : qtype == MXFP4 ? MXFP4_VALUES : nullptr; }

// a GGUF block's 4-bit code of value v (codes as Q4_0's nibbles)
inline int block_index(const uint8_t* b, int qtype, int v) {
  if (qtype == Q8_0) return b[2 + v];  // the int8 code's byte
  const uint8_t* qs = b + (qtype == MXFP4 ? 1 : qtype == Q4_1 ? 4 : 2);
  return v < 16 ? qs[v] & 0x0F : qs[v - 16] >> 4;
}
// where value v's code sits in a group's codes (terms excluded), for row i: Q8_0's byte, or the byte
// of a 4-bit code (in its high nibble for v % 8 >= 4)
inline int code_byte(int qtype, int i, int v) { return qtype == Q8_0 ? 32 * (v / 4) + 4 * i + v % 4 : 32 * (v / 8) + 4 * i + v % 4; }
inline int group_code(const uint8_t* codes, int qtype, int i, int v) {
  const uint8_t byte = codes[code_byte(qtype, i, v)];
  return qtype == Q8_0 ? byte : v % 8 < 4 ? byte & 0x0F : byte >> 4;
}

// MXFP4's e8m0 exponent back from e8m0_half(e)
inline uint8_t e8m0_of(float half_scale) {
  uint32_t x;
  std::memcpy(&x, &half_scale, 4);
  return x >= (1u << 23) ? uint8_t((x >> 23) + 1) : uint8_t(__builtin_ctz(x) - 21);
}

#ifdef __AVX2__
// The products of one 4-byte step of 8 rows' codes w with 4 activations x (broadcast), per row's lane:
// signed codes (a table's values) through |w| and w's sign moved onto x; unsigned ones (Q4_0, Q4_1)
// as they are. Summed as int16 pairs by maddubs, widened to int32 (two pairs of 127 x 127 would
// overflow int16).
template <bool SIGNED>
inline __m256i step_dot(__m256i w, __m256i abs_w, int32_t x) {
  const __m256i ones = _mm256_set1_epi16(1), xs = _mm256_set1_epi32(x);
  if constexpr (SIGNED) return _mm256_madd_epi16(_mm256_maddubs_epi16(abs_w, _mm256_sign_epi8(xs, w)), ones);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, xs), ones);
}

// MR activation rows against one group: out[r][i] = row 8g + i . activation row m0 + r
template <int QT, int MR>
void rows8_dot(const uint8_t* group, int64_t nb, const QuantizedActivations& a, int64_t m0, int64_t K,
               float out[][8]) {
  constexpr bool SIGNED = QT == IQ4_NL || QT == MXFP4 || QT == Q8_0, MIN = QT == Q4_1;
  constexpr int64_t TERMS = rows8_terms(QT), BYTES = TERMS + (QT == Q8_0 ? 256 : 128);  // (rows8_group_bytes)
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i table = rows8_table(QT) ? _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)rows8_table(QT)))
                               : _mm256_setzero_si256();
  __m256 acc[MR];
  for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* p = group + b * BYTES;
    if constexpr (MR == 1)  // decode: the groups stream from DRAM, so ask for each line ahead
      for (int64_t line = 0; line < BYTES; line += 64) _mm_prefetch((const char*)(p + INT8_PREFETCH + line), _MM_HINT_T0);
    __m256i sum[MR];
    for (int r = 0; r < MR; r++) sum[r] = _mm256_setzero_si256();
    if constexpr (QT == Q8_0) {  // 4 int8 codes of each row per step, 8 steps
      for (int k = 0; k < 8; k++) {
        const __m256i w = _mm256_loadu_si256((const __m256i*)(p + TERMS + 32 * k)), abs_w = _mm256_sign_epi8(w, w);
        for (int r = 0; r < MR; r++) {
          int32_t x;
          std::memcpy(&x, a.q.data() + (m0 + r) * K + b * 32 + 4 * k, 4);
          sum[r] = _mm256_add_epi32(sum[r], step_dot<true>(w, abs_w, x));
        }
      }
    } else for (int k = 0; k < 4; k++) {
      const __m256i raw = _mm256_loadu_si256((const __m256i*)(p + TERMS + 32 * k));
      __m256i wl = _mm256_and_si256(raw, low), wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      if constexpr (SIGNED) wl = _mm256_shuffle_epi8(table, wl), wh = _mm256_shuffle_epi8(table, wh);  // (the tables')
      const __m256i al = SIGNED ? _mm256_sign_epi8(wl, wl) : wl, ah = SIGNED ? _mm256_sign_epi8(wh, wh) : wh;
      for (int r = 0; r < MR; r++) {
        const int8_t* xb = a.q.data() + (m0 + r) * K + b * 32 + 8 * k;
        int32_t xl, xh;
        std::memcpy(&xl, xb, 4);
        std::memcpy(&xh, xb + 4, 4);
        sum[r] = _mm256_add_epi32(sum[r], _mm256_add_epi32(step_dot<SIGNED>(wl, al, xl), step_dot<SIGNED>(wh, ah, xh)));
      }
    }
    const __m256 d = QT == MXFP4 ? _mm256_loadu_ps((const float*)p) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    // the offset per row: Q4_1's minimum m, Q4_0's -8 d (w = d q + offset), times the block's d_x sum(x_q)
    const __m256 offset = MIN ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16))) : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
    for (int r = 0; r < MR; r++) {
      const int64_t at = (m0 + r) * nb + b;
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_mul_ps(d, _mm256_set1_ps(a.d[at])), acc[r]);
      if constexpr (!SIGNED) acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(a.dsum[at]), acc[r]);
    }
  }
  for (int r = 0; r < MR; r++) _mm256_storeu_ps(out[r], acc[r]);
}

template <int QT>
void rows8_groups(const uint8_t* w, int64_t g0, int64_t g1, const QuantizedActivations& a, float* y, int64_t M,
                  int64_t N, int64_t K) {
  const int64_t nb = K / 32, group_bytes = nb * rows8_group_bytes(QT);
  alignas(32) float out[4][8];
  for (int64_t g = g0; g < g1; g++)
    for (int64_t m = 0; m < M; m += 4) {
      const int mr = (int)std::min<int64_t>(4, M - m);
      const uint8_t* group = w + g * group_bytes;
      switch (mr) {
        case 4: rows8_dot<QT, 4>(group, nb, a, m, K, out); break;
        case 3: rows8_dot<QT, 3>(group, nb, a, m, K, out); break;
        case 2: rows8_dot<QT, 2>(group, nb, a, m, K, out); break;
        default: rows8_dot<QT, 1>(group, nb, a, m, K, out);
      }
      const int rows = (int)std::min<int64_t>(8, N - 8 * g);
      for (int r = 0; r < mr; r++)
        for (int i = 0; i < rows; i++) y[(m + r) * N + 8 * g + i] = out[r][i];
    }
}
#endif  // __AVX2__

}  // namespace

int64_t rows8_bytes(int qtype, int64_t K) { return K / 32 * rows8_group_bytes(qtype); }

// GGUF blocks uint8 [N, K / 32 * block bytes] -> groups uint8 [ceil(N / 8), rows8_bytes(K)]
void rows8_repack(uintptr_t w_, uintptr_t out_, int64_t N, int64_t K, int qtype, int threads) {
  const int64_t bytes = rows8_group_bytes(qtype), terms = rows8_terms(qtype);
  const uint8_t* w = (const uint8_t*)w_;
  uint8_t* out = (uint8_t*)out_;
  const int64_t nb = K / 32, row_bytes = nb * block_bytes(qtype);
  parallel_ranges((N + 7) / 8, threads, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++)
      for (int64_t b = 0; b < nb; b++) {
        uint8_t* p = out + (g * nb + b) * bytes;
        std::memset(p, 0, bytes);
        for (int i = 0; i < 8 && 8 * g + i < N; i++) {
          const uint8_t* blk = w + (8 * g + i) * row_bytes + b * block_bytes(qtype);
          if (qtype == MXFP4) {
            const float d = e8m0_half(blk[0]);
            std::memcpy(p + 4 * i, &d, 4);
          } else {  // d's float16 bits (Q4_1: and m's, at 16)
            std::memcpy(p + 2 * i, blk, 2);
            if (qtype == Q4_1) std::memcpy(p + 16 + 2 * i, blk + 2, 2);
          }
          for (int v = 0; v < 32; v++)  // Q8_0: its byte; else a nibble (or'ed into a zeroed byte)
            p[terms + code_byte(qtype, i, v)] |= uint8_t(block_index(blk, qtype, v) << (qtype != Q8_0 && v % 8 >= 4 ? 4 : 0));
        }
      }
  });
}

// groups -> the GGUF blocks they were repacked from, uint8 [N, K / 32 * block bytes], byte for byte (for
// what reads blocks as stored: activation sparsity's column layout)
void rows8_blocks(uintptr_t w_, uintptr_t out_, int64_t N, int64_t K, int qtype, int threads) {
  const int64_t bytes = rows8_group_bytes(qtype), terms = rows8_terms(qtype), nb = K / 32, bb = block_bytes(qtype);
  const uint8_t* w = (const uint8_t*)w_;
  uint8_t* out = (uint8_t*)out_;
  parallel_ranges(N, threads, 8, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
      for (int64_t b = 0; b < nb; b++) {
        const uint8_t* p = w + ((n / 8) * nb + b) * bytes;
        const int i = int(n % 8);
        uint8_t* blk = out + n * nb * bb + b * bb;
        uint8_t* qs = blk + 2;
        if (qtype == MXFP4) {
          float d;
          std::memcpy(&d, p + 4 * i, 4);
          blk[0] = e8m0_of(d), qs = blk + 1;
        } else {
          std::memcpy(blk, p + 2 * i, 2);
          if (qtype == Q4_1) std::memcpy(blk + 2, p + 16 + 2 * i, 2), qs = blk + 4;
        }
        if (qtype == Q8_0)
          for (int v = 0; v < 32; v++) qs[v] = uint8_t(group_code(p + terms, qtype, i, v));
        else
          for (int v = 0; v < 16; v++)
            qs[v] = uint8_t(group_code(p + terms, qtype, i, v) | (group_code(p + terms, qtype, i, v + 16) << 4));
      }
  });
}

// y [M, N] = x [M, K] W^T, W in groups of 8 rows; x rounded to int8 per 32 values (q8_0). AVX2 builds only.
void rows8_matmul(uintptr_t x_, uintptr_t w_, uintptr_t y_, int64_t M, int64_t N, int64_t K, int qtype, int threads) {
#ifdef __AVX2__
  rows8_group_bytes(qtype);
  QuantizedActivations a;
  quantize_activations((const float*)x_, M, K, a, threads, 32, false);
  const uint8_t* w = (const uint8_t*)w_;
  float* y = (float*)y_;
  parallel_ranges((N + 7) / 8, threads, 2, [&](int64_t g0, int64_t g1) {
    switch (qtype) {
      case IQ4_NL: return rows8_groups<IQ4_NL>(w, g0, g1, a, y, M, N, K);
      case MXFP4: return rows8_groups<MXFP4>(w, g0, g1, a, y, M, N, K);
      case Q4_0: return rows8_groups<Q4_0>(w, g0, g1, a, y, M, N, K);
      case Q8_0: return rows8_groups<Q8_0>(w, g0, g1, a, y, M, N, K);
      default: return rows8_groups<Q4_1>(w, g0, g1, a, y, M, N, K);
    }
  });
#else
  throw std::invalid_argument("rows8_matmul: an AVX2 build only");
#endif
}

}  // namespace hearth
