// The Python module: hearth/quant/kernels/__init__.py checks and allocates the tensors and passes
// data pointers (and hearth/backend/cpu_kernels/ takes int8_matmul's and dequantize_rows' addresses).
#include <pybind11/pybind11.h>

#include "qmatmul.h"

namespace hearth {
namespace {

// name -> path for int8_matmul's `path`, the ones this build has (fastest first)
std::vector<std::pair<std::string, int>> int8_paths() {
  std::vector<std::pair<std::string, int>> paths;
#ifdef HEARTH_VNNI
  paths.emplace_back("avx512-vnni", FASTEST);
#endif
#ifdef __AVX2__
  paths.emplace_back("avx2", AVX2);
#endif
  paths.emplace_back("portable", PORTABLE);
  return paths;
}

bool has_avx512() {
#ifdef HEARTH_AVX512
  return true;
#else
  return false;
#endif
}

bool has_vnni() {
#ifdef HEARTH_VNNI
  return true;
#else
  return false;
#endif
}

// a grid format's entries as int8 values (gguf.quants' grid, `bytes` of them), and ggml's sign
// patterns (7 bits and an eighth for an even count), before any block of that format is read
void set_grid(int qtype, uintptr_t values, int64_t bytes) {
  GridTables& t = grid_tables;
  const std::pair<void*, size_t> to = qtype == IQ2_XXS ? std::pair<void*, size_t>(t.iq2xxs, sizeof t.iq2xxs)
                                    : qtype == IQ2_XS  ? std::pair<void*, size_t>(t.iq2xs, sizeof t.iq2xs)
                                    : qtype == IQ2_S   ? std::pair<void*, size_t>(t.iq2s, sizeof t.iq2s)
                                    : qtype == IQ3_XXS ? std::pair<void*, size_t>(t.iq3xxs, sizeof t.iq3xxs)
                                    : qtype == IQ3_S   ? std::pair<void*, size_t>(t.iq3s, sizeof t.iq3s)
                                    : qtype == IQ1_S   ? std::pair<void*, size_t>(t.iq1s, sizeof t.iq1s)
                                                       : std::pair<void*, size_t>(nullptr, 0);
  if (!to.first || size_t(bytes) != to.second) throw std::invalid_argument("set_grid: not a grid format, or the wrong size");
  std::memcpy(to.first, reinterpret_cast<const void*>(values), to.second);
  for (int i = 0; i < 128; i++) t.ksigns[i] = uint8_t(i | ((__builtin_popcount(i) & 1) << 7));
}

}  // namespace

}  // namespace hearth

using namespace hearth;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("half_matmul", &half_matmul, "y = x W^T, F16 / BF16 weights, fp32 or bf16 activations", nogil);
  m.def("half_bf16_min_rows", &half_bf16_min_rows,
        "rows from which half_matmul rounds activations to bf16 against BF16_PAIRS weights; 0: that layout does not pay here");
  m.def("dequantize_rows", &dequantize_rows, "W as fp32", nogil);
  m.def("sparse_matmul", &sparse_matmul, "y = mask(x) W^T, W transposed, only the kept columns read", nogil);
  m.def("sparse_blocks_bytes", &sparse_blocks_bytes, "bytes of sparse_repack's layout (throws: no layout for the type)");
  m.def("sparse_repack", &sparse_repack, "blocks -> the column-major layout sparse_matmul skips columns of", nogil);
  m.def("nibble_type", &nibble_type_of, "the nibble format a grid format is read as (grid_nibbles)");
  m.def("grid_nibbles", &grid_nibbles, "a grid format's blocks -> nibble blocks (what int8_matmul reads)", nogil);
  m.def("repack", &repack, "blocks -> packed tiles (codes, terms)", nogil);
  m.def("packed_bytes", [](int qtype, int64_t k) { const auto [c, t] = packed_bytes(qtype, k); return py::make_tuple(c, t); },
        "bytes of one tile's codes and terms");
  m.def("packed_matmul", &packed_matmul, "y = x W^T, W packed tiles, x rounded to int8 per block", nogil);
  m.def("dequantize_packed", &dequantize_packed, "packed tiles as fp32", nogil);
  m.def("rows8_bytes", &rows8_bytes, "bytes of one group of 8 rows of a format (rows8_repack)");
  m.def("rows8_repack", &rows8_repack, "blocks of the 32-value formats, IQ4_XS, Q4_K, Q5_K -> groups of 8 rows (int8_matmul's ROWS8 types)", nogil);
  m.def("rows8_blocks", &rows8_blocks, "groups of 8 rows -> the GGUF blocks they were repacked from", nogil);
  m.def("int8_matmul", &int8_matmul, "y = x W^T, x rounded to int8 per block; W packed or GGUF blocks in place", nogil);
  // for hearth/backend/cpu_kernels/decode_layers.cpp, which calls it between its own kernels
  m.def("grouped_int8_matmul", &grouped_int8_matmul,
        "rows grouped by expert, each group times its expert's W^T (int8_matmul's weights), one call", nogil);
  m.def("int8_matmul_address", [] { return reinterpret_cast<uintptr_t>(&int8_matmul); });
  m.def("sparse_matmul_address", [] { return reinterpret_cast<uintptr_t>(&sparse_matmul); });
  m.def("dequantize_rows_address", [] { return reinterpret_cast<uintptr_t>(&dequantize_rows); });
  m.def("block_values", &block_values);
  m.def("block_bytes", &block_bytes);
  m.def("set_grid", &set_grid, "a grid format's entries (int8 values), before any of its blocks is read");
  m.def("int8_paths", [] {
    py::dict paths;
    for (const auto& [name, path] : int8_paths()) paths[py::str(name)] = path;
    return paths;
  });
  m.def("has_avx512", &has_avx512);
  m.def("has_vnni", &has_vnni);
}
