// The 32-value formats IQ4_NL, MXFP4, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, IQ4_XS (IQ4_NL's codes with a 6-bit scale
// per 32 values under one float16 per 256), Q4_K (Q4_1's codes, a 6-bit scale and minimum per 32
// values under two float16 per 256) and Q5_K (Q4_K with a fifth bit per value), repacked once at load
// into groups of 8 weight rows (AVX2 builds without VNNI tiles). In place, each row pays per 32-value block a horizontal step: its products summed
// in one vector, converted, scaled by its own d and added (and a horizontal sum per row at the end).
// In groups, each 32-bit lane of a vector holds 4 indices of one of the 8 rows, so that one maddubs
// multiplies 4 values of every row by the same 4 activations, broadcast: each lane sums one row's
// products, and a block costs one convert and one multiply-add for all 8 rows (llama.cpp's CPU
// repacking of IQ4_NL does the same for its AVX2 GEMV).
//
// Layout, per group g of rows 8g..8g+7 (rows past N: zeros) and block b, rows8_group_bytes(qtype) bytes:
//   d float16[8], the rows' scales as the blocks hold them (MXFP4: its e8m0 exponent bytes [8], read as
//   their power of 2 halved: the table holds the e2m1 values doubled);
//   Q4_1, Q5_1 only: m float16[8], the rows' minimums (w = d q + m; Q4_0's offset is -8 d, Q5_0's -16 d);
//   Q5_0, Q5_1 only: the rows' fifth bits, uint32 [8] (row r's at 4r: bit v, value v's), or'ed into the
//   codes as bit 4;
//   codes uint8[4][32]: chunk k, byte 4r + t: row r's code (IQ4_NL, MXFP4: its index into the
//   format's 16 values; Q4_0, Q4_1: its unsigned value) of value 8k + t in its low nibble, of value
//   8k + 4 + t in its high one; Q8_0: int8 [8][32], chunk k, byte 4r + t: row r's code of value 4k + t.
// IQ4_XS, per group and 256-value block: d float16[8]; the 8 sub-blocks' scales less 32, int8 [8][8]
// (sub-block j's of row r at 8j + r); then each sub-block's codes as an IQ4_NL block's.
// Q4_K, per group and 256-value block: d float16[8], dmin float16[8]; the sub-blocks' 6-bit scales,
// uint8 [8][8], then their minimums, uint8 [8][8]; then each sub-block's codes as a Q4_1 block's
// (w = d scale q - dmin minimum). Q5_K: the same, with before the codes each sub-block's fifth bits,
// uint32 [8] (row r's at 4r: bit v, value v's), or'ed into the codes as bit 4.
#include "avx2_blocks.h"

