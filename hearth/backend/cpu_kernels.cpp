// The model's CPU kernels besides the matmuls (hearth/quant/kernels): float32 only, no torch
// headers (the Python side checks shapes and passes data pointers). Each is one call where torch
// would run several small ops, each with its own dispatch and, with several threads, its own
// fork and join: at batch 1 those cost more than the arithmetic.
//
// decode_attention (hearth/backend/cpu.py): a few query rows per sequence (one for a decode,
// k + 1 for the verification of k guesses) against that sequence's cached K/V, read in place
// through its block table: no gather into a padded copy, no mask (each row's causal range is an
// interval of the context). A work item is (sequence, KV head, split): the sequence's rows and
// the query heads sharing that KV head (GQA) go together, so each K/V row is read once for all
// of them, and their sums are computed side by side: the scores with the queries transposed (a
// cached row's products with up to 16 of them one vector of multiply-adds along the head), kept
// token-major (a token's scores for every row and head side by side: one vector store, and the
// softmax a vector operation across them), the values a 16-value slice at a time with up to 16
// rows' and heads' sums in registers. A
// sequence's context is cut at the multiples of `split_len` (flash-decoding) so that a few long
// sequences still give every thread work, and so that a row's splits, and with them its arithmetic,
// are the same whatever else its step holds (its own step alone or a verification's, one sequence
// or many); each split keeps its running max m, sum l and unnormalised output, and a second pass
// merges the splits, in order, by log-sum-exp:
//   out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s,   M = max_s m_s.
//
// rms_norm (hearth/backend/cpu.py): out = x / sqrt(mean(x^2) + eps) * (w + offset) per row,
// optionally after x += add in place (the residual stream's add fused into the norm's pass).
//
// decode_layers (hearth/backend/cpu_decode.py): a decode step's whole stack of llama layers (its
// sequences' few new rows each: decodes and verifications), the
// kernels above and the int8 matmul (passed in from hearth/quant/kernels/qmatmul.cpp) called
// in sequence, so that no Python runs between them: at batch 1 the ~25 torch ops a layer costs
// in Python are a fifth of the step, the caches they run in being cold from the weights' stream.
//
// greedy_passes (hearth/backend/cpu_decode.py): a draft model's greedy chain of passes in one
// call: per pass decode_layers, the final norm, lm_head and argmax of each sequence's last row,
// and the chosen tokens' embeddings as the next pass's rows. At batch 1 a draft pass's layers are
// ~0.13 ms, and the Python and torch dispatch around them (norm, lm_head, argmax, the next
// pass's inputs) was ~0.3 ms more.
//
// mask_tokens (hearth/backend/cpu.py, the sampler's grammar masks): a copy of the logits with, in
// the given rows, -inf for every token whose bit is clear in the row's bitmask (bit t of word
// t / 32): one pass of masked vector moves, where torch unpacks the bits into a [rows, vocab]
// tensor and copies the logits first.
//
// rope_and_store_kv (hearth/backend/cpu.py): rotate-half RoPE of each token's q and k heads,
// k written rotated straight into its cache slot and v copied to its slot: one pass where torch
// would run a dozen ops per layer.
//
// A KV cache is float32, float16 (llama.cpp's default: half the bytes a step's attention reads) or
// q8_0 (hearth/backend/kv_quant.py), its KVFormat passed with its pointers. q8_0 is int8 codes
// [slots, KH, D] and float16 scales [slots, KH, D/32]: rope_and_store_kv quantizes each head row
// as it writes it (llama.cpp's quantize_row_q8_0_ref: d = max|x| / 127, codes round(x / d) half
// away from zero; float16: rounded to nearest even, as torch's cast), decode_attention widens each
// row it reads into a D-float buffer in L1 before using it.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

struct Item {
  int64_t seq, kv_head, begin, end, split;  // tokens [begin, end) of the sequence's context; split: its number
};


// Cache rows fetched ahead while the current one is used: K/V rows sit behind the block table
// and each holds one KV head of a token (a 1/kv_heads slice of the token's row), a pattern the
// hardware prefetcher does not follow; after a step's matmuls have streamed the weights through
// the caches every row comes from DRAM, and without this the kernel runs at its latency.
constexpr int64_t PREFETCH_ROWS = 8;

inline void prefetch_bytes(const void* row, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(static_cast<const char*>(row) + i);
}

constexpr int64_t Q8_BLOCK = 32;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// How a KV cache stores its values (the Python side's cpu.kv_format)
enum KVFormat { KV_F32 = 0, KV_Q8_0 = 1, KV_F16 = 2 };

// decode_attention's scores: query (row, head) pairs a pass (one 16-float vector) and cached rows
// at a time (independent sums in flight)
constexpr int64_t SCORE_LANES = 16, SCORE_TOKENS = 8;
// decode_attention's values: query (row, head) pairs a pass, cached rows a pass, head values a
// slice (one 16-float vector: a pass's sums stay in registers, VALUE_LANES of them)
constexpr int64_t VALUE_LANES = 16, VALUE_TOKENS = 64, VALUE_SLICE = 16;
// lanes_softmax's tokens a pattern: 16 values of the narrowest lanes (4)
constexpr int64_t SOFTMAX_TOKENS = 4;

