// The arithmetic of paged_attention_cpu.cpp: online-softmax updates of query rows against a run of
// keys/values read in place from the cache (float32, or float16 / bfloat16 widened as they are
// loaded), the exp and soft-cap helpers they use, and the widening of a narrow cache block.
// Included by paged_attention_cpu.cpp, and by decoder_ops_cpu.cpp for its exp (see
// hasten/kernels/build.py); everything here has internal linkage (an anonymous namespace), so the
// compiler inlines it as it would in one file (external inline functions were called through the
// PLT, and decode attention lost ~20 %).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention_prefetch.h"
#include "float_tiles.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace hasten_attention {
namespace {

// exp(x) for x <= 0 in plain arithmetic so loops that call it vectorize: 2^(x*log2 e) split into an
// integer power (built in the float exponent bits) and a degree-6 polynomial on [0, 1)
// (relative error < 1e-7).
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float t = x * 1.4426950408889634f;
  const float fi = __builtin_floorf(t);
  const float f = t - fi;
  float p = 2.187750486e-04f;
  p = p * f + 1.238782145e-03f;
  p = p * f + 9.684580455e-03f;
  p = p * f + 5.548042632e-02f;
  p = p * f + 2.402305020e-01f;
  p = p * f + 6.931469287e-01f;
  p = p * f + 1.000000003e+00f;
  const int32_t bits = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// cap * tanh(x / cap) for each of s[0 .. n), the attention-logit soft cap (Gemma 2), with tanh(a) =
// (1 - e) / (1 + e), e = exp(-2|a|), built on exp_nonpositive (absolute error ~1e-7 * cap).
inline float softcap_one(float x, float cap) {
  const float a = x / cap;
  const float e = exp_nonpositive(-2.0f * (a < 0.0f ? -a : a));
  const float t = (1.0f - e) / (1.0f + e);
  return cap * (a < 0.0f ? -t : t);
}

inline void softcap_scalar(float* s, int64_t n, float cap) {
  for (int64_t j = 0; j < n; ++j) s[j] = softcap_one(s[j], cap);
}

// One query row against `n` keys/values (rows `stride` floats apart): online-softmax update of
// the row's running max `m`, sum `l` and output accumulator `acc`. `s` is scratch for n scores;
// kCap: the scores soft-capped by `cap` first.
template <bool kCap>
inline void update_row_generic(const float* q, const float* k, const float* v, int64_t stride, int64_t n, int64_t D,
                               float* s, float& m, float& l, float* acc, float cap) {
  float mx = m;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = dot(q, k + j * stride, D);
    if constexpr (kCap) s[j] = softcap_one(s[j], cap);
    mx = s[j] > mx ? s[j] : mx;
  }
  const float corr = exp_nonpositive(m - mx);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    s[j] = exp_nonpositive(s[j] - mx);
    sum += s[j];
  }
  l = l * corr + sum;
  m = mx;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) acc[d] *= corr;
  for (int64_t j = 0; j < n; ++j) {
    const float p = s[j];
    const float* vrow = v + j * stride;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] += p * vrow[d];
  }
}

// An int8 KV cache (kv_cache_dtype="int8") stores each head's row of one token as D int8 codes
// followed by the row's float32 scale (absmax / 127): value = code * scale. Rows are D + 4 bytes.
constexpr int64_t kInt8ScaleBytes = 4;
constexpr int64_t kMaxKeys = 256;  // the most keys one update_rows call takes (a cache block)

inline float int8_row_scale(const int8_t* row, int64_t D) {
  float scale;
  std::memcpy(&scale, row + D, sizeof(scale));
  return scale;
}

// Bytes (elements) of one head's row of one token in a cache of type C.
template <typename C>
constexpr int64_t head_row(int64_t D) {
  return std::is_same_v<C, int8_t> ? D + kInt8ScaleBytes : D;
}