namespace hearth {

namespace {

bool rows8_format(int qtype) {
  return qtype == IQ4_NL || qtype == MXFP4 || qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q5_1 ||
         qtype == Q8_0 || qtype == IQ4_XS || qtype == Q4_K || qtype == Q5_K;
}

// bytes of a group's terms before its codes: the scales (float16, MXFP4's exponent bytes), and Q4_1's
// minimums (IQ4_XS, Q4_K: and the sub-blocks' scales and minimums)
constexpr int64_t rows8_terms(int qtype) {
  return qtype == Q5_K ? 32 + 128 + 256 : qtype == Q4_K ? 32 + 128 : qtype == IQ4_XS ? 16 + 64 : qtype == Q5_1 ? 32 + 32
       : qtype == Q5_0 ? 16 + 32 : qtype == Q4_1 ? 32 : qtype == MXFP4 ? 8 : 16;
}
constexpr bool rows8_super(int qtype) { return qtype == IQ4_XS || qtype == Q4_K || qtype == Q5_K; }  // 256-value blocks
constexpr int64_t rows8_block(int qtype) { return rows8_super(qtype) ? 256 : 32; }  // values of a GGUF block
// a 256-value block's sub-blocks: read as blocks of this 32-value format (their codes' layout and signs)
constexpr int sub_block_format(int qtype) { return qtype == IQ4_XS ? IQ4_NL : qtype == Q5_K ? Q5_1 : Q4_1; }

// the terms, then the codes: 4 bits (Q8_0: 8) for 8 rows x 32 values (IQ4_XS: x 256) of a GGUF block
int64_t rows8_group_bytes(int qtype) {
  if (!rows8_format(qtype))
    throw std::invalid_argument("rows of 8: IQ4_NL, IQ4_XS, MXFP4, Q4_0, Q4_1, Q4_K, Q5_K or Q8_0, got type " + std::to_string(qtype));
  return rows8_terms(qtype) + (qtype == Q8_0 ? 256 : rows8_super(qtype) ? 8 * 128 : 128);
}

// the 16 values an index stands for (IQ4_NL, MXFP4), or nullptr: the code is the value (Q4_0, Q4_1, Q8_0)
const int8_t* rows8_table(int qtype) { return qtype == IQ4_NL ? IQ4_NL_VALUES : qtype == MXFP4 ? MXFP4_VALUES : nullptr; }

// the 4-bit code of value v of 32 as Q4_0's nibbles `qs` hold them
inline int nibble_code(const uint8_t* qs, int v) { return v < 16 ? qs[v] & 0x0F : qs[v - 16] >> 4; }
// a 32-value GGUF block's code of value v (Q8_0: its int8 code's byte)
inline int block_index(const uint8_t* b, int qtype, int v) {
  if (qtype == Q8_0) return b[2 + v];
  return nibble_code(b + (qtype == MXFP4 ? 1 : qtype == Q4_1 ? 4 : qtype == Q5_0 ? 6 : qtype == Q5_1 ? 8 : 2), v);
}
// where value v's code sits in a group's codes (terms excluded), for row i: Q8_0's byte, or the byte
// of a 4-bit code (in its high nibble for v % 8 >= 4)
inline int code_byte(int qtype, int i, int v) { return qtype == Q8_0 ? 32 * (v / 4) + 4 * i + v % 4 : 32 * (v / 8) + 4 * i + v % 4; }
inline int group_code(const uint8_t* codes, int qtype, int i, int v) {
  const uint8_t byte = codes[code_byte(qtype, i, v)];
  return qtype == Q8_0 ? byte : v % 8 < 4 ? byte & 0x0F : byte >> 4;
}

#ifdef __AVX2__
// e8m0_half of 8 exponent bytes (2^(e - 128): a float's exponent field e - 1, but for e < 2 a subnormal)
inline __m256 e8m0_half8(const uint8_t* e) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)e));
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(v, _mm256_set1_epi32(1)), 23);
  const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), v);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), v)));
}

// With AVX-512 VNNI a table's signed values are looked up as unsigned bytes, value + 128 (the table's top
// bits flipped), which one vpdpbusd multiplies by 4 signed activations and sums into each row's lane; the
// block's 128 sum(x) comes off with the offset term, as Q4_0's 8 sum(x) does (the codes' zero point).
// IQ4_XS prefill on an AVX-512 EPYC, 2 threads: ~1.6x (three instructions a step fewer; measured before IQ4_XS
// moved to the VNNI tiles, as every format of these has since: the groups run there only when called directly).
#ifdef HEARTH_VNNI
constexpr bool UNSIGNED_TABLES = true;
#else
constexpr bool UNSIGNED_TABLES = false;
#endif

// The products of one 4-byte step of 8 rows' codes w with 4 activations x (broadcast), per row's lane:
// signed codes (a table's values, Q8_0's) through |w| and w's sign moved onto x; unsigned ones (Q4_0, Q4_1;
// the tables' with VNNI) as they are. Summed as int16 pairs by maddubs, widened to int32 (two pairs of 127 x
// 127 would overflow int16), or by vpdpbusd.
template <bool SIGNED>
inline __m256i step_dot(__m256i sum, __m256i w, __m256i abs_w, int32_t x) {
  const __m256i ones = _mm256_set1_epi16(1), xs = _mm256_set1_epi32(x);
  if constexpr (SIGNED) return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(abs_w, _mm256_sign_epi8(xs, w)), ones));
#ifdef HEARTH_VNNI
  return _mm256_dpbusd_epi32(sum, w, xs);
#else
  return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(w, xs), ones));
#endif
}

