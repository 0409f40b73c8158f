// Activation sparsity for GGUF block formats (docs/sparsity.md): y = mask(x) W^T reading only the
// codes of the input columns that some row keeps.
//
// In the file's layout a row is a run of blocks of 32 (or 256) input values: a masked activation
// saves no byte unless its whole block is masked (s^32 of them at sparsity s). `sparse_repack`
// re-lays a block matrix out once, losslessly, column-major: input column k's codes for every
// output row n side by side (4 bits each where the format's codes fit, Q4_0 / Q4_1 / Q4_K; else 8,
// signed: Q8_0, Q6_K), and the scales apart, row-major per block or sub-block (N a multiple of 64):
//   codes  [K, N/2] nibbles (per 32 rows: 16 bytes, row 32c + i in the low nibble of byte i,
//          row 32c + 16 + i in its high nibble) or int8 [K, N] (q - Z, the format's zero point)
//   d      fp16 [K/BS, N]  the block's scale field as stored (K-quants: the super-block's d)
//   dm     fp16 [K/BS, N]  the block's minimum (Q4_1: m; Q4_K: -dmin), formats with one
//   sc     int8 [K/S, N]   K-quants: each sub-block's integer scale (s = d sc), and mn its integer
//   mn     int8 [K/S, N]   minimum (o = dm mn)
// so that w[n, k] = d sc (q - Z) + dm mn exactly as unpack<QT> gives it (the products are the
// fp32 ones unpack computes). A column is then N/2 or N contiguous bytes that a masked activation
// skips: (1 - s) 4 + 1 bits a weight for Q4_0 / Q4_1 (file: 4.5 / 5), (1 - s) 4 + 0.625 for
// Q4_K (4.5), (1 - s) 8 + 0.5 for Q8_0 (8.5), (1 - s) 8 + 0.56 for Q6_K (6.56).
//
// The product: masked x rounded to int8 per sub-block of S values and row (d_x = amax / 127, as
// the int8 kernels' q8_0), the kept columns of a sub-block taken two at a time (pairs of kept
// columns, not of adjacent ones, so a column is read only when it is kept), their codes side by
// side in 16-bit lanes (maddubs: 4-bit codes) or widened to int16 (madd: 8-bit), 64 output rows at
// a time with their int32 sums in registers; per sub-block and row n the int32 sum becomes
//   y[n] += d_x d sc (sum_k xq_k q_kn - Z sum_k xq_k) + dm mn sum_k x_k.
// Q4_K (Z = 0) regroups it per super-block, as its dense kernel does: y[n] += d t + dm u with
// t = sum over sub-blocks of d_x (sc sum_k xq_k q_kn), sc applied in int16 by the madd that widens
// the sums, and u = sum of mn sum_k x_k: the fp16 scales converted once per super-block, not per
// sub-block (sparse_rows_k).
#include "qmatmul.h"

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define HEARTH_SPARSE_SIMD 1
#endif

