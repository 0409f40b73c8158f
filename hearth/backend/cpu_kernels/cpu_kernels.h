// The model's CPU kernels besides the matmuls (hearth/quant/kernels): float32 only, no torch
// headers (the Python side checks shapes and passes data pointers). Each is one call where torch
// would run several small ops, each with its own dispatch and, with several threads, its own
// fork and join: at batch 1 those cost more than the arithmetic.
//
// decode_attention (hearth/backend/cpu.py): a few query rows per sequence (one for a decode,
// k + 1 for the verification of k guesses) against that sequence's cached K/V, read in place
// through its block table: no gather into a padded copy, no mask (each row's causal range is an
// interval of the context). A work item is a split of a sequence with its KV heads (a share of
// them where the splits are fewer than the threads): its K/V rows read into the caches first, every
// head's side by side in a slot (kv_rows.h), then per KV head the sequence's rows and the query
// heads sharing that KV head (GQA) together, so each K/V row is read once for all of them, and
// their sums are computed side by side: the scores with the queries transposed (a
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
// prefill_attention (hearth/backend/cpu.py): a prompt's (or chunk's) new rows against its context gathered in
// position order, causal (and within a sliding window): prefill_attention.cpp says how.
//
// rms_norm (hearth/backend/cpu.py): out = x / sqrt(mean(x^2) + eps) * (w + offset) per row,
// optionally after x += add in place (the residual stream's add fused into the norm's pass).
//
// decode_layers (hearth/backend/cpu_decode.py): a decode step's whole stack of llama layers (its
// sequences' few new rows each: decodes and verifications), or of Qwen3.5's gated attention and
// Gated DeltaNet layers (one row a sequence; the mixer table says each layer's kind), the
// kernels above and the int8 matmul (passed in from hearth/quant/kernels/int8_dots.cpp) called
// in sequence, so that no Python runs between them: at batch 1 the ~25 torch ops a layer costs
// in Python are a fifth of the step, the caches they run in being cold from the weights' stream.
// A projection with activation sparsity runs hearth/quant/kernels' sparse_matmul (also passed in).
//
// greedy_passes (hearth/backend/cpu_decode.py): a draft model's greedy chain of passes in one
// call: per pass decode_layers, the final norm, lm_head and argmax of each sequence's last row,
// and the chosen tokens' embeddings as the next pass's rows. At batch 1 a draft pass's layers are
// ~0.13 ms, and the Python and torch dispatch around them (norm, lm_head, argmax, the next
// pass's inputs) was ~0.3 ms more. One such pass is also the model's own all-greedy decode step
// (CpuBackend._greedy_step), the chosen tokens' log-probabilities written beside them.
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
// q8_0 (hearth/kv_format.py), its KVFormat passed with its pointers. q8_0 is int8 codes
// [slots, KH, D] and float16 scales [slots, KH, D/32]: rope_and_store_kv quantizes each head row
// as it writes it (llama.cpp's quantize_row_q8_0_ref: d = max|x| / 127, codes round(x / d) half
// away from zero; float16: rounded to nearest even, as torch's cast), decode_attention widens each
// row it reads into a D-float buffer in L1 before using it.
//
// conv1d_step, delta_rule_step, ssm_step (hearth/backend/cpu.py, hybrid models' state layers): a decode step
// of a causal depthwise convolution, of the gated delta rule and of Mamba2's scan, each sequence's state
// updated in place in its slot of the state cache (torch gathers the states by slot and scatters them back);
// gated_delta_net_step: a Gated DeltaNet layer's whole decode step between its projections (convolution,
// norms, gates and delta rule), where its torch ops cost more than their arithmetic at batch 1.
//
// lora_add (decode_layers' LoRA adapters, hearth/model/lora.py): after each projection's matmul,
// each row's own adapter's term scale B (A x), the rows grouped by adapter so that each adapter's
// A and B are read once a step for all of its rows (punica's shrink then expand; the matrices of the
// adapters no row uses are not read). The base weights stay on the int8 kernels: a step with
// adapters is the same whole-layer call.
//
// A source per job: kv_rows.h (the KV caches' formats), vector_math.h (exp, a row's argmax),
// attention.cpp (decode_attention), prefill_attention.cpp (prefill_attention), layer_ops.cpp (rms_norm, rope_and_store_kv, silu_and_mul),
// logits.cpp (mask_tokens, argmax_and_logsumexp), decode_layers.cpp (decode_layers,
// greedy_passes), lora.cpp (lora_add), state_ops.cpp (conv1d_step, delta_rule_step, gated_delta_net_step, ssm_step), bindings.cpp (the Python module).
#pragma once

