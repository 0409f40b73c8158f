// Logits: grammar masks applied in a copy, each row's argmax and log-sum-exp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
#include "cpu_kernels.h"
#include "vector_math.h"

namespace hearth {

void mask_tokens(uintptr_t logits_, uintptr_t out_, int64_t num_logit_rows, int64_t row_stride, uintptr_t rows_,
                 int64_t num_rows, uintptr_t bitmask_, int64_t words, int64_t vocab, int threads) {
  const float* logits = reinterpret_cast<const float*>(logits_);
  float* out = reinterpret_cast<float*>(out_);
  const int64_t* rows = reinterpret_cast<const int64_t*>(rows_);
  const uint32_t* bitmask = reinterpret_cast<const uint32_t*>(bitmask_);
  std::vector<const uint32_t*> mask_of(num_logit_rows, nullptr);  // each logit row's bitmask, or none
  for (int64_t r = 0; r < num_rows; ++r) mask_of[rows[r]] = bitmask + r * words;
  threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, num_logit_rows * vocab / 65536));
#pragma omp parallel for num_threads(threads)
  for (int64_t r = 0; r < num_logit_rows; ++r) {
    const float* src = logits + r * row_stride;
    float* dst = out + r * vocab;
    const uint32_t* mask = mask_of[r];
    if (mask == nullptr) {
      std::copy(src, src + vocab, dst);
      continue;
    }
    const int64_t whole = vocab / 32;
    for (int64_t w = 0; w < whole; ++w) {  // branch-free: the compiler turns it into masked vector moves
      const uint32_t bits = mask[w];
#pragma omp simd
      for (int b = 0; b < 32; ++b) dst[w * 32 + b] = ((bits >> b) & 1u) ? src[w * 32 + b] : NEG_INF;
    }
    for (int64_t t = whole * 32; t < vocab; ++t) dst[t] = ((mask[whole] >> (t - whole * 32)) & 1u) ? src[t] : NEG_INF;
  }
}

// Each row of logits [rows, vocab] (rows row_stride apart): its argmax (row_argmax) into ids int64 [rows] and its log-sum-exp into lse
// float32 [rows]: one pass for the maximum, one for sum exp(x - max), over a row the first pass
// left in the caches (torch's argmax and logsumexp read it from memory once each, with a
// dispatch and a fork and join each).
void argmax_and_logsumexp(uintptr_t logits_, int64_t rows, int64_t vocab, int64_t row_stride, uintptr_t ids_,
                          uintptr_t lse_, int threads) {
  const float* logits = reinterpret_cast<const float*>(logits_);
  int64_t* ids = reinterpret_cast<int64_t*>(ids_);
  float* lse = reinterpret_cast<float*>(lse_);
  threads = (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)threads, rows, rows * vocab / 65536}));
#pragma omp parallel for num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits + r * row_stride;
    const RowArgmax top = row_argmax(x, vocab);
    ids[r] = top.at;
    if (top.nans || std::isinf(top.max)) {  // NaN; +inf: an infinite sum; -inf: every logit -inf (torch's results)
      lse[r] = top.nans ? std::numeric_limits<float>::quiet_NaN() : top.max;
      continue;
    }
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < vocab; ++t) sum += exp_nonpositive(x[t] - top.max);
    lse[r] = top.max + std::log(sum);
  }
}

}  // namespace hearth
