// Prefill attention over an int8 KV cache with the scores in integer arithmetic (paged_attention's
// int8_rows; the switch attention_int8_scores in hasten.config). Included by paged_attention_cpu.cpp.
//
// A sequence with int8_rows or more new tokens (a prefill chunk) is served as follows:
// 1. pack (once per call, shared by all its query tiles): its keys 0 .. ctx - 1 in runs of 16
//    positions per kv head ("units"). A unit holds the 16 keys' int8 codes transposed so that one
//    512-bit load is 4 consecutive dimensions of all 16 keys (dword c of key j at [c][j]), each key's
//    code sum times 128, each key's scale, and the 16 value rows widened to float32 with their scale
//    applied (code * scale, the values the cache stands for). Positions past ctx are zero.
// 2. each query row (already multiplied by the softmax scale) is rounded to int8 with one absmax
//    scale per row (sq = max |q| / 127), stored as q + 128 (unsigned); then for 16 keys at once
//        score[j] = sq * kscale[j] * (sum_d (q_d + 128) k_jd - 128 sum_d k_jd)
//    is D / 4 VNNI u8 x s8 multiply-adds of a broadcast query dword against a unit row, i.e. an
//    integer dot product of the rounded q with the key codes (exact in int32), scaled.
// 3. softmax in float32 over chunks of kChunkUnits units (256 keys): the chunk's scores first, one
//    running-max update and one rescale per row per chunk (the causal limit of each row as a lane
//    mask), then P V in float32 fused multiply-adds against the widened values, the accumulators of
//    rows_per_pass() rows held in registers across the whole walk.
// So the result differs from the float path only by the rounding of q to int8 (llama.cpp's CPU
// attention rounds q the same way against a q8_0 cache); the softmax weights and values are not
// rounded. Measured on 2 Zen 4 cores, 30 layers of a 256-token prefill (9 heads, 3 kv heads, D 64):
// ~27 -> ~16 ms. Rounding P to 8 bits too (P V as VNNI multiply-adds) took ~10 % more off the kernel
// but cost the default GGUF ~1 point of top-1 agreement; not kept.
// bf16_pv (the switch attention_bf16_pv; CPUs with AVX512-BF16): the unit holds the value codes as
// bfloat16 (exact: |code| <= 127) with two keys interleaved per dword, and each softmax weight is
// multiplied by its key's value scale and rounded to bfloat16 (8 significant bits: relative error
// <= 2^-8 per weight, against the 2^-7 or more of an 8-bit value code; the running sum l stays
// float32). P V is then one vdpbf16ps per 16 dimensions and two keys: half the instructions of the
// float32 multiply-adds.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define HASTEN_INT8_SCORES 1
#if defined(__AVX512BF16__)
#define HASTEN_BF16_PV 1
#endif
#endif

