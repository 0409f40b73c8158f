// A decode step's whole stack of layers in one call, and a draft model's greedy passes, with the
// int8 matmul of hearth/quant/kernels (and its sparse_matmul, for activation sparsity) passed in by address.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>
#include "cpu_kernels.h"
#include "vector_math.h"
#include "../../quant/kernels/qmatmul.h"

namespace hearth {
namespace {

// int8_matmul's, sparse_matmul's and dequantize_rows' types, from their declarations (hearth/quant/kernels/qmatmul.h)
using Int8Matmul = decltype(&int8_matmul);
using SparseMatmul = decltype(&sparse_matmul);
using DequantizeRows = decltype(&dequantize_rows);

// One head's q or k (`in`, head_dim values) RMS-normed by the norm's weight where it has one, then
// reordered by `order` where it is given (out[i] = normed[order[i]]).
void qk_head(const float* in, const float* norm, const int64_t* order, float* out, int64_t dim, double eps,
             double offset) {
  float normed[1024];  // head_dim <= 1024 (checked by hearth/backend/cpu_decode.py)
  float inv = 1.f, sq = 0.f;
  if (norm) {
    for (int64_t i = 0; i < dim; ++i) sq += in[i] * in[i];
    inv = 1.f / std::sqrt(sq / (float)dim + (float)eps);
  }
  for (int64_t i = 0; i < dim; ++i) normed[i] = norm ? (in[i] * inv) * (norm[i] + (float)offset) : in[i];
  for (int64_t i = 0; i < dim; ++i) out[i] = normed[order ? order[i] : i];
}

// qkv [T, width]: q's columns (q_width: each head's query, then with an output gate its gate), k's, v's;
// out [T, heads + kv heads, D]: each token's q heads, then its k heads, through qk_head.
void qk_heads(const float* qkv, int64_t width, int64_t q_width, const int64_t* mixer, float* out, int64_t tokens,
              int64_t heads, int64_t kv_heads, int64_t dim, double eps, double offset, int threads) {
  const float* q_norm = reinterpret_cast<const float*>(mixer[Q_NORM]);
  const float* k_norm = reinterpret_cast<const float*>(mixer[K_NORM]);
  const int64_t* order = reinterpret_cast<const int64_t*>(mixer[ROPE_ORDER]);
  const int64_t q_head_stride = mixer[OUTPUT_GATE] ? 2 * dim : dim;
  threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, tokens * (heads + kv_heads) * dim / 65536));
#pragma omp parallel for num_threads(threads) collapse(2)
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      const bool is_q = h < heads;
      const float* in = qkv + t * width + (is_q ? h * q_head_stride : q_width + (h - heads) * dim);
      qk_head(in, is_q ? q_norm : k_norm, order, out + (t * (heads + kv_heads) + h) * dim, dim, eps, offset);
    }
  }
}

// attn [T, heads x D] times sigmoid of each head's gate (qkv [T, width]: head h's gate at h 2D + D)
void output_gate(float* attn, const float* qkv, int64_t width, int64_t tokens, int64_t heads, int64_t dim) {
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const float* gate = qkv + t * width + h * 2 * dim + dim;
      float* o = attn + (t * heads + h) * dim;
      for (int64_t i = 0; i < dim; ++i) o[i] *= 1.f / (1.f + std::exp(-gate[i]));
    }
}