#if defined(__AVX512F__)
// quantize_int8_row's rounding on 16 lanes (cvtps rounds to nearest even) for a row of n16 vectors
// that load(i) yields (called twice per vector: for the absmax, then for the codes); store(i, codes)
// takes each vector's 16 codes. Returns the row's scale. quantize_int8_row and the int8-score queries
// (attention_int8_scores.h), which must round alike, both go through it.
template <typename Load, typename Store>
inline float quantize_int8_vectors(int64_t n16, Load load, Store store) {
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t i = 0; i < n16; ++i) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load(i)));
  const float amax = _mm512_reduce_max_ps(vmax);
  const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  for (int64_t i = 0; i < n16; ++i) store(i, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(load(i), inv))));
  return amax / 127.0f;
}
#endif

// x[0 .. D) as int8 codes and their scale into row (D + 4 bytes): symmetric, round to nearest (even).
inline void quantize_int8_row(const float* x, int64_t D, int8_t* row) {
#if defined(__AVX512F__)
  if (D % 16 == 0 && D <= 256) {
    const float scale = quantize_int8_vectors(
        D / 16, [&](int64_t i) { return _mm512_loadu_ps(x + 16 * i); },
        [&](int64_t i, __m128i codes) { _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 16 * i), codes); });
    std::memcpy(row + D, &scale, sizeof(scale));
    return;
  }
#endif
  float amax = 0.0f;
  for (int64_t i = 0; i < D; ++i) amax = std::max(amax, x[i] < 0.0f ? -x[i] : x[i]);
  const float scale = amax / 127.0f;
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int64_t i = 0; i < D; ++i) row[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
  std::memcpy(row + D, &scale, sizeof(scale));
}

#if defined(__AVX2__) && defined(__FMA__)
using hasten_tiles::hsum;

// 8 cache values widened to float32 as they are loaded (no conversion pass over the block).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
#if defined(__F16C__)
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif
inline __m256 load8(const at::BFloat16* p) {  // bfloat16 is the top half of a float32
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
// int8 codes (kv_cache_dtype="int8"): the codes as floats; their row's scale is applied per key to
// the scores (keys) and to the softmax weights (values), see update_rows_avx2
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// NR query rows (D floats apart) against n keys; scores go to s[r * s_stride + j].
// NK keys per pass so each loaded key chunk feeds NR fused multiply-adds; with NK = 4 the four
// sums of a row are reduced together (two rounds of horizontal adds) instead of one by one.
template <int NR, int NK, typename C>
inline void scores_avx2(const float* q, const C* k, int64_t stride, int64_t n, int64_t D, float* s,
                        int64_t s_stride, LineQueue* lines = nullptr) {
  int64_t j = 0;
  for (; j + NK <= n; j += NK) {
    if (lines) lines->request(2);
    __m256 a[NR][NK];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < NK; ++c) a[r][c] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      __m256 kv[NK];
      for (int c = 0; c < NK; ++c) kv[c] = load8(k + (j + c) * stride + d);
      for (int r = 0; r < NR; ++r) {
        const __m256 qv = _mm256_loadu_ps(q + r * D + d);
        for (int c = 0; c < NK; ++c) a[r][c] = _mm256_fmadd_ps(qv, kv[c], a[r][c]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      if constexpr (NK == 4) {
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[r][0], a[r][1]), _mm256_hadd_ps(a[r][2], a[r][3]));
        _mm_storeu_ps(s + r * s_stride + j, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
      } else {
        for (int c = 0; c < NK; ++c) s[r * s_stride + j + c] = hsum(a[r][c]);
      }
    }
  }
  for (; j < n; ++j) {
    for (int r = 0; r < NR; ++r) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + d), load8(k + j * stride + d), a);
      s[r * s_stride + j] = hsum(a);
    }
  }
}