namespace hearth {
namespace {

// A block format's geometry in this layout (sparse_layout) and where its scales lie in a block.
struct SparseLayout {
  int bs = 0, s = 0, z = 0;          // values a block, a sub-block; the kernel's zero point (nibbles only)
  bool nibble = false, off = false;  // 4-bit codes; a minimum term
  int d_at = 0, dm_at = -1;          // byte offsets of the fp16 scale and minimum in a block (-1: none)
  bool neg_min = false;              // the minimum is subtracted (K-quants: w = d sc q - dmin mn)
  int64_t codes = 0, d = 0, dm = 0, sc = 0, mn = 0, bytes = 0;  // offsets in the buffer, its size
  bool sub() const { return s != bs; }
};

// The layout's geometry for `qtype`, or false: a format without one (sparse_blocks_matmul masks x
// and multiplies the file's blocks)
bool sparse_format(int qtype, SparseLayout& L) {
  switch (qtype) {  //        bs   s   z  nibble off   d  dm  neg_min
    case Q8_0: L = {32, 32, 0, false, false, 0, -1, false}; return true;
    case Q4_0: L = {32, 32, 8, true, false, 0, -1, false}; return true;
    case Q4_1: L = {32, 32, 0, true, true, 0, 2, false}; return true;
    case Q4_K: L = {256, 32, 0, true, true, 0, 2, true}; return true;
    case Q6_K: L = {256, 16, 0, false, false, 208, -1, false}; return true;
    default: return false;
  }
}

SparseLayout sparse_layout(int qtype, int64_t N, int64_t K) {
  SparseLayout L;
  if (!sparse_format(qtype, L)) throw std::invalid_argument("sparse_repack: no sparse layout for type " + std::to_string(qtype));
  if (N % 64 || K % L.bs) throw std::invalid_argument("sparse_repack: N must be a multiple of 64, K of the block");
  const int64_t blocks = K / L.bs * N, subs = L.sub() ? K / L.s * N : 0;
  L.d = L.nibble ? K * N / 2 : K * N;
  L.dm = L.d + 2 * blocks;
  L.sc = L.dm + (L.off ? 2 * blocks : 0);
  L.mn = L.sc + subs;
  L.bytes = L.mn + (L.off ? subs : 0);
  return L;
}

// v = D * m exactly (m an integer): m, or throws (the layout would not be lossless)
inline int8_t exact_multiple(float v, float D) {
  const float m = D == 0.f ? 0.f : std::nearbyint(v / D);
  if (D * m != v || m < -128.f || m > 127.f) throw std::runtime_error("sparse_repack: a scale is no integer multiple");
  return (int8_t)m;
}

template <int QT>
void repack_row(const uint8_t* row, const SparseLayout& L, int64_t n, int64_t N, int64_t K, uint8_t* out) {
  using F = Fmt<QT>;
  constexpr int NS = F::BS / F::S;
  uint8_t q[F::BS];
  float s[NS], o[NS];
  for (int64_t b = 0; b < K / F::BS; b++) {
    const uint8_t* blk = row + b * F::BYTES;
    for (int j = 0; j < NS; j++) o[j] = 0.f;
    unpack<QT>(blk, q, s, o);
    uint16_t d, dm = 0;
    std::memcpy(&d, blk + L.d_at, 2);
    if (L.off) std::memcpy(&dm, blk + L.dm_at, 2), dm ^= L.neg_min ? 0x8000 : 0;
    std::memcpy(out + L.d + 2 * (b * N + n), &d, 2);
    if (L.off) std::memcpy(out + L.dm + 2 * (b * N + n), &dm, 2);
    for (int j = 0; j < NS; j++) {
      const int8_t sc = exact_multiple(s[j], half_to_float(d)), mn = L.off ? exact_multiple(o[j], half_to_float(dm)) : 0;
      if (L.sub()) {
        out[L.sc + (b * NS + j) * N + n] = (uint8_t)sc;
        if (L.off) out[L.mn + (b * NS + j) * N + n] = (uint8_t)mn;
      } else if ((sc != 1 && s[j] != 0.f) || (L.off && mn != 1 && o[j] != 0.f)) {
        throw std::runtime_error("sparse_repack: a block's scale or minimum is not its field");
      }
    }
    for (int i = 0; i < F::BS; i++) {
      const int64_t k = b * F::BS + i;
      if (L.nibble) {
        uint8_t& byte = out[k * N / 2 + n / 32 * 16 + n % 16];
        byte = (uint8_t)(n % 32 < 16 ? (byte & 0xF0) | q[i] : (byte & 0x0F) | (q[i] << 4));
      } else {
        out[k * N + n] = (uint8_t)(int8_t)(int(q[i]) - F::Z);
      }
    }
  }
}

// Masked x in the kernel's terms, SPARSE_BLOCK_ROWS rows at most: the kept columns (some row's |x| >=
// threshold) of each sub-block g at kept[first[g] .. first[g + 1]), taken in pairs from first[g]: for
// the pair at j and row m, xv[j * M + m] holds the two int8 values (0 where the row masks the column,
// and for a pair's missing second) as the products take them (nibble codes: two bytes, twice;
// else two int16); per row and sub-block d_x, sum xq, sum x.
struct MaskedRows {
  std::vector<int32_t> kept, first, xv, qsum;
  std::vector<float> dx, xsum;
};

constexpr int64_t SPARSE_BLOCK_ROWS = 8;  // activation rows a pass over the kept codes serves

void mask_rows(const float* x, int64_t M, int64_t K, int S, bool nibble, float threshold, MaskedRows& r) {
  const int64_t groups = K / S;
  r.kept.clear();
  r.first.assign(1, 0);
  for (int64_t k = 0; k < K; k++) {
    for (int64_t m = 0; m < M; m++)
      if (std::fabs(x[m * K + k]) >= threshold && x[m * K + k] != 0.f) {
        r.kept.push_back((int32_t)k);
        break;
      }
    if ((k + 1) % S == 0) r.first.push_back((int32_t)r.kept.size());
  }
  r.xv.assign(r.kept.size() * M, 0);
  r.dx.assign(M * groups, 0.f), r.xsum.assign(M * groups, 0.f), r.qsum.assign(M * groups, 0);
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < groups; g++) {
      float amax = 0.f, sum = 0.f;
      const auto value = [&](int32_t j) {
        const float v = j < r.first[g + 1] ? x[m * K + r.kept[j]] : 0.f;
        return std::fabs(v) >= threshold ? v : 0.f;
      };
      for (int32_t j = r.first[g]; j < r.first[g + 1]; j++) amax = std::max(amax, std::fabs(value(j))), sum += value(j);
      const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
      int32_t qsum = 0;
      for (int32_t j = r.first[g]; j < r.first[g + 1]; j += 2) {
        const int q1 = (int)std::nearbyint(value(j) * id), q2 = (int)std::nearbyint(value(j + 1) * id);
        const uint32_t bytes = (uint32_t)(uint8_t)q1 | (uint32_t)(uint8_t)q2 << 8;
        r.xv[j * M + m] = (int32_t)(nibble ? bytes | bytes << 16 : (uint32_t)(uint16_t)q1 | (uint32_t)(uint16_t)q2 << 16);
        qsum += q1 + q2;
      }
      r.dx[m * groups + g] = d, r.xsum[m * groups + g] = sum, r.qsum[m * groups + g] = qsum;
    }
}

#ifdef HEARTH_SPARSE_SIMD
constexpr int64_t SPARSE_STEP = 64;  // output rows a pass of group_sums covers

// 8 scales of consecutive output rows as fp32: fp16 (the d and dm fields), int8 (sc, mn)
inline __m256 halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline __m256 bytes(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }

// Nibble codes of two columns, 64 rows from n (32 bytes each), side by side per 16-bit lane:
// p[i] holds rows n + 8i .. n + 8i + 7 (lane 0) and n + 32 + 8i .. (lane 1)
inline void nibble_pairs(const uint8_t* c1, const uint8_t* c2, __m256i (&p)[4]) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i v1 = _mm256_loadu_si256((const __m256i*)c1), v2 = _mm256_loadu_si256((const __m256i*)c2);
  const __m256i lo = _mm256_unpacklo_epi8(v1, v2), hi = _mm256_unpackhi_epi8(v1, v2);  // bytes 0-7, 8-15 of each 32 rows
  p[0] = _mm256_and_si256(lo, low), p[1] = _mm256_and_si256(hi, low);
  p[2] = _mm256_and_si256(_mm256_srli_epi16(lo, 4), low), p[3] = _mm256_and_si256(_mm256_srli_epi16(hi, 4), low);
}