// sums[j][0 .. D) += sum over t < count of w[t * stride + j] x v[t][0 .. D), for LANES lanes (the
// weights token-major: one base pointer, each lane's weight a broadcast at a fixed offset): per slice
// of VALUE_SLICE values the lanes' sums in registers over the rows, each summed in row order
template <int LANES>
inline void add_weighted_values(const float* w, int64_t stride, const float* const* v, int64_t count, int64_t D,
                                float* const* sums) {
  int64_t d0 = 0;
  for (; d0 + VALUE_SLICE <= D; d0 += VALUE_SLICE) {
    float acc[LANES][VALUE_SLICE];
    for (int j = 0; j < LANES; ++j)
      for (int64_t i = 0; i < VALUE_SLICE; ++i) acc[j][i] = sums[j][d0 + i];
    for (int64_t t = 0; t < count; ++t) {
      const float* vt = v[t] + d0;
      const float* wt = w + t * stride;
      for (int j = 0; j < LANES; ++j) {
        const float weight = wt[j];
#pragma omp simd
        for (int64_t i = 0; i < VALUE_SLICE; ++i) acc[j][i] += weight * vt[i];
      }
    }
    for (int j = 0; j < LANES; ++j)
      for (int64_t i = 0; i < VALUE_SLICE; ++i) sums[j][d0 + i] = acc[j][i];
  }
  for (; d0 < D; ++d0)  // a head size short of a whole slice: the rest one value at a time
    for (int j = 0; j < LANES; ++j) {
      float a = sums[j][d0];
      for (int64_t t = 0; t < count; ++t) a += w[t * stride + j] * v[t][d0];
      sums[j][d0] = a;
    }
}

// float16 <-> float32, n values, 16 (8) at a time through the conversion instructions (F16C, or
// AVX-512's): GCC turns a loop of _Float16 casts into one scalar conversion per value
inline void widen_f16(const _Float16* x, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i))));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
#endif
  for (; i < n; ++i) out[i] = (float)x[i];
}

// rounded to nearest even, as torch's cast
inline void narrow_f16(const float* x, _Float16* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) out[i] = (_Float16)x[i];
}

// One layer's K or V cache: float32 or float16 rows, or q8_0 codes and scales.
struct KVRows {
  const void* data;
  const _Float16* scales;  // q8_0's
  int64_t D;
  int format;  // KVFormat

  // the row's values: in place (float32), or widened into buf [D]
  const float* get(int64_t row, float* buf) const {
    if (format == KV_F32) return static_cast<const float*>(data) + row * D;
    if (format == KV_F16) {
      widen_f16(static_cast<const _Float16*>(data) + row * D, buf, D);
      return buf;
    }
    const int8_t* codes = static_cast<const int8_t*>(data) + row * D;
    const _Float16* d = scales + row * (D / Q8_BLOCK);
    for (int64_t b = 0; b < D / Q8_BLOCK; ++b) {
      const float scale = (float)d[b];
#pragma omp simd
      for (int64_t i = 0; i < Q8_BLOCK; ++i) buf[b * Q8_BLOCK + i] = scale * (float)codes[b * Q8_BLOCK + i];
    }
    return buf;
  }

  void prefetch(int64_t row) const {
    if (format == KV_F32) return prefetch_bytes(static_cast<const float*>(data) + row * D, D * sizeof(float));
    if (format == KV_F16) return prefetch_bytes(static_cast<const _Float16*>(data) + row * D, D * sizeof(_Float16));
    prefetch_bytes(static_cast<const int8_t*>(data) + row * D, D);
    __builtin_prefetch(scales + row * (D / Q8_BLOCK));
  }
};

// x [D] -> codes [D], scales [D/32]: llama.cpp's quantize_row_q8_0_ref (and gguf-py's Q8_0), bit for bit
inline void quantize_row_q8_0(const float* x, int8_t* codes, _Float16* scales, int64_t D) {
  for (int64_t b = 0; b < D / Q8_BLOCK; ++b) {
    const float* xb = x + b * Q8_BLOCK;
    float amax = 0.f;
    for (int64_t i = 0; i < Q8_BLOCK; ++i) amax = std::max(amax, std::abs(xb[i]));
    const float d = amax / 127.f, inverse = d != 0.f ? 1.f / d : 0.f;
    for (int64_t i = 0; i < Q8_BLOCK; ++i) codes[b * Q8_BLOCK + i] = (int8_t)std::round(xb[i] * inverse);
    scales[b] = (_Float16)d;
  }
}

// Store a head row x [D] at `row` of a cache of `format`.
inline void store_row(void* cache, _Float16* scales, int format, int64_t row, const float* x, int64_t D) {
  if (format == KV_F32) {
    std::memcpy(static_cast<float*>(cache) + row * D, x, D * sizeof(float));
    return;
  }
  if (format == KV_F16) {
    narrow_f16(x, static_cast<_Float16*>(cache) + row * D, D);
    return;
  }
  quantize_row_q8_0(x, static_cast<int8_t*>(cache) + row * D, scales + row * (D / Q8_BLOCK), D);
}

