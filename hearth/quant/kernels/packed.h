// The packed tiles' layout (repack.cpp writes them, packed_matmul.cpp and dequantize.cpp read them).
#pragma once

#include "qmatmul.h"

namespace hearth {
namespace {  // this source's own copies, internal as when the kernels were one file

// ------------------------------------------------------------------ packed tiles
// Every block format but TQ2_0 (read in place), the grid formats from their nibble blocks (grid_nibbles.cpp),
// repacked once at
// load on AVX-512 VNNI builds (`repack`; the file's pages are then released: one copy): tiles of NR rows (the last one padded with zero rows), each
// tile two arrays that run block after block along K, so a thread reads each as one stream.
//
//   codes, per chunk of 32 values: the codes of the tiles decoded per call, unsigned bytes laid out
//     [8 groups of 4 values][32 rows][4] (one 64-byte vector: 4 codes of 16 rows, what one vpdpbusd
//     multiplies by 4 activation codes), kept at the format's bits:
//       8 bits (Q8_0): the bytes themselves (code + 128), 1024 bytes;
//       4 bits (Q4_*, Q5_*, Q6_K; IQ4_NL, IQ4_XS, the IQ3_* nibble blocks: their table indices): [4][32][4]
//         bytes, low nibble group g, high nibble group g + 4, 512;
//       2 bits (Q2_K, Q3_K; the IQ2_* / IQ1_* nibble blocks' 3-bit indices, their third bit a mask below):
//         [2][32][4] bytes, bits 2s, 2s + 1 group g + 2s, 256;
//     then the bits above those: Q5_*, Q3_K's one as [8 groups][2 halves of 16 rows] uint64 masks,
//     bit i = that bit of byte i of the group's vector, 128 bytes (AVX-512BW adds it back with one
//     masked add); Q6_K's two as a 2-bit plane of their own laid out as Q2_K's, 256 bytes (a shift
//     and a vpternlog put them above the nibble: fewer operations on the two vector ports, which
//     the batched kernel is bound by, than two mask moves and masked adds; 2-3% at 32 rows).
//   terms, per block: d [32 rows] float16 | f [32] float16 (formats with an offset) | sc [NS][32]
//     int8 (K-quants) | mn [NS][32] int8 (K-quants with a minimum), the block's own numbers, so that
//       w = d sc_j (q - Z) - f mn_j     (sc, mn = 1 where the format has none; Q4_1 / Q5_1: f = -m)
//
// The same bits as the file per weight (Q2_K and Q3_K keep 8-bit scales: 0.5 and 0.125 bits more
// per weight; Q4_K / Q5_K 0.125 more), rearranged so that the batched kernel reads tiles with no
// decoding (the tiles decoded per call cost as much as their dot products at 32 rows) and decode
// at batch 1 reads one vector per 16 rows x 4 values (in place: one per 32 values of one row).
template <int QT> struct Packed {
  using F = Fmt<QT>;
  static constexpr bool CODE3 = QT == NIB3_IQ2 || QT == NIB3_IQ1;  // 3-bit codes: a 2-bit plane and a mask
  static constexpr int BITS = QT == Q8_0 ? 8 : (QT == Q2_K || QT == Q3_K || CODE3) ? 2 : 4;
  static constexpr int EXTRA = QT == Q6_K ? 2 : (QT == Q5_0 || QT == Q5_1 || QT == Q5_K || QT == Q3_K || CODE3) ? 1 : 0;
  static constexpr bool HIGH_PLANE = EXTRA == 2;  // the extra bits as a 2-bit plane, not masks
  static constexpr int MASKS = HIGH_PLANE ? 0 : EXTRA;
  static constexpr int NS = F::BS / F::S;
  static constexpr bool SC = F::BS == 256, MIN = F::OFF;
  static constexpr int64_t PLANE = 32 * NR * BITS / 8, CHUNK = PLANE + EXTRA * 16 * 8;  // bytes per chunk
  // d float16; the nibble blocks' float32; MXFP4's bfloat16, which holds its e8m0 scales (2^-128..2^127) exactly
  static constexpr int D_BYTES = nibble_format<QT>() ? 4 : 2;
  static constexpr bool D_BF16 = QT == MXFP4;
  static constexpr int64_t F_AT = D_BYTES * NR, SC_AT = F_AT + 2 * NR * MIN, MN_AT = SC_AT + NR * NS;  // in a block's terms
  static constexpr int64_t TERMS = SC_AT + (SC ? NR * NS * (1 + MIN) : 0);                          // bytes per block
};
// IQ4_NL, IQ4_XS, MXFP4 and the nibble blocks of the grid formats: their indices (4 bits; IQ2_*, IQ1_*: 3)
// packed as codes, looked up per call as value + 128 (one byte shuffle a vector; Z = 128).
template <int QT> constexpr bool table_packed() { return codebook<QT>() || nibble_format<QT>(); }
template <int QT> constexpr const int8_t* table_values() {
  if constexpr (nibble_format<QT>()) return Nibbles<QT>::values;
  else if constexpr (QT == MXFP4) return MXFP4_VALUES;
  else return IQ4_NL_VALUES;
}
template <int QT> constexpr bool packable() {
  return QT != TQ2_0 && !grid_format<QT>();
}

// ... and back: chunk `in` -> byte codes [8][32 rows][4]
template <int QT>
void unpack_chunk(const uint8_t* in, uint8_t* v) {
  using P = Packed<QT>;
  for (int g = 0; g < 8; g++)
    for (int i = 0; i < 128; i++) {  // rows 0..31 x 4 values of group g
      uint8_t q;
      if constexpr (P::BITS == 8) q = in[g * 128 + i];
      else if constexpr (P::BITS == 4) q = (in[(g % 4) * 128 + i] >> (4 * (g / 4))) & 0x0F;
      else q = (in[(g % 2) * 128 + i] >> (2 * (g / 2))) & 3;
      if constexpr (P::HIGH_PLANE) q |= uint8_t(((in[P::PLANE + (g % 2) * 128 + i] >> (2 * (g / 2))) & 3) << P::BITS);
      for (int e = 0; e < P::MASKS; e++) {
        uint64_t m;
        std::memcpy(&m, in + P::PLANE + (e * 16 + g * 2 + i / 64) * 8, 8);
        q |= uint8_t(((m >> (i % 64)) & 1) << (P::BITS + e));
      }
      v[g * 128 + i] = table_packed<QT>() ? uint8_t(table_values<QT>()[q] + 128) : q;
    }
}

// One tile's block b, read back: row j's w = s[sub-block][j] (q - Z) + o[sub-block][j], fp32 as decode<QT>
template <int QT>
void tile_block_terms(const uint8_t* tt, float (*s)[NR], float (*o)[NR]) {
  using P = Packed<QT>;
  for (int j = 0; j < NR; j++) {
    float d;
    if constexpr (P::D_BYTES == 4) std::memcpy(&d, tt + 4 * j, 4);
    else if constexpr (P::D_BF16) d = bf16_to_float(uint16_t(tt[2 * j] | tt[2 * j + 1] << 8));
    else d = h2f(tt + 2 * j);
    const float f = P::MIN ? h2f(tt + P::F_AT + 2 * j) : 0.f;
    for (int i = 0; i < P::NS; i++) {
      s[i][j] = P::SC ? d * float(int8_t(tt[P::SC_AT + i * NR + j])) : d;
      o[i][j] = P::MIN ? -(f * (P::SC ? float(int8_t(tt[P::MN_AT + i * NR + j])) : 1.f)) : 0.f;
    }
  }
}

}  // namespace
}  // namespace hearth