// CALM's saturation checks (ExitOperand) over the rows' residual streams (stream_t = residual_t + delta_t,
// or residual_t alone before the first layer): `tap` keeps each row's stream a layer before an exit
// layer; at the exit layer `check` writes the cosines and says whether the pass stops there.
class ExitChecks {
 public:
  ExitChecks(uintptr_t exits, int64_t tokens, int64_t hidden) : tokens_(tokens), hidden_(hidden) {
    if (!exits) return;
    const int64_t* e = reinterpret_cast<const int64_t*>(exits);
    layers_.assign(reinterpret_cast<const int64_t*>(e[EXIT_LAYERS]), reinterpret_cast<const int64_t*>(e[EXIT_LAYERS]) + e[EXIT_COUNT]);
    thresholds_ = reinterpret_cast<const float*>(e[EXIT_THRESHOLDS]);
    cosines_ = reinterpret_cast<float*>(e[EXIT_COSINES]);
    tap_.resize(tokens * hidden);
  }
  bool taps_after(int64_t count) const { return std::find(layers_.begin(), layers_.end(), count + 1) != layers_.end(); }
  bool checks_after(int64_t count) const { return std::find(layers_.begin(), layers_.end(), count) != layers_.end(); }
  void tap(const float* residual, const float* delta) {
    for (int64_t i = 0; i < tokens_ * hidden_; ++i) tap_[i] = residual[i] + (delta ? delta[i] : 0.f);
  }
  bool check(const float* residual, const float* delta) {
    bool stop = false;
    for (int64_t t = 0; t < tokens_; ++t) {
      if (thresholds_[t] == INFINITY) continue;
      double dot = 0, before = 0, after = 0;
      for (int64_t i = t * hidden_; i < (t + 1) * hidden_; ++i) {
        const double a = tap_[i], b = residual[i] + delta[i];
        dot += a * b, before += a * a, after += b * b;
      }
      cosines_[t] = before > 0 && after > 0 ? (float)(dot / std::sqrt(before * after)) : 0.f;
      stop |= cosines_[t] >= thresholds_[t];
    }
    return stop;
  }

 private:
  int64_t tokens_, hidden_;
  std::vector<int64_t> layers_;
  const float* thresholds_ = nullptr;
  float* cosines_ = nullptr;
  std::vector<float> tap_;
};

}  // namespace