// Nibble codes' int16 sums over a sub-block's kept columns (kept[0 .. count), 32 at most), 64 output rows
// from n, activation row m: h[c][m][i] over its c-th 16 kept columns (zero past count), rows as
// nibble_pairs gives them. Two columns' codes side by side in each 16-bit lane, one maddubs per 16
// rows and activation row (int16 sums of 8 pairs at most: 8 x 2 x 15 x 127 fits).
template <int MR>
inline void nibble_sums(const uint8_t* codes, int64_t N, const int32_t* kept, const int32_t* xv, int32_t count,
                        int64_t n, __m256i (&h)[2][MR][4]) {
  for (int c = 0; c < 2; c++) {
    for (int m = 0; m < MR; m++)
      for (int i = 0; i < 4; i++) h[c][m][i] = _mm256_setzero_si256();
    for (int32_t j = 16 * c; j < std::min(count, 16 * c + 16); j += 2) {
      const uint8_t* c1 = codes + kept[j] * (N / 2) + n / 2;
      const uint8_t* c2 = j + 1 < count ? codes + kept[j + 1] * (N / 2) + n / 2 : c1;  // (x2 = 0 then)
      __builtin_prefetch(c1 + 256), __builtin_prefetch(c2 + 256);
      __m256i p[4];
      nibble_pairs(c1, c2, p);
      for (int m = 0; m < MR; m++) {
        const __m256i x = _mm256_set1_epi32(xv[j * MR + m]);
        for (int i = 0; i < 4; i++) h[c][m][i] = _mm256_add_epi16(h[c][m][i], _mm256_maddubs_epi16(p[i], x));
      }
    }
  }
}

