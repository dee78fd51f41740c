// Decode rows over an int8 KV cache with the scores in integer arithmetic, the cache read in place
// (no packing: paged_attention's int8_decode; the switch attention_int8_decode in hasten.config).
// Included by paged_attention_cpu.cpp, whose attend_item calls attend_heads_int8 for the rows of the
// sequences the packed path (attention_int8_scores.h) does not take: decodes and chunks of fewer than
// int8_rows new tokens, plain causal attention (no window short of key 0, no soft cap).
//
// Each query row (already multiplied by the softmax scale) is rounded to int8 with one absmax scale
// (quantize_int8_row: the rounding the packed path's queries and the cache's rows use). A cache row is
// D codes and its float32 scale. For one key and the query rows of its kv head, 64 dimensions at a
// time: the key's codes as magnitudes (|k|, unsigned; |-128| = 128 fits) and each query's codes with
// the key's signs applied (q_d where k_d >= 0, -q_d where not: |q_d| <= 127, so no overflow) make one
// VNNI u8 x s8 multiply-add per row, 16 partial int32 sums of the exact integer dot product. A
// transposing reduction turns 16 keys' partial sums into one register of 16 dot products per row
// (45 shuffles and adds per row per 16 keys, against 16 horizontal sums), so
//     score[j] = sq * kscale[j] * sum_d q_d k_jd
// for 16 keys at once. Plain AVX2 (no VNNI) does the same integer sums in 256-bit registers: the
// key's signs go onto the query's codes by vpsignb, |k| x (signed q) by vpmaddubsw into int16 pairs
// (|pair| <= 2 * 128 * 127 < 2^15: exact), vpmaddwd by ones into int32; a transposing reduction of
// 8 keys' sums, up to 3 rows at a time (the accumulators of 4 keys x 3 rows fill 12 of the 16
// registers). The walk is key-major, as the pool lays a token's kv heads out side by side:
// kDecodeChunk keys at a time, every head's scores, then one running-max update and rescale per row,
// then every head's P V (float32 fused multiply-adds over the value codes widened on load, the
// accumulators of 64 dimensions of up to 4 rows in registers across the chunk; on AVX2 16 or 32
// dimensions of up to 3 rows), the rows of the keys
// kPrefetchKeys ahead asked for as it goes. The result differs from the float path by the rounding of
// q to int8 only, as the packed path's does.
// The integer sums are the same on both, so are the scores up to the order of the softmax's sums.
// Measured on 2 vCPUs of a Xeon with AVX-512 VNNI, 9 heads / 3 kv heads / D 64: with the cache in L2,
// 12-15 ns per key and kv head against 17-19 for the float path; 32 decodes of ~320 keys over 30
// layers' pools (~125 MB read per step, from memory) 12.0 against 13.2-13.4 ms per step in the engine,
// where the rows' scattered blocks, not the arithmetic, set the pace. On 2 AMD Zen 3 vCPUs (plain
// AVX2) the same 32 decodes over 30 layers: 11.8-13.2 -> 9.3-10.6 ms with one pool, 26-29 -> 18-22 ms
// over 30 pools (docs/architecture.md).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define HASTEN_INT8_DECODE 1
#define HASTEN_INT8_DECODE_512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HASTEN_INT8_DECODE 1
#endif