// Step k's fifth bits (Q5_*: `high`, lane r row r's 32 bits, bit v value v's) as bit 4 of the bytes of the
// step's low and high nibbles' values (8k + t, 8k + 4 + t in lane byte t): byte k of each lane spread
// over the lane's bytes, each byte's own bit picked
inline void fifth_bits(__m256i high, int k, __m256i& wl, __m256i& wh) {
  const __m256i spread = _mm256_shuffle_epi8(high, _mm256_add_epi8(
      _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12),
      _mm256_set1_epi8(char(k))));
  const __m256i bits_low = _mm256_set1_epi32(0x08040201), bits_high = _mm256_set1_epi32(int(0x80402010u));
  const __m256i bit4 = _mm256_set1_epi8(0x10);
  wl = _mm256_or_si256(wl, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bits_low), bits_low), bit4));
  wh = _mm256_or_si256(wh, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bits_high), bits_high), bit4));
}

// Step k of a 32-value block's codes (`codes`, a group's layout; Q5_*: `high_bits`, its fifth bits) as
// bytes: the 8 rows' values 8k + t (wl) and 8k + 4 + t (wh) in lane bytes t (a table's looked up)
template <int QT>
inline void step_codes(const uint8_t* codes, __m256i high_bits, __m256i table, int k, __m256i& wl, __m256i& wh) {
  constexpr bool TABLE = QT == IQ4_NL || QT == MXFP4, FIFTH = QT == Q5_0 || QT == Q5_1;
  const __m256i low = _mm256_set1_epi8(0x0F), raw = _mm256_loadu_si256((const __m256i*)(codes + 32 * k));
  wl = _mm256_and_si256(raw, low), wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
  if constexpr (TABLE) wl = _mm256_shuffle_epi8(table, wl), wh = _mm256_shuffle_epi8(table, wh);  // (the tables')
  if constexpr (FIFTH) fifth_bits(high_bits, k, wl, wh);
}

// The int32 products of one 32-value block's codes (`codes`, a group's layout; Q5_*: and `high`, its fifth
// bits; UNPACKED: the block's steps as rows8_unpack left them) of 8 rows with MR activation rows from m0,
// values x0.. of each: sum[r], lane i row i's
template <int QT, int MR, bool UNPACKED = false>
inline void block_sums(const uint8_t* codes, __m256i table, const QuantizedActivations& a, int64_t m0, int64_t K,
                       int64_t x0, __m256i sum[MR], const uint8_t* high = nullptr) {
  constexpr bool TABLE = QT == IQ4_NL || QT == MXFP4, FIFTH = QT == Q5_0 || QT == Q5_1;
  constexpr bool SIGNED = QT == Q8_0 || (TABLE && !UNSIGNED_TABLES);
  const __m256i high_bits = FIFTH && !UNPACKED ? _mm256_loadu_si256((const __m256i*)high) : _mm256_setzero_si256();
  for (int r = 0; r < MR; r++) sum[r] = _mm256_setzero_si256();
  if constexpr (QT == Q8_0) {  // 4 int8 codes of each row per step, 8 steps
    for (int k = 0; k < 8; k++) {
      const __m256i w = _mm256_loadu_si256((const __m256i*)(codes + 32 * k)), abs_w = _mm256_sign_epi8(w, w);
      for (int r = 0; r < MR; r++) {
        int32_t x;
        std::memcpy(&x, a.q.data() + (m0 + r) * K + x0 + 4 * k, 4);
        sum[r] = step_dot<true>(sum[r], w, abs_w, x);
      }
    }
  } else for (int k = 0; k < 4; k++) {
    __m256i wl, wh;
    if constexpr (UNPACKED)
      wl = _mm256_loadu_si256((const __m256i*)(codes + 64 * k)), wh = _mm256_loadu_si256((const __m256i*)(codes + 64 * k + 32));
    else
      step_codes<QT>(codes, high_bits, table, k, wl, wh);
    const __m256i al = SIGNED ? _mm256_sign_epi8(wl, wl) : wl, ah = SIGNED ? _mm256_sign_epi8(wh, wh) : wh;
    for (int r = 0; r < MR; r++) {
      const int8_t* xb = a.q.data() + (m0 + r) * K + x0 + 8 * k;
      int32_t xl, xh;
      std::memcpy(&xl, xb, 4);
      std::memcpy(&xh, xb + 4, 4);
      sum[r] = step_dot<SIGNED>(step_dot<SIGNED>(sum[r], wl, al, xl), wh, ah, xh);
    }
  }
}