// acc[r] = acc[r] * corr[r] + sum_j p[r * p_stride + j] * row_at(j)[0 .. D) for NR rows, row_at(j)
// the start of value row j (rows `stride` apart in a block, or anywhere in the pool). VC vectors of d
// per pass stay in registers across all n keys, so each key costs NR broadcasts and VC loads for
// NR * VC fused multiply-adds; at 3 rows and VC = 4 the 12 accumulators, 3 weights and a value fill
// the 16 registers (attention_int8_decode.h's values_pv takes VC = 2 there: with VC = 4 it spilled).
template <int NR, int VC, typename RowAt>
inline void accumulate_rows_avx2(const RowAt& row_at, int64_t n, int64_t D, const float* p, int64_t p_stride,
                                 const float* corr, float* acc, LineQueue* lines = nullptr) {
  int64_t d = 0;
  for (; d + 8 * VC <= D; d += 8 * VC) {
    __m256 a[NR][VC];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < VC; ++c)
        a[r][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d + 8 * c), _mm256_set1_ps(corr[r]));
    for (int64_t j = 0; j < n; ++j) {
      if (lines) lines->request(1);
      __m256 pv[NR];
      for (int r = 0; r < NR; ++r) pv[r] = _mm256_broadcast_ss(p + r * p_stride + j);
      const auto* vr = row_at(j) + d;
      for (int c = 0; c < VC; ++c) {
        const __m256 vv = load8(vr + 8 * c);
        for (int r = 0; r < NR; ++r) a[r][c] = _mm256_fmadd_ps(pv[r], vv, a[r][c]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < VC; ++c) _mm256_storeu_ps(acc + r * D + d + 8 * c, a[r][c]);
  }
  for (; d < D; d += 8) {
    __m256 a[NR];
    for (int r = 0; r < NR; ++r) a[r] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d), _mm256_set1_ps(corr[r]));
    for (int64_t j = 0; j < n; ++j) {
      const __m256 vv = load8(row_at(j) + d);
      for (int r = 0; r < NR; ++r) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r * p_stride + j), vv, a[r]);
    }
    for (int r = 0; r < NR; ++r) _mm256_storeu_ps(acc + r * D + d, a[r]);
  }
}

// accumulate_rows_avx2 over n value rows `stride` apart from v.
template <int NR, typename C>
inline void accumulate_avx2(const C* v, int64_t stride, int64_t n, int64_t D, const float* p, int64_t p_stride,
                            const float* corr, float* acc, LineQueue* lines = nullptr) {
  constexpr int VC = NR <= 3 ? 4 : 2;
  accumulate_rows_avx2<NR, VC>([v, stride](int64_t j) { return v + j * stride; }, n, D, p, p_stride, corr, acc, lines);
}

// exp_nonpositive on 8 lanes, the same operations in the same order (so the same values): GCC
// left the scalar loop below unvectorized, and the softmax's exps were then the kernel's hottest
// instructions (decode at 16 sequences x 330 tokens).
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 fi = _mm256_floor_ps(t);
  const __m256 f = _mm256_sub_ps(t, fi);
  __m256 p = _mm256_set1_ps(2.187750486e-04f);
  p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(1.238782145e-03f));
  p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(9.684580455e-03f));
  p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(5.548042632e-02f));
  p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(2.402305020e-01f));
  p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(6.931469287e-01f));
  p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(1.000000003e+00f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fi), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// silu(x) * u on 8 lanes with exp_nonpositive8 (sigmoid_fast's operations in its order): silu_mul's
// fast path on AVX2 (decoder_ops_cpu.cpp) and the int4 GEMM's gate_up form (int4_linear_q8_gemm_silu)
inline __m256 silu_mul_fast8(__m256 x, __m256 u) {
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  const __m256 neg = _mm256_cmp_ps(x, zero, _CMP_LT_OQ);
  const __m256 e = exp_nonpositive8(_mm256_blendv_ps(_mm256_sub_ps(zero, x), x, neg));
  const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, neg), _mm256_add_ps(one, e));
  return _mm256_mul_ps(_mm256_mul_ps(x, sig), u);
}