namespace hasten_attention {
namespace {

// Whether a head size takes the in-place integer-score path (64-byte chunks; a 32-byte tail).
inline bool int8_decode_take(int64_t D) { return D % 32 == 0 && D <= 256; }

#if defined(HASTEN_INT8_DECODE)
// rows query rows (D floats apart) -> their int8 codes (D + 4 bytes apart: quantize_int8_row) and scales
inline void quantize_rows_int8(const float* q, int64_t rows, int64_t D, std::vector<int8_t>& codes,
                               std::vector<float>& scales) {
  if (static_cast<int64_t>(scales.size()) < rows) {
    codes.resize(rows * (D + kInt8ScaleBytes));
    scales.resize(rows);
  }
  for (int64_t r = 0; r < rows; ++r) {
    int8_t* row = codes.data() + r * (D + kInt8ScaleBytes);
    quantize_int8_row(q + r * D, D, row);
    scales[r] = int8_row_scale(row, D);
  }
}

// Where the keys of one sequence sit in the pool: key j's row for the first kv head served starts at
// element (table[j / BS] * BS + j % BS) * row + head of either cache (the same offset in both), the
// next head's P elements later.
struct KeyRows {
  const int8_t *k, *v;
  const int32_t* table;
  int64_t BS, row, head;
  int64_t offset(int64_t j) const { return (static_cast<int64_t>(table[j / BS]) * BS + j % BS) * row + head; }
  // ask for keys [a, b)'s rows (`bytes` from each one's offset) of both caches: consecutive blocks are
  // scattered over the pool, which the hardware prefetcher cannot follow
  void prefetch(int64_t a, int64_t b, int64_t bytes) const {
    for (int64_t j = a; j < b; ++j) {
      const int64_t o = offset(j);
      for (int64_t x = 0; x < bytes; x += 64) {
        __builtin_prefetch(k + o + x, 0, 3);
        __builtin_prefetch(v + o + x, 0, 3);
      }
      __builtin_prefetch(k + o + bytes - 1, 0, 3);
      __builtin_prefetch(v + o + bytes - 1, 0, 3);
    }
  }
};

constexpr int64_t kDecodeChunk = 64;    // keys per softmax update (one running-max rescale per row)
constexpr int64_t kPrefetchKeys = 128;  // how far ahead of the scores the rows are asked for
#endif

#if defined(HASTEN_INT8_DECODE_512)
constexpr int64_t kKeyGroup = 16;  // keys whose scores one register holds
constexpr int kPassRows = 4;       // query rows per pass of the scores and of P V

// Four registers of 16 int32 partial sums (keys 0 .. 3) -> one whose 128-bit lane i holds the four
// keys' sums of their lane i (key order within the lane).
inline __m512i sum_lanes4(const __m512i* v) {
  // per 128-bit lane: [v0(0+2), v1(0+2), v0(1+3), v1(1+3)], the same for v2, v3
  const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
  const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}

// sum_lanes4 of keys 0-3, 4-7, 8-11, 12-15 -> one register whose lane j is key j's whole sum.
inline __m512i sum_quads(const __m512i* w) {
  const __m512i c0 = _mm512_add_epi32(_mm512_shuffle_i32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_i32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i c1 = _mm512_add_epi32(_mm512_shuffle_i32x4(w[2], w[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_i32x4(w[2], w[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(c0, c1, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(c0, c1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Integer dot products of NR query code rows (qc, `qstride` bytes apart) with 16 keys, key j's codes
// at k + off[j]: out[r] lane j = sum_d qc[r][d] k_j[d]. Four keys at a time, so the partial sums in
// flight (4 NR registers) stay in registers.
template <int NR>
inline void key_dots16(const int8_t* qc, int64_t qstride, const int8_t* k, const int64_t* off, int64_t D,
                       __m512i* out) {
  __m512i quads[NR][4];
  for (int c = 0; c < 4; ++c) {
    __m512i part[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < 4; ++i) part[r][i] = _mm512_setzero_si512();
    for (int64_t d = 0; d < D; d += 64) {
      const __mmask64 live = D - d >= 64 ? ~__mmask64{0} : (__mmask64{1} << (D - d)) - 1;
      __m512i q[NR];
      for (int r = 0; r < NR; ++r) q[r] = _mm512_maskz_loadu_epi8(live, qc + r * qstride + d);
      for (int i = 0; i < 4; ++i) {
        const __m512i key = _mm512_maskz_loadu_epi8(live, k + off[4 * c + i] + d);
        const __mmask64 negative = _mm512_movepi8_mask(key);
        const __m512i magnitude = _mm512_abs_epi8(key);
        for (int r = 0; r < NR; ++r)
          part[r][i] = _mm512_dpbusd_epi32(part[r][i], magnitude,
                                           _mm512_mask_sub_epi8(q[r], negative, _mm512_setzero_si512(), q[r]));
      }
    }
    for (int r = 0; r < NR; ++r) quads[r][c] = sum_lanes4(part[r]);
  }
  for (int r = 0; r < NR; ++r) out[r] = sum_quads(quads[r]);
}

// Scores of NR query rows (codes qc, `qstride` bytes apart, scales qs) against the 16 keys whose codes
// start at k + off[j] (scales ks): p[r * ld + j] = qs[r] * ks[j] * (q_r . k_j).
template <int NR>
inline void key_scores(const int8_t* qc, int64_t qstride, const float* qs, const int8_t* k, const int64_t* off,
                       const float* ks, int64_t D, float* p, int64_t ld) {
  __m512i dots[NR];
  key_dots16<NR>(qc, qstride, k, off, D, dots);
  const __m512 kscale = _mm512_loadu_ps(ks);
  for (int r = 0; r < NR; ++r)
    _mm512_storeu_ps(p + r * ld, _mm512_mul_ps(_mm512_cvtepi32_ps(dots[r]), _mm512_mul_ps(kscale, _mm512_set1_ps(qs[r]))));
}

// acc[r] = acc[r] * corr[r] + sum_j p[r * ld + j] v_j for NR rows over the n values at v + off[j],
// 64 dimensions at a time with every row's accumulators in registers across the keys.
template <int NR>
inline void values_pv(const float* p, int64_t ld, const float* corr, const int8_t* v, const int64_t* off, int64_t n,
                      int64_t D, float* acc) {
  for (int64_t d = 0; d < D; d += 64) {
    const int64_t vc = std::min<int64_t>(4, (D - d) / 16);  // 16-float vectors in this pass
    __m512 a[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < vc; ++c)
        a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d + 16 * c), _mm512_set1_ps(corr[r]));
    for (int64_t j = 0; j < n; ++j) {
      const int8_t* vr = v + off[j] + d;
      for (int c = 0; c < vc; ++c) {
        const __m512 vv =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vr + 16 * c))));
        for (int r = 0; r < NR; ++r) a[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * ld + j]), vv, a[r][c]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < vc; ++c) _mm512_storeu_ps(acc + r * D + d + 16 * c, a[r][c]);
  }
}

// One row's softmax step over a chunk of cn scores pr[0 .. cn) (padded to a multiple of 16 with
// copies of the last): the running max m and sum l updated, pr[j] = exp(pr[j] - max) * vs[j] (the
// value scales ride on the weights). Returns the factor the row's accumulators take.
inline float chunk_softmax(float* pr, int64_t cn, int64_t padded, const float* vs, float& m, float& l) {
  __m512 vmax = _mm512_set1_ps(m);
  for (int64_t g = 0; g < padded; g += 16) {
    const __mmask16 live = cn - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (cn - g)) - 1);
    vmax = _mm512_mask_max_ps(vmax, live, vmax, _mm512_loadu_ps(pr + g));
  }
  const float mx = _mm512_reduce_max_ps(vmax);
  const float corr = exp_nonpositive(m - mx);
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t g = 0; g < padded; g += 16) {
    const __mmask16 live = cn - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (cn - g)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive16<true>(_mm512_sub_ps(_mm512_loadu_ps(pr + g), vmx)));
    sum = _mm512_add_ps(sum, e);
    _mm512_storeu_ps(pr + g, _mm512_mul_ps(e, _mm512_loadu_ps(vs + g)));
  }
  l = l * corr + _mm512_reduce_add_ps(sum);
  m = mx;
  return corr;
}
#elif defined(HASTEN_INT8_DECODE)
constexpr int64_t kKeyGroup = 8;
constexpr int kPassRows = 3;

// Four registers of 8 int32 partial sums (keys 0 .. 3) -> one whose 128-bit half i holds the four
// keys' sums of their half i (key order within the half).
inline __m256i sum_lanes4(const __m256i* v) {
  const __m256i a = _mm256_add_epi32(_mm256_unpacklo_epi32(v[0], v[1]), _mm256_unpackhi_epi32(v[0], v[1]));
  const __m256i b = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2], v[3]), _mm256_unpackhi_epi32(v[2], v[3]));
  return _mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
}

