// Quantized matmul on the CPU (docs/quantized-matmul.md): what the sources of this folder share.
//
//   int8_matmul:   every block format, every batch size: activations rounded to int8 per block
//                  of the weight's format (llama.cpp's q8_K for K-quants, q8_0 otherwise) and
//                  integer dot products (AVX2 maddubs) against the GGUF blocks where they lie;
//                  (IQ4_NL, IQ4_XS, MXFP4: 4-bit indices looked up in their 16 int8 values by one
//                  shuffle, then read as Q8_0's signed codes; the grid i-quants IQ3_S..IQ1_M:
//                  rewritten once at load into nibble blocks, `grid_nibbles`, read as Q4_K's);
//                  or, on AVX-512 VNNI builds, every format but TQ2_0 and those repacked once into tiles
//                  of 32 rows at the format's own bits (`repack`, `packed_matmul`).
//   grouped_int8_matmul: a mixture-of-experts layer's chosen experts in one call, rows grouped
//                  by expert, each group through int8_matmul against its own expert's weight.
//   half_matmul:   F16 / BF16 arrays, every batch size, read as stored: weights widened to fp32
//                  in registers, fp32 FMA; fp32 or bf16 activations; where AVX512_BF16's pairs pay, BF16
//                  laid out once at load as pairs of 16 rows (BF16_PAIRS) and multiplied by vdpbf16ps.
//   sparse_matmul: activation sparsity's matmul: activations under a threshold count as zero and
//                  the weight, kept transposed (F32 / F16 / BF16) or its block format's codes
//                  re-laid out column by column (`sparse_repack`), is read only at the kept columns.
//   rows8_matmul:  the 32-value formats, IQ4_XS, Q4_K, Q5_K on AVX2 builds, repacked once at load into groups of 8 rows
//                  (`rows8_repack`): one maddubs multiplies 4 values of each of the 8 rows.
//   dequantize_rows: the kernels' own decoding, tested bit-exact against hearth.quant.formats.
//
// A source per job: formats.h (the block formats), avx2_blocks.h (a block's codes and terms in
// AVX2 registers), packed.h (the packed tiles' layout); half_matmul.cpp, quantize_activations.cpp,
// int8_dots.cpp (blocks in place: the portable loops and AVX2 / VNNI dot products), int8_tiles.cpp
// (tiles decoded per call, VNNI), grid_nibbles.cpp, repack.cpp, packed_matmul.cpp, dequantize.cpp (the kernels' own
// decodings), grouped_experts.cpp, sparse_matmul.cpp, sparse_blocks.cpp, bindings.cpp (the Python module).
// AVX2 / AVX-512 paths are compiled when the build machine has them (-march=native); the plain
// C++ loops are the portable path and the reference the fast paths are tested against.
// No torch headers (they cost half a minute of compile time): the Python side passes data
// pointers of tensors it has checked and allocated (hearth/quant/kernels/__init__.py), and the
// thread count torch uses; threads are OpenMP's, the runtime torch itself runs on.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HEARTH_AVX512 1
#endif
#if defined(HEARTH_AVX512) && defined(__AVX512VNNI__)
#define HEARTH_VNNI 1
#endif

#include "formats.h"

