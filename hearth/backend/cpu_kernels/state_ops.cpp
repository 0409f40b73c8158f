// The state layers' decode steps (hybrid models: hearth/backend/state_ops.py has the torch forms they
// are tested against): one new row per sequence, its state read and written in place in its slot of
// the state cache, where torch gathers the states by slot, computes, and scatters them back.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"
#include "vector_math.h"

namespace hearth {

namespace {

// One channel's step: its window (the last `width` inputs, oldest first) against the K = width + 1 taps w,
// then shifted by `input`; the convolution's output (no activation).
inline float conv_channel(float* window, const float* w, float input, float bias, int64_t width) {
  float sum = bias;
  for (int64_t j = 0; j < width; ++j) sum += w[j] * window[j];
  for (int64_t j = 0; j + 1 < width; ++j) window[j] = window[j + 1];
  window[width - 1] = input;
  return sum + w[width] * input;
}

// One head's delta rule step on its state S [dk, dv], with decay a = exp(g): S' = a S + k d^T with
// d = beta (v - a S^T k), and out = S'^T q = a S^T q + (k . q) d. S is read twice and written once: a
// first pass reads S^T k and S^T q, a second (S then in L2) updates it.
inline void delta_rule_head(float* S, const float* q, const float* k, const float* v, float decay, float beta,
                            float* out, int64_t dk, int64_t dv) {
  float delta[1024], sq[1024];  // dv <= 1024 (checked by the caller)
  std::fill(delta, delta + dv, 0.f);
  std::fill(sq, sq + dv, 0.f);
  float kq = 0.f;
  for (int64_t i = 0; i < dk; ++i) {  // delta = S^T k; sq = S^T q
    const float* Si = S + i * dv;
    const float ki = k[i], qi = q[i];
    kq += ki * qi;
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) {
      delta[j] += ki * Si[j];
      sq[j] += qi * Si[j];
    }
  }
#pragma omp simd
  for (int64_t j = 0; j < dv; ++j) {
    delta[j] = (v[j] - decay * delta[j]) * beta;
    out[j] = decay * sq[j] + kq * delta[j];
  }
  for (int64_t i = 0; i < dk; ++i) {  // S = a S + k delta^T
    float* Si = S + i * dv;
    const float ki = k[i];
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) Si[j] = decay * Si[j] + ki * delta[j];
  }
}

}  // namespace

// x, out [D, C]; state [slots, C, K - 1] (a sequence's last K - 1 inputs per channel, oldest first);
// slots int64 [D]; fresh uint8 [D] (1: the sequence starts here, its window is zeros); weight [C, K];
// bias [C] or null. out = the causal convolution's output (no activation); the window shifts by x.
void conv1d_step(uintptr_t x_, uintptr_t state_, uintptr_t slots_, uintptr_t fresh_, uintptr_t weight_,
                 uintptr_t bias_, uintptr_t out_, int64_t rows, int64_t channels, int64_t taps, int threads) {
  const float* x = reinterpret_cast<const float*>(x_);
  float* state = reinterpret_cast<float*>(state_);
  const int64_t* slots = reinterpret_cast<const int64_t*>(slots_);
  const uint8_t* fresh = reinterpret_cast<const uint8_t*>(fresh_);
  const float* weight = reinterpret_cast<const float*>(weight_);
  const float* bias = reinterpret_cast<const float*>(bias_);
  float* out = reinterpret_cast<float*>(out_);
  const int64_t width = taps - 1;
  threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, rows * channels * taps / 16384));
#pragma omp parallel for num_threads(threads) collapse(2)
  for (int64_t d = 0; d < rows; ++d) {
    for (int64_t c = 0; c < channels; ++c) {
      float* window = state + (slots[d] * channels + c) * width;
      if (fresh[d]) std::fill(window, window + width, 0.f);
      out[d * channels + c] = conv_channel(window, weight + c * taps, x[d * channels + c], bias ? bias[c] : 0.f, width);
    }
  }
}

