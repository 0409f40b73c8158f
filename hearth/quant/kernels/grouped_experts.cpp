// A mixture-of-experts layer's chosen experts in one call (grouped_int8_matmul).
#include "qmatmul.h"

namespace hearth {
namespace {

// ------------------------------------------------------------------ grouped int8 matmul (mixtures of experts)
// A layer's chosen experts in one call: activation rows grouped by expert (rows of expert e are
// counts[e] consecutive rows of x, experts in order), each group times its expert's weight.
// The threads share out the chosen experts' weight rows end to end, in ranges of whole 32-row tiles
// (a range may cover several experts, or part of one) of about equal cost, a tile of an expert
// with r rows costing r + GROUPED_READ_COST: one fork and join per projection of the layer, not
// one per expert, and each thread reads long runs of weights; experts no row chose are not read.
// Each piece runs int8_matmul on one thread (its own activation rows quantized per piece: a few
// rows of K values, against the piece's weight rows).
constexpr int64_t GROUPED_READ_COST = 2;  // reading a tile, in rows' worth of its dot products

// Where rows [n0, ...) of a weight start: GGUF rows in place, groups of 8 rows (the ROWS8 types,
// rows8.cpp), or (terms non-zero) packed 32-row tiles' codes and terms (repack's layout), n0 a
// multiple of NR.
struct WeightRows {
  uintptr_t w, terms;
  int qtype;
  int64_t row_bytes, term_bytes;  // in place: bytes per row; groups: per group; packed: code and term bytes per tile

  WeightRows(const int64_t* expert, int64_t K) : w((uintptr_t)expert[0]), terms((uintptr_t)expert[1]), qtype((int)expert[2]) {
    term_bytes = 0;
    if (terms) {
      std::tie(row_bytes, term_bytes) = packed_bytes(qtype, K);
    } else if (qtype > ROWS8) {
      row_bytes = rows8_bytes(qtype - ROWS8, K);
    } else {
      HEARTH_DISPATCH(qtype, row_bytes = K / Fmt<QT>::BS * Fmt<QT>::BYTES);
    }
  }
  uintptr_t weight_at(int64_t n0) const {
    return terms ? w + n0 / NR * row_bytes : qtype > ROWS8 ? w + n0 / 8 * row_bytes : w + n0 * row_bytes;
  }
  uintptr_t terms_at(int64_t n0) const { return terms ? terms + n0 / NR * term_bytes : 0; }
};

}  // namespace

// experts int64 [E, 3]: weight or packed codes, packed terms or 0, qtype (int8_matmul's arguments); counts int64 [E];
// x [R, K] fp32, R = sum of counts; y [R, N] fp32.
void grouped_int8_matmul(uintptr_t x_, uintptr_t experts_, uintptr_t counts_, int64_t num_experts, uintptr_t y_,
                         int64_t N, int64_t K, int threads) {
  const int64_t* experts = (const int64_t*)experts_;
  const int64_t* counts = (const int64_t*)counts_;
  struct Group { WeightRows weight; int64_t row0, rows; };
  std::vector<Group> groups;
  for (int64_t e = 0, row = 0; e < num_experts; row += counts[e], e++)
    if (counts[e] > 0) {
      if (K % block_values((int)experts[3 * e + 2])) throw std::invalid_argument("grouped_int8_matmul: K is not a multiple of the block size");
      groups.push_back({WeightRows(experts + 3 * e, K), row, counts[e]});
    }
  const float* x = (const float*)x_;
  float* y = (float*)y_;
  const int64_t tiles = (N + NR - 1) / NR, units = (int64_t)groups.size() * tiles;  // units: (expert, tile)
  // thread i's units: [bounds[i], bounds[i + 1]), the cumulative cost split evenly
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(threads, units));
  std::vector<int64_t> bounds(nt + 1, units);
  int64_t total = 0;
  for (const Group& g : groups) total += tiles * (g.rows + GROUPED_READ_COST);
  bounds[0] = 0;
  for (int64_t gi = 0, cost = 0, i = 1; gi < (int64_t)groups.size() && i < nt; gi++) {
    const int64_t per_tile = groups[gi].rows + GROUPED_READ_COST;
    for (; i < nt && total * i / nt < cost + tiles * per_tile; i++)  // boundary i falls in this expert
      bounds[i] = gi * tiles + (total * i / nt - cost) / per_tile;
    cost += tiles * per_tile;
  }
  const auto run = [&](int64_t u0, int64_t u1) {
    std::vector<float> piece;
    for (int64_t u = u0; u < u1;) {
      const Group& g = groups[u / tiles];
      const int64_t t0 = u % tiles, t1 = std::min(tiles, t0 + (u1 - u));
      const int64_t n0 = t0 * NR, n = std::min(N, t1 * NR) - n0;
      const uintptr_t xg = (uintptr_t)(x + g.row0 * K);
      if (n == N) {  // the whole weight: straight into y's rows
        int8_matmul(xg, g.weight.weight_at(0), g.weight.terms_at(0), (uintptr_t)(y + g.row0 * N), g.rows, N, K,
                    g.weight.qtype, FASTEST, 1);
      } else {  // part of its rows: [rows, n], then into y's columns
        piece.resize(g.rows * n);
        int8_matmul(xg, g.weight.weight_at(n0), g.weight.terms_at(n0), (uintptr_t)piece.data(), g.rows, n, K,
                    g.weight.qtype, FASTEST, 1);
        for (int64_t r = 0; r < g.rows; r++) std::memcpy(y + (g.row0 + r) * N + n0, piece.data() + r * n, n * sizeof(float));
      }
      u += t1 - t0;
    }
  };
  if (nt == 1) return run(0, units);
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
  for (int i = omp_get_thread_num(); i < nt; i += omp_get_num_threads()) run(bounds[i], bounds[i + 1]);  // fewer threads given: several ranges each
#else
  run(0, units);
#endif
}


}  // namespace hearth
