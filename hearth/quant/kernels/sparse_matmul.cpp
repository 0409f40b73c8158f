// Activation sparsity (TEAL / CATS, docs/sparsity.md): y = (x masked) W^T where an activation with
// |x| < threshold counts as zero, reading only the weight columns that some row still needs.
//
// The weight is kept transposed (column-major: wt [K, N], F32, F16 or BF16 values), so that input
// column k of W is one contiguous row wt[k, :]: a zero activation skips N contiguous values, which
// is what saves memory traffic. (In W's own row-major layout a skipped column is one value inside
// every row: each cache line would still be read.)
#include "qmatmul.h"

namespace hearth {
namespace {

constexpr int F32 = 0;
constexpr int64_t SPARSE_COLUMNS = 1024;  // output columns a thread accumulates at once (4 KiB per row: in L1)
constexpr int SPARSE_PREFETCH = 4;        // kept columns ahead whose weights are prefetched

template <int QT>
inline float weight_value(const uint8_t* p) {
  if constexpr (QT == F32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  } else {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return QT == F16 ? half_to_float(h) : bf16_to_float(h);
  }
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
template <int QT>
inline __m256 weight_lanes(const uint8_t* p) {
  if constexpr (QT == F32) return _mm256_loadu_ps((const float*)p);
  const __m128i raw = _mm_loadu_si128((const __m128i*)p);
  if constexpr (QT == F16) return _mm256_cvtph_ps(raw);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif

// acc[m, 0:width) += sum over kept columns j of values[m, j] * wt[kept[j], n0 : n0 + width), GROUP kept
// columns at a time: one load and store of the accumulators per GROUP weights (L1 traffic, not the
// multiplies, bounds the loop otherwise)
constexpr int GROUP = 4;

template <int QT>
void accumulate_columns(const uint8_t* wt, int64_t N, int64_t n0, int64_t width, const int64_t* kept,
                        int64_t count, const float* values, int64_t M, float* acc) {
  constexpr int64_t E = QT == F32 ? 4 : 2;  // bytes per weight
  for (int64_t j = 0; j < count; j += GROUP) {
    const int g = (int)std::min<int64_t>(GROUP, count - j);
    const uint8_t* w[GROUP];
    for (int i = 0; i < GROUP; i++) w[i] = wt + (kept[j + std::min(i, g - 1)] * N + n0) * E;
    for (int i = 0; i < g && j + GROUP * SPARSE_PREFETCH + i < count; i++)
      for (int64_t b = 0; b < width * E; b += 64)
        __builtin_prefetch(wt + (kept[j + GROUP * SPARSE_PREFETCH + i] * N + n0) * E + b);
    for (int64_t m = 0; m < M; m++) {
      float v[GROUP];
      bool any = false;
      for (int i = 0; i < GROUP; i++) {  // a value under its row's threshold is 0 (another row kept the column)
        v[i] = i < g ? values[m * count + j + i] : 0.f;
        any = any || v[i] != 0.f;
      }
      if (!any) continue;
      float* a = acc + m * width;
      int64_t n = 0;
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
      const __m256 v0 = _mm256_set1_ps(v[0]), v1 = _mm256_set1_ps(v[1]), v2 = _mm256_set1_ps(v[2]),
                   v3 = _mm256_set1_ps(v[3]);
      for (; n + 8 <= width; n += 8) {
        __m256 s = _mm256_loadu_ps(a + n);
        s = _mm256_fmadd_ps(v0, weight_lanes<QT>(w[0] + n * E), s);
        s = _mm256_fmadd_ps(v1, weight_lanes<QT>(w[1] + n * E), s);
        s = _mm256_fmadd_ps(v2, weight_lanes<QT>(w[2] + n * E), s);
        _mm256_storeu_ps(a + n, _mm256_fmadd_ps(v3, weight_lanes<QT>(w[3] + n * E), s));
      }
#endif
      for (; n < width; n++)
        for (int i = 0; i < GROUP; i++) a[n] += v[i] * weight_value<QT>(w[i] + n * E);
    }
  }
}

template <int QT>
void sparse_columns(const uint8_t* wt, int64_t N, const int64_t* kept, int64_t count, const float* values,
                    int64_t M, float* y, int threads) {
  parallel_ranges(N / 8, threads, 8, [&](int64_t b0, int64_t b1) {  // ranges of 8 output columns
    const int64_t begin = 8 * b0, end = b1 * 8 == N / 8 * 8 ? N : 8 * b1;  // the last range takes N's tail
    std::vector<float> acc(M * SPARSE_COLUMNS);
    for (int64_t n0 = begin; n0 < end; n0 += SPARSE_COLUMNS) {
      const int64_t width = std::min(SPARSE_COLUMNS, end - n0);
      std::fill(acc.begin(), acc.begin() + M * width, 0.f);
      accumulate_columns<QT>(wt, N, n0, width, kept, count, values, M, acc.data());
      for (int64_t m = 0; m < M; m++) std::memcpy(y + m * N + n0, acc.data() + m * width, width * 4);
    }
  });
}

}  // namespace

// y [M, N] = mask(x) [M, K] W^T, W given transposed: wt [K, N] F32 / F16 / BF16 values, mask(x) =
// x where |x| >= threshold, else 0. Only the columns k where some row's masked x is nonzero are
// read. fp32 products and sums (each output a sum over the kept columns in increasing k).
// A block format: wt is sparse_repack's layout, multiplied by sparse_blocks_matmul (the one entry
// that hearth/backend/cpu_kernels' decode_layers calls for every sparse projection).
void sparse_matmul(uintptr_t x_, uintptr_t wt_, uintptr_t y_, int64_t M, int64_t N, int64_t K, int qtype,
                   float threshold, int threads) {
  if (qtype != F32 && qtype != F16 && qtype != BF16)
    return sparse_blocks_matmul(x_, wt_, y_, M, N, K, qtype, threshold, threads);
  const float* x = (const float*)x_;
  std::vector<int64_t> kept;
  for (int64_t k = 0; k < K; k++)
    for (int64_t m = 0; m < M; m++)
      if (std::fabs(x[m * K + k]) >= threshold && x[m * K + k] != 0.f) {
        kept.push_back(k);
        break;
      }
  const int64_t count = (int64_t)kept.size();
  std::vector<float> values(M * count);  // [M, count]: the masked activations of the kept columns
  for (int64_t m = 0; m < M; m++)
    for (int64_t j = 0; j < count; j++) {
      const float v = x[m * K + kept[j]];
      values[m * count + j] = std::fabs(v) >= threshold ? v : 0.f;
    }
  const uint8_t* wt = (const uint8_t*)wt_;
  float* y = (float*)y_;
  if (qtype == F32) sparse_columns<F32>(wt, N, kept.data(), count, values.data(), M, y, threads);
  else if (qtype == F16) sparse_columns<F16>(wt, N, kept.data(), count, values.data(), M, y, threads);
  else sparse_columns<BF16>(wt, N, kept.data(), count, values.data(), M, y, threads);
}

}  // namespace hearth