namespace hasten_attention {
namespace {

constexpr int64_t kUnitKeys = 16;  // keys per unit: one 512-bit register of int32 scores

// Whether a head size takes the integer-score path (values held as D / 16 registers per row).
inline bool int8_scores_take(int64_t D) { return D == 64 || D == 96 || D == 128; }

// Bytes of one packed unit: transposed codes, 128 * code sums, scales, then the widened values
// (float32) or, with bf16_pv, the value scales and the value codes as interleaved bfloat16 pairs.
inline int64_t int8_unit_bytes(int64_t D, bool bf16_pv) {
  return kUnitKeys * D + 2 * kUnitKeys * 4 + (bf16_pv ? kUnitKeys * 4 + kUnitKeys * D * 2 : kUnitKeys * D * 4);
}

struct PackedUnit {
  const int32_t* codes;    // [D / 4][16]: dword c of key j
  const int32_t* sums;     // [16]: 128 * sum of key j's codes
  const float* scales;     // [16]
  const float* values;     // [16][D] (float32 units)
  const float* vscales;    // [16] (bf16_pv units)
  const uint16_t* vpairs;  // [8][D][2]: bfloat16 value codes of keys 2 i and 2 i + 1 (bf16_pv units)
};

inline PackedUnit unit_at(const uint8_t* base, int64_t D) {
  const int32_t* codes = reinterpret_cast<const int32_t*>(base);
  const int32_t* sums = codes + kUnitKeys * D / 4;
  const float* scales = reinterpret_cast<const float*>(sums + kUnitKeys);
  const float* tail = scales + kUnitKeys;
  return {codes, sums, scales, tail, tail, reinterpret_cast<const uint16_t*>(tail + kUnitKeys)};
}

// the bfloat16 bits of a small integer (exact: its float32 low 16 bits are zero)
inline uint16_t bf16_of_code(int8_t c) {
  const float f = static_cast<float>(c);
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return static_cast<uint16_t>(bits >> 16);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// r[j] (16 dwords each) -> r[c] holding dword c of every r[j], in place: unpacks of dword and qword
// pairs give, per 128-bit lane L, dword 4L + x of 4 rows; a 4 x 4 shuffle of lanes finishes it.
inline void transpose16x16_epi32(__m512i r[16]) {
  __m512i a[8], b[8], q[4][4];
  for (int i = 0; i < 8; ++i) {
    a[i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);  // lane L: dwords 4L, 4L + 1 of rows 2i, 2i + 1
    b[i] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);  // lane L: dwords 4L + 2, 4L + 3
  }
  for (int g = 0; g < 4; ++g) {  // q[g][x], lane L: dword 4L + x of rows 4g .. 4g + 3
    q[g][0] = _mm512_unpacklo_epi64(a[2 * g], a[2 * g + 1]);
    q[g][1] = _mm512_unpackhi_epi64(a[2 * g], a[2 * g + 1]);
    q[g][2] = _mm512_unpacklo_epi64(b[2 * g], b[2 * g + 1]);
    q[g][3] = _mm512_unpackhi_epi64(b[2 * g], b[2 * g + 1]);
  }
  for (int x = 0; x < 4; ++x) {
    const __m512i s0 = _mm512_shuffle_i32x4(q[0][x], q[1][x], 0x44), s1 = _mm512_shuffle_i32x4(q[0][x], q[1][x], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(q[2][x], q[3][x], 0x44), s3 = _mm512_shuffle_i32x4(q[2][x], q[3][x], 0xEE);
    r[x] = _mm512_shuffle_i32x4(s0, s2, 0x88);  // dword x of every row
    r[4 + x] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    r[8 + x] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    r[12 + x] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
}
#endif

// Packs keys [16 u, 16 u + 16) of kv head h of one sequence (block table `table`, ctx tokens) from
// the int8 cache pool (rows of D + 4 bytes, KVH heads per token, BS tokens per block) into dst. With
// bf16_pv, `pairs` (if given) takes the value pairs instead of the unit's own tail (attention_amx.h).
inline void pack_unit(const int8_t* kp, const int8_t* vp, const int32_t* table, int64_t ctx, int64_t u, int64_t h,
                      int64_t BS, int64_t KVH, int64_t D, bool bf16_pv, uint8_t* dst, uint16_t* pairs = nullptr) {
  const int64_t P = D + kInt8ScaleBytes;
  int32_t* codes = reinterpret_cast<int32_t*>(dst);
  int32_t* sums = codes + kUnitKeys * D / 4;
  float* scales = reinterpret_cast<float*>(sums + kUnitKeys);
  float* values = scales + kUnitKeys;  // float32 units; bf16_pv: the value scales, then the pairs
  uint16_t* vpairs = pairs != nullptr ? pairs : reinterpret_cast<uint16_t*>(values + kUnitKeys);
  const int8_t* krow[kUnitKeys];
  const int8_t* vrow[kUnitKeys];  // nullptr: past ctx (zeros)
  for (int64_t j = 0; j < kUnitKeys; ++j) {
    const int64_t pos = u * kUnitKeys + j;
    const int64_t row = pos < ctx ? ((static_cast<int64_t>(table[pos / BS]) * BS + pos % BS) * KVH + h) * P : -1;
    krow[j] = row >= 0 ? kp + row : nullptr;
    vrow[j] = row >= 0 ? vp + row : nullptr;
  }
  bool keys_done = false;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  if (D % 64 == 0 && krow[kUnitKeys - 1] != nullptr) {  // a full unit: 16 rows of 64 codes at a time
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t part = 0; part < D / 64; ++part) {
      __m512i r[kUnitKeys];
      for (int64_t j = 0; j < kUnitKeys; ++j) r[j] = _mm512_loadu_si512(krow[j] + 64 * part);
      transpose16x16_epi32(r);
      for (int c = 0; c < 16; ++c) {
        _mm512_storeu_si512(codes + (16 * part + c) * kUnitKeys, r[c]);
        sum = _mm512_dpbusd_epi32(sum, ones, r[c]);  // per key: the sum of its 4 codes in this dword
      }
    }
    _mm512_storeu_si512(sums, _mm512_slli_epi32(sum, 7));  // 128 * sum
    for (int64_t j = 0; j < kUnitKeys; ++j) scales[j] = int8_row_scale(krow[j], D);
    keys_done = true;
  }
#endif
  for (int64_t j = 0; j < kUnitKeys; ++j) {
    const int8_t* k = krow[j];
    const int8_t* v = vrow[j];
    if (k == nullptr) {
      for (int64_t c = 0; c < D / 4; ++c) codes[c * kUnitKeys + j] = 0;
      sums[j] = 0;
      scales[j] = 0.0f;
      if (bf16_pv) {
        values[j] = 0.0f;
        for (int64_t d = 0; d < D; ++d) vpairs[((j / 2) * D + d) * 2 + j % 2] = 0;
      } else {
        std::fill(values + j * D, values + (j + 1) * D, 0.0f);
      }
      continue;
    }
    if (!keys_done) {
      int32_t sum = 0;
      for (int64_t d = 0; d < D; ++d) sum += k[d];
      for (int64_t c = 0; c < D / 4; ++c) std::memcpy(codes + c * kUnitKeys + j, k + 4 * c, 4);
      sums[j] = 128 * sum;
      scales[j] = int8_row_scale(k, D);
    }
    const float vs = int8_row_scale(v, D);
    if (bf16_pv) {
      values[j] = vs;
      uint16_t* pair = vpairs + (j / 2) * D * 2 + j % 2;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      if (D % 16 == 0) {  // 16 codes to float32, whose top halves are their bfloat16, into every other lane
        const __mmask32 lanes = j % 2 == 0 ? 0x55555555u : 0xAAAAAAAAu;
        for (int64_t d = 0; d < D; d += 16) {
          const __m512i bits = _mm512_castps_si512(
              _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + d)))));
          const __m512i half = j % 2 == 0 ? _mm512_srli_epi32(bits, 16) : bits;  // the lane keeps its top half
          _mm512_mask_storeu_epi16(pair - j % 2 + 2 * d, lanes, half);
        }
        continue;
      }
#endif
      for (int64_t d = 0; d < D; ++d) pair[2 * d] = bf16_of_code(v[d]);
    } else {
      for (int64_t d = 0; d < D; ++d) values[j * D + d] = static_cast<float>(v[d]) * vs;
    }
  }
}