// exp(x) for x <= 0 (scores minus their maximum), in a form the compiler vectorises (std::exp
// is a scalar call): 2^(x log2 e) = 2^i 2^f with i = round(.), |f| <= 1/2, 2^f by its degree-7
// Taylor polynomial in f ln 2 (relative error < 1e-8, below float32's rounding).
inline float exp_nonpositive(float x) {
  const float t = std::max(x * 1.44269504088896341f, -126.f);  // below: 2^-126, as good as 0 here
  const float i = std::nearbyint(t);
  const float y = (t - i) * 0.693147180559945309f;
  float p = 1.f / 5040;
  p = p * y + 1.f / 720;
  p = p * y + 1.f / 120;
  p = p * y + 1.f / 24;
  p = p * y + 1.f / 6;
  p = p * y + 0.5f;
  p = p * y + 1.f;
  p = p * y + 1.f;
  const int32_t bits = ((int32_t)i + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// out[0 .. width) = x[0 .. width) scale, width 4, 8 or 16 (each a loop of fixed length: a vector store)
inline void store_scaled(const float* x, float scale, int64_t width, float* out) {
  const auto store = [&](auto lanes) {
#pragma omp simd
    for (int64_t j = 0; j < decltype(lanes)::value; ++j) out[j] = x[j] * scale;
  };
  if (width == 16) store(std::integral_constant<int64_t, 16>{});
  else if (width == 8) store(std::integral_constant<int64_t, 8>{});
  else store(std::integral_constant<int64_t, 4>{});
}

// The softmax numerators of token-major scores x [n, stride] (stride 4, 8 or a multiple of 16: row
// t's lane j at t * stride + j): lane j's max m[j] (-inf where it has no finite score), x replaced
// by exp(x - m) (0 where x is -inf) and their sum l[j]. The buffer is read flat, 16 values a vector
// whatever the lanes (value i is lane i % stride), so it must hold -inf from n * stride up to a
// multiple of P = SOFTMAX_TOKENS stride; maxima and sums are kept per value of a P-value pattern and
// folded into lanes at the end. pattern: scratch [2 P]. A lane's sum is the same at every stride
// (the sums of its tokens t = i mod SOFTMAX_TOKENS, each in token order, added for i = 0, 1, ...),
// so a row's attention does not depend on how many rows its step has: a verification's rows are
// bit for bit those of single-row steps (greedy speculation keeps plain decoding's tokens).
inline void lanes_softmax(float* x, int64_t n, int64_t stride, float* m, float* l, float* pattern) {
  constexpr int64_t V = 16;
  const int64_t P = SOFTMAX_TOKENS * stride, vectors = (n * stride + P - 1) / P * (P / V);
  float* top = pattern;  // then the shift each value takes
  float* sum = pattern + P;
  std::fill_n(top, P, NEG_INF);
  std::fill_n(sum, P, 0.f);
  for (int64_t c = 0; c < vectors; ++c) {
    float* t = top + c % (P / V) * V;
    const float* xc = x + c * V;
#pragma omp simd
    for (int64_t k = 0; k < V; ++k) t[k] = t[k] > xc[k] ? t[k] : xc[k];
  }
  for (int64_t j = 0; j < stride; ++j) {
    m[j] = NEG_INF;
    for (int64_t k = j; k < P; k += stride) m[j] = std::max(m[j], top[k]);
  }
  for (int64_t k = 0; k < P; ++k) top[k] = m[k % stride] == NEG_INF ? 0.f : m[k % stride];
  for (int64_t c = 0; c < vectors; ++c) {
    const float* shift = top + c % (P / V) * V;
    float* s = sum + c % (P / V) * V;
    float* xc = x + c * V;
#pragma omp simd
    for (int64_t k = 0; k < V; ++k) {
      const float e = xc[k] == NEG_INF ? 0.f : exp_nonpositive(xc[k] - shift[k]);
      xc[k] = e;
      s[k] += e;
    }
  }
  for (int64_t j = 0; j < stride; ++j) {
    l[j] = 0.f;
    for (int64_t k = j; k < P; k += stride) l[j] += sum[k];
  }
}

// q, out [R, H, D]: the new rows of S sequences end to end, sequence s owning rows
// [query_start[s], query_start[s + 1]) (int32 [S + 1]), at least one each; k_cache, v_cache
// [slots, KH, D] in kv_format (KVFormat; q8_0: int8 codes with float16 scales k_scales, v_scales
// [slots, KH, D/32]); block_tables int32 [S, max_blocks]; context_lens int32 [S], the new rows
// included (their K/V already in the cache). Row r of a sequence with n rows and context len
// sits at position len - n + r and sees positions up to its own (causal among the new rows);
// window > 0: only its last `window` positions (sliding-window attention); 0: all of them.
// Token trees (speculative branches; tree_start, tree_masks null: causal): tree_start int32 [S],
// where sequence s's tree region begins; tree_masks int64 [R], bit j set = the row sees position
// tree_start + j (its ancestors and itself); it sees every position before the region, and its own
// position is tree_start + its bits set - 1 (its depth: the window counts from there).
// A work item reads each K/V row once for every query row and head of its group.
void decode_attention(uintptr_t q_, uintptr_t k_, uintptr_t v_, uintptr_t k_scales_, uintptr_t v_scales_,
                      int kv_format, uintptr_t tables_, uintptr_t lens_, uintptr_t query_start_, uintptr_t tree_start_,
                      uintptr_t tree_masks_, uintptr_t out_, int64_t num_seqs,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                      int64_t max_blocks, double scale, int64_t split_len, int64_t window, int threads) {
  const float* q = reinterpret_cast<const float*>(q_);
  const KVRows k_cache{reinterpret_cast<const void*>(k_), reinterpret_cast<const _Float16*>(k_scales_), head_dim,
                       kv_format};
  const KVRows v_cache{reinterpret_cast<const void*>(v_), reinterpret_cast<const _Float16*>(v_scales_), head_dim,
                       kv_format};
  const int32_t* tables = reinterpret_cast<const int32_t*>(tables_);
  const int32_t* lens = reinterpret_cast<const int32_t*>(lens_);
  const int32_t* query_start = reinterpret_cast<const int32_t*>(query_start_);
  const int32_t* tree_start = reinterpret_cast<const int32_t*>(tree_start_);
  const uint64_t* tree_masks = reinterpret_cast<const uint64_t*>(tree_masks_);
  float* out = reinterpret_cast<float*>(out_);
  const int64_t group = num_heads / num_kv_heads, D = head_dim, num_rows = query_start[num_seqs];
  // one past the position of row r of sequence s
  const auto row_end = [&](int64_t s, int64_t r) -> int64_t {
    if (tree_masks) return tree_start[s] + __builtin_popcountll(tree_masks[query_start[s] + r]);
    return (int64_t)lens[s] - (query_start[s + 1] - query_start[s]) + 1 + r;
  };
  // the interval [row_begin, row_last) of positions row r of sequence s may see (a tree's row: those
  // of it that `sees`)
  const auto row_begin = [&](int64_t s, int64_t r) {
    return window > 0 ? std::max<int64_t>(0, row_end(s, r) - window) : (int64_t)0;
  };
  const auto row_last = [&](int64_t s, int64_t r) { return tree_masks ? (int64_t)lens[s] : row_end(s, r); };
  const auto sees = [&](int64_t s, int64_t row, int64_t pos) {
    const int64_t j = pos - tree_start[s];
    return j < 0 || (j < 64 && (tree_masks[row] >> j) & 1);
  };

  std::vector<Item> items;
  // splits of sequence s: [first_split[s], first_split[s+1]); partial results of its split i and
  // row r: entry first_part[s] + i * rows + r (times num_heads, plus the query head)
  std::vector<int64_t> first_split(num_seqs + 1, 0), first_part(num_seqs + 1, 0), row_seq(num_rows);
  int64_t work = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t rows = query_start[s + 1] - query_start[s];
    int64_t begin = row_begin(s, 0);
    for (int64_t r = 1; r < rows; ++r) begin = std::min(begin, row_begin(s, r));
    begin -= begin % SOFTMAX_TOKENS;  // a token's softmax sum (t mod SOFTMAX_TOKENS) by its position
    const int64_t len = lens[s], first = begin / split_len;
    const int64_t n_splits = (len + split_len - 1) / split_len - first;
    first_split[s + 1] = first_split[s] + n_splits;
    first_part[s + 1] = first_part[s] + n_splits * rows;
    for (int64_t r = 0; r < rows; ++r) row_seq[query_start[s] + r] = s;
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t i = 0; i < n_splits; ++i)
        items.push_back({s, h, std::max(begin, (first + i) * split_len), std::min(len, (first + i + 1) * split_len), i});
    work += (len - begin) * rows * num_heads * D * 2;
  }
  // per (split, row, query head): running max, sum of exp, unnormalised output [D]
  const int64_t total_parts = first_part[num_seqs];
  // threads only where there is enough work to pay for waking them (~64K multiply-adds each)
  threads = (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)threads, (int64_t)items.size(), work / 65536}));
  std::vector<float> part_max(total_parts * num_heads), part_sum(total_parts * num_heads);
  std::vector<float> part_out(total_parts * num_heads * D);
  const float fscale = (float)scale;

