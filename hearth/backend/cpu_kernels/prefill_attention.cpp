// prefill_attention: a prompt's (or a chunk's) T new rows against its whole context of L positions, causal,
// as flash attention does it on a CPU. A work item is (KV head, a few consecutive query positions): its rows are
// those positions' query heads that share the KV head (GQA), up to ITEM_ROWS of them, so that each key and
// value is read once for all of them. It walks the keys in blocks of KEYS: the block's scores as a small matrix
// product (ROW_GROUP rows x SCORE_SLICE keys of sums in registers, key vectors and a broadcast query value a
// step), soft-capping, the causal and window masks, an online softmax (running max m, sum l, the output
// rescaled by exp(m - m'); with sinks, m and l start at the row's sink and 1), then the weighted values
// (ROW_GROUP rows x a value slice in registers). Blocks past an item's last position are never read: about
// half of a prompt's score matrix is skipped (torch's CPU SDPA splits keys by 512 and computes the whole
// square for shorter prompts). Keys are transposed once per call into blocks [D][KEYS], shared by every item.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_kernels.h"
#include "vector_math.h"

namespace hearth {
namespace {

constexpr int64_t KEYS = 64;       // keys a block
constexpr int64_t ITEM_ROWS = PREFILL_MAX_GROUP;  // rows (positions x the KV head's query heads) a work item
// rows whose sums sit in registers together, and how many sums of each: AVX-512's 32 registers hold 6 x 64 floats
// (24 vectors) beside the keys' 4; AVX2's 16 hold 4 x 16 (8 vectors; 6 x 64 spills: no faster than SDPA)
#ifdef __AVX512F__
constexpr int64_t ROW_GROUP = 6, SCORE_SLICE = 64, VALUE_SLICE = 64;
#else
constexpr int64_t ROW_GROUP = 4, SCORE_SLICE = 16, VALUE_SLICE = 16;
#endif

struct Prefill {
  const float *q, *k, *v;
  const float* sinks;  // [H] or null
  float* out;
  int64_t T, L, H, KH, G, D, Dv, window;
  float scale, softcap;  // softcap 0: none
  std::vector<float> kt;  // [KH][blocks][D][KEYS], zero past L

