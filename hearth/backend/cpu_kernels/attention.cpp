// decode_attention: a few query rows per sequence against its cached K/V read in place through its
// block table (cpu_kernels.h says how). A work item (a split of a sequence, its KV heads) reads its rows
// into the caches, then per KV head runs three passes: the scores, the softmax's numerators, the
// values; a last pass merges each row's splits.
// A work item's tokens are positions, not cache slots: a token tree's rows (speculative branches)
// each see their own ancestors at the positions past the tree's start, wherever their K/V sit, so
// that every sum runs in position order as when the row's branch is decoded alone (greedy
// speculation with trees keeps plain decoding's tokens bit for bit).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>
#include "cpu_kernels.h"
#include "kv_rows.h"
#include "vector_math.h"

namespace hearth {
namespace {

struct Item {
  // KV heads [head_begin, head_end) of tokens [begin, end) of the sequence's context; split: its number
  int64_t seq, head_begin, head_end, begin, end, split;
};

// decode_attention's scores: query (row, head) pairs a pass (one 16-float vector) and cached rows
// at a time (independent sums in flight)
constexpr int64_t SCORE_LANES = 16, SCORE_TOKENS = 8;
// decode_attention's values: query (row, head) pairs a pass, cached rows a pass, head values a
// slice (one 16-float vector: a pass's sums stay in registers, VALUE_LANES of them)
constexpr int64_t VALUE_LANES = 16, VALUE_TOKENS = 64, VALUE_SLICE = 16;
// lanes_softmax's tokens a pattern: 16 values of the narrowest lanes (4)
constexpr int64_t SOFTMAX_TOKENS = 4;
// touch_item's slots between the rows it prefetches into L2 and those it loads (4-32 measured alike)
constexpr int64_t TOUCH_AHEAD = 8;

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
  for (int64_t c = 0; c < vectors; ++c) exp_shifted(x + c * V, top + c % (P / V) * V, sum + c % (P / V) * V, V);
  for (int64_t j = 0; j < stride; ++j) {
    l[j] = 0.f;
    for (int64_t k = j; k < P; k += stride) l[j] += sum[k];
  }
}

// decode_attention's arguments, shared by its passes (decode_attention's comment says what each is)
struct Attention {
  const float* q;
  KVRows k_cache, v_cache;
  const int32_t *tables, *lens, *query_start, *tree_start;
  const uint64_t* tree_masks;
  const float* sinks;  // [num_heads] or null
  int64_t num_heads, num_kv_heads, group, D, block_size, max_blocks, window;
  float scale, softcap;  // softcap 0: none