#pragma omp parallel num_threads(threads)
  {
    // token-major: the scores (then weights) of token t in [t * stride, t * stride + lanes), a
    // cached row's products with 16 lanes one vector store, the softmax vertical across lanes and
    // the values' pass one base pointer for every lane's weight
    std::vector<float> scores;  // [split_len, stride]
    std::vector<float> lane_max, lane_sum, pattern;  // lanes_softmax's
    std::vector<int64_t> cache_rows, lo, hi;  // cache row of each token of the split; each query row's part of it
    std::vector<float> row_buf(SCORE_TOKENS * D);  // float16 and q8_0 rows widened
    std::vector<float> qt(D * 2 * SCORE_LANES);  // queries transposed (the scores' pass)
    // the values' pass: its cached rows (float16 and q8_0 widened), a scratch row for the lanes past
    // the item's, each lane's sums
    std::vector<float> value_buf(VALUE_TOKENS * D), scratch(D);
    const float* v_rows[VALUE_TOKENS];
    float* sums[VALUE_LANES];
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < (int64_t)items.size(); ++w) {
      const Item it = items[w];
      const int64_t n = it.end - it.begin, rows = query_start[it.seq + 1] - query_start[it.seq];
      // lane j: the item's query row j / group, its head j % group; lanes past them (to 4, 8 or a
      // multiple of 16: the softmax's widths) score 0 and weigh into the scratch row
      const int64_t lanes_total = rows * group;
      const int64_t stride = lanes_total <= 4 ? 4 : lanes_total <= 8 ? 8 : (lanes_total + SCORE_LANES - 1) / SCORE_LANES * SCORE_LANES;
      const int64_t chunk = SOFTMAX_TOKENS * stride;  // lanes_softmax's: n * stride values padded with -inf
      scores.resize((n * stride + chunk - 1) / chunk * chunk);
      std::fill(scores.begin() + n * stride, scores.end(), NEG_INF);
      lane_max.resize(stride);
      lane_sum.resize(stride);
      pattern.resize(2 * chunk);
      cache_rows.resize(n);
      lo.resize(rows);
      hi.resize(rows);
      for (int64_t r = 0; r < rows; ++r) {  // split tokens [lo, hi) are the row's to see
        lo[r] = std::max<int64_t>(0, row_begin(it.seq, r) - it.begin);
        hi[r] = std::max(lo[r], std::min(n, row_last(it.seq, r) - it.begin));
      }
      const int32_t* table = tables + it.seq * max_blocks;
      // block by block: one division per item, not per token (a 64-bit idiv was ~5% of the kernel)
      for (int64_t t = 0, block = it.begin / block_size, offset = it.begin % block_size; t < n; ++block, offset = 0) {
        const int64_t first_row = (int64_t)table[block] * block_size;
        for (; offset < block_size && t < n; ++offset, ++t) cache_rows[t] = (first_row + offset) * num_kv_heads + it.kv_head;
      }
      const float* q_seq = q + query_start[it.seq] * num_heads * D + it.kv_head * group * D;
      // the scores, SCORE_LANES lanes at a time (two vectors of them where more than SCORE_LANES are
      // left: each cached row read once for both): their queries transposed [D][lanes], so that a
      // cached row's products with all of them are vectors of multiply-adds along D, SCORE_TOKENS
      // rows in flight; each lane sums along D in order, whatever the other lanes hold
      const auto score_chunk = [&](int64_t first, auto pass_lanes) {
        constexpr int64_t LANES = decltype(pass_lanes)::value;
        const int64_t lanes = std::min(LANES, lanes_total - first);
        std::fill(qt.begin(), qt.begin() + D * LANES, 0.f);
        for (int64_t j = 0; j < lanes; ++j) {
          const int64_t row = (first + j) / group, head = (first + j) % group;
          for (int64_t d = 0; d < D; ++d) qt[d * LANES + j] = q_seq[(row * num_heads + head) * D + d];
        }
        for (int64_t t = 0; t < std::min(n, PREFETCH_ROWS); ++t) k_cache.prefetch(cache_rows[t]);
        for (int64_t t0 = 0; t0 < n; t0 += SCORE_TOKENS) {
          const int64_t count = std::min(SCORE_TOKENS, n - t0);
          const float* k[SCORE_TOKENS];
          for (int64_t u = 0; u < SCORE_TOKENS; ++u) {  // past the end: the last row again (not stored)
            const int64_t t = t0 + std::min(u, count - 1);
            if (u < count && t + PREFETCH_ROWS < n) k_cache.prefetch(cache_rows[t + PREFETCH_ROWS]);
            if (u < count && first == 0) v_cache.prefetch(cache_rows[t]);  // read after the scores
            k[u] = k_cache.get(cache_rows[t], row_buf.data() + u * D);
          }
          float acc[SCORE_TOKENS][LANES] = {};
          for (int64_t d = 0; d < D; ++d)
            for (int64_t u = 0; u < SCORE_TOKENS; ++u) {
              const float kd = k[u][d];
#pragma omp simd
              for (int64_t j = 0; j < LANES; ++j) acc[u][j] += kd * qt[d * LANES + j];
            }
          for (int64_t u = 0; u < count; ++u)
            for (int64_t v = 0; v < LANES; v += SCORE_LANES)
              store_scaled(acc[u] + v, fscale, std::min(SCORE_LANES, stride - first - v),
                           scores.data() + (t0 + u) * stride + first + v);
        }
      };
      for (int64_t first = 0; first < lanes_total;) {
        if (lanes_total - first > SCORE_LANES) {
          score_chunk(first, std::integral_constant<int64_t, 2 * SCORE_LANES>{});
          first += 2 * SCORE_LANES;
        } else {
          score_chunk(first, std::integral_constant<int64_t, SCORE_LANES>{});
          first += SCORE_LANES;
        }
      }
      // -inf where a lane's row does not look: outside its [lo, hi), and the tree positions it does not see
      for (int64_t j = 0; j < lanes_total; ++j) {
        const int64_t r = j / group;
        for (int64_t t = 0; t < std::min(lo[r], n); ++t) scores[t * stride + j] = NEG_INF;
        for (int64_t t = hi[r]; t < n; ++t) scores[t * stride + j] = NEG_INF;
        if (tree_masks)
          for (int64_t t = std::max(lo[r], tree_start[it.seq] - it.begin); t < hi[r]; ++t)
            if (!sees(it.seq, query_start[it.seq] + r, it.begin + t)) scores[t * stride + j] = NEG_INF;
      }
      // the softmax's numerators, every lane side by side; lanes' maxima and sums into their parts
      const int64_t part_row = first_part[it.seq] + it.split * rows;  // this split's row 0
      lanes_softmax(scores.data(), n, stride, lane_max.data(), lane_sum.data(), pattern.data());
      for (int64_t j = 0; j < lanes_total; ++j) {
        const int64_t p = (part_row + j / group) * num_heads + it.kv_head * group + j % group;
        part_max[p] = lane_max[j];
        part_sum[p] = lane_sum[j];
        std::fill_n(part_out.data() + p * D, D, 0.f);
      }
      // the values, VALUE_TOKENS cached rows at a time (float16 and q8_0 rows widened once for all lanes)
      for (int64_t t0 = 0; t0 < n; t0 += VALUE_TOKENS) {
        const int64_t count = std::min(VALUE_TOKENS, n - t0);
        for (int64_t u = 0; u < count; ++u) v_rows[u] = v_cache.get(cache_rows[t0 + u], value_buf.data() + u * D);
        for (int64_t first = 0; first < lanes_total; first += VALUE_LANES) {
          const int64_t lanes = std::min(VALUE_LANES, lanes_total - first);
          for (int64_t j = 0; j < VALUE_LANES; ++j) {
            const int64_t rg = first + j, r = rg / group;
            sums[j] = j < lanes ? part_out.data() + ((part_row + r) * num_heads + it.kv_head * group + rg % group) * D
                                : scratch.data();
          }
          const float* weights = scores.data() + t0 * stride + first;
          if (lanes <= 4) add_weighted_values<4>(weights, stride, v_rows, count, D, sums);
          else if (lanes <= 8) add_weighted_values<8>(weights, stride, v_rows, count, D, sums);
          else add_weighted_values<VALUE_LANES>(weights, stride, v_rows, count, D, sums);
        }
      }
    }
    // merge the splits of each (row, query head); a split the row saw nothing of weighs exp(-inf) = 0