// q, k [D, H, dk]; v, out [D, H, dv]; g, beta [D, H]; state [slots, H, dk, dv]; slots int64 [D];
// fresh uint8 [D]. Per (sequence, head): delta_rule_head with a = exp(g).
void delta_rule_step(uintptr_t q_, uintptr_t k_, uintptr_t v_, uintptr_t g_, uintptr_t beta_, uintptr_t state_,
                     uintptr_t slots_, uintptr_t fresh_, uintptr_t out_, int64_t rows, int64_t heads, int64_t dk,
                     int64_t dv, int threads) {
  const float* q = reinterpret_cast<const float*>(q_);
  const float* k = reinterpret_cast<const float*>(k_);
  const float* v = reinterpret_cast<const float*>(v_);
  const float* g = reinterpret_cast<const float*>(g_);
  const float* beta = reinterpret_cast<const float*>(beta_);
  float* state = reinterpret_cast<float*>(state_);
  const int64_t* slots = reinterpret_cast<const int64_t*>(slots_);
  const uint8_t* fresh = reinterpret_cast<const uint8_t*>(fresh_);
  float* out = reinterpret_cast<float*>(out_);
  threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, rows * heads * dk * dv / 16384));
#pragma omp parallel for num_threads(threads) collapse(2)
  for (int64_t d = 0; d < rows; ++d) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t row = d * heads + h;
      float* S = state + (slots[d] * heads + h) * dk * dv;
      if (fresh[d]) std::fill(S, S + dk * dv, 0.f);
      delta_rule_head(S, q + row * dk, k + row * dk, v + row * dv, std::exp(g[row]), beta[row], out + row * dv, dk, dv);
    }
  }
}

// A Gated DeltaNet layer's decode step between in_proj and out_proj (hearth/model/state_layers.py's
// GatedDeltaNet, one row per sequence), what its torch ops do in one pass: the causal convolution (SiLU)
// of qkv's channels, q and k L2-normalised per key head (q also scaled by dk^-0.5), g = -exp(A_log)
// softplus(a + dt_bias), beta = sigmoid(b), the delta rule per value head, its output RMS-normed (eps, the
// norm's weight [dv]) and gated by SiLU(z). Row d of qkv [D, C = 2 KH dk + VH dv], z [D, VH dv] and
// b, a [D, VH] starts at d times its stride; conv_weight [C, K]; conv_state [slots, C, K - 1] and state
// [slots, VH, dk, dv] in place; slots int64 [D], fresh uint8 [D]; out [D, VH dv]. Value head h reads key
// head h % KH (tiled) or h / (VH / KH).
void gated_delta_net_step(uintptr_t qkv_, int64_t qkv_stride, uintptr_t z_, int64_t z_stride, uintptr_t b_,
                          int64_t b_stride, uintptr_t a_, int64_t a_stride, uintptr_t conv_weight_,
                          uintptr_t conv_state_, int64_t taps, uintptr_t a_log_, uintptr_t dt_bias_,
                          uintptr_t norm_weight_, double eps, uintptr_t state_, uintptr_t slots_, uintptr_t fresh_,
                          uintptr_t out_, int64_t rows, int64_t key_heads, int64_t value_heads, int64_t dk,
                          int64_t dv, bool tiled, int threads) {
  const float* qkv = reinterpret_cast<const float*>(qkv_);
  const float* z = reinterpret_cast<const float*>(z_);
  const float* b = reinterpret_cast<const float*>(b_);
  const float* a = reinterpret_cast<const float*>(a_);
  const float* conv_weight = reinterpret_cast<const float*>(conv_weight_);
  float* conv_state = reinterpret_cast<float*>(conv_state_);
  const float* a_log = reinterpret_cast<const float*>(a_log_);
  const float* dt_bias = reinterpret_cast<const float*>(dt_bias_);
  const float* norm_weight = reinterpret_cast<const float*>(norm_weight_);
  float* state = reinterpret_cast<float*>(state_);
  const int64_t* slots = reinterpret_cast<const int64_t*>(slots_);
  const uint8_t* fresh = reinterpret_cast<const uint8_t*>(fresh_);
  float* out = reinterpret_cast<float*>(out_);
  const int64_t channels = 2 * key_heads * dk + value_heads * dv, width = taps - 1;
  std::vector<float> mixed(rows * channels);  // [D, C]: the convolution's outputs after SiLU
  threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, rows * value_heads * dk * dv / 16384));