// sums[m][i] = for output rows n + 8i .. n + 8i + 7 (i < 8), the int32 sum over the sub-block's kept
// columns (kept[0 .. count)) of code x int8 value, activation row m. Nibble codes: nibble_sums' two
// halves widened; int8 codes: widened to int16, one madd per 16 rows.
template <int MR, bool NIBBLE>
inline void group_sums(const uint8_t* codes, int64_t N, const int32_t* kept, const int32_t* xv, int32_t count,
                       int64_t n, __m256i (&sums)[MR][8]) {
  if constexpr (NIBBLE) {
    __m256i h[2][MR][4];
    nibble_sums<MR>(codes, N, kept, xv, count, n, h);
    for (int m = 0; m < MR; m++)
      for (int i = 0; i < 4; i++) {
        const __m256i lo = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(h[0][m][i])),
                                            _mm256_cvtepi16_epi32(_mm256_castsi256_si128(h[1][m][i])));
        const __m256i hi = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(h[0][m][i], 1)),
                                            _mm256_cvtepi16_epi32(_mm256_extracti128_si256(h[1][m][i], 1)));
        sums[m][i] = lo, sums[m][4 + i] = hi;
      }
    return;
  }
  for (int m = 0; m < MR; m++)
    for (int i = 0; i < 8; i++) sums[m][i] = _mm256_setzero_si256();
  for (int32_t j = 0; j < count; j += 2) {
    const uint8_t* c1 = codes + kept[j] * N + n;
    const uint8_t* c2 = j + 1 < count ? codes + kept[j + 1] * N + n : c1;  // (x2 = 0 then)
    __builtin_prefetch(c1 + 256), __builtin_prefetch(c2 + 256);
    for (int h = 0; h < 4; h++) {  // rows 16h .. 16h + 15: madd leaves [0-3, 8-11 | 4-7, 12-15]
      const __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(c1 + 16 * h)));
      const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(c2 + 16 * h)));
      const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
      for (int m = 0; m < MR; m++) {
        const __m256i x = _mm256_set1_epi32(xv[j * MR + m]);
        sums[m][2 * h] = _mm256_add_epi32(sums[m][2 * h], _mm256_madd_epi16(lo, x));
        sums[m][2 * h + 1] = _mm256_add_epi32(sums[m][2 * h + 1], _mm256_madd_epi16(hi, x));
      }
    }
  }
  for (int m = 0; m < MR; m++)
    for (int h = 0; h < 8; h += 2) {
      const __m256i a = sums[m][h], b = sums[m][h + 1];
      sums[m][h] = _mm256_permute2x128_si256(a, b, 0x20), sums[m][h + 1] = _mm256_permute2x128_si256(a, b, 0x31);
    }
}

// Q4_K: sums[m][i] as group_sums gives them times each row's integer sub-block scale (sc: the
// sub-block's, per output row): the two halves' int16 sums interleaved so that one madd applies the
// scale to both and widens them (the dense Q4_K kernel's trick; |sum| <= 2 x 63 x 30480 fits int32)
template <int MR>
inline void scaled_sums(const uint8_t* codes, int64_t N, const int32_t* kept, const int32_t* xv, int32_t count,
                        int64_t n, const uint8_t* sc, __m256i (&sums)[MR][8]) {
  __m256i h[2][MR][4];
  nibble_sums<MR>(codes, N, kept, xv, count, n, h);
  for (int i = 0; i < 4; i++) {  // lanes: rows n + 8i .. n + 8i + 7 | n + 32 + 8i .. n + 32 + 8i + 7
    const __m256i s = _mm256_cvtepi8_epi16(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)(sc + n + 8 * i)),
                                                              _mm_loadl_epi64((const __m128i*)(sc + n + 32 + 8 * i))));
    const __m256i slo = _mm256_unpacklo_epi16(s, s), shi = _mm256_unpackhi_epi16(s, s);
    for (int m = 0; m < MR; m++) {  // lo: rows 0-3 of each lane, hi: 4-7
      const __m256i lo = _mm256_madd_epi16(_mm256_unpacklo_epi16(h[0][m][i], h[1][m][i]), slo);
      const __m256i hi = _mm256_madd_epi16(_mm256_unpackhi_epi16(h[0][m][i], h[1][m][i]), shi);
      sums[m][i] = _mm256_permute2x128_si256(lo, hi, 0x20), sums[m][4 + i] = _mm256_permute2x128_si256(lo, hi, 0x31);
    }
  }
}