#pragma omp for collapse(2)
    for (int64_t row = 0; row < num_rows; ++row) {
      for (int64_t h = 0; h < num_heads; ++h) {
        const int64_t s = row_seq[row], rows = query_start[s + 1] - query_start[s], r = row - query_start[s];
        const int64_t n_splits = first_split[s + 1] - first_split[s];
        float m = NEG_INF;
        for (int64_t i = 0; i < n_splits; ++i) m = std::max(m, part_max[(first_part[s] + i * rows + r) * num_heads + h]);
        float l = 0.f;
        float* o = out + (row * num_heads + h) * D;
        std::fill_n(o, D, 0.f);
        for (int64_t i = 0; i < n_splits; ++i) {
          const int64_t p = (first_part[s] + i * rows + r) * num_heads + h;
          const float c = std::exp(part_max[p] - m);
          l += c * part_sum[p];
          const float* acc = part_out.data() + p * D;
#pragma omp simd
          for (int64_t j = 0; j < D; ++j) o[j] += c * acc[j];
        }
        const float inv = 1.f / l;
        for (int64_t j = 0; j < D; ++j) o[j] *= inv;
      }
    }
  }
}

// x, out [rows, dim]; add [rows, dim] or null; w [dim]
void rms_norm(uintptr_t x_, uintptr_t add_, uintptr_t w_, uintptr_t out_, int64_t rows, int64_t dim, double eps,
              double offset, int threads) {
  float* x = reinterpret_cast<float*>(x_);
  const float* add = reinterpret_cast<const float*>(add_);
  const float* w = reinterpret_cast<const float*>(w_);
  float* out = reinterpret_cast<float*>(out_);
  const float foffset = (float)offset;
  threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, rows * dim / 16384));