  int64_t position(int64_t i) const { return L - T + i; }  // of new row i
  int64_t blocks() const { return (L + KEYS - 1) / KEYS; }
  const float* key_block(int64_t h, int64_t b) const { return kt.data() + (h * blocks() + b) * D * KEYS; }
};

void transpose_keys(Prefill& a, int threads) {
  a.kt.assign(a.KH * a.blocks() * a.D * KEYS, 0.f);
#pragma omp parallel for collapse(2) num_threads(threads)
  for (int64_t h = 0; h < a.KH; ++h)
    for (int64_t b = 0; b < a.blocks(); ++b) {
      float* kt = a.kt.data() + (h * a.blocks() + b) * a.D * KEYS;
      for (int64_t j = 0; j < std::min(KEYS, a.L - b * KEYS); ++j) {
        const float* key = a.k + ((b * KEYS + j) * a.KH + h) * a.D;
        for (int64_t d = 0; d < a.D; ++d) kt[d * KEYS + j] = key[d];
      }
    }
}

// A work item's state: its rows' queries and outputs, running max and sum, and its scratch.
struct Item {
  int64_t h, i0, positions, rows;  // KV head, first new row, new rows, rows (positions x G)
  const float* q[ITEM_ROWS];
  float s[ITEM_ROWS][KEYS];  // a block's scores, then the softmax's numerators
  float m[ITEM_ROWS], l[ITEM_ROWS];
  std::vector<float> o;  // [ITEM_ROWS][Dv] unnormalised outputs
  float shift[KEYS], sum[KEYS];
};

// s[r][j] = scale q_r . k_j over the key block, for ROW_GROUP rows from r0 (rows past the item: its last again),
// SCORE_SLICE keys at a time
inline void group_scores(const Prefill& a, Item& it, int64_t r0, const float* kt) {
  const float* q[ROW_GROUP];
  for (int64_t r = 0; r < ROW_GROUP; ++r) q[r] = it.q[std::min(r0 + r, it.rows - 1)];
  for (int64_t j0 = 0; j0 < KEYS; j0 += SCORE_SLICE) {
    float acc[ROW_GROUP][SCORE_SLICE] = {};
    for (int64_t d = 0; d < a.D; ++d) {
      const float* kd = kt + d * KEYS + j0;
      for (int64_t r = 0; r < ROW_GROUP; ++r) {
        const float x = q[r][d];
#pragma omp simd
        for (int64_t j = 0; j < SCORE_SLICE; ++j) acc[r][j] += x * kd[j];
      }
    }
    for (int64_t r = 0; r < std::min(ROW_GROUP, it.rows - r0); ++r)
#pragma omp simd
      for (int64_t j = 0; j < SCORE_SLICE; ++j) it.s[r0 + r][j0 + j] = acc[r][j] * a.scale;
  }
}

// o[r][d0, d0 + W) += sum_j p[r][j] v_j[d0, d0 + W) over the block's n keys, for ROW_GROUP rows from r0
template <int64_t W>
inline void group_values(const Prefill& a, Item& it, int64_t r0, int64_t j0, int64_t n, int64_t d0) {
  const int64_t rows = std::min(ROW_GROUP, it.rows - r0);
  float acc[ROW_GROUP][W];
  for (int64_t r = 0; r < ROW_GROUP; ++r)
    for (int64_t i = 0; i < W; ++i) acc[r][i] = r < rows ? it.o[(r0 + r) * a.Dv + d0 + i] : 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = a.v + ((j0 + j) * a.KH + it.h) * a.Dv + d0;
    for (int64_t r = 0; r < ROW_GROUP; ++r) {
      const float w = it.s[std::min(r0 + r, it.rows - 1)][j];
#pragma omp simd
      for (int64_t i = 0; i < W; ++i) acc[r][i] += w * vj[i];
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < W; ++i) it.o[(r0 + r) * a.Dv + d0 + i] = acc[r][i];
}

// The masks and the online softmax of row r over a block's scores (keys from j0, n of them): s[r] becomes
// exp(s - m') (0 where masked), l and the output are carried over to the new max m'
inline void row_softmax(const Prefill& a, Item& it, int64_t r, int64_t j0, int64_t n) {
  const int64_t p = a.position(it.i0 + r / a.G);
  // the block's keys [lo, hi) are seen: [p - window + 1, p] (window 0: [0, p]) within the block's n
  const int64_t lo = a.window > 0 ? std::clamp<int64_t>(p - a.window + 1 - j0, 0, KEYS) : 0;
  const int64_t hi = std::clamp<int64_t>(std::min(p + 1 - j0, n), 0, KEYS);
  float* s = it.s[r];
  if (hi <= lo) {  // nothing seen here: the row adds nothing
    std::fill_n(s, KEYS, 0.f);
    return;
  }
  if (a.softcap > 0.f) soft_cap_all(s + lo, hi - lo, a.softcap);
  std::fill(s, s + lo, NEG_INF);
  std::fill(s + hi, s + KEYS, NEG_INF);
  float lanes[16];  // the maximum as 16 running ones (a reduction GCC leaves scalar otherwise)
  std::fill_n(lanes, 16, it.m[r]);
  for (int64_t c = 0; c < KEYS; c += 16)
#pragma omp simd
    for (int64_t k = 0; k < 16; ++k) lanes[k] = lanes[k] > s[c + k] ? lanes[k] : s[c + k];
  const float top = *std::max_element(lanes, lanes + 16);
  const float carry = it.m[r] == NEG_INF ? 0.f : exp_nonpositive(it.m[r] - top);
  std::fill_n(it.shift, KEYS, top);
  std::fill_n(it.sum, KEYS, 0.f);
  exp_shifted(s, it.shift, it.sum, KEYS);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < KEYS; ++j) total += it.sum[j];
  it.l[r] = it.l[r] * carry + total;
  it.m[r] = top;
  float* o = it.o.data() + r * a.Dv;
#pragma omp simd
  for (int64_t i = 0; i < a.Dv; ++i) o[i] *= carry;
}

void run_item(const Prefill& a, Item& it) {
  for (int64_t r = 0; r < it.rows; ++r) {
    it.q[r] = a.q + ((it.i0 + r / a.G) * a.H + it.h * a.G + r % a.G) * a.D;
    // a sink: a logit in the softmax with no value, its share exp(sink - m) in l from the start
    it.m[r] = a.sinks ? a.sinks[it.h * a.G + r % a.G] : NEG_INF;
    it.l[r] = a.sinks ? 1.f : 0.f;
  }
  std::fill_n(it.o.begin(), it.rows * a.Dv, 0.f);
  const int64_t last = a.position(it.i0 + it.positions - 1);
  const int64_t first = a.window > 0 ? std::max<int64_t>(0, a.position(it.i0) - a.window + 1) : 0;
  for (int64_t b = first / KEYS; b * KEYS <= last; ++b) {
    const int64_t j0 = b * KEYS, n = std::min(KEYS, last + 1 - j0);
    for (int64_t r0 = 0; r0 < it.rows; r0 += ROW_GROUP) group_scores(a, it, r0, a.key_block(it.h, b));
    for (int64_t r = 0; r < it.rows; ++r) row_softmax(a, it, r, j0, n);
    for (int64_t r0 = 0; r0 < it.rows; r0 += ROW_GROUP) {
      int64_t d0 = 0;
      for (; d0 + VALUE_SLICE <= a.Dv; d0 += VALUE_SLICE) group_values<VALUE_SLICE>(a, it, r0, j0, n, d0);
      for (; d0 + 16 <= a.Dv; d0 += 16) group_values<16>(a, it, r0, j0, n, d0);
      for (; d0 < a.Dv; ++d0) group_values<1>(a, it, r0, j0, n, d0);
    }
  }
  for (int64_t r = 0; r < it.rows; ++r) {
    float* out = a.out + ((it.i0 + r / a.G) * a.H + it.h * a.G + r % a.G) * a.Dv;
    const float inv = 1.f / it.l[r];
    for (int64_t i = 0; i < a.Dv; ++i) out[i] = it.o[r * a.Dv + i] * inv;
  }
}

}  // namespace