#if defined(HASTEN_INT8_SCORES)
// q[0 .. D) times `scale` rounded as an int8 cache row is (quantize_int8_row: one absmax scale, round
// half to even), stored as q + 128 (the code with its sign bit flipped); returns the scale. D <= 256.
template <typename scalar_t>
inline float quantize_query_u8(const scalar_t* q, float scale, int64_t D, uint8_t* out) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (D % 16 == 0) {  // quantize_int8_row's rounding, the codes flipped as they are stored (no staging row)
      const __m512 s = _mm512_set1_ps(scale);
      const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
      return quantize_int8_vectors(
          D / 16, [&](int64_t i) { return _mm512_mul_ps(_mm512_loadu_ps(q + 16 * i), s); },
          [&](int64_t i, __m128i codes) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * i), _mm_xor_si128(codes, flip));
          });
    }
  }
  float x[256];
  int8_t row[256 + kInt8ScaleBytes];
  for (int64_t d = 0; d < D; ++d) x[d] = static_cast<float>(q[d]) * scale;
  quantize_int8_row(x, D, row);
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<uint8_t>(row[d]) ^ 0x80u;
  return int8_row_scale(row, D);
}

constexpr int64_t kChunkUnits = 16;  // units scored before one softmax update (256 keys)

#if defined(HASTEN_BF16_PV)
// acc[r] += P V over keys 0 .. keys of a chunk (its first unit at `units`): two keys per step (a unit
// holds 16, so a pair never straddles units; a key past `keys` has weight 0 in every row), pb[r] the
// row's weights times the value scales in bfloat16. A function of its own so that only the NR x DV
// accumulators, the step's DV value registers and one broadcast weight pair are live in its loop: inside
// the whole walk the compiler kept some accumulators on the stack (a load and a store per multiply-add).
template <int NR, int DV>
__attribute__((noinline)) void pv_bf16_pairs(__m512 (&acc_io)[NR][DV], const uint16_t (*pb)[kChunkUnits * kUnitKeys],
                                             int64_t keys, const uint8_t* units, int64_t unit_stride) {
  constexpr int64_t D = 16 * DV;
  __m512 acc[NR][DV];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < DV; ++c) acc[r][c] = acc_io[r][c];
  for (int64_t j = 0; j < keys; j += 2) {
    const uint16_t* vpair = unit_at(units + (j / kUnitKeys) * unit_stride, D).vpairs + (j % kUnitKeys) * D;
    __m512i v[DV];
    for (int c = 0; c < DV; ++c) v[c] = _mm512_loadu_si512(vpair + 32 * c);
    for (int r = 0; r < NR; ++r) {
      int32_t two;
      std::memcpy(&two, pb[r] + j, sizeof(two));
      const __m512i pj = _mm512_set1_epi32(two);
      for (int c = 0; c < DV; ++c)
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], reinterpret_cast<__m512bh>(pj), reinterpret_cast<__m512bh>(v[c]));
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < DV; ++c) acc_io[r][c] = acc[r][c];
}
#endif