  int64_t rows(int64_t s) const { return query_start[s + 1] - query_start[s]; }
  // one past the position of row r of sequence s
  int64_t row_end(int64_t s, int64_t r) const {
    if (tree_masks) return tree_start[s] + __builtin_popcountll(tree_masks[query_start[s] + r]);
    return (int64_t)lens[s] - (query_start[s + 1] - query_start[s]) + 1 + r;
  }
  // the interval [row_begin, row_end) of positions row r of sequence s sees
  int64_t row_begin(int64_t s, int64_t r) const {
    return window > 0 ? std::max<int64_t>(0, row_end(s, r) - window) : (int64_t)0;
  }
  // one past the last position a row of sequence s sees (the context length, but for a tree's)
  int64_t seq_end(int64_t s) const {
    int64_t end = 0;
    for (int64_t r = 0; r < rows(s); ++r) end = std::max(end, row_end(s, r));
    return end;
  }
  // where sequence s's positions stop being its slots: its tree's start (no tree: its length); its
  // tree's nodes are the slots from there to its length, each row's ancestors among them
  int64_t tree_begin(int64_t s) const { return tree_masks ? (int64_t)tree_start[s] : (int64_t)lens[s]; }
};

// The work items, and where each (split, row, query head)'s partial results go.
struct Splits {
  std::vector<Item> items;
  // splits of sequence s: [first_split[s], first_split[s+1]); partial results of its split i and
  // row r: entry first_part[s] + i * rows + r (times num_heads, plus the query head)
  std::vector<int64_t> first_split, first_part, row_seq;
  int64_t work = 0;  // multiply-adds
};

// A work item is a split of a sequence with all its KV heads (their rows side by side in a slot: read
// together, see kv_rows.h), or a share of the heads where the splits are fewer than the threads
Splits plan_splits(const Attention& a, int64_t num_seqs, int64_t split_len, int threads) {
  Splits p;
  p.first_split.assign(num_seqs + 1, 0);
  p.first_part.assign(num_seqs + 1, 0);
  p.row_seq.resize(a.query_start[num_seqs]);
  std::vector<int64_t> begins(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t rows = a.rows(s);
    int64_t begin = a.row_begin(s, 0);
    for (int64_t r = 1; r < rows; ++r) begin = std::min(begin, a.row_begin(s, r));
    begins[s] = begin - begin % SOFTMAX_TOKENS;  // a token's softmax sum (t mod SOFTMAX_TOKENS) by its position
    const int64_t n_splits = (a.seq_end(s) + split_len - 1) / split_len - begins[s] / split_len;
    p.first_split[s + 1] = p.first_split[s] + n_splits;
    p.first_part[s + 1] = p.first_part[s] + n_splits * rows;
    for (int64_t r = 0; r < rows; ++r) p.row_seq[a.query_start[s] + r] = s;
    p.work += (a.seq_end(s) - begins[s]) * rows * a.num_heads * a.D * 2;
  }
  threads = (int)std::min<int64_t>(threads, std::max<int64_t>(1, p.work / 65536));  // (decode_attention's rule)
  const int64_t splits = std::max<int64_t>(1, p.first_split[num_seqs]);
  const int64_t shares = std::clamp<int64_t>((threads + splits - 1) / splits, 1, a.num_kv_heads);
  const int64_t heads = (a.num_kv_heads + shares - 1) / shares;  // a share's
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = a.seq_end(s), first = begins[s] / split_len;
    for (int64_t i = 0; i < p.first_split[s + 1] - p.first_split[s]; ++i)
      for (int64_t h = 0; h < a.num_kv_heads; h += heads)
        p.items.push_back({s, h, std::min(a.num_kv_heads, h + heads), std::max(begins[s], (first + i) * split_len),
                           std::min(len, (first + i + 1) * split_len), i});
  }
  return p;
}

// per (split, row, query head): running max, sum of exp, unnormalised output [D]
struct Parts {
  std::vector<float> max, sum, out;
};

// A thread's buffers. Token-major: the scores (then weights) of token t in [t * stride, t * stride
// + lanes), a cached row's products with 16 lanes one vector store, the softmax vertical across
// lanes and the values' pass one base pointer for every lane's weight.
struct Scratch {
  std::vector<float> scores;  // [split_len, stride]
  std::vector<float> lane_max, lane_sum, pattern;  // lanes_softmax's
  std::vector<int64_t> cache_rows, lo, hi;  // cache row of each token of the split; each query row's part of it
  // a token tree's nodes: their cache rows, their scores by node [nodes, stride], then their weights
  std::vector<int64_t> node_rows;
  std::vector<float> node_scores;
  std::vector<float> row_buf;  // float16 and q8_0 rows widened
  std::vector<float> qt;  // queries transposed (the scores' pass)
  // the values' pass: its cached rows (float16 and q8_0 widened), a scratch row for the lanes past
  // the item's, each lane's sums
  std::vector<float> value_buf, scratch;
  const float* v_rows[VALUE_TOKENS];
  float* sums[VALUE_LANES];

  explicit Scratch(int64_t D)
      : row_buf(SCORE_TOKENS * D), qt(D * 2 * SCORE_LANES), value_buf(VALUE_TOKENS * D), scratch(D) {}
};

// One work item as its passes see it: lane j is the item's query row j / group, its head j % group;
// lanes past them (to 4, 8 or a multiple of 16: the softmax's widths) score 0 and weigh into the
// scratch row.
struct Lanes {
  Item it;
  int64_t kv_head, n, rows, lanes_total, stride, part_row;  // part_row: this split's row 0 in Parts
  // tokens [0, context) are cached rows at their positions; [context, n) a tree's, each row's
  // ancestor there read from the tree's `nodes` (0: the split holds none of the tree's positions)
  int64_t context, nodes;
  const float* q_seq;
};