// y [MR, N] (rows n0 .. n1, multiples of 64) = the masked product, WIDTH rows at a time: per
// sub-block (its kept columns' codes streamed in order, a run of WIDTH / 2 or WIDTH bytes each), per
// 64 rows the sums scaled into fp32 accumulators: d_x d sc (sum - Z sum xq) + dm mn sum x
template <int MR, bool NIBBLE>
void sparse_rows(const uint8_t* buf, const SparseLayout& L, int64_t N, const MaskedRows& r, int64_t n0, int64_t n1,
                 float* y) {
  constexpr int64_t WIDTH = MR <= 2 ? 2048 : 512;  // out: 16 KiB at most (L1)
  const int64_t groups = (int64_t)r.first.size() - 1;
  alignas(32) float out[MR * WIDTH];
  for (int64_t c = n0; c < n1; c += WIDTH) {
    const int64_t width = std::min(WIDTH, n1 - c);
    std::fill(out, out + MR * width, 0.f);
    for (int64_t g = 0; g < groups; g++) {
      const int32_t begin = r.first[g], count = r.first[g + 1] - begin;
      if (count == 0) continue;  // the whole sub-block masked: its scales unread too
      const int64_t b = g * L.s / L.bs;
      for (int64_t n = c; n < c + width; n += SPARSE_STEP) {
        __m256i sums[MR][8];
        group_sums<MR, NIBBLE>(buf + L.codes, N, r.kept.data() + begin, r.xv.data() + begin * MR, count, n, sums);
        for (int i = 0; i < 8; i++) {
          const int64_t at = n + 8 * i;
          const __m256 d = halves(buf + L.d + 2 * (b * N + at));
          const __m256 scale = L.sub() ? _mm256_mul_ps(d, bytes(buf + L.sc + g * N + at)) : d;
          __m256 offset = _mm256_setzero_ps();
          if (L.off) {
            const __m256 dm = halves(buf + L.dm + 2 * (b * N + at));
            offset = L.sub() ? _mm256_mul_ps(dm, bytes(buf + L.mn + g * N + at)) : dm;
          }
          for (int m = 0; m < MR; m++) {
            const int64_t mg = m * groups + g;
            float* o = out + m * width + (at - c);
            const __m256i q = _mm256_sub_epi32(sums[m][i], _mm256_set1_epi32(L.z * r.qsum[mg]));
            const __m256 t = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(q));
            _mm256_storeu_ps(o, _mm256_fmadd_ps(offset, _mm256_set1_ps(r.xsum[mg]),
                                                _mm256_fmadd_ps(_mm256_set1_ps(r.dx[mg]), t, _mm256_loadu_ps(o))));
          }
        }
      }
    }
    for (int64_t m = 0; m < MR; m++) std::memcpy(y + m * N + c, out + m * width, width * 4);
  }
}

