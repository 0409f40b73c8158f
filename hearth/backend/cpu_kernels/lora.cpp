// LoRA adapters' low-rank terms inside decode_layers (hearth/model/lora.py holds the matrices): each
// row through its own adapter only, rows of one adapter together (punica's shrink then expand).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#include "cpu_kernels.h"

namespace hearth {
namespace {

constexpr int64_t EXPAND_BLOCK = 64;  // output columns per work item of the expand

struct BFloat16 {
  uint16_t bits;
};

// a matrix element as float32 (a bfloat16's bits are a float32's upper half: exact)
inline float widen(float v) { return v; }
inline float widen(BFloat16 v) {
  const uint32_t bits = (uint32_t)v.bits << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// out [W] = x [in] A^T, A^T [in, width] from its column 0: W sums side by side, a vector of
// multiply-adds per x[i] (no horizontal sums; W / 8 independent chains)
template <int W, typename T>
inline void shrink_columns(const float* x, const T* a_t, int64_t in, int64_t width, float* out) {
  float sums[W] = {};
  for (int64_t i = 0; i < in; ++i) {
    const float xi = x[i];
    const T* row = a_t + i * width;
#pragma omp simd
    for (int c = 0; c < W; ++c) sums[c] += xi * widen(row[c]);
  }
  std::copy_n(sums, W, out);
}

// out [width] = x [in] A^T, A^T [in, width]: as wide a pass as divides width (one pass for width 48,
// hearth's merged q/k/v at rank 16), 8 columns a pass otherwise, one for a remainder below 8
template <typename T>
void shrink(const float* x, const T* a_t, int64_t in, int64_t width, float* out) {
  int64_t c = 0;
  if (width % 48 == 0) {
    for (; c < width; c += 48) shrink_columns<48, T>(x, a_t + c, in, width, out + c);
  } else if (width % 32 == 0) {
    for (; c < width; c += 32) shrink_columns<32, T>(x, a_t + c, in, width, out + c);
  } else {
    for (; c + 16 <= width; c += 16) shrink_columns<16, T>(x, a_t + c, in, width, out + c);
    for (; c + 8 <= width; c += 8) shrink_columns<8, T>(x, a_t + c, in, width, out + c);
    for (; c < width; ++c) shrink_columns<1, T>(x, a_t + c, in, width, out + c);
  }
}

// lora_add's work with A^T and B^T of element type T
template <typename T>
void add_low_rank(const LoraGroups& groups, const T* a, const T* b, const int64_t* sizes, const float* x,
                  int64_t x_stride, float* y, int64_t y_stride, int64_t in, std::vector<float>& xa, int threads) {
  const int64_t rank = groups.rank, num_groups = (int64_t)groups.slot.size(), num_rows = (int64_t)groups.rows.size();
  int64_t parts = 0, out = 0, blocks = 0;  // blocks: a group's expand work items, EXPAND_BLOCK columns of a part each
  for (; parts < MAX_LORA_PARTS && sizes[parts]; ++parts) {
    out += sizes[parts];
    blocks += (sizes[parts] + EXPAND_BLOCK - 1) / EXPAND_BLOCK;
  }
  const int64_t width = parts * rank;
  xa.resize(num_rows * width);  // [the groups' rows, in group order, width]
#pragma omp parallel num_threads(threads)
  {
    // shrink: a row's A_s x_t (A_s^T a few hundred KiB at most: its group's other rows find it in L2)
#pragma omp for schedule(static)
    for (int64_t r = 0; r < num_rows; ++r)
      shrink(x + groups.rows[r] * x_stride, a + groups.slot[groups.group[r]] * in * width, in, width,
             xa.data() + r * width);
    // expand: a block of a part's columns for each of its group's rows
#pragma omp for schedule(static)
    for (int64_t item = 0; item < num_groups * blocks; ++item) {
      const int64_t g = item / blocks;
      int64_t block = item % blocks, p = 0, first = 0;  // the block's part and that part's first column
      for (;; first += sizes[p], ++p) {
        const int64_t in_part = (sizes[p] + EXPAND_BLOCK - 1) / EXPAND_BLOCK;
        if (block < in_part) break;
        block -= in_part;
      }
      const int64_t begin = first + block * EXPAND_BLOCK, end = std::min(first + sizes[p], begin + EXPAND_BLOCK);
      const T* b_slot = b + groups.slot[g] * rank * out + begin;  // B_s^T's rows from column `begin`
      const int64_t n = end - begin;
      for (int64_t r = groups.starts[g]; r < groups.starts[g + 1]; ++r) {
        const float* xa_row = xa.data() + r * width + p * rank;
        float sums[EXPAND_BLOCK] = {};  // the block's columns of B_s (A_s x_t), a vector of multiply-adds per rank
        for (int64_t k = 0; k < rank; ++k) {
          const float c = xa_row[k];
          const T* b_row = b_slot + k * out;
#pragma omp simd
          for (int64_t o = 0; o < n; ++o) sums[o] += c * widen(b_row[o]);
        }
        float* y_row = y + groups.rows[r] * y_stride + begin;
        const float scale = groups.scale[g];
#pragma omp simd
        for (int64_t o = 0; o < n; ++o) y_row[o] += scale * sums[o];
      }
    }
  }
}

}  // namespace

LoraGroups::LoraGroups(const int64_t* operands, int64_t tokens) {
  const int32_t* row_slots = reinterpret_cast<const int32_t*>(operands[LORA_ROW_SLOTS]);
  const float* slot_scales = reinterpret_cast<const float*>(operands[LORA_SLOT_SCALES]);
  rank = operands[LORA_RANK];
  slots = operands[LORA_SLOTS];
  table = reinterpret_cast<const int64_t*>(operands[LORA_TABLE]);
  starts.push_back(0);
  for (int64_t s = 0; s < slots; ++s) {  // a counting sort of the rows by slot; rows of none left out
    for (int64_t t = 0; t < tokens; ++t)
      if (row_slots[t] == s) {
        rows.push_back(t);
        group.push_back((int64_t)slot.size());
      }
    if ((int64_t)rows.size() > starts.back()) {
      slot.push_back(s);
      scale.push_back(slot_scales[s]);
      starts.push_back((int64_t)rows.size());
    }
  }
}

// y [T, sum(sizes)] (row stride y_stride) += scale_s B_s (A_s x_t) for each row t of each group's
// slot s: A^T [slots, in, parts x rank], B^T [slots, rank, sum(sizes)], output column o of part p
// taking the rank columns p x rank... of A_s x_t. x [T, in] at row stride x_stride.
void lora_add(const LoraGroups& groups, const int64_t* part, const float* x, int64_t x_stride, float* y,
              int64_t y_stride, int64_t in, std::vector<float>& xa, int threads) {
  if (part[LORA_FORMAT] == LORA_BF16)
    add_low_rank(groups, reinterpret_cast<const BFloat16*>(part[LORA_A]), reinterpret_cast<const BFloat16*>(part[LORA_B]),
                 part + LORA_SIZES, x, x_stride, y, y_stride, in, xa, threads);
  else
    add_low_rank(groups, reinterpret_cast<const float*>(part[LORA_A]), reinterpret_cast<const float*>(part[LORA_B]),
                 part + LORA_SIZES, x, x_stride, y, y_stride, in, xa, threads);
}

}  // namespace hearth