// A 32-value block's codes unpacked (rows8_unpack): its 4 steps' low and high values, 32 bytes each
constexpr int64_t UNPACKED_BLOCK = 4 * 64;

// decode: the groups stream from DRAM, so ask for each line of the block ahead
template <int MR, int64_t BYTES>
inline void prefetch_block(const uint8_t* p) {
  if constexpr (MR == 1)
    for (int64_t line = 0; line < BYTES; line += 64) _mm_prefetch((const char*)(p + INT8_PREFETCH + line), _MM_HINT_T0);
}

inline __m256i table_of(int qtype) {  // (UNSIGNED_TABLES: value + 128)
  if (!rows8_table(qtype)) return _mm256_setzero_si256();
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)rows8_table(qtype)));
  return UNSIGNED_TABLES ? _mm256_xor_si256(table, _mm256_set1_epi8(char(0x80))) : table;
}

// MR activation rows against one group of a 32-value format: out[r][i] = row 8g + i . activation row m0 + r
template <int QT, int MR, bool UNPACKED>
void rows8_dot(const uint8_t* group, const uint8_t* unpacked, int64_t nb, const QuantizedActivations& a, int64_t m0,
               int64_t K, float out[][8]) {
  constexpr bool TABLE = QT == IQ4_NL || QT == MXFP4, MIN = QT == Q4_1 || QT == Q5_1;
  constexpr bool SIGNED = QT == Q8_0 || (TABLE && !UNSIGNED_TABLES);
  constexpr int64_t TERMS = rows8_terms(QT), BYTES = TERMS + (QT == Q8_0 ? 256 : 128);  // (rows8_group_bytes)
  constexpr float ZERO = TABLE ? -128.f : QT == Q5_0 ? -16.f : -8.f;  // the codes' offset in units of d
  constexpr bool FIFTH = QT == Q5_0 || QT == Q5_1;  // (their fifth bits just before the codes)
  const __m256i table = table_of(QT);
  __m256 acc[MR];
  for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* p = group + b * BYTES;
    prefetch_block<MR, BYTES>(p);
    __m256i sum[MR];
    block_sums<QT, MR, UNPACKED>(UNPACKED ? unpacked + b * UNPACKED_BLOCK : p + TERMS, table, a, m0, K, b * 32, sum,
                                 FIFTH ? p + TERMS - 32 : nullptr);
    const __m256 d = QT == MXFP4 ? e8m0_half8(p) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    // the offset per row: Q4_1's, Q5_1's minimum m, Q4_0's -8 d, Q5_0's -16 d, unsigned tables' -128 d
    // (w = d q + offset), times the block's d_x sum(x_q)
    const __m256 offset = MIN ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16))) : _mm256_mul_ps(d, _mm256_set1_ps(ZERO));
    for (int r = 0; r < MR; r++) {
      const int64_t at = (m0 + r) * nb + b;
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_mul_ps(d, _mm256_set1_ps(a.d[at])), acc[r]);
      if constexpr (!SIGNED) acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(a.dsum[at]), acc[r]);
    }
  }
  for (int r = 0; r < MR; r++) _mm256_storeu_ps(out[r], acc[r]);
}