#pragma omp parallel num_threads(threads)
  {
#pragma omp for collapse(2)
    for (int64_t d = 0; d < rows; ++d) {
      for (int64_t c = 0; c < channels; ++c) {
        float* window = conv_state + (slots[d] * channels + c) * width;
        if (fresh[d]) std::fill(window, window + width, 0.f);
        mixed[d * channels + c] = conv_channel(window, conv_weight + c * taps, qkv[d * qkv_stride + c], 0.f, width);
      }
    }
#pragma omp for simd
    for (int64_t i = 0; i < rows * channels; ++i) mixed[i] = silu(mixed[i]);
#pragma omp for collapse(2)
    for (int64_t d = 0; d < rows; ++d) {
      for (int64_t h = 0; h < value_heads; ++h) {
        const int64_t key = tiled ? h % key_heads : h / (value_heads / key_heads);
        const float* row = mixed.data() + d * channels;
        float qn[1024], kn[1024], o[1024];  // dk, dv <= 1024 (checked by the caller)
        const float* qr = row + key * dk;
        const float* kr = row + (key_heads + key) * dk;
        float qq = 0.f, kk = 0.f;
        for (int64_t i = 0; i < dk; ++i) {
          qq += qr[i] * qr[i];
          kk += kr[i] * kr[i];
        }
        const float q_scale = 1.f / std::sqrt(qq + 1e-6f), k_scale = 1.f / std::sqrt(kk + 1e-6f);
        const float head_scale = 1.f / std::sqrt((float)dk);
        for (int64_t i = 0; i < dk; ++i) {
          qn[i] = qr[i] * q_scale * head_scale;
          kn[i] = kr[i] * k_scale;
        }
        const float x = a[d * a_stride + h] + dt_bias[h];
        const float softplus = x > 20.f ? x : std::log1p(std::exp(x));
        const float decay = std::exp(-std::exp(a_log[h]) * softplus);
        const float beta = 1.f / (1.f + std::exp(-b[d * b_stride + h]));
        float* S = state + (slots[d] * value_heads + h) * dk * dv;
        if (fresh[d]) std::fill(S, S + dk * dv, 0.f);
        delta_rule_head(S, qn, kn, row + 2 * key_heads * dk + h * dv, decay, beta, o, dk, dv);
        float sq = 0.f;
        for (int64_t j = 0; j < dv; ++j) sq += o[j] * o[j];
        const float inv = 1.f / std::sqrt(sq / (float)dv + (float)eps);
        const float* zr = z + d * z_stride + h * dv;
        float* y = out + (d * value_heads + h) * dv;
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) y[j] = o[j] * inv * norm_weight[j] * silu(zr[j]);
      }
    }
  }
}

// Mamba2's selective scan, a step: q, k [D, H, n] (its C and B per head); v, out [D, H, p] (dt x); g [D, H]
// (dt A); state [slots, H, n, p]; slots int64 [D]; fresh uint8 [D]. Per (sequence, head), with a = exp(g):
// S = a S + k v^T; out = S^T q, in one pass over S.
void ssm_step(uintptr_t q_, uintptr_t k_, uintptr_t v_, uintptr_t g_, uintptr_t state_, uintptr_t slots_,
              uintptr_t fresh_, uintptr_t out_, int64_t rows, int64_t heads, int64_t n, int64_t p, int threads) {
  const float* q = reinterpret_cast<const float*>(q_);
  const float* k = reinterpret_cast<const float*>(k_);
  const float* v = reinterpret_cast<const float*>(v_);
  const float* g = reinterpret_cast<const float*>(g_);
  float* state = reinterpret_cast<float*>(state_);
  const int64_t* slots = reinterpret_cast<const int64_t*>(slots_);
  const uint8_t* fresh = reinterpret_cast<const uint8_t*>(fresh_);
  float* out = reinterpret_cast<float*>(out_);
  threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, rows * heads * n * p / 16384));
#pragma omp parallel for num_threads(threads) collapse(2)
  for (int64_t d = 0; d < rows; ++d) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t row = d * heads + h;
      float* S = state + (slots[d] * heads + h) * n * p;
      const float* qr = q + row * n;
      const float* kr = k + row * n;
      const float* vr = v + row * p;
      float* o = out + row * p;
      if (fresh[d]) std::fill(S, S + n * p, 0.f);
      const float decay = std::exp(g[row]);
      std::fill(o, o + p, 0.f);
      for (int64_t i = 0; i < n; ++i) {
        float* Si = S + i * p;
        const float ki = kr[i], qi = qr[i];
#pragma omp simd
        for (int64_t j = 0; j < p; ++j) {
          Si[j] = decay * Si[j] + ki * vr[j];
          o[j] += qi * Si[j];
        }
      }
    }
  }
}

}  // namespace hearth
