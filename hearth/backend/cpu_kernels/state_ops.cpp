// The state layers' decode steps (hybrid models: hearth/backend/state_ops.py has the torch forms they
// are tested against): one new row per sequence, its state read and written in place in its slot of
// the state cache, where torch gathers the states by slot, computes, and scatters them back.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include "cpu_kernels.h"

namespace hearth {

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
      const float* w = weight + c * taps;
      const float input = x[d * channels + c];
      if (fresh[d]) std::fill(window, window + width, 0.f);
      float sum = bias ? bias[c] : 0.f;
      for (int64_t j = 0; j < width; ++j) sum += w[j] * window[j];
      out[d * channels + c] = sum + w[width] * input;
      for (int64_t j = 0; j + 1 < width; ++j) window[j] = window[j + 1];
      window[width - 1] = input;
    }
  }
}

// q, k [D, H, dk]; v, out [D, H, dv]; g, beta [D, H]; state [slots, H, dk, dv]; slots int64 [D];
// fresh uint8 [D]. Per (sequence, head), with a = exp(g): S = a S; d = beta (v - S^T k);
// S += k d^T; out = S^T q. Two passes over S: the decay and S^T k, then the update and S^T q.
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
      const float* qr = q + row * dk;
      const float* kr = k + row * dk;
      const float* vr = v + row * dv;
      float* o = out + row * dv;
      if (fresh[d]) std::fill(S, S + dk * dv, 0.f);
      const float decay = std::exp(g[row]), b = beta[row];
      float delta[1024];  // dv <= 1024 (checked by the caller)
      std::fill(delta, delta + dv, 0.f);
      for (int64_t i = 0; i < dk; ++i) {  // S = a S; delta = S^T k
        float* Si = S + i * dv;
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) {
          Si[j] *= decay;
          delta[j] += kr[i] * Si[j];
        }
      }
#pragma omp simd
      for (int64_t j = 0; j < dv; ++j) {
        delta[j] = (vr[j] - delta[j]) * b;
        o[j] = 0.f;
      }
      for (int64_t i = 0; i < dk; ++i) {  // S += k delta^T; out = S^T q
        float* Si = S + i * dv;
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) {
          Si[j] += kr[i] * delta[j];
          o[j] += qr[i] * Si[j];
        }
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