#pragma omp parallel for num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * dim;
    float* o = out + r * dim;
    if (add) {
      const float* a = add + r * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) xr[i] += a[i];
    }
    float sq = 0.f;
#pragma omp simd reduction(+ : sq)
    for (int64_t i = 0; i < dim; ++i) sq += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(sq / (float)dim + (float)eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) o[i] = (xr[i] * inv) * (w[i] + foffset);
  }
}

// out [D] = rotate-half RoPE of x [D] with cos, sin [D/2]
inline void rope_head(const float* x, const float* cos, const float* sin, float* out, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    out[i] = x[i] * cos[i] - x[i + half] * sin[i];
    out[i + half] = x[i + half] * cos[i] + x[i] * sin[i];
  }
}

// q [T, H, D], k and v [T, KH, D], each with its own token stride (heads contiguous); cos, sin
// [T, D/2]; slots int64 [T]; q_out [T, H, D]; k_cache, v_cache [slots, KH, D] in kv_format
// (KVFormat; q8_0: int8 codes with float16 scales k_scales, v_scales [slots, KH, D/32])
void rope_and_store_kv(uintptr_t q_, uintptr_t k_, uintptr_t v_, int64_t q_stride, int64_t k_stride,
                       int64_t v_stride, uintptr_t cos_, uintptr_t sin_, uintptr_t slots_, uintptr_t q_out_,
                       uintptr_t k_cache_, uintptr_t v_cache_, uintptr_t k_scales_, uintptr_t v_scales_,
                       int kv_format, int64_t tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int threads) {
  const float* q = reinterpret_cast<const float*>(q_);
  const float* k = reinterpret_cast<const float*>(k_);
  const float* v = reinterpret_cast<const float*>(v_);
  const float* cos = reinterpret_cast<const float*>(cos_);
  const float* sin = reinterpret_cast<const float*>(sin_);
  const int64_t* slots = reinterpret_cast<const int64_t*>(slots_);
  float* q_out = reinterpret_cast<float*>(q_out_);
  void* k_cache = reinterpret_cast<void*>(k_cache_);
  void* v_cache = reinterpret_cast<void*>(v_cache_);
  _Float16* k_scales = reinterpret_cast<_Float16*>(k_scales_);
  _Float16* v_scales = reinterpret_cast<_Float16*>(v_scales_);
  const int64_t half = head_dim / 2;
  threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, tokens * (num_heads + num_kv_heads) * head_dim / 65536));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> k_rotated(head_dim);
#pragma omp for
    for (int64_t t = 0; t < tokens; ++t) {
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      for (int64_t h = 0; h < num_heads; ++h)
        rope_head(q + t * q_stride + h * head_dim, c, s, q_out + (t * num_heads + h) * head_dim, half);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t row = slots[t] * num_kv_heads + h;
        rope_head(k + t * k_stride + h * head_dim, c, s, k_rotated.data(), half);
        store_row(k_cache, k_scales, kv_format, row, k_rotated.data(), head_dim);
        store_row(v_cache, v_scales, kv_format, row, v + t * v_stride + h * head_dim, head_dim);
      }
    }
  }
}

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

// A row's argmax as torch's: the first of equal maxima, or the first NaN where there is one (a
// NaN counts as the largest); `max` is the largest number, NaNs passed over. 16 running maxima
// side by side, each with the first index it was seen at.
struct RowArgmax {
  int64_t at;
  float max;
  bool nans;
};

inline RowArgmax row_argmax(const float* x, int64_t n) {
  float lane_max[16];
  int32_t lane_at[16], lane_nans[16];
  std::fill_n(lane_max, 16, NEG_INF);
  std::fill_n(lane_at, 16, 0);
  std::fill_n(lane_nans, 16, 0);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
#pragma omp simd
    for (int j = 0; j < 16; ++j) {
      const float v = x[i + j];
      const bool larger = v > lane_max[j];
      lane_max[j] = larger ? v : lane_max[j];
      lane_at[j] = larger ? (int32_t)(i + j) : lane_at[j];
      lane_nans[j] |= v != v;
    }
  for (; i < n; ++i) {
    const bool larger = x[i] > lane_max[0];
    lane_max[0] = larger ? x[i] : lane_max[0];
    lane_at[0] = larger ? (int32_t)i : lane_at[0];
    lane_nans[0] |= x[i] != x[i];
  }
  const float m = *std::max_element(lane_max, lane_max + 16);
  if (std::any_of(lane_nans, lane_nans + 16, [](int32_t flag) { return flag != 0; }))
    return {std::find_if(x, x + n, [](float v) { return v != v; }) - x, m, true};
  int64_t best = n;
  for (int j = 0; j < 16; ++j)
    if (lane_max[j] == m) best = std::min<int64_t>(best, lane_at[j]);
  return {best, m, false};
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

// out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]; silu(x) = x / (1 + exp(-x)) with the exp of
// -|x| (so never of a positive number): x >= 0: x / (1 + e), x < 0: x e / (1 + e)
void silu_and_mul(const float* gate_up, float* out, int64_t tokens, int64_t inter, int threads) {
  threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, tokens * inter / 65536));
#pragma omp parallel for num_threads(threads)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* g = gate_up + t * 2 * inter;
    const float* u = g + inter;
    float* o = out + t * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) {
      const float x = g[i], e = exp_nonpositive(-std::abs(x));
      o[i] = (x >= 0.f ? x : x * e) / (1.f + e) * u[i];
    }
  }
}

