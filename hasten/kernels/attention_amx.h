// attention_int8_scores' prefill rows on AMX tiles (paged_attention's int8_tiles; the switch
// attention_amx in hasten.config). Included by paged_attention_cpu.cpp; reads the units packed by
// attention_int8_scores.h in their bf16_pv form, with each kv head's value pairs in one run of their
// own (pack_unit's `pairs`: [units * 8][D][2]) so that one B tile spans the 16 pairs of two units.
//
// The arithmetic is attend_rows_int8's with bf16_pv, 16 query rows of one kv head at a time:
// 1. scores: a unit's key codes ([D / 4][16] dwords: row c holds dims 4c .. 4c + 3 of its 16 keys)
//    are, as packed, the B operand of TDPBUSD, and the 16 rows' q + 128 codes (64 bytes per row) the
//    A operand: one TDPBUSD per 64 dims gives the 16 x 16 integer dot products, exact in int32 as the
//    VNNI loop's are; they are stored, and each row's scores are scaled, masked and put through the
//    online softmax over chunks of 256 keys exactly as attend_rows_int8 does;
// 2. P V: each row's weights times the value scales, rounded to bfloat16 (as bf16_pv), 32 keys per
//    A tile (16 rows x 32 bfloat16), against two units' value pairs (16 rows of 16 dims x 2 keys per B
//    tile): TDPBF16PS into 16 x 16 float32 sums per 16 dims. A chunk's sums go to the rows'
//    accumulators after the rescale of the running maximum. A sequence's unit count is even (the
//    last unit past its keys is zeros), and the weights of a unit past the chunk's are set to 0.
// So the scores and weights are those of the bf16_pv path; only the order in which float32 P V
// products are added differs (and the tiles treat bfloat16 subnormals as zero).
// Tiles, all 16 rows of 64 bytes: scores of two units in tmm0 and tmm5 from the q codes in tmm1 and
// the units' key codes in tmm2 and tmm6; then the P V sums in tmm0, tmm5, tmm6 and tmm7 from 32
// weights per row in tmm3 and 16 value pairs in tmm4 and tmm2 by turns.
#pragma once

#include "amx_tiles.h"
#include "attention_int8_scores.h"

#if defined(HASTEN_INT8_SCORES) && defined(HASTEN_BF16_PV) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && \
    defined(__AMX_BF16__)
#define HASTEN_AMX_ATTENTION 1
#endif