// the cache rows (slot x KV heads + head) of the sequence's `count` slots from `first`, block by
// block: one division per call, not per token (a 64-bit idiv was ~5% of the kernel)
void slot_rows(const Attention& a, const Item& it, int64_t kv_head, int64_t first, int64_t count, int64_t* out) {
  const int32_t* table = a.tables + it.seq * a.max_blocks;
  for (int64_t t = 0, block = first / a.block_size, offset = first % a.block_size; t < count; ++block, offset = 0) {
    const int64_t first_row = (int64_t)table[block] * a.block_size;
    for (; offset < a.block_size && t < count; ++offset, ++t) out[t] = (first_row + offset) * a.num_kv_heads + kv_head;
  }
}

// The item's rows of every KV head it holds read into the caches (kv_rows.h): its context's tokens and a
// tree's nodes
void touch_item(const Attention& a, const Item& it, Scratch& s) {
  const int64_t tree = a.tree_begin(it.seq), context = std::clamp(tree - it.begin, (int64_t)0, it.end - it.begin);
  const int64_t nodes = context < it.end - it.begin ? a.lens[it.seq] - tree : 0, heads = it.head_end - it.head_begin;
  s.cache_rows.resize(std::max(context, nodes));
  for (const auto [first, count] : {std::pair{it.begin, context}, std::pair{tree, nodes}}) {
    slot_rows(a, it, it.head_begin, first, count, s.cache_rows.data());
    for (int64_t t = 0; t < count; ++t) {
      if (t + TOUCH_AHEAD < count) a.k_cache.prefetch_l2(s.cache_rows[t + TOUCH_AHEAD], heads), a.v_cache.prefetch_l2(s.cache_rows[t + TOUCH_AHEAD], heads);
      a.k_cache.touch(s.cache_rows[t], heads), a.v_cache.touch(s.cache_rows[t], heads);
    }
  }
}

// The lanes of the item's KV head kv_head, its buffers sized, the part of the split each query row sees,
// its tokens' cache rows
Lanes start_item(const Attention& a, const Splits& p, const Item& it, int64_t kv_head, Scratch& s) {
  const int64_t n = it.end - it.begin, rows = a.rows(it.seq);
  const int64_t lanes_total = rows * a.group;
  const int64_t stride = lanes_total <= 4 ? 4 : lanes_total <= 8 ? 8 : (lanes_total + SCORE_LANES - 1) / SCORE_LANES * SCORE_LANES;
  const int64_t chunk = SOFTMAX_TOKENS * stride;  // lanes_softmax's: n * stride values padded with -inf
  s.scores.resize((n * stride + chunk - 1) / chunk * chunk);
  std::fill(s.scores.begin() + n * stride, s.scores.end(), NEG_INF);
  s.lane_max.resize(stride);
  s.lane_sum.resize(stride);
  s.pattern.resize(2 * chunk);
  s.cache_rows.resize(n);
  s.lo.resize(rows);
  s.hi.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {  // split tokens [lo, hi) are the row's to see
    s.lo[r] = std::max<int64_t>(0, a.row_begin(it.seq, r) - it.begin);
    s.hi[r] = std::max(s.lo[r], std::min(n, a.row_end(it.seq, r) - it.begin));
  }
  const int64_t tree = a.tree_begin(it.seq), context = std::clamp(tree - it.begin, (int64_t)0, n);
  const int64_t nodes = context < n ? a.lens[it.seq] - tree : 0;
  slot_rows(a, it, kv_head, it.begin, context, s.cache_rows.data());
  s.node_rows.resize(nodes);
  s.node_scores.resize(nodes * stride);
  slot_rows(a, it, kv_head, tree, nodes, s.node_rows.data());
  const float* q_seq = a.q + a.query_start[it.seq] * a.num_heads * a.D + kv_head * a.group * a.D;
  return {it, kv_head, n, rows, lanes_total, stride, p.first_part[it.seq] + it.split * rows, context, nodes, q_seq};
}