using Int8Matmul = void (*)(uintptr_t x, uintptr_t w, uintptr_t scales, uintptr_t y, int64_t M, int64_t N, int64_t K,
                           int qtype, int path, int threads);

// Columns of decode_layers' layer table (int64 [layers, LAYER_FIELDS]): weight pointers and
// formats, fixed at load. A projection is up to PARTS[p] parts side by side in its output (q, k,
// v in another format each, as llama.cpp's mixed files store them), each PART_FIELDS columns:
// weight or packed codes, packed terms or 0 (int8_matmul's arguments), qtype, output rows (0: no such part).
enum Projection { QKV, O, GATE_UP, DOWN, PROJECTIONS };
constexpr int PARTS[PROJECTIONS] = {3, 1, 2, 1};
constexpr int PART_FIELDS = 4;
enum LayerField { IN_NORM, POST_NORM, FIRST_PART };
constexpr int LAYER_FIELDS = FIRST_PART + (PARTS[QKV] + PARTS[O] + PARTS[GATE_UP] + PARTS[DOWN]) * PART_FIELDS;

// rows of sequence s: [query_start[s], query_start[s + 1]), token trees in tree_start and
// tree_masks (as decode_attention's).
// residual [T, hidden]: the embeddings in, the stream before the last layer's MLP addition out
// (in place); delta [T, hidden]: that addition. caches int64 [layers, 4]: K and V cache pointers,
// then their q8_0 scales' (0: not q8_0), every layer's in kv_format.
void decode_layers(uintptr_t matmul_, uintptr_t table_, uintptr_t caches_, int kv_format, int64_t num_layers, uintptr_t residual_,
                   uintptr_t delta_, uintptr_t cos_, uintptr_t sin_, uintptr_t slots_, uintptr_t block_tables_,
                   uintptr_t lens_, uintptr_t query_start_, uintptr_t tree_start_, uintptr_t tree_masks_, int64_t num_seqs, int64_t tokens, int64_t hidden, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, int64_t inter, double eps, int64_t block_size, int64_t max_blocks, double scale,
                   int64_t split_len, int64_t window, int threads) {
  const Int8Matmul matmul = reinterpret_cast<Int8Matmul>(matmul_);
  const int64_t* table = reinterpret_cast<const int64_t*>(table_);
  const int64_t* caches = reinterpret_cast<const int64_t*>(caches_);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
  std::vector<float> h(tokens * hidden), qkv(tokens * qkv_size), q(tokens * q_size), attn(tokens * q_size);
  std::vector<float> gate_up(tokens * 2 * inter), act(tokens * inter), part_out;
  const auto ptr = [](const std::vector<float>& v) { return reinterpret_cast<uintptr_t>(v.data()); };
  // y [T, n] = x [T, k] W^T, W the projection's parts one after another along n
  const auto project = [&](const int64_t* layer, Projection p, uintptr_t x, float* y, int64_t n, int64_t k) {
    int first = FIRST_PART;
    for (int i = 0; i < p; i++) first += PARTS[i] * PART_FIELDS;
    for (int64_t i = 0, column = 0; i < PARTS[p]; i++) {
      const int64_t* part = layer + first + i * PART_FIELDS;
      const int64_t rows = part[3];
      if (rows == 0) break;
      if (rows == n) {  // the whole projection in one format
        matmul(x, part[0], part[1], reinterpret_cast<uintptr_t>(y), tokens, n, k, (int)part[2], 0, threads);
        break;
      }
      part_out.resize(tokens * rows);  // [T, rows], then its columns of y
      matmul(x, part[0], part[1], ptr(part_out), tokens, rows, k, (int)part[2], 0, threads);
      for (int64_t t = 0; t < tokens; ++t)
        std::memcpy(y + t * n + column, part_out.data() + t * rows, rows * sizeof(float));
      column += rows;
    }
  };
  float* delta = reinterpret_cast<float*>(delta_);
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* layer = table + l * LAYER_FIELDS;
    rms_norm(residual_, l == 0 ? 0 : delta_, layer[IN_NORM], ptr(h), tokens, hidden, eps, 0.0, threads);
    project(layer, QKV, ptr(h), qkv.data(), qkv_size, hidden);
    const int64_t* cache = caches + 4 * l;  // K, V, K scales, V scales
    rope_and_store_kv(ptr(qkv), ptr(qkv) + q_size * sizeof(float), ptr(qkv) + (q_size + kv_size) * sizeof(float),
                      qkv_size, qkv_size, qkv_size, cos_, sin_, slots_, ptr(q), cache[0], cache[1], cache[2], cache[3],
                      kv_format, tokens, num_heads, num_kv_heads, head_dim, threads);
    decode_attention(ptr(q), cache[0], cache[1], cache[2], cache[3], kv_format, block_tables_, lens_, query_start_, tree_start_,
                     tree_masks_, ptr(attn),
                     num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale, split_len, window,
                     threads);
    project(layer, O, ptr(attn), delta, hidden, q_size);
    rms_norm(residual_, delta_, layer[POST_NORM], ptr(h), tokens, hidden, eps, 0.0, threads);
    project(layer, GATE_UP, ptr(h), gate_up.data(), 2 * inter, hidden);
    silu_and_mul(gate_up.data(), act.data(), tokens, inter, threads);
    project(layer, DOWN, ptr(act), delta, hidden, inter);
  }
}

using DequantizeRows = void (*)(uintptr_t w, uintptr_t out, int64_t rows, int64_t K, int64_t row_bytes, int qtype,
                                int threads);

