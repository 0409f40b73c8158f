// The model's CPU kernels besides the matmuls (hearth/quant/kernels): float32 only, no torch
// headers (the Python side checks shapes and passes data pointers). Each is one call where torch
// would run several small ops, each with its own dispatch and, with several threads, its own
// fork and join: at batch 1 those cost more than the arithmetic.
//
// decode_attention (hearth/backend/cpu.py): one query token per sequence against that sequence's cached K/V, read in place through its
// block table: no gather into a padded copy, no mask. A work item is (sequence, KV head, split):
// the query heads sharing that KV head (GQA) go together, so each K/V row is read once for the
// group. A sequence's context is cut into splits of `split_len` tokens (flash-decoding) so that
// a few long sequences still give every thread work; each split keeps its running max m, sum l
// and unnormalised output, and a second pass merges the splits by log-sum-exp:
//   out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s,   M = max_s m_s.
//
// rms_norm (hearth/backend/cpu.py): out = x / sqrt(mean(x^2) + eps) * (w + offset) per row,
// optionally after x += add in place (the residual stream's add fused into the norm's pass).
//
// decode_layers (hearth/backend/cpu_decode.py): a decode step's whole stack of llama layers, the
// kernels above and the int8 matmul (passed in from hearth/quant/kernels/qmatmul.cpp) called
// in sequence, so that no Python runs between them: at batch 1 the ~25 torch ops a layer costs
// in Python are a fifth of the step, the caches they run in being cold from the weights' stream.
//
// rope_and_store_kv (hearth/backend/cpu.py): rotate-half RoPE of each token's q and k heads,
// k written rotated straight into its cache slot and v copied to its slot: one pass where torch
// would run a dozen ops per layer.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

struct Item {
  int64_t seq, kv_head, begin, end, split;  // tokens [begin, end) of the sequence's context
};

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Cache rows fetched ahead while the current one is used: K/V rows sit behind the block table
// and each holds one KV head of a token (a 1/kv_heads slice of the token's row), a pattern the
// hardware prefetcher does not follow; after a step's matmuls have streamed the weights through
// the caches every row comes from DRAM, and without this the kernel runs at its latency.
constexpr int64_t PREFETCH_ROWS = 8;

inline void prefetch_row(const float* row, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(row + i);
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

// q, out [S, H, D]; k_cache, v_cache [slots, KH, D]; block_tables int32 [S, max_blocks];
// context_lens int32 [S]. Every sequence has at least one token. window > 0: the query sees only the
// last `window` positions (sliding-window attention); 0: the whole context.
void decode_attention(uintptr_t q_, uintptr_t k_, uintptr_t v_, uintptr_t tables_, uintptr_t lens_, uintptr_t out_,
                      int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                      int64_t max_blocks, double scale, int64_t split_len, int64_t window, int threads) {
  const float* q = reinterpret_cast<const float*>(q_);
  const float* k_cache = reinterpret_cast<const float*>(k_);
  const float* v_cache = reinterpret_cast<const float*>(v_);
  const int32_t* tables = reinterpret_cast<const int32_t*>(tables_);
  const int32_t* lens = reinterpret_cast<const int32_t*>(lens_);
  float* out = reinterpret_cast<float*>(out_);
  const int64_t group = num_heads / num_kv_heads, D = head_dim;

  std::vector<Item> items;
  std::vector<int64_t> first_split(num_seqs + 1, 0);  // splits of sequence s: [first_split[s], first_split[s+1])
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = lens[s], begin = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t n_splits = (len - begin + split_len - 1) / split_len;
    first_split[s + 1] = first_split[s] + n_splits;
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t i = 0; i < n_splits; ++i)
        items.push_back({s, h, begin + i * split_len, std::min(len, begin + (i + 1) * split_len), first_split[s] + i});
  }
  // per (split, query head): running max, sum of exp, unnormalised output [D]
  const int64_t total_splits = first_split[num_seqs];
  // threads only where there is enough work to pay for waking them (~64K multiply-adds each)
  int64_t work = 0;
  for (int64_t s = 0; s < num_seqs; ++s) work += (int64_t)lens[s] * num_heads * D * 2;
  threads = (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)threads, (int64_t)items.size(), work / 65536}));
  std::vector<float> part_max(total_splits * num_heads), part_sum(total_splits * num_heads);
  std::vector<float> part_out(total_splits * num_heads * D);
  const float fscale = (float)scale;

