// LoRA adapters' low-rank terms inside decode_layers (hearth/model/lora.py holds the matrices): each
// row through its own adapter only, rows of one adapter together (punica's shrink then expand).
#include <algorithm>
#include <cstdint>
#include <vector>
#include "cpu_kernels.h"

namespace hearth {
namespace {

constexpr int64_t EXPAND_BLOCK = 64;  // output columns per work item of the expand

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
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
      if (row_slots[t] == s) rows.push_back(t);
    if ((int64_t)rows.size() > starts.back()) {
      slot.push_back(s);
      scale.push_back(slot_scales[s]);
      starts.push_back((int64_t)rows.size());
    }
  }
}

// y [T, sum(sizes)] (row stride y_stride) += scale_s B_s (A_s x_t) for each row t of each group's
// slot s: A [slots, parts x rank, in], B [slots, sum(sizes), rank], output column o of part p
// taking the rank columns p x rank... of A_s x_t. x [T, in] at row stride x_stride.
void lora_add(const LoraGroups& groups, const int64_t* part, const float* x, int64_t x_stride, float* y,
              int64_t y_stride, int64_t in, std::vector<float>& xa, int threads) {
  const float* a = reinterpret_cast<const float*>(part[LORA_A]);
  const float* b = reinterpret_cast<const float*>(part[LORA_B]);
  const int64_t* sizes = part + LORA_SIZES;
  const int64_t rank = groups.rank, num_groups = (int64_t)groups.slot.size();
  int64_t parts = 0, out = 0, blocks = 0;  // blocks: a group's expand work items, EXPAND_BLOCK columns of a part each
  for (; parts < MAX_LORA_PARTS && sizes[parts]; ++parts) {
    out += sizes[parts];
    blocks += (sizes[parts] + EXPAND_BLOCK - 1) / EXPAND_BLOCK;
  }
  const int64_t width = parts * rank;
  xa.resize(groups.rows.size() * width);  // [the groups' rows, in group order, width]
  // shrink: each of A_s's rows read once for all of its group's rows
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t item = 0; item < num_groups * width; ++item) {
      const int64_t g = item / width, j = item % width;
      const float* a_row = a + (groups.slot[g] * width + j) * in;
      for (int64_t r = groups.starts[g]; r < groups.starts[g + 1]; ++r)
        xa[r * width + j] = dot(a_row, x + groups.rows[r] * x_stride, in);
    }
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
      const float* b_slot = b + groups.slot[g] * out * rank;
      for (int64_t r = groups.starts[g]; r < groups.starts[g + 1]; ++r) {
        const float* xa_row = xa.data() + r * width + p * rank;
        float* y_row = y + groups.rows[r] * y_stride;
        for (int64_t o = begin; o < end; ++o) y_row[o] += groups.scale[g] * dot(b_slot + o * rank, xa_row, rank);
      }
    }
  }
}

}  // namespace hearth