// The same for the 256-value formats' groups (nb: their blocks): each sub-block a block of
// sub_block_format(QT) whose scale is d (6-bit scale - 32) (IQ4_XS) or d times its 6-bit scale and
// whose minimum is -dmin times its 6-bit minimum (Q4_K, Q5_K), both exact in float32
template <int QT, int MR, bool UNPACKED>
void rows8_dot_super(const uint8_t* group, const uint8_t* unpacked, int64_t nb, const QuantizedActivations& a,
                     int64_t m0, int64_t K, float out[][8]) {
  constexpr bool MIN = QT == Q4_K || QT == Q5_K;
  constexpr int SUB = sub_block_format(QT);
  constexpr int64_t CODES = rows8_terms(QT), BYTES = CODES + 8 * 128;  // (rows8_group_bytes)
  const __m256i table = table_of(SUB);
  const auto row_bytes = [](const uint8_t* at) {  // 8 rows' 6-bit numbers as float: Q4_K's unsigned, IQ4_XS's less 32
    const __m128i v = _mm_loadl_epi64((const __m128i*)at);
    return _mm256_cvtepi32_ps(MIN ? _mm256_cvtepu8_epi32(v) : _mm256_cvtepi8_epi32(v));
  };
  __m256 acc[MR];
  for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* p = group + b * BYTES;
    prefetch_block<MR, BYTES>(p);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    const __m256 dmin = MIN ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16))) : _mm256_setzero_ps();
    for (int j = 0; j < 8; j++) {
      __m256i sum[MR];
      block_sums<SUB, MR, UNPACKED>(UNPACKED ? unpacked + (8 * b + j) * UNPACKED_BLOCK : p + CODES + 128 * j, table, a,
                                    m0, K, b * 256 + 32 * j, sum, QT == Q5_K ? p + 160 + 32 * j : nullptr);
      const __m256 scale = _mm256_mul_ps(d, row_bytes(p + (MIN ? 32 : 16) + 8 * j));
      // -dmin times the minimum (Q4_K, Q5_K); IQ4_XS's unsigned table: -128 times the scale
      const __m256 offset = MIN ? _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, row_bytes(p + 96 + 8 * j)))
                                : _mm256_mul_ps(scale, _mm256_set1_ps(-128.f));
      for (int r = 0; r < MR; r++) {
        const int64_t at = (m0 + r) * nb * 8 + b * 8 + j;  // (activations quantized per 32 values)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_mul_ps(scale, _mm256_set1_ps(a.d[at])), acc[r]);
        if constexpr (MIN || UNSIGNED_TABLES) acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(a.dsum[at]), acc[r]);
      }
    }
  }
  for (int r = 0; r < MR; r++) _mm256_storeu_ps(out[r], acc[r]);
}

template <int QT, int MR, bool UNPACKED>
void group_dot(const uint8_t* group, const uint8_t* unpacked, int64_t nb, const QuantizedActivations& a, int64_t m0,
               int64_t K, float out[][8]) {
  if constexpr (rows8_super(QT)) rows8_dot_super<QT, MR, UNPACKED>(group, unpacked, nb, a, m0, K, out);
  else rows8_dot<QT, MR, UNPACKED>(group, unpacked, nb, a, m0, K, out);
}

// activation rows per pass over a group: 4 in AVX2's 16 vector registers; 8 in AVX-512's 32 (IQ4_XS prefill on
// an AVX-512 EPYC, 2 threads, 1.2x over 4, before it moved to the VNNI tiles)
#ifdef HEARTH_AVX512
constexpr int ROWS8_MR = 8;
#else
constexpr int ROWS8_MR = 4;
#endif

// A call of ROWS8_UNPACK_ROWS rows or more unpacks each group once (rows8_unpack) where spreading the fifth bits
// (Q5_0, Q5_1, Q5_K) costs each pass ~11 operations a step, a third of its dot products at 4 rows; the passes
// then load the bytes
constexpr int64_t ROWS8_UNPACK_ROWS = 4 * ROWS8_MR;
constexpr bool rows8_unpacks(int qtype) { return qtype != Q8_0; }

template <int QT, bool UNPACKED, int MR = ROWS8_MR>
void group_dot_mr(int mr, const uint8_t* group, const uint8_t* unpacked, int64_t nb, const QuantizedActivations& a,
                  int64_t m0, int64_t K, float out[][8]) {
  if constexpr (MR > 1)
    if (mr < MR) return group_dot_mr<QT, UNPACKED, MR - 1>(mr, group, unpacked, nb, a, m0, K, out);
  group_dot<QT, MR, UNPACKED>(group, unpacked, nb, a, m0, K, out);
}