// The scores of LANES lanes from `first` against the n cached rows `rows`, token-major into out
// [n, stride]: the queries transposed in s.qt [D][LANES], so that a cached row's products with all of
// them are vectors of multiply-adds along D, SCORE_TOKENS rows in flight; each lane sums along D in
// order, whatever the other lanes hold
template <int64_t LANES>
void score_rows(const Attention& a, const int64_t* rows, int64_t n, int64_t stride, int64_t first, Scratch& s,
                float* out) {
  const int64_t D = a.D;
  for (int64_t t0 = 0; t0 < n; t0 += SCORE_TOKENS) {
    const int64_t count = std::min(SCORE_TOKENS, n - t0);
    const float* k[SCORE_TOKENS];
    for (int64_t u = 0; u < SCORE_TOKENS; ++u) {  // past the end: the last row again (not stored)
      const int64_t t = t0 + std::min(u, count - 1);
      k[u] = a.k_cache.get(rows[t], s.row_buf.data() + u * D);
    }
    float acc[SCORE_TOKENS][LANES] = {};
    for (int64_t d = 0; d < D; ++d)
      for (int64_t u = 0; u < SCORE_TOKENS; ++u) {
        const float kd = k[u][d];
#pragma omp simd
        for (int64_t j = 0; j < LANES; ++j) acc[u][j] += kd * s.qt[d * LANES + j];
      }
    for (int64_t u = 0; u < count; ++u)
      for (int64_t v = 0; v < LANES; v += SCORE_LANES)
        store_scaled(acc[u] + v, a.scale, std::min(SCORE_LANES, stride - first - v), out + (t0 + u) * stride + first + v);
  }
}

// The scores of LANES lanes from `first` (two vectors of them where more than SCORE_LANES are left:
// each cached row read once for both): the context's tokens, and the tree's nodes by node
template <int64_t LANES>
void score_lanes(const Attention& a, const Lanes& w, int64_t first, Scratch& s) {
  const int64_t D = a.D;
  const int64_t lanes = std::min(LANES, w.lanes_total - first);
  std::fill(s.qt.begin(), s.qt.begin() + D * LANES, 0.f);
  for (int64_t j = 0; j < lanes; ++j) {
    const int64_t row = (first + j) / a.group, head = (first + j) % a.group;
    for (int64_t d = 0; d < D; ++d) s.qt[d * LANES + j] = w.q_seq[(row * a.num_heads + head) * D + d];
  }
  score_rows<LANES>(a, s.cache_rows.data(), w.context, w.stride, first, s, s.scores.data());
  score_rows<LANES>(a, s.node_rows.data(), w.nodes, w.stride, first, s, s.node_scores.data());
}

// Calls f(j, t, node) for each lane j and the tree's split tokens t: the lane's row's ancestor
// `node` at that position (the k-th set bit of its mask: the ancestor at depth k)
template <typename F>
void for_each_ancestor(const Attention& a, const Lanes& w, F f) {
  const int64_t t0 = a.tree_start[w.it.seq] - w.it.begin;
  for (int64_t j = 0; j < w.lanes_total; ++j) {
    uint64_t mask = a.tree_masks[a.query_start[w.it.seq] + j / a.group];
    for (int64_t t = t0; mask; ++t, mask &= mask - 1)
      if (t >= w.context && t < w.n) f(j, t, (int64_t)__builtin_ctzll(mask));
  }
}

// Every lane's scores, a pass 4, 8, 16 or 32 lanes, the fewest that hold the lanes left (wider passes
// for one query row spill their sums out of the registers; a lane's sum is the same in any pass), a
// tree's each lane's ancestors' at their positions; then -inf where a lane's row does not look:
// outside its [lo, hi)
void score_pass(const Attention& a, const Lanes& w, Scratch& s) {
  for (int64_t first = 0; first < w.lanes_total;) {
    const int64_t left = w.lanes_total - first;
    if (left > SCORE_LANES) {
      score_lanes<2 * SCORE_LANES>(a, w, first, s);
      first += 2 * SCORE_LANES;
    } else if (left > 8) {
      score_lanes<SCORE_LANES>(a, w, first, s);
      first += SCORE_LANES;
    } else if (left > 4) {
      score_lanes<8>(a, w, first, s);
      first += 8;
    } else {
      score_lanes<4>(a, w, first, s);
      first += 4;
    }
  }
  const int64_t n = w.n, stride = w.stride;
  if (w.nodes)
    for_each_ancestor(a, w, [&](int64_t j, int64_t t, int64_t node) { s.scores[t * stride + j] = s.node_scores[node * stride + j]; });
  if (a.softcap > 0.f) soft_cap_all(s.scores.data(), n * stride, a.softcap);
  for (int64_t j = 0; j < w.lanes_total; ++j) {
    const int64_t r = j / a.group;
    for (int64_t t = 0; t < std::min(s.lo[r], n); ++t) s.scores[t * stride + j] = NEG_INF;
    for (int64_t t = s.hi[r]; t < n; ++t) s.scores[t * stride + j] = NEG_INF;
  }
}