// Q4_K (zero point 0): per super-block b and output row, t = sum over b's kept sub-blocks of
// d_x (sc x sum) in fp32, then y += d t + dm (sum over them of mn sum x): the fp16 scales read and
// applied once per super-block, the integer ones by the madd that widens the sums
template <int MR>
void sparse_rows_k(const uint8_t* buf, const SparseLayout& L, int64_t N, const MaskedRows& r, int64_t n0, int64_t n1,
                   float* y) {
  constexpr int64_t WIDTH = MR == 1 ? 2048 : MR <= 4 ? 512 : 256;  // out and t: 16 KiB at most (L1)
  const int64_t groups = (int64_t)r.first.size() - 1, per = L.bs / L.s;
  alignas(32) float out[MR * WIDTH], t[MR * WIDTH];
  for (int64_t c = n0; c < n1; c += WIDTH) {
    const int64_t width = std::min(WIDTH, n1 - c);
    std::fill(out, out + MR * width, 0.f);
    for (int64_t b = 0; b < groups / per; b++) {
      const int64_t g0 = b * per;
      if (r.first[g0] == r.first[g0 + per]) continue;  // the whole super-block masked: its scales unread too
      std::fill(t, t + MR * width, 0.f);
      for (int64_t g = g0; g < g0 + per; g++) {
        const int32_t begin = r.first[g], count = r.first[g + 1] - begin;
        if (count == 0) continue;
        for (int64_t n = c; n < c + width; n += SPARSE_STEP) {
          __m256i sums[MR][8];
          scaled_sums<MR>(buf + L.codes, N, r.kept.data() + begin, r.xv.data() + begin * MR, count, n, buf + L.sc + g * N, sums);
          for (int i = 0; i < 8; i++)
            for (int m = 0; m < MR; m++) {
              float* o = t + m * width + (n + 8 * i - c);
              _mm256_store_ps(o, _mm256_fmadd_ps(_mm256_set1_ps(r.dx[m * groups + g]), _mm256_cvtepi32_ps(sums[m][i]), _mm256_load_ps(o)));
            }
        }
      }
      for (int64_t at = c; at < c + width; at += 8) {
        __m256 u[MR];
        for (int m = 0; m < MR; m++) u[m] = _mm256_setzero_ps();
        for (int64_t g = g0; g < g0 + per; g++) {
          if (r.first[g] == r.first[g + 1]) continue;
          const __m256 mn = bytes(buf + L.mn + g * N + at);
          for (int m = 0; m < MR; m++) u[m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(r.xsum[m * groups + g]), u[m]);
        }
        const __m256 d = halves(buf + L.d + 2 * (b * N + at)), dm = halves(buf + L.dm + 2 * (b * N + at));
        for (int m = 0; m < MR; m++) {
          float* o = out + m * width + (at - c);
          _mm256_store_ps(o, _mm256_fmadd_ps(dm, u[m], _mm256_fmadd_ps(d, _mm256_load_ps(t + m * width + (at - c)), _mm256_load_ps(o))));
        }
      }
    }
    for (int64_t m = 0; m < MR; m++) std::memcpy(y + m * N + c, out + m * width, width * 4);
  }
}
#endif

// The portable loops: what sparse_rows computes, one output row and code at a time.
void sparse_rows_portable(const uint8_t* buf, const SparseLayout& L, int64_t M, int64_t N, const MaskedRows& r,
                          int64_t n0, int64_t n1, float* y) {
  const int64_t groups = (int64_t)r.first.size() - 1;
  for (int64_t n = n0; n < n1; n++) {
    for (int64_t m = 0; m < M; m++) y[m * N + n] = 0.f;
    for (int64_t g = 0; g < groups; g++) {
      const int64_t b = g * L.s / L.bs;
      const float scale = half_to_float(((const uint16_t*)(buf + L.d))[b * N + n]) * (L.sub() ? (float)(int8_t)buf[L.sc + g * N + n] : 1.f);
      const float offset = !L.off ? 0.f : half_to_float(((const uint16_t*)(buf + L.dm))[b * N + n]) * (L.sub() ? (float)(int8_t)buf[L.mn + g * N + n] : 1.f);
      for (int64_t m = 0; m < M; m++) {
        int32_t sum = 0;
        for (int32_t j = r.first[g]; j < r.first[g + 1]; j++) {
          const int64_t k = r.kept[j];
          const int code = L.nibble ? (buf[L.codes + k * N / 2 + n / 32 * 16 + n % 16] >> (n % 32 < 16 ? 0 : 4)) & 0x0F
                                    : (int8_t)buf[L.codes + k * N + n];
          const int32_t pair = r.xv[(j - (j - r.first[g]) % 2) * M + m];
          const int shift = (j - r.first[g]) % 2 ? (L.nibble ? 8 : 16) : 0;
          sum += code * (L.nibble ? (int8_t)(pair >> shift) : (int16_t)(pair >> shift));
        }
        const int64_t mg = m * groups + g;
        y[m * N + n] += r.dx[mg] * (scale * (float)(sum - L.z * r.qsum[mg])) + offset * r.xsum[mg];
      }
    }
  }
}