// Integer dot products of NR (<= 3) query code rows with 8 keys, as key_dots16 above: 32 dimensions
// per step, |k| x (q with k's signs) in int16 pairs, widened to int32 by a multiply-add with ones.
template <int NR>
inline void key_dots8(const int8_t* qc, int64_t qstride, const int8_t* k, const int64_t* off, int64_t D,
                      __m256i* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i quads[NR][2];
  for (int c = 0; c < 2; ++c) {
    __m256i part[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < 4; ++i) part[r][i] = _mm256_setzero_si256();
    for (int64_t d = 0; d < D; d += 32) {
      for (int i = 0; i < 4; ++i) {
        const __m256i key = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + off[4 * c + i] + d));
        const __m256i magnitude = _mm256_abs_epi8(key);
        for (int r = 0; r < NR; ++r) {
          const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qc + r * qstride + d));
          const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(q, key));
          part[r][i] = _mm256_add_epi32(part[r][i], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int r = 0; r < NR; ++r) quads[r][c] = sum_lanes4(part[r]);
  }
  for (int r = 0; r < NR; ++r)
    out[r] = _mm256_add_epi32(_mm256_permute2x128_si256(quads[r][0], quads[r][1], 0x20),
                              _mm256_permute2x128_si256(quads[r][0], quads[r][1], 0x31));
}