#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores;  // [group, split_len]
    std::vector<int64_t> rows;  // cache row of each token of the split
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < (int64_t)items.size(); ++w) {
      const Item it = items[w];
      const int64_t n = it.end - it.begin;
      scores.resize(group * n);
      rows.resize(n);
      const int32_t* table = tables + it.seq * max_blocks;
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = it.begin + t;
        rows[t] = ((int64_t)table[pos / block_size] * block_size + pos % block_size) * num_kv_heads + it.kv_head;
      }
      const float* q_group = q + (it.seq * num_heads + it.kv_head * group) * D;
      for (int64_t t = 0; t < std::min(n, PREFETCH_ROWS); ++t) prefetch_row(k_cache + rows[t] * D, D);
      for (int64_t t = 0; t < n; ++t) {
        if (t + PREFETCH_ROWS < n) prefetch_row(k_cache + rows[t + PREFETCH_ROWS] * D, D);
        prefetch_row(v_cache + rows[t] * D, D);  // read after the scores
        const float* k = k_cache + rows[t] * D;
        for (int64_t g = 0; g < group; ++g) scores[g * n + t] = dot(q_group + g * D, k, D) * fscale;
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sc = scores.data() + g * n;
        const float m = *std::max_element(sc, sc + n);
        float l = 0.f;
#pragma omp simd reduction(+ : l)
        for (int64_t t = 0; t < n; ++t) {
          sc[t] = exp_nonpositive(sc[t] - m);
          l += sc[t];
        }
        const int64_t p = it.split * num_heads + it.kv_head * group + g;
        part_max[p] = m;
        part_sum[p] = l;
        std::fill_n(part_out.data() + p * D, D, 0.f);
      }
      for (int64_t t = 0; t < n; ++t) {
        const float* v = v_cache + rows[t] * D;
        for (int64_t g = 0; g < group; ++g) {
          float* acc = part_out.data() + (it.split * num_heads + it.kv_head * group + g) * D;
          const float p = scores[g * n + t];
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) acc[i] += p * v[i];
        }
      }
    }
    // merge the splits of each (sequence, query head)
#pragma omp for collapse(2)
    for (int64_t s = 0; s < num_seqs; ++s) {
      for (int64_t h = 0; h < num_heads; ++h) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = first_split[s]; i < first_split[s + 1]; ++i) m = std::max(m, part_max[i * num_heads + h]);
        float l = 0.f;
        float* o = out + (s * num_heads + h) * D;
        std::fill_n(o, D, 0.f);
        for (int64_t i = first_split[s]; i < first_split[s + 1]; ++i) {
          const int64_t p = i * num_heads + h;
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
  threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, rows * dim / 65536));
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
// [T, D/2]; slots int64 [T]; q_out [T, H, D]; k_cache, v_cache [slots, KH, D]
void rope_and_store_kv(uintptr_t q_, uintptr_t k_, uintptr_t v_, int64_t q_stride, int64_t k_stride,
                       int64_t v_stride, uintptr_t cos_, uintptr_t sin_, uintptr_t slots_, uintptr_t q_out_,
                       uintptr_t k_cache_, uintptr_t v_cache_, int64_t tokens, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int threads) {
  const float* q = reinterpret_cast<const float*>(q_);
  const float* k = reinterpret_cast<const float*>(k_);
  const float* v = reinterpret_cast<const float*>(v_);
  const float* cos = reinterpret_cast<const float*>(cos_);
  const float* sin = reinterpret_cast<const float*>(sin_);
  const int64_t* slots = reinterpret_cast<const int64_t*>(slots_);
  float* q_out = reinterpret_cast<float*>(q_out_);
  float* k_cache = reinterpret_cast<float*>(k_cache_);
  float* v_cache = reinterpret_cast<float*>(v_cache_);
  const int64_t half = head_dim / 2, kv_row = num_kv_heads * head_dim;
  threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, tokens * (num_heads + num_kv_heads) * head_dim / 65536));