#if defined(__AVX512F__)
// exp_nonpositive8 on 16 lanes: the same operations in the same order (so the same values).
// Fused = true: the polynomial's steps as fused multiply-adds and the power of two applied by
// scalef (11 instructions instead of 20); its last bits differ, so only paths that round the result
// further take it (attention_int8_scores.h's bf16_pv).
template <bool Fused = false>
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, fi);
  __m512 p = _mm512_set1_ps(2.187750486e-04f);
  for (const float c : {1.238782145e-03f, 9.684580455e-03f, 5.548042632e-02f, 2.402305020e-01f, 6.931469287e-01f,
                        1.000000003e+00f})
    p = Fused ? _mm512_fmadd_ps(p, f, _mm512_set1_ps(c)) : _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(c));
  if constexpr (Fused) return _mm512_scalef_ps(p, fi);
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fi), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// silu(x) * u on 16 lanes with exp_nonpositive16: silu_mul's fast path (decoder_ops_cpu.cpp), and the
// same operations where the gate_up GEMM applies it to its own tiles (bf16_tiles_linear_silu).
inline __m512 silu_mul_fast16(__m512 x, __m512 u) {
  const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
  const __mmask16 neg = _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ);
  const __m512 e = exp_nonpositive16(_mm512_mask_blend_ps(neg, _mm512_sub_ps(zero, x), x));
  const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(neg, one, e), _mm512_add_ps(one, e));
  return _mm512_mul_ps(_mm512_mul_ps(x, sig), u);
}
#endif

// max(m, s[0], ..., s[n - 1]) (a max is exact, so the order does not matter). This and
// exp_shifted_sum are forced inline: with two instantiations of update_rows (soft cap or not) the
// compiler stopped inlining them, a call per row per 16-key block.
__attribute__((always_inline)) inline float running_max(const float* s, int64_t n, float m) {
  int64_t j = 0;
  float mx = m;
  if (n >= 8) {
    __m256 v = _mm256_loadu_ps(s);
    for (j = 8; j + 8 <= n; j += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(s + j));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    mx = std::max(mx, _mm_cvtss_f32(h));
  }
  for (; j < n; ++j) mx = s[j] > mx ? s[j] : mx;
  return mx;
}

// s[j] = exp(s[j] - mx) for j < n; returns their sum (8 lanes at a time, then the tail).
__attribute__((always_inline)) inline float exp_shifted_sum(float* s, int64_t n, float mx) {
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum(acc);
  for (; j < n; ++j) {
    s[j] = exp_nonpositive(s[j] - mx);
    sum += s[j];
  }
  return sum;
}

// softcap_scalar on 8 lanes at a time (same operations, same values), then the tail
inline void softcap_avx2(float* s, int64_t n, float cap) {
  const __m256 vcap = _mm256_set1_ps(cap), one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 a = _mm256_div_ps(_mm256_loadu_ps(s + j), vcap);
    const __m256 e = exp_nonpositive8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), _mm256_andnot_ps(sign, a)));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    const __m256 signed_t = _mm256_blendv_ps(t, _mm256_sub_ps(zero, t), _mm256_cmp_ps(a, zero, _CMP_LT_OQ));
    _mm256_storeu_ps(s + j, _mm256_mul_ps(vcap, signed_t));
  }
  softcap_scalar(s + j, n - j, cap);
}

