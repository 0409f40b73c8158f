// The lattice grids of the i-quants (IQ1_*, IQ2_*, IQ3_*) as llama.cpp's quantizer holds them
// (ggml-quants.c's iq2xs_init_impl / iq3xs_init_impl): each grid point's coordinates as 2 l + 1 for
// its levels l, a map from every packed point of levels to its grid index, and for each point not on
// the grid its nearest grid points (all of those at the `nwant` smallest squared distances, in order
// of distance, then index), among which the search picks by weighted error. The points themselves
// come from gguf-py (hearth/quant/quantizer/__init__.py passes each grid's levels in).
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <utility>
#include <vector>

namespace hearth {
namespace {

struct Grid {
  int size = 0, dim = 0, bits = 0;  // grid points, coordinates a point (8 or 4), bits a packed level (2 or 3)
  std::vector<int8_t> points;       // [size][dim]: 2 l + 1
  std::vector<int32_t> map;         // packed levels -> grid index, or -(1 + the offset of its neighbours)
  std::vector<uint16_t> neighbours; // at each offset: their count, then their grid indices

  // levels l[dim] (each below 1 << bits) packed as llama.cpp's kmap index
  int pack(const int8_t* l) const {
    int u = 0;
    for (int i = 0; i < dim; ++i) u |= l[i] << (bits * i);
    return u;
  }
  const int8_t* point(int index) const { return points.data() + index * dim; }
};

// the grid points nearest to `pos` (coordinates 2 l + 1): those at the nwant smallest distances
void nearest_points(const Grid& g, const int8_t* pos, int nwant, std::vector<std::pair<int, int>>& found) {
  int smallest[3] = {INT_MAX, INT_MAX, INT_MAX};  // the nwant (<= 3) smallest distinct distances
  std::vector<int> d2(g.size);
  for (int j = 0; j < g.size; ++j) {
    int d = 0;
    for (int i = 0; i < g.dim; ++i) d += (g.point(j)[i] - pos[i]) * (g.point(j)[i] - pos[i]);
    d2[j] = d;
    for (int k = 0; k < nwant; ++k) {
      if (d == smallest[k]) break;
      if (d < smallest[k]) {
        for (int m = nwant - 1; m > k; --m) smallest[m] = smallest[m - 1];
        smallest[k] = d;
        break;
      }
    }
  }
  found.clear();
  for (int j = 0; j < g.size; ++j)
    if (d2[j] <= smallest[nwant - 1]) found.emplace_back(d2[j], j);
  std::sort(found.begin(), found.end());
}

// the grid of `size` points of `dim` levels each (levels[size][dim], every level <= max_level),
// with the neighbours of every packed point whose levels are all <= max_level (the searches clamp
// their levels there; llama.cpp also lists points it never looks up)
void build_grid(Grid& g, const int8_t* levels, int size, int dim, int bits, int max_level, int nwant) {
  g.size = size;
  g.dim = dim;
  g.bits = bits;
  g.points.resize(size_t(size) * dim);
  g.map.assign(size_t(1) << (bits * dim), INT32_MIN);
  for (int j = 0; j < size; ++j) {
    for (int i = 0; i < dim; ++i) g.points[j * dim + i] = int8_t(2 * levels[j * dim + i] + 1);
    g.map[g.pack(levels + j * dim)] = j;
  }
  g.neighbours.clear();
  std::vector<std::pair<int, int>> found;
  int8_t l[8], pos[8];
  int combos = 1;
  for (int i = 0; i < dim; ++i) combos *= max_level + 1;
  for (int c = 0; c < combos; ++c) {
    for (int i = 0, rest = c; i < dim; ++i, rest /= max_level + 1) {
      l[i] = int8_t(rest % (max_level + 1));
      pos[i] = int8_t(2 * l[i] + 1);
    }
    const int u = g.pack(l);
    if (g.map[u] >= 0) continue;
    nearest_points(g, pos, nwant, found);
    g.map[u] = -(1 + int(g.neighbours.size()));
    g.neighbours.push_back(uint16_t(found.size()));
    for (const auto& f : found) g.neighbours.push_back(uint16_t(f.second));
  }
}

// the neighbours of a point off the grid: count, then indices
inline const uint16_t* neighbours_of(const Grid& g, int u) { return g.neighbours.data() - g.map[u] - 1; }

// the neighbour of least weighted squared error against scale * point ~ xval (dim values); its
// levels into L; returns its index (iq2_find_best_neighbour / iq3_find_best_neighbour). `values`:
// what each level stands for (IQ1_S: iq1_find_best_neighbour2's shifted -1, 0, 1), else 2 l + 1
int best_neighbour(const Grid& g, int u, const float* xval, const float* weight, float scale, int8_t* L,
                   const float* values = nullptr) {
  const uint16_t* nb = neighbours_of(g, u);
  float best_d2 = 3.4028235e38f;
  int index = -1;
  for (int j = 1; j <= nb[0]; ++j) {
    const int8_t* pg = g.point(nb[j]);
    float d2 = 0;
    for (int i = 0; i < g.dim; ++i) {
      const float q = values ? values[(pg[i] - 1) / 2] : pg[i], diff = scale * q - xval[i];
      d2 += weight[i] * diff * diff;
    }
    if (d2 < best_d2) {
      best_d2 = d2;
      index = nb[j];
    }
  }
  if (index < 0) index = nb[1];  // NaN or infinite values: llama.cpp aborts; any neighbour will do
  for (int i = 0; i < g.dim; ++i) L[i] = int8_t((g.point(index)[i] - 1) / 2);
  return index;
}

}  // namespace
}  // namespace hearth