#pragma omp parallel for num_threads(threads)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos + t * half;
    const float* s = sin + t * half;
    for (int64_t h = 0; h < num_heads; ++h)
      rope_head(q + t * q_stride + h * head_dim, c, s, q_out + (t * num_heads + h) * head_dim, half);
    for (int64_t h = 0; h < num_kv_heads; ++h)
      rope_head(k + t * k_stride + h * head_dim, c, s, k_cache + slots[t] * kv_row + h * head_dim, half);
    std::memcpy(v_cache + slots[t] * kv_row, v + t * v_stride, kv_row * sizeof(float));
  }
}

// out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]; silu(x) = x / (1 + exp(-x)) with the exp of
// -|x| (so never of a positive number): x >= 0: x / (1 + e), x < 0: x e / (1 + e)
void silu_and_mul(const float* gate_up, float* out, int64_t tokens, int64_t inter) {
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
// weight, packed scales or 0 (int8_matmul's arguments), qtype, output rows (0: no such part).
enum Projection { QKV, O, GATE_UP, DOWN, PROJECTIONS };
constexpr int PARTS[PROJECTIONS] = {3, 1, 2, 1};
constexpr int PART_FIELDS = 4;
enum LayerField { IN_NORM, POST_NORM, FIRST_PART };
constexpr int LAYER_FIELDS = FIRST_PART + (PARTS[QKV] + PARTS[O] + PARTS[GATE_UP] + PARTS[DOWN]) * PART_FIELDS;

// residual [T, hidden]: the embeddings in, the stream before the last layer's MLP addition out
// (in place); delta [T, hidden]: that addition. caches int64 [layers, 2]: K and V cache pointers.
void decode_layers(uintptr_t matmul_, uintptr_t table_, uintptr_t caches_, int64_t num_layers, uintptr_t residual_,
                   uintptr_t delta_, uintptr_t cos_, uintptr_t sin_, uintptr_t slots_, uintptr_t block_tables_,
                   uintptr_t lens_, int64_t tokens, int64_t hidden, int64_t num_heads, int64_t num_kv_heads,
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
    const uintptr_t k_cache = caches[2 * l], v_cache = caches[2 * l + 1];
    rope_and_store_kv(ptr(qkv), ptr(qkv) + q_size * sizeof(float), ptr(qkv) + (q_size + kv_size) * sizeof(float),
                      qkv_size, qkv_size, qkv_size, cos_, sin_, slots_, ptr(q), k_cache, v_cache, tokens, num_heads,
                      num_kv_heads, head_dim, threads);
    decode_attention(ptr(q), k_cache, v_cache, block_tables_, lens_, ptr(attn), tokens, num_heads, num_kv_heads,
                     head_dim, block_size, max_blocks, scale, split_len, window, threads);
    project(layer, O, ptr(attn), delta, hidden, q_size);
    rms_norm(residual_, delta_, layer[POST_NORM], ptr(h), tokens, hidden, eps, 0.0, threads);
    project(layer, GATE_UP, ptr(h), gate_up.data(), 2 * inter, hidden);
    silu_and_mul(gate_up.data(), act.data(), tokens, inter);
    project(layer, DOWN, ptr(act), delta, hidden, inter);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("decode_attention", &decode_attention, "paged decode attention, split-KV, float32", nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (after an optional in-place add), float32", nogil);
  m.def("rope_and_store_kv", &rope_and_store_kv, "RoPE on q and k, k and v into their cache slots, float32", nogil);
  m.def("decode_layers", &decode_layers, "a decode step through every layer, float32, int8-kernel weights", nogil);
  m.attr("LAYER_FIELDS") = (int)LAYER_FIELDS;
  m.attr("PROJECTION_PARTS") = pybind11::make_tuple(PARTS[QKV], PARTS[O], PARTS[GATE_UP], PARTS[DOWN]);
}