template <int NR, bool kCap, typename C>
inline void update_rows_avx2(const float* q, const C* k, const C* v, int64_t stride, int64_t n, int64_t D,
                             float* s, int64_t s_stride, float* m, float* l, float* acc, float cap,
                             LineQueue* lines) {
  constexpr int NK = NR <= 3 ? 4 : 2;
  scores_avx2<NR, NK>(q, k, stride, n, D, s, s_stride, lines);
  [[maybe_unused]] float kscale[kMaxKeys], vscale[kMaxKeys];
  if constexpr (std::is_same_v<C, int8_t>) {
    for (int64_t j = 0; j < n; ++j) {
      kscale[j] = int8_row_scale(k + j * stride, D);
      vscale[j] = int8_row_scale(v + j * stride, D);
    }
    for (int r = 0; r < NR; ++r)
      for (int64_t j = 0; j < n; ++j) s[r * s_stride + j] *= kscale[j];
  }
  float corr[NR];
  for (int r = 0; r < NR; ++r) {
    float* sr = s + r * s_stride;
    if constexpr (kCap) softcap_avx2(sr, n, cap);
    const float mx = running_max(sr, n, m[r]);
    corr[r] = exp_nonpositive(m[r] - mx);
    l[r] = l[r] * corr[r] + exp_shifted_sum(sr, n, mx);
    m[r] = mx;
    if constexpr (std::is_same_v<C, int8_t>)  // the value rows' scales ride on the weights
      for (int64_t j = 0; j < n; ++j) sr[j] *= vscale[j];
  }
  accumulate_avx2<NR>(v, stride, n, D, s, s_stride, corr, acc, lines);
}
#endif

// Whether update_rows reads a cache of type C in place (else attend_item widens it to float first).
template <typename C>
constexpr bool reads_in_place() {
  if constexpr (std::is_same_v<C, float>) return true;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<C, at::BFloat16> || std::is_same_v<C, int8_t>) return true;
#if defined(__F16C__)
  if constexpr (std::is_same_v<C, at::Half>) return true;
#endif
#endif
  return false;
}

// `rows` query rows (D floats apart) that see the same `n` keys/values (rows `stride` values
// apart): online-softmax update of their running max m, sum l and output accumulators acc.
// C is float, or (in-place readers only, D % 8 == 0) the narrower cache type. kCap: scores soft-capped.
template <bool kCap, typename C>
inline void update_rows(const float* q, int64_t rows, const C* k, const C* v, int64_t stride, int64_t n,
                        int64_t D, float* s, int64_t s_stride, float* m, float* l, float* acc, float cap,
                        LineQueue* lines = nullptr) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const int64_t nr = std::min<int64_t>(4, rows - r0);
      float* sr = s + r0 * s_stride;
      const float* qr = q + r0 * D;
      float* ar = acc + r0 * D;
      switch (nr) {
        case 1: update_rows_avx2<1, kCap>(qr, k, v, stride, n, D, sr, s_stride, m + r0, l + r0, ar, cap, lines); break;
        case 2: update_rows_avx2<2, kCap>(qr, k, v, stride, n, D, sr, s_stride, m + r0, l + r0, ar, cap, lines); break;
        case 3: update_rows_avx2<3, kCap>(qr, k, v, stride, n, D, sr, s_stride, m + r0, l + r0, ar, cap, lines); break;
        default: update_rows_avx2<4, kCap>(qr, k, v, stride, n, D, sr, s_stride, m + r0, l + r0, ar, cap, lines); break;
      }
    }
    return;
  }
#endif
  (void)lines;
  if constexpr (std::is_same_v<C, float>) {
    for (int64_t r = 0; r < rows; ++r)
      update_row_generic<kCap>(q + r * D, k, v, stride, n, D, s + r * s_stride, m[r], l[r], acc + r * D, cap);
  } else {
    TORCH_CHECK(false, "internal: narrow cache reached the portable attention path");
  }
}

// One int8 cache row (D codes and their scale) as D floats.
inline void int8_row_to_float(const int8_t* row, float* dst, int64_t D) {
  const float scale = int8_row_scale(row, D);
  for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<float>(row[i]) * scale;
}

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
  if constexpr (std::is_same_v<T, at::Half>) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {  // bfloat16 is the top half of a float32
    for (; i + 8 <= n; i += 8) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

}  // namespace
}  // namespace hasten_attention
