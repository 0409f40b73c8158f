// int8_matmul: activations rounded to int8, their dot products with GGUF blocks read in place
// (the portable loops, the reference the AVX2 / VNNI paths are tested against), or on VNNI
// builds packed tiles (packed_matmul.cpp) and tiles decoded per call (int8_tiles.cpp).
#include "avx2_blocks.h"

namespace hearth {
namespace {

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

// A 256-value block as Block<QT> decodes it, stored once for the passes of many activation rows
// (int8_matmul_impl, from INT8_UNPACK_ROWS rows): d, f | c16 | per chunk c its codes and scales, 32 bytes
// each. The passes then load what each of them decoded again (Q6_K's planes, Q3_K's scales, the nibble
// blocks' lookups)
template <int QT>
struct UnpackedBlock {
  static constexpr int64_t BYTES = 64 + 8 * 64;
  const uint8_t* p;
  float d, f;
  __m256i c16;
  explicit UnpackedBlock(const uint8_t* at) : p(at), c16(_mm256_loadu_si256((const __m256i*)(at + 32))) {
    std::memcpy(&d, at, 4);
    std::memcpy(&f, at + 4, 4);
  }
  __m256i codes(int c) const { return _mm256_loadu_si256((const __m256i*)(p + 64 + 64 * c)); }
  __m256i scales(int c) const { return _mm256_loadu_si256((const __m256i*)(p + 96 + 64 * c)); }
  static void write(const uint8_t* block, uint8_t* out) {
    const Block<QT> blk(block);
    std::memcpy(out, &blk.d, 4);
    std::memcpy(out + 4, &blk.f, 4);
    _mm256_storeu_si256((__m256i*)(out + 32), blk.c16);
    for (int c = 0; c < 8; c++) {
      _mm256_storeu_si256((__m256i*)(out + 64 + 64 * c), blk.codes(c));
      _mm256_storeu_si256((__m256i*)(out + 96 + 64 * c), blk.scales(c));
    }
  }
};

// One weight row against MR activation rows from m0: y[r * N] for r < MR. UNPACKED: the row's blocks as
// UnpackedBlock wrote them.
template <int QT, int MR, bool VNNI, bool UNPACKED = false>
void int8_dot_rows_avx2(const uint8_t* row, int64_t K, const QuantizedActivations& a, int64_t m0, float* y, int64_t N) {
  using F = Fmt<QT>;
  using B = std::conditional_t<UNPACKED, UnpackedBlock<QT>, Block<QT>>;
  constexpr int64_t ROW_BLOCK = UNPACKED ? UnpackedBlock<QT>::BYTES : F::BYTES;  // bytes a block of the row
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
    const B blk(row + b * ROW_BLOCK);
    const int8_t* xb = xq + b * BS;
    if constexpr (MR <= 2 && !UNPACKED)  // decode: the stream of rows runs from DRAM, so ask for it ahead
      for (int off = 0; off < F::BYTES; off += 64) _mm_prefetch((const char*)(row + b * F::BYTES + off + INT8_PREFETCH), _MM_HINT_T0);
    if constexpr (BS == 256) {
      __m256i dot[MR];
      for (int r = 0; r < MR; r++) dot[r] = _mm256_setzero_si256();
      constexpr bool SIGNED = requires { Block<QT>::SIGNED; };
#pragma GCC unroll 8
      for (int c = 0; c < 8; c++) {
        const __m256i q = blk.codes(c), scales = blk.scales(c);
        const __m256i codes = SIGNED ? _mm256_sign_epi8(q, q) : q;  // signed codes: |q|, q's sign onto x
        for (int r = 0; r < MR; r++) {
          __m256i x = _mm256_loadu_si256((const __m256i*)(xb + r * K + 32 * c));
          if constexpr (SIGNED) x = _mm256_sign_epi8(x, q);
          dot[r] = D::scaled(dot[r], codes, x, scales);
          // keeps the sum in this order: left free, gcc computes all 8 x MR products first and
          // adds them as a tree, spilling most of them to the stack
          asm("" : "+x"(dot[r]));
        }
      }
      for (int r = 0; r < MR; r++) {
        const int64_t m = m0 + r;
        const float dx = a.d[m * nb + b];
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_set1_ps(blk.d * dx), acc[r]);
        if constexpr (!SIGNED) {  // signed codes have no offset
          const __m256i sums = _mm256_loadu_si256((const __m256i*)(a.s16.data() + m * (K / 16) + b * 16));
          const __m256i corr = _mm256_madd_epi16(sums, blk.c16);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(corr), _mm256_set1_ps(-blk.f * dx), acc[r]);
        }
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

template <int QT, bool VNNI, bool UNPACKED>
void int8_dot_rows_simd(int mr, const uint8_t* row, int64_t K, const QuantizedActivations& a, int64_t m0, float* y,
                        int64_t N) {
  switch (mr) {
    case 4: return int8_dot_rows_avx2<QT, 4, VNNI, UNPACKED>(row, K, a, m0, y, N);
    case 3: return int8_dot_rows_avx2<QT, 3, VNNI, UNPACKED>(row, K, a, m0, y, N);
    case 2: return int8_dot_rows_avx2<QT, 2, VNNI, UNPACKED>(row, K, a, m0, y, N);
    default: return int8_dot_rows_avx2<QT, 1, VNNI, UNPACKED>(row, K, a, m0, y, N);
  }
}
#endif  // __AVX2__

// Activation rows handled per pass over a weight row: its codes are decoded once for all of them.
constexpr int INT8_MR = 4;

// unpacked: the row's blocks as UnpackedBlock wrote them (a SIMD path), else the row as stored
template <int QT, bool UNPACKED = false>
void int8_dot_rows(int path, int mr, const uint8_t* row, int64_t K, const QuantizedActivations& a, int64_t m0,
                   float* y, int64_t N) {
#ifdef HEARTH_VNNI
  if (path == FASTEST) return int8_dot_rows_simd<QT, true, UNPACKED>(mr, row, K, a, m0, y, N);
#endif
#ifdef __AVX2__
  if (path != PORTABLE) return int8_dot_rows_simd<QT, false, UNPACKED>(mr, row, K, a, m0, y, N);
#endif
  if constexpr (!UNPACKED) int8_dot_rows_generic<QT>(row, K, a, m0, mr, y, N);
}

// Activation rows from which a call decodes each weight row's 256-value blocks once (UnpackedBlock) on the
// SIMD paths, rather than in each pass of INT8_MR rows
constexpr int64_t INT8_UNPACK_ROWS = 4 * INT8_MR;

// Weight rows per group: their blocks stay in L1 while every INT8_MR activation rows pass over them.
constexpr int64_t INT8_ROW_GROUP = 16;

#ifdef __AVX2__
// int8_matmul_impl's groups of weight rows, each row's blocks decoded once (UnpackedBlock) before the passes
template <int QT>
void int8_matmul_unpacked(int path, const uint8_t* w, int64_t K, const QuantizedActivations& a, int64_t M, float* y,
                          int64_t N, int threads) {
  const int64_t nb = K / 256, row_bytes = nb * Fmt<QT>::BYTES, unpacked_row = nb * UnpackedBlock<QT>::BYTES;
  parallel_ranges(N, threads, 16, [&](int64_t n0, int64_t n1) {
    std::vector<uint8_t> unpacked(INT8_ROW_GROUP * unpacked_row);
    for (int64_t g = n0; g < n1; g += INT8_ROW_GROUP) {
      const int64_t rows = std::min(n1, g + INT8_ROW_GROUP) - g;
      for (int64_t i = 0; i < rows; i++)
        for (int64_t b = 0; b < nb; b++)
          UnpackedBlock<QT>::write(w + (g + i) * row_bytes + b * Fmt<QT>::BYTES,
                                   unpacked.data() + i * unpacked_row + b * UnpackedBlock<QT>::BYTES);
      for (int64_t m = 0; m < M; m += INT8_MR) {
        const int mr = (int)std::min<int64_t>(INT8_MR, M - m);
        for (int64_t i = 0; i < rows; i++)
          int8_dot_rows<QT, true>(path, mr, unpacked.data() + i * unpacked_row, K, a, m, y + m * N + g + i, N);
      }
    }
  });
}
#endif

template <int QT>
void int8_matmul_impl(int path, const uint8_t* w, int64_t K, const QuantizedActivations& a, int64_t M, float* y,
                      int64_t N, int threads) {
#ifdef HEARTH_VNNI
  if (path == FASTEST && M >= INT8_TILE_MIN_ROWS && !codebook<QT>()) return int8_tiles_matmul(QT, w, K, a, M, y, N, threads);
#endif
  const int64_t row_bytes = K / Fmt<QT>::BS * Fmt<QT>::BYTES;
#ifdef __AVX2__
  if constexpr (Fmt<QT>::BS == 256)
    if (path != PORTABLE && M >= INT8_UNPACK_ROWS) return int8_matmul_unpacked<QT>(path, w, K, a, M, y, N, threads);
#endif
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
    if constexpr (grid_format<QT>()) {
      throw std::invalid_argument("int8_matmul: grid format " + std::to_string(qtype) + " is read as nibble blocks (grid_nibbles)");
    } else {
      quantize_activations((const float*)x_, M, K, a, threads, Fmt<QT>::BS, path == PORTABLE);
      int8_matmul_impl<QT>(path, (const uint8_t*)w_, K, a, M, (float*)y_, N, threads);
    }
  });
}

}  // namespace

// The one entry for int8-activation matmuls (Int8Linear, hearth/backend/cpu_kernels' decode_layers):
// `terms` non-zero: `w` is packed tiles' codes and `terms` their terms (packed_matmul, VNNI
// builds); zero: `w` is the GGUF blocks as stored (int8_matmul_blocks), or for the ROWS8 types groups of 8
// rows (rows8_matmul). F16 / BF16 arrays
// (decode_layers' projections in those formats; HalfLinear calls half_matmul itself):
// half_matmul, fp32 activations unrounded.
void int8_matmul(uintptr_t x, uintptr_t w, uintptr_t terms, uintptr_t y, int64_t M, int64_t N, int64_t K, int qtype,
                 int path, int threads) {
  if (terms) return packed_matmul(x, w, terms, y, M, N, K, qtype, path == PORTABLE, threads);
  if (qtype > ROWS8) return rows8_matmul(x, w, y, M, N, K, qtype - ROWS8, threads);
  if (qtype == F16 || qtype == BF16 || qtype == BF16_PAIRS) return half_matmul(x, w, y, M, N, K, 2 * K, qtype, false, path == PORTABLE, threads);
  int8_matmul_blocks(x, w, y, M, N, K, qtype, path, threads);
}

}  // namespace hearth