// The softmax's numerators, every lane side by side; lanes' maxima and sums into their parts (whose
// outputs start at 0)
void softmax_pass(const Attention& a, const Lanes& w, Scratch& s, Parts& parts) {
  lanes_softmax(s.scores.data(), w.n, w.stride, s.lane_max.data(), s.lane_sum.data(), s.pattern.data());
  for (int64_t j = 0; j < w.lanes_total; ++j) {
    const int64_t p = (w.part_row + j / a.group) * a.num_heads + w.kv_head * a.group + j % a.group;
    parts.max[p] = s.lane_max[j];
    parts.sum[p] = s.lane_sum[j];
    std::fill_n(parts.out.data() + p * a.D, a.D, 0.f);
  }
}

// The values of the n cached rows `rows` with their token-major weights [n, stride], VALUE_TOKENS
// rows at a time (float16 and q8_0 rows widened once for all lanes), into the parts' outputs
void weigh_values(const Attention& a, const Lanes& w, const int64_t* rows, const float* weights, int64_t n, Scratch& s,
                  Parts& parts) {
  const int64_t D = a.D, stride = w.stride, lanes_total = w.lanes_total;
  for (int64_t t0 = 0; t0 < n; t0 += VALUE_TOKENS) {
    const int64_t count = std::min(VALUE_TOKENS, n - t0);
    for (int64_t u = 0; u < count; ++u) s.v_rows[u] = a.v_cache.get(rows[t0 + u], s.value_buf.data() + u * D);
    for (int64_t first = 0; first < lanes_total; first += VALUE_LANES) {
      const int64_t lanes = std::min(VALUE_LANES, lanes_total - first);
      for (int64_t j = 0; j < VALUE_LANES; ++j) {
        const int64_t rg = first + j, r = rg / a.group;
        s.sums[j] = j < lanes ? parts.out.data() + ((w.part_row + r) * a.num_heads + w.kv_head * a.group + rg % a.group) * D
                              : s.scratch.data();
      }
      const float* wt = weights + t0 * stride + first;
      if (lanes <= 4) add_weighted_values<4>(wt, stride, s.v_rows, count, D, s.sums);
      else if (lanes <= 8) add_weighted_values<8>(wt, stride, s.v_rows, count, D, s.sums);
      else add_weighted_values<VALUE_LANES>(wt, stride, s.v_rows, count, D, s.sums);
    }
  }
}

// The values: the context's tokens, then a tree's nodes in order, each weighing for the lanes whose
// row's ancestor it is (0 for the others: each lane's sum runs over its positions in order)
void value_pass(const Attention& a, const Lanes& w, Scratch& s, Parts& parts) {
  weigh_values(a, w, s.cache_rows.data(), s.scores.data(), w.context, s, parts);
  if (!w.nodes) return;
  std::fill(s.node_scores.begin(), s.node_scores.end(), 0.f);
  for_each_ancestor(a, w, [&](int64_t j, int64_t t, int64_t node) { s.node_scores[node * w.stride + j] = s.scores[t * w.stride + j]; });
  weigh_values(a, w, s.node_rows.data(), s.node_scores.data(), w.nodes, s, parts);
}

// out [D] of query row `row`, head h: its splits merged in order; a split the row saw nothing of
// weighs exp(-inf) = 0; the head's sink, if any, joins the sum with no value
void merge_splits(const Attention& a, const Splits& p, const Parts& parts, int64_t row, int64_t h, float* out) {
  const int64_t D = a.D, num_heads = a.num_heads;
  const int64_t s = p.row_seq[row], rows = a.rows(s), r = row - a.query_start[s];
  const int64_t n_splits = p.first_split[s + 1] - p.first_split[s];
  float m = a.sinks ? a.sinks[h] : NEG_INF;
  for (int64_t i = 0; i < n_splits; ++i) m = std::max(m, parts.max[(p.first_part[s] + i * rows + r) * num_heads + h]);
  float l = a.sinks ? std::exp(a.sinks[h] - m) : 0.f;
  float* o = out + (row * num_heads + h) * D;
  std::fill_n(o, D, 0.f);
  for (int64_t i = 0; i < n_splits; ++i) {
    const int64_t part = (p.first_part[s] + i * rows + r) * num_heads + h;
    const float c = std::exp(parts.max[part] - m);
    l += c * parts.sum[part];
    const float* acc = parts.out.data() + part * D;
#pragma omp simd
    for (int64_t j = 0; j < D; ++j) o[j] += c * acc[j];
  }
  const float inv = 1.f / l;
  for (int64_t j = 0; j < D; ++j) o[j] *= inv;
}

}  // namespace