// rows of sequence s: [query_start[s], query_start[s + 1]), token trees in tree_start and
// tree_masks (as decode_attention's).
// residual [T, hidden]: the embeddings in, the stream before the last layer's MLP addition out
// (in place); delta [T, hidden]: that addition. caches int64 [layers, 4]: K and V cache pointers,
// then their q8_0 scales' (0: not q8_0), every layer's in kv_format. lora: LoRA operands
// (LoraOperand) or 0: each part's matmul followed by its rows' adapters' terms (lora_add). exits:
// CALM's saturation checks (ExitOperand) or 0. Returns the layers run (num_layers but where an exit
// check stopped the pass).
int64_t decode_layers(uintptr_t matmul_, uintptr_t sparse_, uintptr_t table_, uintptr_t mixers_, uintptr_t caches_, int kv_format, int64_t num_layers, uintptr_t residual_,
                   uintptr_t delta_, uintptr_t cos_, uintptr_t sin_, uintptr_t slots_, uintptr_t block_tables_,
                   uintptr_t lens_, uintptr_t query_start_, uintptr_t tree_start_, uintptr_t tree_masks_, uintptr_t lora_,
                   uintptr_t exits_, int64_t num_seqs, int64_t tokens, int64_t hidden, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, int64_t inter, double eps, int64_t block_size, int64_t max_blocks, double scale,
                   int64_t split_len, int64_t window, uintptr_t state_slots_, uintptr_t state_fresh_, double norm_offset,
                   int threads) {
  const Int8Matmul int8 = reinterpret_cast<Int8Matmul>(matmul_);
  const SparseMatmul sparse = reinterpret_cast<SparseMatmul>(sparse_);
  const int64_t* table = reinterpret_cast<const int64_t*>(table_);
  const int64_t* caches = reinterpret_cast<const int64_t*>(caches_);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  std::vector<float> h(tokens * hidden), qkv, q(tokens * q_size), attn(tokens * q_size), qk_in;
  std::vector<float> gate_up(tokens * 2 * inter), act(tokens * inter), part_out, lora_rank_out;
  const auto ptr = [](const std::vector<float>& v) { return reinterpret_cast<uintptr_t>(v.data()); };
  // one part: y [T, rows] = x [T, k] W^T, x masked by the part's threshold where it has one
  const auto matmul = [&](uintptr_t x, const int64_t* part, uintptr_t y, int64_t rows, int64_t k) {
    if (part[4]) sparse(x, part[0], y, tokens, rows, k, (int)part[2], *reinterpret_cast<const float*>(part[4]), threads);
    else int8(x, part[0], part[1], y, tokens, rows, k, (int)part[2], 0, threads);
  };
  std::optional<LoraGroups> lora;
  if (lora_) lora.emplace(reinterpret_cast<const int64_t*>(lora_), tokens);
  const int64_t* lora_layer = nullptr;  // the layer's rows of the LoRA table
  // y [T, n] = x [T, k] W^T, W the projection's parts one after another along n; with adapters, each
  // part's rows' low-rank terms added to its columns
  const auto project = [&](const int64_t* layer, Projection p, uintptr_t x, float* y, int64_t n, int64_t k) {
    int first = 0;  // the projection's first part
    for (int i = 0; i < p; i++) first += PARTS[i];
    for (int64_t i = 0, column = 0; i < PARTS[p]; i++) {
      const int64_t* part = layer + FIRST_PART + (first + i) * PART_FIELDS;
      const int64_t rows = part[3];
      if (rows == 0) break;
      if (rows == n) {  // the whole projection in one format
        matmul(x, part, reinterpret_cast<uintptr_t>(y), n, k);
      } else {
        part_out.resize(tokens * rows);  // [T, rows], then its columns of y
        matmul(x, part, ptr(part_out), rows, k);
        for (int64_t t = 0; t < tokens; ++t)
          std::memcpy(y + t * n + column, part_out.data() + t * rows, rows * sizeof(float));
      }
      const int64_t* lora_part = lora ? lora_layer + (first + i) * LORA_FIELDS : nullptr;
      if (lora_part && lora_part[LORA_A])
        lora_add(*lora, lora_part, reinterpret_cast<const float*>(x), k, y + column, n, k, lora_rank_out, threads);
      column += rows;
      if (rows == n) break;
    }
  };
  float* delta = reinterpret_cast<float*>(delta_);
  const float* residual = reinterpret_cast<const float*>(residual_);
  ExitChecks exits(exits_, tokens, hidden);
  if (exits.taps_after(0)) exits.tap(residual, nullptr);
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* layer = table + l * LAYER_FIELDS;
    const int64_t* mixer = reinterpret_cast<const int64_t*>(mixers_) + l * MIXER_FIELDS;
    if (lora) lora_layer = lora->table + l * LORA_PART_ROWS * LORA_FIELDS;
    rms_norm(residual_, l == 0 ? 0 : delta_, layer[IN_NORM], ptr(h), tokens, hidden, eps, norm_offset, threads);
    int64_t width = 0;  // the QKV projection's output columns: its parts' rows
    for (int i = 0; i < PARTS[QKV]; i++) width += layer[FIRST_PART + i * PART_FIELDS + 3];
    qkv.resize(tokens * width);
    project(layer, QKV, ptr(h), qkv.data(), width, hidden);
    const int64_t* cache = caches + 4 * l;  // K, V, K scales, V scales (a state layer's: its two states)
    int64_t mixed = q_size;  // the O projection's input columns
    if (mixer[KIND] == GATED_DELTA_NET) {
      const int64_t channels = 2 * mixer[KEY_HEADS] * mixer[KEY_DIM] + mixer[VALUE_HEADS] * mixer[VALUE_DIM];
      mixed = mixer[VALUE_HEADS] * mixer[VALUE_DIM];
      attn.resize(tokens * mixed);
      const uintptr_t z = ptr(qkv) + channels * sizeof(float), b = z + mixed * sizeof(float), a = b + mixer[VALUE_HEADS] * sizeof(float);
      gated_delta_net_step(ptr(qkv), width, z, width, b, width, a, width, mixer[CONV_WEIGHT], cache[0], mixer[TAPS],
                           mixer[A_LOG], mixer[DT_BIAS], mixer[GATED_NORM], eps, cache[1], state_slots_, state_fresh_,
                           ptr(attn), tokens, mixer[KEY_HEADS], mixer[VALUE_HEADS], mixer[KEY_DIM], mixer[VALUE_DIM],
                           mixer[TILED] != 0, threads);
    } else {
      attn.resize(tokens * q_size);
      uintptr_t q_in = ptr(qkv), k_in = ptr(qkv) + q_size * sizeof(float);
      int64_t q_stride = width, k_stride = width;
      const bool reshaped = mixer[Q_NORM] || mixer[K_NORM] || mixer[ROPE_ORDER] || mixer[OUTPUT_GATE];
      if (reshaped) {  // q and k normed and reordered per head into qk_in [T, heads + kv heads, head_dim]
        const int64_t q_width = q_size * (1 + (mixer[OUTPUT_GATE] != 0));
        qk_in.resize(tokens * (q_size + kv_size));
        qk_heads(qkv.data(), width, q_width, mixer, qk_in.data(), tokens, num_heads, num_kv_heads, head_dim, eps,
                 norm_offset, threads);
        q_in = ptr(qk_in), k_in = q_in + q_size * sizeof(float), q_stride = k_stride = q_size + kv_size;
      }
      const uintptr_t v_in = ptr(qkv) + (width - kv_size) * sizeof(float);
      rope_and_store_kv(q_in, k_in, v_in, q_stride, k_stride, width, cos_, sin_, slots_, ptr(q), cache[0], cache[1],
                        cache[2], cache[3], kv_format, tokens, num_heads, num_kv_heads, head_dim, threads);
      decode_attention(ptr(q), cache[0], cache[1], cache[2], cache[3], kv_format, block_tables_, lens_, query_start_,
                       tree_start_, tree_masks_, 0, ptr(attn), num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                       max_blocks, scale, 0.0, split_len, window, threads);
      if (mixer[OUTPUT_GATE]) output_gate(attn.data(), qkv.data(), width, tokens, num_heads, head_dim);
    }
    project(layer, O, ptr(attn), delta, hidden, mixed);
    rms_norm(residual_, delta_, layer[POST_NORM], ptr(h), tokens, hidden, eps, norm_offset, threads);
    project(layer, GATE_UP, ptr(h), gate_up.data(), 2 * inter, hidden);
    silu_and_mul(gate_up.data(), act.data(), tokens, inter, threads);
    project(layer, DOWN, ptr(act), delta, hidden, inter);
    if (exits.checks_after(l + 1) && exits.check(residual, delta)) return l + 1;
    if (exits.taps_after(l + 1)) exits.tap(residual, delta);  // (after the check: consecutive exit layers)
  }
  return num_layers;
}