#include <cstdint>
#include <vector>

namespace hearth {

// The entries, each defined in the source of its job (the comments there say what they compute).
void decode_attention(uintptr_t q_, uintptr_t k_, uintptr_t v_, uintptr_t k_scales_, uintptr_t v_scales_,
                      int kv_format, uintptr_t tables_, uintptr_t lens_, uintptr_t query_start_, uintptr_t tree_start_,
                      uintptr_t tree_masks_, uintptr_t sinks_, uintptr_t out_, int64_t num_seqs,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                      int64_t max_blocks, double scale, double softcap, int64_t split_len, int64_t window,
                      int threads);
constexpr int64_t PREFILL_MAX_GROUP = 48;  // query heads a KV head prefill_attention takes: a work item's rows
void prefill_attention(uintptr_t q_, uintptr_t k_, uintptr_t v_, uintptr_t sinks_, uintptr_t out_, int64_t T, int64_t L,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t value_dim, double scale,
                       double softcap, int64_t window, int threads);
void rms_norm(uintptr_t x_, uintptr_t add_, uintptr_t w_, uintptr_t out_, int64_t rows, int64_t dim, double eps,
              double offset, int threads);
void rope_and_store_kv(uintptr_t q_, uintptr_t k_, uintptr_t v_, int64_t q_stride, int64_t k_stride,
                       int64_t v_stride, uintptr_t cos_, uintptr_t sin_, uintptr_t slots_, uintptr_t q_out_,
                       uintptr_t k_cache_, uintptr_t v_cache_, uintptr_t k_scales_, uintptr_t v_scales_,
                       int kv_format, int64_t tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int threads);
void silu_and_mul(const float* gate_up, float* out, int64_t tokens, int64_t inter, int threads);
void mask_tokens(uintptr_t logits_, uintptr_t out_, int64_t num_logit_rows, int64_t row_stride, uintptr_t rows_,
                 int64_t num_rows, uintptr_t bitmask_, int64_t words, int64_t vocab, int threads);
void argmax_and_logsumexp(uintptr_t logits_, int64_t rows, int64_t vocab, int64_t row_stride, uintptr_t ids_,
                          uintptr_t lse_, int threads);
int64_t decode_layers(uintptr_t matmul_, uintptr_t sparse_, uintptr_t table_, uintptr_t mixers_, uintptr_t caches_, int kv_format, int64_t num_layers, uintptr_t residual_,
                   uintptr_t delta_, uintptr_t cos_, uintptr_t sin_, uintptr_t slots_, uintptr_t block_tables_,
                   uintptr_t lens_, uintptr_t query_start_, uintptr_t tree_start_, uintptr_t tree_masks_, uintptr_t lora_,
                   uintptr_t exits_, int64_t num_seqs, int64_t tokens, int64_t hidden, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, int64_t inter, double eps, int64_t block_size, int64_t max_blocks, double scale,
                   int64_t split_len, int64_t window, uintptr_t state_slots_, uintptr_t state_fresh_, double norm_offset,
                   int threads);
void greedy_passes(uintptr_t matmul_, uintptr_t sparse_, uintptr_t dequantize_, uintptr_t table_, uintptr_t mixers_, uintptr_t caches_, int kv_format,
    int64_t num_layers, uintptr_t passes_, int64_t num_passes, uintptr_t first_ids_, uintptr_t choices_,
    uintptr_t logprobs_, uintptr_t embedding_, int64_t embedding_row_bytes, int embedding_qtype, uintptr_t norm_, uintptr_t head_,
    uintptr_t head_terms_, int head_qtype, int64_t vocab, uintptr_t cos_table_, uintptr_t sin_table_,
    int64_t rope_table_rows, int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t inter, double eps,
    int64_t block_size, double scale, int64_t window, int threads);

void conv1d_step(uintptr_t x_, uintptr_t state_, uintptr_t slots_, uintptr_t fresh_, uintptr_t weight_,
                 uintptr_t bias_, uintptr_t out_, int64_t rows, int64_t channels, int64_t taps, int threads);
void delta_rule_step(uintptr_t q_, uintptr_t k_, uintptr_t v_, uintptr_t g_, uintptr_t beta_, uintptr_t state_,
                     uintptr_t slots_, uintptr_t fresh_, uintptr_t out_, int64_t rows, int64_t heads, int64_t dk,
                     int64_t dv, int threads);
void gated_delta_net_step(uintptr_t qkv_, int64_t qkv_stride, uintptr_t z_, int64_t z_stride, uintptr_t b_,
                          int64_t b_stride, uintptr_t a_, int64_t a_stride, uintptr_t conv_weight_,
                          uintptr_t conv_state_, int64_t taps, uintptr_t a_log_, uintptr_t dt_bias_,
                          uintptr_t norm_weight_, double eps, uintptr_t state_, uintptr_t slots_, uintptr_t fresh_,
                          uintptr_t out_, int64_t rows, int64_t key_heads, int64_t value_heads, int64_t dk,
                          int64_t dv, bool tiled, int threads);
void ssm_step(uintptr_t q_, uintptr_t k_, uintptr_t v_, uintptr_t g_, uintptr_t state_, uintptr_t slots_,
              uintptr_t fresh_, uintptr_t out_, int64_t rows, int64_t heads, int64_t n, int64_t p, int threads);

// Columns of decode_layers' layer table (int64 [layers, LAYER_FIELDS]): weight pointers and
// formats, fixed at load. A projection is up to PARTS[p] parts side by side in its output (q, k,
// v in another format each, as llama.cpp's mixed files store them), each PART_FIELDS columns:
// weight or packed codes, packed terms or 0 (int8_matmul's arguments), qtype, output rows (0: no such part),
// and for activation sparsity (docs/sparsity.md) a pointer to the input's float32 threshold (0: dense),
// the weight then in sparse_matmul's layout for its qtype.
enum Projection { QKV, O, GATE_UP, DOWN, PROJECTIONS };
constexpr int PARTS[PROJECTIONS] = {4, 1, 2, 1};  // QKV: a Gated DeltaNet's in_proj has 4 (qkv, z, b, a)
constexpr int PART_FIELDS = 5;
enum LayerField { IN_NORM, POST_NORM, FIRST_PART };
// Columns of decode_layers' mixer table (int64 [layers, MIXER_FIELDS]): what mixes the tokens in each
// layer. ATTENTION: q and k normed per head where Q_NORM / K_NORM point at the norms' weights, their
// dimensions reordered by ROPE_ORDER (int64 [head_dim], partial RoPE: hearth/model/layers.py's
// partial_rotary_order) where it is not 0, and with OUTPUT_GATE (Qwen3.5) q_proj's rows are each head's
// query then its gate, the attention's output times sigmoid(gate); the QKV projection's parts are q, k
// and v. GATED_DELTA_NET: the QKV projection is in_proj (qkv, z, b, a), gated_delta_net_step's weights
// and shapes in the fields after it, its caches (decode_layers' caches table) the convolution's and the
// delta rule's states; the O projection is out_proj.
enum MixerKind { ATTENTION, GATED_DELTA_NET };
enum MixerField { KIND, Q_NORM, K_NORM, ROPE_ORDER, OUTPUT_GATE, CONV_WEIGHT, TAPS, A_LOG, DT_BIAS, GATED_NORM, KEY_HEADS,
                  VALUE_HEADS, KEY_DIM, VALUE_DIM, TILED, MIXER_FIELDS };
constexpr int LAYER_FIELDS = FIRST_PART + (PARTS[QKV] + PARTS[O] + PARTS[GATE_UP] + PARTS[DOWN]) * PART_FIELDS;

// decode_layers' LoRA operands (int64 [LORA_OPERANDS], or none): the LoRA table (int64 [layers,
// LORA_PART_ROWS, LORA_FIELDS]: a row per part of the layer table, in its order), each row's slot
// (int32 [T], -1: none), each slot's scale (float32 [slots]), the rank R every slot is padded to, the
// number of slots. A part's row: its A^T ([slots, in, parts x R]) and B^T ([slots, R, out]) or 0 and
// 0 (no adapters there), their LoraFormat, then the output sizes of the projections it holds side by side
// (hearth's merged q/k/v, gate/up; 0 past the last), each with its own R columns of A x.
enum LoraOperand { LORA_TABLE, LORA_ROW_SLOTS, LORA_SLOT_SCALES, LORA_RANK, LORA_SLOTS, LORA_OPERANDS };
constexpr int MAX_LORA_PARTS = 3;
enum LoraField { LORA_A, LORA_B, LORA_FORMAT, LORA_SIZES, LORA_FIELDS = LORA_SIZES + MAX_LORA_PARTS };
enum LoraFormat { LORA_F32, LORA_BF16 };  // bfloat16 widened to float32 exactly as it is read
constexpr int LORA_PART_ROWS = PARTS[QKV] + PARTS[O] + PARTS[GATE_UP] + PARTS[DOWN];

// decode_layers' exit checks (int64 [EXIT_OPERANDS], or none), CALM's hidden-state saturation
// (hearth/model/calm.py): EXIT_COUNT layer counts (EXIT_LAYERS: int64, increasing, in [1, layers));
// after each, every row t whose threshold (EXIT_THRESHOLDS: float32 [T]) is not +inf gets the cosine
// of its residual stream there and a layer before (EXIT_COSINES: float32 [T], written), and the call
// stops after the first of them where some row's cosine reaches its threshold (-inf: always),
// returning that layer count (else num_layers: it ran through).
enum ExitOperand { EXIT_COUNT, EXIT_LAYERS, EXIT_THRESHOLDS, EXIT_COSINES, EXIT_OPERANDS };

// A step's rows grouped by their LoRA slot (from the operands above): group g's rows are
// rows[starts[g]], ..., rows[starts[g + 1] - 1] (group[i]: the group of rows[i]), all of slot[g],
// scaled by scale[g].
struct LoraGroups {
  LoraGroups(const int64_t* operands, int64_t tokens);
  const int64_t* table;
  int64_t rank, slots;
  std::vector<int64_t> slot, starts, rows, group;
  std::vector<float> scale;
};
void lora_add(const LoraGroups& groups, const int64_t* part, const float* x, int64_t x_stride, float* y,
              int64_t y_stride, int64_t in, std::vector<float>& xa, int threads);

// Columns of greedy_passes' pass table (int64 [passes, PASS_FIELDS]), a row per pass: pointers to
// its rows' cache slots (int64 [T]), its sequences' block tables (int32 [S, max_blocks]), context
// lengths (int32 [S]) and query starts (int32 [S + 1]), its rows' rows of the rope tables (int64 [T]),
// and per row the choice of the pass before whose token it is fed (int64 [T]; the first pass's
// tokens are given); then S, T, max_blocks and split_len (decode_layers' arguments).
enum PassField { SLOTS, BLOCK_TABLES, LENS, QUERY_START, ROPE_ROWS, FEEDS, SEQS, TOKENS, MAX_BLOCKS, SPLIT_LEN,
                 PASS_FIELDS };

}  // namespace hearth