// q, out [R, H, D]: the new rows of S sequences end to end, sequence s owning rows
// [query_start[s], query_start[s + 1]) (int32 [S + 1]), at least one each; k_cache, v_cache
// [slots, KH, D] in kv_format (KVFormat; q8_0: int8 codes with float16 scales k_scales, v_scales
// [slots, KH, D/32]); block_tables int32 [S, max_blocks]; context_lens int32 [S], the new rows
// included (their K/V already in the cache). Row r of a sequence with n rows and context len
// sits at position len - n + r and sees positions up to its own (causal among the new rows);
// window > 0: only its last `window` positions (sliding-window attention); 0: all of them.
// Token trees (speculative branches; tree_start, tree_masks null: causal): tree_start int32 [S],
// where sequence s's tree region begins; tree_masks int64 [R], bit j set = the row sees the K/V in
// the region's slot j (its ancestors and itself); it sees every position before the region, its
// ancestor at depth k (its k-th bit set) at position tree_start + k, and its own position is
// tree_start + its bits set - 1 (its depth: the window counts from there).
// sinks float [H] (0: none): a logit per query head that joins each row's softmax with no value
// (gpt-oss's attention sinks). softcap > 0: scores become softcap tanh(scores / softcap) before the softmax
// (gemma2).
// A work item reads each K/V row once for every query row and head of its group.
void decode_attention(uintptr_t q_, uintptr_t k_, uintptr_t v_, uintptr_t k_scales_, uintptr_t v_scales_,
                      int kv_format, uintptr_t tables_, uintptr_t lens_, uintptr_t query_start_, uintptr_t tree_start_,
                      uintptr_t tree_masks_, uintptr_t sinks_, uintptr_t out_, int64_t num_seqs,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                      int64_t max_blocks, double scale, double softcap, int64_t split_len, int64_t window, int threads) {
  const Attention a{reinterpret_cast<const float*>(q_),
                    {reinterpret_cast<const void*>(k_), reinterpret_cast<const _Float16*>(k_scales_), head_dim, kv_format},
                    {reinterpret_cast<const void*>(v_), reinterpret_cast<const _Float16*>(v_scales_), head_dim, kv_format},
                    reinterpret_cast<const int32_t*>(tables_), reinterpret_cast<const int32_t*>(lens_),
                    reinterpret_cast<const int32_t*>(query_start_), reinterpret_cast<const int32_t*>(tree_start_),
                    reinterpret_cast<const uint64_t*>(tree_masks_), reinterpret_cast<const float*>(sinks_), num_heads, num_kv_heads, num_heads / num_kv_heads,
                    head_dim, block_size, max_blocks, window, (float)scale, (float)softcap};
  float* out = reinterpret_cast<float*>(out_);
  const int64_t num_rows = a.query_start[num_seqs];
  const Splits p = plan_splits(a, num_seqs, split_len, threads);
  const int64_t total_parts = p.first_part[num_seqs];
  // threads only where there is enough work to pay for waking them (~64K multiply-adds each)
  threads = (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)threads, (int64_t)p.items.size(), p.work / 65536}));
  Parts parts{std::vector<float>(total_parts * num_heads), std::vector<float>(total_parts * num_heads),
              std::vector<float>(total_parts * num_heads * head_dim)};

#pragma omp parallel num_threads(threads)
  {
    Scratch s(head_dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < (int64_t)p.items.size(); ++w) {
      touch_item(a, p.items[w], s);
      for (int64_t h = p.items[w].head_begin; h < p.items[w].head_end; ++h) {
        const Lanes lanes = start_item(a, p, p.items[w], h, s);
        score_pass(a, lanes, s);
        softmax_pass(a, lanes, s, parts);
        value_pass(a, lanes, s, parts);
      }
    }
#pragma omp for collapse(2)
    for (int64_t row = 0; row < num_rows; ++row) {
      for (int64_t h = 0; h < num_heads; ++h) merge_splits(a, p, parts, row, h, out);
    }
  }
}

}  // namespace hearth