namespace hasten_attention {
namespace {

// Head sizes the tiles take (whole 64-byte rows of q codes).
inline bool amx_attention_take(int64_t D) { return D == 64 || D == 128; }

// Bytes of a unit without its value pairs (codes, 128 * code sums, key scales, value scales), and of
// one unit's pairs in the run of its kv head.
inline int64_t amx_unit_bytes(int64_t D) { return kUnitKeys * D + 3 * kUnitKeys * 4; }
inline int64_t amx_pair_bytes(int64_t D) { return kUnitKeys * D * 2; }

#if defined(HASTEN_AMX_ATTENTION)
constexpr int kAmxRows = 16;  // query rows per tile pass

inline bool amx_attention_ready() {
  return hasten_amx::amx_ready(hasten_amx::kAmxInt8 | hasten_amx::kAmxBf16);
}

// `rows` <= 16 query rows (codes q + 128 at qcodes, D bytes per row, 16 rows readable; scales sq;
// newest visible key positions last) over the units up to the newest any of them sees (`unit_base` +
// u * unit_stride bytes each, their value pairs from `pairs`); writes their normalised outputs (D
// floats) to out[r]. The tiles must be configured (hasten_amx::configure_16x64_tiles).
template <int DT>  // D = 64 DT
inline void attend_block_amx(const uint8_t* qcodes, const float* sq, const int64_t* last, int rows,
                             const uint8_t* unit_base, int64_t unit_stride, const uint16_t* pairs,
                             float* const* out) {
  constexpr int64_t D = 64 * DT, CK = kChunkUnits * kUnitKeys;
  int64_t newest = 0;
  for (int r = 0; r < rows; ++r) newest = std::max(newest, last[r]);
  const int64_t units = newest / kUnitKeys + 1;
  alignas(64) int32_t scores[kAmxRows][CK];  // int32 dot products, then (in place) the scaled scores
  alignas(64) uint16_t weights[kAmxRows][CK];
  alignas(64) float part[kAmxRows][D];
  alignas(64) float acc[kAmxRows][D];
  float m[kAmxRows], l[kAmxRows], corr[kAmxRows];
  __mmask16 seen[kAmxRows][kChunkUnits];
  for (int r = 0; r < rows; ++r) {
    std::fill(acc[r], acc[r] + D, 0.0f);
    m[r] = -1e30f;
    l[r] = 0.0f;
  }
  // rows past `rows` (a decode's G rows, a tile's last rows) go through the tiles with zero weights;
  // the scalar work (softmax, rescale, output) is done for the first `rows` only
  for (int r = rows; r < kAmxRows; ++r) std::fill(weights[r], weights[r] + CK, 0);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 lowest = _mm512_set1_ps(-1e30f);
  if constexpr (DT == 1) _tile_loadd(1, qcodes, D);
  for (int64_t u0 = 0; u0 < units; u0 += kChunkUnits) {
    const int64_t nu = std::min(kChunkUnits, units - u0);
    for (int64_t i = 0; i < nu; i += 2) {  // two units at a time (sums in tmm0 and tmm5, codes in tmm2 and
      // tmm6), so that one unit's products overlap the other's loads and stores
      const PackedUnit a = unit_at(unit_base + (u0 + i) * unit_stride, D);
      const PackedUnit b = unit_at(unit_base + (u0 + i + 1) * unit_stride, D);  // i + 1 < count (even)
      _tile_zero(0);
      _tile_zero(5);
      _tile_loadd(2, a.codes, 64);
      _tile_loadd(6, b.codes, 64);
      if constexpr (DT == 2) _tile_loadd(1, qcodes, D);
      _tile_dpbusd(0, 1, 2);
      _tile_dpbusd(5, 1, 6);
      if constexpr (DT == 2) {
        _tile_loadd(1, qcodes + 64, D);
        _tile_loadd(2, a.codes + 16 * kUnitKeys, 64);
        _tile_loadd(6, b.codes + 16 * kUnitKeys, 64);
        _tile_dpbusd(0, 1, 2);
        _tile_dpbusd(5, 1, 6);
      }
      _tile_stored(0, scores[0] + i * kUnitKeys, CK * 4);
      _tile_stored(5, scores[0] + (i + 1) * kUnitKeys, CK * 4);  // past nu: never read
    }
    for (int r = 0; r < rows; ++r) {
      float* s = reinterpret_cast<float*>(scores[r]);
      const __m512i limit = _mm512_set1_epi32(static_cast<int32_t>(last[r]));
      __m512 vmax = lowest;
      for (int64_t i = 0; i < nu; ++i) {
        const PackedUnit un = unit_at(unit_base + (u0 + i) * unit_stride, D);
        const __m512i pos = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>((u0 + i) * kUnitKeys)));
        seen[r][i] = _mm512_cmple_epi32_mask(pos, limit);
        const __m512i dot = _mm512_load_si512(scores[r] + i * kUnitKeys);
        const __m512 x = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot, _mm512_loadu_si512(un.sums))),
                                       _mm512_mul_ps(_mm512_loadu_ps(un.scales), _mm512_set1_ps(sq[r])));
        _mm512_store_ps(s + i * kUnitKeys, x);
        vmax = _mm512_mask_max_ps(vmax, seen[r][i], vmax, x);
      }
      const float mx = std::max(m[r], _mm512_reduce_max_ps(vmax));
      corr[r] = exp_nonpositive(m[r] - mx);
      const __m512 vm = _mm512_set1_ps(mx);
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t i = 0; i < nu; ++i) {
        const __m512 x = _mm512_sub_ps(_mm512_load_ps(s + i * kUnitKeys), vm);
        const __m512 e = _mm512_maskz_mov_ps(seen[r][i], exp_nonpositive16<true>(x));
        const __m512 vscale = _mm512_loadu_ps(unit_at(unit_base + (u0 + i) * unit_stride, D).vscales);
        _mm256_store_si256(reinterpret_cast<__m256i*>(weights[r] + i * kUnitKeys),
                           reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(e, vscale))));
        vsum = _mm512_add_ps(vsum, e);
      }
      l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(vsum);
      m[r] = mx;
    }
    if (nu % 2 == 1)  // the pair's second unit is past the chunk: no weight
      for (int r = 0; r < rows; ++r) std::fill(weights[r] + nu * kUnitKeys, weights[r] + (nu + 1) * kUnitKeys, 0);
    for (int half = 0; half < DT; ++half) {  // 64 dims (four 16 x 16 tiles of sums) at a time
      _tile_zero(0);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t i = 0; i < nu; i += 2) {  // units i and i + 1: 16 pairs of D dims x 2 keys x 2 bytes
        const char* v = reinterpret_cast<const char*>(pairs + (u0 + i) * kUnitKeys * D) + half * 256;
        _tile_loadd(3, weights[0] + i * kUnitKeys, CK * 2);
        _tile_loadd(4, v, D * 4);  // values alternate between tmm4 and tmm2 (free after the scores)
        _tile_loadd(2, v + 64, D * 4);
        _tile_dpbf16ps(0, 3, 4);
        _tile_dpbf16ps(5, 3, 2);
        _tile_loadd(4, v + 128, D * 4);
        _tile_loadd(2, v + 192, D * 4);
        _tile_dpbf16ps(6, 3, 4);
        _tile_dpbf16ps(7, 3, 2);
      }
      float* p = part[0] + half * 64;
      _tile_stored(0, p, D * 4);
      _tile_stored(5, p + 16, D * 4);
      _tile_stored(6, p + 32, D * 4);
      _tile_stored(7, p + 48, D * 4);
    }
    for (int r = 0; r < rows; ++r) {
      const __m512 vc = _mm512_set1_ps(corr[r]);
      for (int64_t c = 0; c < D; c += 16)
        _mm512_store_ps(acc[r] + c, _mm512_fmadd_ps(_mm512_load_ps(acc[r] + c), vc, _mm512_load_ps(part[r] + c)));
    }
  }
  for (int r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(out[r] + c, _mm512_mul_ps(_mm512_load_ps(acc[r] + c), inv));
  }
}

// `rows` query rows (codes at qcodes, D bytes each, contiguous and padded to a multiple of 16 rows;
// sq and last padded alike) through attend_block_amx, 16 at a time.
inline void attend_int8_rows_amx(const uint8_t* qcodes, const float* sq, const int64_t* last, int64_t rows, int64_t D,
                                 const uint8_t* unit_base, int64_t unit_stride, const uint16_t* pairs,
                                 float* const* out) {
  hasten_amx::configure_16x64_tiles();  // kAmxRows rows of 64 bytes each
  for (int64_t r = 0; r < rows; r += kAmxRows) {
    const int n = static_cast<int>(std::min<int64_t>(kAmxRows, rows - r));
    if (D == 64)
      attend_block_amx<1>(qcodes + r * D, sq + r, last + r, n, unit_base, unit_stride, pairs, out + r);
    else
      attend_block_amx<2>(qcodes + r * D, sq + r, last + r, n, unit_base, unit_stride, pairs, out + r);
  }
  _tile_release();
}
#endif

}  // namespace
}  // namespace hasten_attention