// q [T, H, D], k [L, KH, D], v [L, KH, Dv] contiguous float32 (the context's K/V gathered in position order, the
// T new rows the last of them) -> out [T, H, Dv]; new row i at position L - T + i sees positions [p - window + 1, p]
// (window 0: [0, p]); query head x uses KV head x / (H / KH). sinks: float [H] (0: none), a logit per query head
// that joins each row's softmax with no value (gpt-oss's attention sinks). softcap > 0: scores become
// softcap tanh(scores / softcap) before the softmax (gemma2).
void prefill_attention(uintptr_t q_, uintptr_t k_, uintptr_t v_, uintptr_t sinks_, uintptr_t out_, int64_t T, int64_t L,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t value_dim, double scale,
                       double softcap, int64_t window, int threads) {
  Prefill a{reinterpret_cast<const float*>(q_), reinterpret_cast<const float*>(k_), reinterpret_cast<const float*>(v_),
            reinterpret_cast<const float*>(sinks_), reinterpret_cast<float*>(out_), T, L, num_heads, num_kv_heads,
            num_heads / num_kv_heads, head_dim, value_dim, window, (float)scale, (float)softcap, {}};
  if (a.G > ITEM_ROWS)
    throw std::invalid_argument("prefill_attention: more than " + std::to_string(ITEM_ROWS) + " query heads a KV head");
  transpose_keys(a, threads);
  const int64_t per_item = std::max<int64_t>(1, ITEM_ROWS / a.G);  // positions a work item
  const int64_t spans = (T + per_item - 1) / per_item, items = spans * a.KH;
#pragma omp parallel num_threads(threads)
  {
    Item it;
    it.o.resize(ITEM_ROWS * a.Dv);
    // the last positions see the most keys: handed out first
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < items; ++w) {
      const int64_t span = spans - 1 - w / a.KH;
      it.h = w % a.KH;
      it.i0 = span * per_item;
      it.positions = std::min(per_item, T - it.i0);
      it.rows = it.positions * a.G;
      run_item(a, it);
    }
  }
}

}  // namespace hearth