// key_scores as above, for 8 keys
template <int NR>
inline void key_scores(const int8_t* qc, int64_t qstride, const float* qs, const int8_t* k, const int64_t* off,
                       const float* ks, int64_t D, float* p, int64_t ld) {
  __m256i dots[NR];
  key_dots8<NR>(qc, qstride, k, off, D, dots);
  const __m256 kscale = _mm256_loadu_ps(ks);
  for (int r = 0; r < NR; ++r)
    _mm256_storeu_ps(p + r * ld, _mm256_mul_ps(_mm256_cvtepi32_ps(dots[r]), _mm256_mul_ps(kscale, _mm256_set1_ps(qs[r]))));
}

// values_pv as above, on accumulate_rows_avx2 (16 or 32 dimensions of up to 3 rows at a time)
template <int NR>
inline void values_pv(const float* p, int64_t ld, const float* corr, const int8_t* v, const int64_t* off, int64_t n,
                      int64_t D, float* acc) {
  accumulate_rows_avx2<NR, NR <= 2 ? 4 : 2>([v, off](int64_t j) { return v + off[j]; }, n, D, p, ld, corr, acc);
}

// chunk_softmax as above, 8 scores at a time (padded to a multiple of 8)
inline float chunk_softmax(float* pr, int64_t cn, int64_t padded, const float* vs, float& m, float& l) {
  const float mx = running_max(pr, cn, m);
  const float corr = exp_nonpositive(m - mx);
  const __m256 vmx = _mm256_set1_ps(mx);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t g = 0; g < padded; g += 8) {
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(cn - g)), lane));
    const __m256 e = _mm256_and_ps(live, exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(pr + g), vmx)));
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(pr + g, _mm256_mul_ps(e, _mm256_loadu_ps(vs + g)));
  }
  l = l * corr + hsum(sum);
  m = mx;
  return corr;
}
#endif