// A group's codes as bytes, each 32-value block's steps (step_codes) one after the other, UNPACKED_BLOCK bytes
// a block (a 256-value format's: its 8 sub-blocks')
template <int QT>
void rows8_unpack(const uint8_t* group, int64_t nb, uint8_t* out) {
  constexpr int SUB = rows8_super(QT) ? sub_block_format(QT) : QT;
  constexpr bool FIFTH = SUB == Q5_0 || SUB == Q5_1;
  constexpr int64_t TERMS = rows8_terms(QT), BYTES = TERMS + (rows8_super(QT) ? 8 * 128 : 128);  // (rows8_group_bytes)
  const __m256i table = table_of(SUB);
  for (int64_t b = 0; b < nb; b++)
    for (int j = 0; j < (rows8_super(QT) ? 8 : 1); j++) {
      const uint8_t* p = group + b * BYTES;
      const uint8_t* codes = rows8_super(QT) ? p + TERMS + 128 * j : p + TERMS;
      const uint8_t* high = QT == Q5_K ? p + 160 + 32 * j : p + TERMS - 32;
      const __m256i high_bits = FIFTH ? _mm256_loadu_si256((const __m256i*)high) : _mm256_setzero_si256();
      uint8_t* to = out + ((rows8_super(QT) ? 8 : 1) * b + j) * UNPACKED_BLOCK;
      for (int k = 0; k < 4; k++) {
        __m256i wl, wh;
        step_codes<SUB>(codes, high_bits, table, k, wl, wh);
        _mm256_storeu_si256((__m256i*)(to + 64 * k), wl);
        _mm256_storeu_si256((__m256i*)(to + 64 * k + 32), wh);
      }
    }
}

template <int QT>
void rows8_groups(const uint8_t* w, int64_t g0, int64_t g1, const QuantizedActivations& a, float* y, int64_t M,
                  int64_t N, int64_t K) {
  const int64_t nb = K / rows8_block(QT), group_bytes = nb * rows8_group_bytes(QT);
  const bool unpack = rows8_unpacks(QT) && M >= ROWS8_UNPACK_ROWS;
  std::vector<uint8_t> unpacked(unpack ? K / 32 * UNPACKED_BLOCK : 0);
  alignas(32) float out[ROWS8_MR][8];
  for (int64_t g = g0; g < g1; g++) {
    const uint8_t* group = w + g * group_bytes;
    if (unpack) rows8_unpack<QT>(group, nb, unpacked.data());
    for (int64_t m = 0; m < M; m += ROWS8_MR) {
      const int mr = (int)std::min<int64_t>(ROWS8_MR, M - m);
      if (unpack) group_dot_mr<QT, true>(mr, group, unpacked.data(), nb, a, m, K, out);
      else group_dot_mr<QT, false>(mr, group, nullptr, nb, a, m, K, out);
      const int rows = (int)std::min<int64_t>(8, N - 8 * g);
      for (int r = 0; r < mr; r++)
        for (int i = 0; i < rows; i++) y[(m + r) * N + 8 * g + i] = out[r][i];
    }
  }
}
#endif  // __AVX2__


// a nibble `code` of value v of row i or'ed into a group's codes (a 4-bit format's), or Q8_0's byte
inline void put_code(uint8_t* codes, int qtype, int i, int v, int code) {
  codes[code_byte(qtype, i, v)] |= uint8_t(code << (qtype != Q8_0 && v % 8 >= 4 ? 4 : 0));
}