// Greedy passes (hearth/backend/cpu_decode.py; a draft model's chain, or one pass of the model's own greedy
// decode step): per pass, decode_layers on its rows, then for each sequence's last row the final norm, lm_head
// (matmul: the weight, its terms or 0, its qtype and rows `vocab`) and the argmax (row_argmax, as torch's),
// written to choices; a later pass's rows are the embeddings of the choices they are fed (rows of
// embedding_row_bytes in embedding_qtype, widened by hearth/quant/kernels' dequantize_rows).
// first_ids int64 [the first pass's T]; choices int64 [the passes' S, end to end]; logprobs float32 [the same]
// (0: none): each choice's log-probability, its logit less the row's log-sum-exp (argmax_and_logsumexp's).
// cos_table / sin_table float32 [rope_table_rows, head_dim / 2]: a row's cos and sin are the rows of them its
// pass's ROPE_ROWS name (gathered here: in Python, torch's indexing cost ~80 us of a small model's step).
void greedy_passes(uintptr_t matmul_, uintptr_t sparse_, uintptr_t dequantize_, uintptr_t table_, uintptr_t mixers_, uintptr_t caches_, int kv_format,
                   int64_t num_layers,
                   uintptr_t passes_, int64_t num_passes, uintptr_t first_ids_, uintptr_t choices_, uintptr_t logprobs_,
                   uintptr_t embedding_, int64_t embedding_row_bytes, int embedding_qtype, uintptr_t norm_,
                   uintptr_t head_, uintptr_t head_terms_, int head_qtype, int64_t vocab, uintptr_t cos_table_,
                   uintptr_t sin_table_, int64_t rope_table_rows, int64_t hidden,
                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t inter, double eps,
                   int64_t block_size, double scale, int64_t window, int threads) {
  const Int8Matmul matmul = reinterpret_cast<Int8Matmul>(matmul_);
  const DequantizeRows dequantize = reinterpret_cast<DequantizeRows>(dequantize_);
  const int64_t* first_ids = reinterpret_cast<const int64_t*>(first_ids_);
  int64_t* choices = reinterpret_cast<int64_t*>(choices_);
  const float* cos_table = reinterpret_cast<const float*>(cos_table_);
  const float* sin_table = reinterpret_cast<const float*>(sin_table_);
  const int64_t half = head_dim / 2;
  std::vector<float> residual, delta, last, logits, cos, sin;
  const auto ptr = [](std::vector<float>& v, int64_t offset = 0) {
    return reinterpret_cast<uintptr_t>(v.data() + offset);
  };
  const int64_t* fed = nullptr;  // the choices of the pass before
  for (int64_t p = 0; p < num_passes; ++p) {
    const int64_t* pass = reinterpret_cast<const int64_t*>(passes_) + p * PASS_FIELDS;
    const int64_t tokens = pass[TOKENS], seqs = pass[SEQS];
    const int64_t* feeds = reinterpret_cast<const int64_t*>(pass[FEEDS]);
    const int64_t* rope_rows = reinterpret_cast<const int64_t*>(pass[ROPE_ROWS]);
    residual.resize(tokens * hidden);
    delta.resize(tokens * hidden);
    cos.resize(tokens * half);
    sin.resize(tokens * half);
    for (int64_t t = 0; t < tokens; ++t) {
      if (rope_rows[t] < 0 || rope_rows[t] >= rope_table_rows)
        throw std::out_of_range("greedy_passes: position " + std::to_string(rope_rows[t]) + " outside the rope table's " +
                                std::to_string(rope_table_rows) + " rows");
      std::copy_n(cos_table + rope_rows[t] * half, half, cos.data() + t * half);
      std::copy_n(sin_table + rope_rows[t] * half, half, sin.data() + t * half);
      const int64_t token = p == 0 ? first_ids[t] : fed[feeds[t]];
      dequantize(embedding_ + token * embedding_row_bytes, ptr(residual, t * hidden), 1, hidden, embedding_row_bytes,
                 embedding_qtype, 1);
    }
    decode_layers(matmul_, sparse_, table_, mixers_, caches_, kv_format, num_layers, ptr(residual), ptr(delta), ptr(cos), ptr(sin), pass[SLOTS],
                  pass[BLOCK_TABLES], pass[LENS], pass[QUERY_START], 0, 0, 0, 0, seqs, tokens, hidden, num_heads,
                  num_kv_heads, head_dim, inter, eps, block_size, pass[MAX_BLOCKS], scale, pass[SPLIT_LEN], window,
                  0, 0, 0.0, threads);
    const int32_t* query_start = reinterpret_cast<const int32_t*>(pass[QUERY_START]);
    last.resize(seqs * hidden);
    for (int64_t s = 0; s < seqs; ++s) {
      const int64_t row = (query_start[s + 1] - 1) * hidden;
      rms_norm(ptr(residual, row), ptr(delta, row), norm_, ptr(last, s * hidden), 1, hidden, eps, 0.0, 1);
    }
    logits.resize(seqs * vocab);
    matmul(ptr(last), head_, head_terms_, ptr(logits), seqs, vocab, hidden, head_qtype, 0, threads);
    if (logprobs_) {
      float* logprobs = reinterpret_cast<float*>(logprobs_) + (choices - reinterpret_cast<int64_t*>(choices_));
      argmax_and_logsumexp(ptr(logits), seqs, vocab, vocab, reinterpret_cast<uintptr_t>(choices),
                           reinterpret_cast<uintptr_t>(logprobs), threads);  // the log-sum-exp, then less the logit
      for (int64_t s = 0; s < seqs; ++s) logprobs[s] = logits[s * vocab + choices[s]] - logprobs[s];
    } else {
      for (int64_t s = 0; s < seqs; ++s) choices[s] = row_argmax(logits.data() + s * vocab, vocab).at;
    }
    fed = choices;
    choices += seqs;
  }
}

}  // namespace hearth