// NR query rows (codes q + 128, D bytes each, scales sq, newest visible key positions last[r]) over
// units 0 .. last unit any of them sees (`unit_base` + u * unit_stride bytes each); writes each row's
// normalised output (D floats) to out[r]. DV = D / 16. The units are taken kChunkUnits at a time:
// all their scores first (integer dot products, scaled), then one online-softmax update per row
// for the whole chunk (one horizontal max, one rescale of the accumulators), then P V.
template <int NR, int DV, bool BF16PV>
inline void attend_rows_int8(const uint8_t* const* qc, const float* sq, const int64_t* last, const uint8_t* unit_base,
                             int64_t unit_stride, float* const* out) {
  constexpr int64_t D = 16 * DV;
  int64_t newest = 0;
  for (int r = 0; r < NR; ++r) newest = std::max(newest, last[r]);
  const int64_t units = newest / kUnitKeys + 1;
  __m512 acc[NR][DV];
  float m[NR], l[NR];
  for (int r = 0; r < NR; ++r) {
    for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_setzero_ps();
    m[r] = -1e30f;
    l[r] = 0.0f;
  }
  alignas(64) float p[NR][kChunkUnits * kUnitKeys];
  alignas(64) uint16_t pb[BF16PV ? NR : 1][kChunkUnits * kUnitKeys];  // bf16_pv: p times value scale
  __mmask16 seen[NR][kChunkUnits];
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 lowest = _mm512_set1_ps(-1e30f);
  for (int64_t u0 = 0; u0 < units; u0 += kChunkUnits) {
    const int64_t nu = std::min(kChunkUnits, units - u0);
    __m512 vmax[NR];
    for (int r = 0; r < NR; ++r) vmax[r] = lowest;
    for (int64_t i = 0; i < nu; ++i) {
      const PackedUnit un = unit_at(unit_base + (u0 + i) * unit_stride, D);
      __m512i dot[NR];
      for (int r = 0; r < NR; ++r) dot[r] = _mm512_setzero_si512();
      for (int64_t c = 0; c < D / 4; ++c) {
        const __m512i k = _mm512_loadu_si512(un.codes + c * kUnitKeys);
        for (int r = 0; r < NR; ++r) {
          int32_t q4;
          std::memcpy(&q4, qc[r] + 4 * c, 4);
          dot[r] = _mm512_dpbusd_epi32(dot[r], _mm512_set1_epi32(q4), k);
        }
      }
      const __m512i sums = _mm512_loadu_si512(un.sums);
      const __m512 kscale = _mm512_loadu_ps(un.scales);
      const __m512i pos = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>((u0 + i) * kUnitKeys)));
      for (int r = 0; r < NR; ++r) {
        seen[r][i] = _mm512_cmple_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(last[r])));
        const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r], sums)),
                                       _mm512_mul_ps(kscale, _mm512_set1_ps(sq[r])));
        _mm512_store_ps(p[r] + i * kUnitKeys, s);
        vmax[r] = _mm512_mask_max_ps(vmax[r], seen[r][i], vmax[r], s);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const float mx = std::max(m[r], _mm512_reduce_max_ps(vmax[r]));
      const float corr = exp_nonpositive(m[r] - mx);
      const __m512 vm = _mm512_set1_ps(mx);
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t i = 0; i < nu; ++i) {
        const __m512 x = _mm512_sub_ps(_mm512_load_ps(p[r] + i * kUnitKeys), vm);
        const __m512 e = _mm512_maskz_mov_ps(seen[r][i], exp_nonpositive16<BF16PV>(x));
        if constexpr (BF16PV) {
#if defined(HASTEN_BF16_PV)
          const __m512 vscale = _mm512_loadu_ps(unit_at(unit_base + (u0 + i) * unit_stride, D).vscales);
          _mm256_store_si256(reinterpret_cast<__m256i*>(pb[r] + i * kUnitKeys),
                             reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(e, vscale))));