// A 256-value block (IQ4_XS, Q4_K) into row i of a group's block p (its bytes zeroed before)
void pack_super_block(const uint8_t* blk, int qtype, int i, uint8_t* p) {
  const bool k_quant = qtype != IQ4_XS;  // Q4_K, Q5_K: d, dmin, 6-bit scales and minimums
  const uint8_t* qs = blk + (qtype == Q5_K ? 48 : 16);  // (K-quants': sub-blocks 2c, 2c + 1 the nibbles of 32 bytes)
  uint8_t* codes = p + rows8_terms(qtype);
  std::memcpy(p + 2 * i, blk, 2);
  if (k_quant) std::memcpy(p + 16 + 2 * i, blk + 2, 2);
  for (int j = 0; j < 8; j++) {
    if (k_quant) {
      int scale, minimum;
      k_scale_min(blk + 4, j, scale, minimum);
      p[32 + 8 * j + i] = uint8_t(scale), p[96 + 8 * j + i] = uint8_t(minimum);
    } else {
      p[16 + 8 * j + i] = uint8_t(int8_t(iq4_xs_scale(blk, j)));
    }
    uint32_t high = 0;  // Q5_K's fifth bits of the sub-block (qh[v] bit j: value v's)
    for (int v = 0; v < 32; v++) {
      put_code(codes + 128 * j, sub_block_format(qtype), i, v,
               k_quant ? (qs[32 * (j / 2) + v] >> (4 * (j % 2))) & 0x0F : nibble_code(blk + 8 + 16 * j, v));
      high |= qtype == Q5_K ? uint32_t((blk[16 + v] >> j) & 1) << v : 0;
    }
    if (qtype == Q5_K) std::memcpy(p + 160 + 32 * j + 4 * i, &high, 4);
  }
}

// A GGUF block's terms and codes into row i of a group's block p (its bytes zeroed before)
void pack_block(const uint8_t* blk, int qtype, int i, uint8_t* p) {
  if (rows8_super(qtype)) return pack_super_block(blk, qtype, i, p);
  if (qtype == MXFP4) {
    p[i] = blk[0];  // the exponent byte
  } else {  // d's float16 bits (Q4_1, Q5_1: and m's, at 16; Q5_*: the fifth bits before the codes)
    std::memcpy(p + 2 * i, blk, 2);
    if (qtype == Q4_1 || qtype == Q5_1) std::memcpy(p + 16 + 2 * i, blk + 2, 2);
    if (qtype == Q5_0 || qtype == Q5_1) std::memcpy(p + rows8_terms(qtype) - 32 + 4 * i, blk + (qtype == Q5_1 ? 4 : 2), 4);
  }
  for (int v = 0; v < 32; v++) put_code(p + rows8_terms(qtype), qtype, i, v, block_index(blk, qtype, v));
}

// Row i of a group's 256-value block p back into the GGUF block blk (zeroed before)
void unpack_super_block(const uint8_t* p, int qtype, int i, uint8_t* blk) {
  const uint8_t* codes = p + rows8_terms(qtype);
  const auto code = [&](int j, int v) { return group_code(codes + 128 * j, sub_block_format(qtype), i, v); };
  std::memcpy(blk, p + 2 * i, 2);
  if (qtype != IQ4_XS) {  // Q4_K, Q5_K
    std::memcpy(blk + 2, p + 16 + 2 * i, 2);
    uint8_t* packed = blk + 4;  // k_scale_min's 12 bytes: j < 4 in bytes j, j + 4; j >= 4 split over three
    for (int j = 0; j < 4; j++) {
      const int s0 = p[32 + 8 * j + i], m0 = p[96 + 8 * j + i], s1 = p[32 + 8 * (j + 4) + i], m1 = p[96 + 8 * (j + 4) + i];
      packed[j] = uint8_t(s0 | ((s1 >> 4) << 6)), packed[j + 4] = uint8_t(m0 | ((m1 >> 4) << 6));
      packed[j + 8] = uint8_t((s1 & 0x0F) | ((m1 & 0x0F) << 4));
    }
    uint8_t* qs = blk + (qtype == Q5_K ? 48 : 16);
    for (int c = 0; c < 4; c++)
      for (int v = 0; v < 32; v++) qs[32 * c + v] = uint8_t(code(2 * c, v) | (code(2 * c + 1, v) << 4));
    for (int j = 0; j < 8 && qtype == Q5_K; j++) {  // qh[v] bit j: the fifth bit of sub-block j's value v
      uint32_t high;
      std::memcpy(&high, p + 160 + 32 * j + 4 * i, 4);
      for (int v = 0; v < 32; v++) blk[16 + v] |= uint8_t(((high >> v) & 1) << j);
    }
    return;
  }
  uint16_t high = 0;
  for (int j = 0; j < 8; j++) {
    const int scale = int8_t(p[16 + 8 * j + i]) + 32;
    high |= uint16_t(((scale >> 4) & 3) << (2 * j));
    blk[4 + j / 2] |= uint8_t((scale & 0x0F) << (4 * (j % 2)));
    for (int v = 0; v < 16; v++) blk[8 + 16 * j + v] = uint8_t(code(j, v) | (code(j, v + 16) << 4));
  }
  std::memcpy(blk + 2, &high, 2);
}