namespace hearth {
namespace {  // each source's own copies, internal as when the kernels were one file

#ifdef __AVX2__
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// Threads: [0, n) split into `threads` contiguous ranges, fn(begin, end) on each.
template <typename Fn>
void parallel_ranges(int64_t n, int threads, int64_t min_per_thread, const Fn& fn) {
  int t = (int)std::max<int64_t>(1, std::min<int64_t>(threads, n / std::max<int64_t>(1, min_per_thread)));
  if (t <= 1) return fn(int64_t(0), n);
#ifdef _OPENMP
#pragma omp parallel num_threads(t)
  {
    const int i = omp_get_thread_num(), nt = omp_get_num_threads();
    fn(n * i / nt, n * (i + 1) / nt);
  }
#else
  fn(int64_t(0), n);
#endif
}

constexpr int NR = 32;  // weight rows per packed tile (two 16-lane vectors)

constexpr int INT8_PREFETCH = 4096;  // bytes ahead of the block being read

}  // namespace

// ------------------------------------------------------------------ int8 activations

// x [M, K] fp32 -> int8 codes, per block of `block` values (32: llama.cpp's q8_0; 256: its
// q8_K) a scale d = amax / 127 kept in fp32, per 16 values the sum of the codes, and per block
// d * (sum of its codes) (q8_1's term: multiplies a weight block's offset).
struct QuantizedActivations {
  int64_t block = 32;
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> d;       // [M, K/block]
  std::vector<int16_t> s16;   // [M, K/16]
  std::vector<float> dsum;    // [M, K/block]
};

// Which code runs int8_matmul: the fastest this build has (VNNI: tiles from INT8_TILE_MIN_ROWS
// rows, in place with vpdpwssd below), the AVX2 one, or the plain loops (the tests run each one
// this build has, `int8_paths`).
enum Int8Path : int { FASTEST = 0, AVX2 = 1, PORTABLE = 2 };

// The entries, each defined in the source of its job (the comments there say what they compute).
void half_matmul(uintptr_t x_, uintptr_t w_, uintptr_t y_, int64_t M, int64_t N, int64_t K, int64_t rb, int qtype,
                 bool x_bf16, bool portable, int threads);
int64_t half_bf16_min_rows();  // rows from which half_matmul takes bf16 pairs for BF16_PAIRS weights; 0: no such layout
void dequantize_rows(uintptr_t w_, uintptr_t out_, int64_t rows, int64_t K, int64_t rb, int qtype, int threads);
void sparse_matmul(uintptr_t x_, uintptr_t wt_, uintptr_t y_, int64_t M, int64_t N, int64_t K, int qtype,
                   float threshold, int threads);
int64_t sparse_blocks_bytes(int qtype, int64_t N, int64_t K);
void sparse_repack(uintptr_t w_, uintptr_t out_, int64_t N, int64_t K, int64_t rb, int qtype, int threads);
void sparse_blocks_matmul(uintptr_t x_, uintptr_t buf_, uintptr_t y_, int64_t M, int64_t N, int64_t K, int qtype,
                          float threshold, int threads);
void quantize_activations(const float* x, int64_t M, int64_t K, QuantizedActivations& a, int threads,
                          int64_t block, bool portable);
void int8_matmul(uintptr_t x, uintptr_t w, uintptr_t terms, uintptr_t y, int64_t M, int64_t N, int64_t K, int qtype,
                 int path, int threads);
int64_t rows8_bytes(int qtype, int64_t K);
void rows8_repack(uintptr_t w_, uintptr_t out_, int64_t N, int64_t K, int qtype, int threads);
void rows8_blocks(uintptr_t w_, uintptr_t out_, int64_t N, int64_t K, int qtype, int threads);
void rows8_matmul(uintptr_t x_, uintptr_t w_, uintptr_t y_, int64_t M, int64_t N, int64_t K, int qtype, int threads);
#ifdef HEARTH_VNNI
constexpr int64_t INT8_TILE_MIN_ROWS = 24;  // below, the in-place kernel (the tile decoding costs ~2-5 rows of it)
void int8_tiles_matmul(int qtype, const uint8_t* w, int64_t K, const QuantizedActivations& a, int64_t M, float* y,
                       int64_t N, int threads);
#endif
int nibble_type_of(int qtype);
void grid_nibbles(uintptr_t w_, uintptr_t out_, int64_t N, int64_t K, int64_t rb, int qtype, int threads);
std::pair<int64_t, int64_t> packed_bytes(int qtype, int64_t K);
void repack(uintptr_t w_, uintptr_t codes_, uintptr_t terms_, int64_t N, int64_t K, int64_t rb, int qtype, int threads);
void packed_matmul(uintptr_t x_, uintptr_t codes_, uintptr_t terms_, uintptr_t y_, int64_t M, int64_t N, int64_t K,
                   int qtype, bool portable, int threads);
void dequantize_packed(uintptr_t codes_, uintptr_t terms_, uintptr_t out_, int64_t tiles, int64_t K, int qtype,
                       int threads);
void grouped_int8_matmul(uintptr_t x_, uintptr_t experts_, uintptr_t counts_, int64_t num_experts, uintptr_t y_,
                         int64_t N, int64_t K, int threads);

}  // namespace hearth