template <int MR>
void sparse_rows_of(const uint8_t* buf, const SparseLayout& L, int64_t N, const MaskedRows& r, int64_t n0, int64_t n1,
                    float* y) {
#ifdef HEARTH_SPARSE_SIMD
  if (L.nibble && L.sub()) return sparse_rows_k<MR>(buf, L, N, r, n0, n1, y);
  if (L.nibble) return sparse_rows<MR, true>(buf, L, N, r, n0, n1, y);
  return sparse_rows<MR, false>(buf, L, N, r, n0, n1, y);
#else
  sparse_rows_portable(buf, L, MR, N, r, n0, n1, y);
#endif
}

void sparse_blocks_pass(const float* x, const uint8_t* buf, float* y, int64_t M, int64_t N, int64_t K,
                        const SparseLayout& L, float threshold, int threads) {
  MaskedRows r;
  mask_rows(x, M, K, L.s, L.nibble, threshold, r);
  parallel_ranges(N / 64, threads, 2, [&](int64_t c0, int64_t c1) {  // ranges of 64 output rows
    const int64_t n0 = 64 * c0, n1 = 64 * c1;
    switch (M) {
      case 1: return sparse_rows_of<1>(buf, L, N, r, n0, n1, y);
      case 2: return sparse_rows_of<2>(buf, L, N, r, n0, n1, y);
      case 3: return sparse_rows_of<3>(buf, L, N, r, n0, n1, y);
      case 4: return sparse_rows_of<4>(buf, L, N, r, n0, n1, y);
      case 5: return sparse_rows_of<5>(buf, L, N, r, n0, n1, y);
      case 6: return sparse_rows_of<6>(buf, L, N, r, n0, n1, y);
      case 7: return sparse_rows_of<7>(buf, L, N, r, n0, n1, y);
      default: return sparse_rows_of<8>(buf, L, N, r, n0, n1, y);
    }
  });
}

}  // namespace

// Bytes of `sparse_repack`'s buffer for an N x K weight of `qtype` (throws for a format it does not cover).
int64_t sparse_blocks_bytes(int qtype, int64_t N, int64_t K) { return sparse_layout(qtype, N, K).bytes; }

// GGUF blocks w [N, rb bytes] -> out [sparse_blocks_bytes]: the column-major layout above.
void sparse_repack(uintptr_t w_, uintptr_t out_, int64_t N, int64_t K, int64_t rb, int qtype, int threads) {
  const SparseLayout L = sparse_layout(qtype, N, K);
  const uint8_t* w = (const uint8_t*)w_;
  uint8_t* out = (uint8_t*)out_;
  if (L.nibble) std::memset(out, 0, K * N / 2);
  parallel_ranges(N / 32, threads, 1, [&](int64_t c0, int64_t c1) {  // whole groups of 32 rows: their nibbles' bytes
    for (int64_t n = 32 * c0; n < 32 * c1; n++) HEARTH_DISPATCH(qtype, repack_row<QT>(w + n * rb, L, n, N, K, out));
  });
}

// y [M, N] = mask(x) [M, K] W^T, W in sparse_repack's layout; mask(x) = x where |x| >= threshold,
// else 0. The codes of a column that every row (of each pass of SPARSE_BLOCK_ROWS) masks are not read.
// A format without that layout: W is the file's blocks, and mask(x) goes through int8_matmul (nothing
// skipped: the quality of the sparse model, in the one-call decode path with the rest).
void sparse_blocks_matmul(uintptr_t x_, uintptr_t buf_, uintptr_t y_, int64_t M, int64_t N, int64_t K, int qtype,
                          float threshold, int threads) {
  SparseLayout known;
  if (!sparse_format(qtype, known)) {
    std::vector<float> masked((const float*)x_, (const float*)x_ + M * K);
    for (float& v : masked) v = std::fabs(v) >= threshold ? v : 0.f;
    return int8_matmul((uintptr_t)masked.data(), buf_, 0, y_, M, N, K, qtype, FASTEST, threads);
  }
  const SparseLayout L = sparse_layout(qtype, N, K);
  for (int64_t m0 = 0; m0 < M; m0 += SPARSE_BLOCK_ROWS)
    sparse_blocks_pass((const float*)x_ + m0 * K, (const uint8_t*)buf_, (float*)y_ + m0 * N,
                       std::min(SPARSE_BLOCK_ROWS, M - m0), N, K, L, threshold, threads);
}

}  // namespace hearth