#if defined(HASTEN_INT8_DECODE)
// f<NR>(r0) for the rows [r0, r0 + NR) of `rows`, NR <= kPassRows.
template <typename F>
inline void in_passes(int64_t rows, F&& f) {
  for (int64_t r0 = 0; r0 < rows; r0 += kPassRows) {
    switch (std::min<int64_t>(kPassRows, rows - r0)) {
      case 1: f.template operator()<1>(r0); break;
      case 2: f.template operator()<2>(r0); break;
      case 3: f.template operator()<3>(r0); break;
      default: f.template operator()<kPassRows>(r0); break;
    }
  }
}

// One token's rows of nh kv heads (G rows each, row h * G + g; codes qc `qstride` bytes apart, scales
// qs) against keys [0, n) of kr (head h's rows P elements after head 0's): online-softmax update of
// their running max m, sum l and output accumulators acc (rows of D floats). Key-major, as the pool
// lays the heads out: kDecodeChunk keys at a time, every head's scores, then one rescale per row,
// then every head's P V with the accumulators in registers across the chunk's keys.
inline void attend_heads_int8(const int8_t* qc, int64_t qstride, const float* qs, int64_t G, int64_t nh, int64_t P,
                              const KeyRows& kr, int64_t n, int64_t D, float* m, float* l, float* acc) {
  const int64_t rows = nh * G;
  thread_local std::vector<float> buf;  // p [rows][chunk], key and value scales [nh][chunk], corr [rows]
  const int64_t size = (rows + 2 * nh) * kDecodeChunk + rows;
  if (static_cast<int64_t>(buf.size()) < size) buf.resize(size);
  float *p = buf.data(), *kscale = p + rows * kDecodeChunk, *vscale = kscale + nh * kDecodeChunk;
  float* corr = vscale + nh * kDecodeChunk;
  int64_t off[kDecodeChunk];
  kr.prefetch(0, std::min(n, kPrefetchKeys), nh * P);
  for (int64_t c0 = 0; c0 < n; c0 += kDecodeChunk) {
    const int64_t cn = std::min(kDecodeChunk, n - c0), padded = (cn + kKeyGroup - 1) / kKeyGroup * kKeyGroup;
    for (int64_t g = 0; g < padded; g += kKeyGroup) {
      // the group's rows and scales just before its scores, so that the first group waits for its own
      // rows only (read at a chunk's start, a cold sequence's first 64 rows stalled the walk)
      for (int64_t j = g; j < g + kKeyGroup; ++j) {  // lanes past cn repeat the last key (masked out below)
        off[j] = kr.offset(c0 + std::min(j, cn - 1));
        for (int64_t h = 0; h < nh; ++h) {
          kscale[h * kDecodeChunk + j] = int8_row_scale(kr.k + off[j] + h * P, D);
          vscale[h * kDecodeChunk + j] = int8_row_scale(kr.v + off[j] + h * P, D);
        }
      }
      const int64_t ahead = c0 + g + kPrefetchKeys;
      kr.prefetch(std::min(n, ahead), std::min(n, ahead + kKeyGroup), nh * P);
      for (int64_t h = 0; h < nh; ++h)
        in_passes(G, [&]<int NR>(int64_t r0) {
          const int64_t r = h * G + r0;
          key_scores<NR>(qc + r * qstride, qstride, qs + r, kr.k + h * P, off + g, kscale + h * kDecodeChunk + g, D,
                         p + r * kDecodeChunk + g, kDecodeChunk);
        });
    }
    for (int64_t r = 0; r < rows; ++r)
      corr[r] = chunk_softmax(p + r * kDecodeChunk, cn, padded, vscale + r / G * kDecodeChunk, m[r], l[r]);
    for (int64_t h = 0; h < nh; ++h)
      in_passes(G, [&]<int NR>(int64_t r0) {
        const int64_t r = h * G + r0;
        values_pv<NR>(p + r * kDecodeChunk, kDecodeChunk, corr + r, kr.v + h * P, off, cn, D, acc + r * D);
      });
  }
}
#endif

}  // namespace
}  // namespace hasten_attention