// Row i of a group's block p back into the GGUF block blk it was packed from (zeroed before)
void unpack_block(const uint8_t* p, int qtype, int i, uint8_t* blk) {
  if (rows8_super(qtype)) return unpack_super_block(p, qtype, i, blk);
  const uint8_t* codes = p + rows8_terms(qtype);
  uint8_t* qs = blk + 2;
  if (qtype == MXFP4) {
    blk[0] = p[i], qs = blk + 1;
  } else {
    std::memcpy(blk, p + 2 * i, 2);
    if (qtype == Q4_1 || qtype == Q5_1) std::memcpy(blk + 2, p + 16 + 2 * i, 2), qs = blk + 4;
    if (qtype == Q5_0 || qtype == Q5_1) std::memcpy(qs, codes - 32 + 4 * i, 4), qs += 4;  // qh, then qs
  }
  if (qtype == Q8_0)
    for (int v = 0; v < 32; v++) qs[v] = uint8_t(group_code(codes, qtype, i, v));
  else
    for (int v = 0; v < 16; v++) qs[v] = uint8_t(group_code(codes, qtype, i, v) | (group_code(codes, qtype, i, v + 16) << 4));
}

}  // namespace

int64_t rows8_bytes(int qtype, int64_t K) { return K / rows8_block(qtype) * rows8_group_bytes(qtype); }

// GGUF blocks uint8 [N, K / block values * block bytes] -> groups uint8 [ceil(N / 8), rows8_bytes(K)]
void rows8_repack(uintptr_t w_, uintptr_t out_, int64_t N, int64_t K, int qtype, int threads) {
  const int64_t bytes = rows8_group_bytes(qtype), nb = K / rows8_block(qtype), row_bytes = nb * block_bytes(qtype);
  const uint8_t* w = (const uint8_t*)w_;
  uint8_t* out = (uint8_t*)out_;
  parallel_ranges((N + 7) / 8, threads, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++)
      for (int64_t b = 0; b < nb; b++) {
        uint8_t* p = out + (g * nb + b) * bytes;
        std::memset(p, 0, bytes);
        for (int i = 0; i < 8 && 8 * g + i < N; i++) pack_block(w + (8 * g + i) * row_bytes + b * block_bytes(qtype), qtype, i, p);
      }
  });
}

// groups -> the GGUF blocks they were repacked from, uint8 [N, K / block values * block bytes], byte for
// byte (for what reads blocks as stored: activation sparsity's column layout)
void rows8_blocks(uintptr_t w_, uintptr_t out_, int64_t N, int64_t K, int qtype, int threads) {
  const int64_t bytes = rows8_group_bytes(qtype), nb = K / rows8_block(qtype), bb = block_bytes(qtype);
  const uint8_t* w = (const uint8_t*)w_;
  uint8_t* out = (uint8_t*)out_;
  parallel_ranges(N, threads, 8, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
      for (int64_t b = 0; b < nb; b++) {
        uint8_t* blk = out + (n * nb + b) * bb;
        std::memset(blk, 0, bb);
        unpack_block(w + ((n / 8) * nb + b) * bytes, qtype, int(n % 8), blk);
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
      case IQ4_XS: return rows8_groups<IQ4_XS>(w, g0, g1, a, y, M, N, K);
      case Q4_K: return rows8_groups<Q4_K>(w, g0, g1, a, y, M, N, K);
      case Q5_K: return rows8_groups<Q5_K>(w, g0, g1, a, y, M, N, K);
      case Q5_0: return rows8_groups<Q5_0>(w, g0, g1, a, y, M, N, K);
      case Q5_1: return rows8_groups<Q5_1>(w, g0, g1, a, y, M, N, K);
      default: return rows8_groups<Q4_1>(w, g0, g1, a, y, M, N, K);
    }
  });
#else
  throw std::invalid_argument("rows8_matmul: an AVX2 build only");
#endif
}

}  // namespace hearth