// Columns of greedy_passes' pass table (int64 [passes, PASS_FIELDS]), a row per pass: pointers to
// its rows' cache slots (int64 [T]), its sequences' block tables (int32 [S, max_blocks]), context
// lengths (int32 [S]) and query starts (int32 [S + 1]), its rows' cos and sin (float32 [T, D/2]),
// and per row the choice of the pass before whose token it is fed (int64 [T]; the first pass's
// tokens are given); then S, T, max_blocks and split_len (decode_layers' arguments).
enum PassField { SLOTS, BLOCK_TABLES, LENS, QUERY_START, COS, SIN, FEEDS, SEQS, TOKENS, MAX_BLOCKS, SPLIT_LEN,
                 PASS_FIELDS };

// A draft model's greedy passes (hearth/backend/cpu_decode.py): per pass, decode_layers on its
// rows, then for each sequence's last row the final norm, lm_head (matmul: the weight, its terms
// or 0, its qtype and rows `vocab`) and the argmax (row_argmax, as torch's), written
// to choices; a later pass's rows are the embeddings of the choices they are fed (rows of
// embedding_row_bytes in embedding_qtype, widened by qmatmul.cpp's dequantize_rows).
// first_ids int64 [the first pass's T]; choices int64 [the passes' S, end to end].
void greedy_passes(uintptr_t matmul_, uintptr_t dequantize_, uintptr_t table_, uintptr_t caches_, int kv_format,
                   int64_t num_layers,
                   uintptr_t passes_, int64_t num_passes, uintptr_t first_ids_, uintptr_t choices_,
                   uintptr_t embedding_, int64_t embedding_row_bytes, int embedding_qtype, uintptr_t norm_,
                   uintptr_t head_, uintptr_t head_terms_, int head_qtype, int64_t vocab, int64_t hidden,
                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t inter, double eps,
                   int64_t block_size, double scale, int64_t window, int threads) {
  const Int8Matmul matmul = reinterpret_cast<Int8Matmul>(matmul_);
  const DequantizeRows dequantize = reinterpret_cast<DequantizeRows>(dequantize_);
  const int64_t* first_ids = reinterpret_cast<const int64_t*>(first_ids_);
  int64_t* choices = reinterpret_cast<int64_t*>(choices_);
  std::vector<float> residual, delta, last, logits;
  const auto ptr = [](std::vector<float>& v, int64_t offset = 0) {
    return reinterpret_cast<uintptr_t>(v.data() + offset);
  };
  const int64_t* fed = nullptr;  // the choices of the pass before
  for (int64_t p = 0; p < num_passes; ++p) {
    const int64_t* pass = reinterpret_cast<const int64_t*>(passes_) + p * PASS_FIELDS;
    const int64_t tokens = pass[TOKENS], seqs = pass[SEQS];
    const int64_t* feeds = reinterpret_cast<const int64_t*>(pass[FEEDS]);
    residual.resize(tokens * hidden);
    delta.resize(tokens * hidden);
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t token = p == 0 ? first_ids[t] : fed[feeds[t]];
      dequantize(embedding_ + token * embedding_row_bytes, ptr(residual, t * hidden), 1, hidden, embedding_row_bytes,
                 embedding_qtype, 1);
    }
    decode_layers(matmul_, table_, caches_, kv_format, num_layers, ptr(residual), ptr(delta), pass[COS], pass[SIN], pass[SLOTS],
                  pass[BLOCK_TABLES], pass[LENS], pass[QUERY_START], 0, 0, seqs, tokens, hidden, num_heads,
                  num_kv_heads, head_dim, inter, eps, block_size, pass[MAX_BLOCKS], scale, pass[SPLIT_LEN], window,
                  threads);
    const int32_t* query_start = reinterpret_cast<const int32_t*>(pass[QUERY_START]);
    last.resize(seqs * hidden);
    for (int64_t s = 0; s < seqs; ++s) {
      const int64_t row = (query_start[s + 1] - 1) * hidden;
      rms_norm(ptr(residual, row), ptr(delta, row), norm_, ptr(last, s * hidden), 1, hidden, eps, 0.0, 1);
    }
    logits.resize(seqs * vocab);
    matmul(ptr(last), head_, head_terms_, ptr(logits), seqs, vocab, hidden, head_qtype, 0, threads);
    for (int64_t s = 0; s < seqs; ++s) choices[s] = row_argmax(logits.data() + s * vocab, vocab).at;
    fed = choices;
    choices += seqs;
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("decode_attention", &decode_attention,
        "paged attention of a few query rows per sequence, split-KV, float32, float16 or q8_0 K/V", nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (after an optional in-place add), float32", nogil);
  m.def("rope_and_store_kv", &rope_and_store_kv, "RoPE on q and k, k and v into their cache slots, float32, float16 or q8_0", nogil);
  m.def("argmax_and_logsumexp", &argmax_and_logsumexp, "each row's argmax and log-sum-exp, float32", nogil);
  m.def("mask_tokens", &mask_tokens, "float32 logits copied, grammar bitmasks applied to the given rows", nogil);
  m.def("silu_and_mul", [](uintptr_t gate_up, uintptr_t out, int64_t tokens, int64_t inter, int threads) {
    silu_and_mul(reinterpret_cast<const float*>(gate_up), reinterpret_cast<float*>(out), tokens, inter, threads);
  }, "silu(gate) * up of each row of [gate | up], float32", nogil);
  m.def("decode_layers", &decode_layers, "a decode step through every layer, float32, int8_matmul weights", nogil);
  m.def("greedy_passes", &greedy_passes, "a draft model's greedy passes: layers, norm, lm_head, argmax, next embeddings",
        nogil);
  m.attr("KV_FORMATS") = pybind11::make_tuple("float32", "q8_0", "float16");  // by KVFormat
  m.attr("LAYER_FIELDS") = (int)LAYER_FIELDS;
  m.attr("PASS_FIELDS") = (int)PASS_FIELDS;
  m.attr("PROJECTION_PARTS") = pybind11::make_tuple(PARTS[QKV], PARTS[O], PARTS[GATE_UP], PARTS[DOWN]);
}