#endif
        } else {
          _mm512_store_ps(p[r] + i * kUnitKeys, e);
        }
        vsum = _mm512_add_ps(vsum, e);
      }
      l[r] = l[r] * corr + _mm512_reduce_add_ps(vsum);
      m[r] = mx;
      const __m512 vc = _mm512_set1_ps(corr);
      for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], vc);
    }
    const int64_t keys = std::min<int64_t>(nu * kUnitKeys, newest - u0 * kUnitKeys + 1);
    if constexpr (BF16PV) {
#if defined(HASTEN_BF16_PV)
      pv_bf16_pairs<NR, DV>(acc, pb, keys, unit_base + u0 * unit_stride, unit_stride);
#endif
      continue;
    }
    for (int64_t j = 0; j < keys; ++j) {
      const float* vrow = unit_at(unit_base + (u0 + j / kUnitKeys) * unit_stride, D).values + (j % kUnitKeys) * D;
      __m512 pj[NR];
      for (int r = 0; r < NR; ++r) pj[r] = _mm512_set1_ps(p[r][j]);
      for (int c = 0; c < DV; ++c) {
        const __m512 v = _mm512_loadu_ps(vrow + 16 * c);
        for (int r = 0; r < NR; ++r) acc[r][c] = _mm512_fmadd_ps(pj[r], v, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(out[r] + 16 * c, _mm512_mul_ps(acc[r][c], inv));
  }
}

// Rows per pass for DV = D / 16 registers of accumulators per row: 24 accumulators for D = 64
// (benchmarks/kernels_cpu.py, 256 new tokens over 512 keys, 30 layers, on 2 Zen 4 cores, builds
// alternating: 4 -> 6 rows 37.4-37.5 -> 36.3 ms, with bf16_pv 27.0-27.5 -> 24.6-24.7 ms).
template <int DV>
constexpr int rows_per_pass() {
  return DV <= 4 ? 6 : 2;
}

// `rows` query rows through attend_rows_int8, rows_per_pass<DV>() at a time.
template <int DV, bool BF16PV>
inline void attend_int8_dv(const uint8_t* const* qc, const float* sq, const int64_t* last, int64_t rows,
                           const uint8_t* unit_base, int64_t unit_stride, float* const* out) {
  constexpr int NR = rows_per_pass<DV>();
  int64_t r = 0;
  for (; r + NR <= rows; r += NR)
    attend_rows_int8<NR, DV, BF16PV>(qc + r, sq + r, last + r, unit_base, unit_stride, out + r);
  for (; r < rows; ++r) attend_rows_int8<1, DV, BF16PV>(qc + r, sq + r, last + r, unit_base, unit_stride, out + r);
}

template <bool BF16PV>
inline void attend_int8_rows_as(const uint8_t* const* qc, const float* sq, const int64_t* last, int64_t rows,
                                int64_t D, const uint8_t* unit_base, int64_t unit_stride, float* const* out) {
  switch (D) {
    case 64: attend_int8_dv<4, BF16PV>(qc, sq, last, rows, unit_base, unit_stride, out); break;
    case 96: attend_int8_dv<6, BF16PV>(qc, sq, last, rows, unit_base, unit_stride, out); break;
    default: attend_int8_dv<8, BF16PV>(qc, sq, last, rows, unit_base, unit_stride, out); break;
  }
}

inline void attend_int8_rows(const uint8_t* const* qc, const float* sq, const int64_t* last, int64_t rows, int64_t D,
                             bool bf16_pv, const uint8_t* unit_base, int64_t unit_stride, float* const* out) {
#if defined(HASTEN_BF16_PV)
  if (bf16_pv) return attend_int8_rows_as<true>(qc, sq, last, rows, D, unit_base, unit_stride, out);
#endif
  attend_int8_rows_as<false>(qc, sq, last, rows, D, unit_base, unit_stride, out);
}

#endif

}  // namespace
}  // namespace hasten_attention
