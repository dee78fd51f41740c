// Shared pieces of the int4 linears (quant_linear_cpu.cpp: float32 activations;
// quant_linear_q8_cpu.cpp: int8 activations): the code layout is documented in
// quant_linear_cpu.cpp. Included by those two sources only (see hasten/kernels/build.py).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "float_tiles.h"

namespace hasten_int4 {

constexpr int64_t kChunk = 32;  // k values per 16 bytes of codes

inline float half_to_float(at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// The batch-1 kernels walk the weight rows 4 at a time (over_row_quads). While a quad is computed
// they request the next one: its codes one 64-byte line per 32-run of this quad (a quad's codes are
// 4 * K / 2 contiguous bytes, so its K / 32 runs cover them exactly), its scales and mins up front
// (`count` = 4 * groups per row halves each). The hardware prefetcher alone falls behind on rows of
// a few hundred bytes: SmolLM2's 30 layers of int4 matmuls at batch 1, 7.3 -> 6.3 ms per token
// (int8 activations, interleaved A/B in one process).
inline void prefetch_next_quad_groups(const at::Half* scales, const at::Half* mins, int64_t count) {
  for (int64_t i = 0; i < count; i += 32) {  // 32 halves per cache line
    __builtin_prefetch(scales + count + i);
    __builtin_prefetch(mins + count + i);
  }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// sum_g min[g] * xs[g] (xs: x's group sums) for one weight row, 8 groups per step (a scalar chain
// over the groups cost as much as the codes themselves at K = 1536)
inline float min_term(const at::Half* mins, const float* xs, int64_t G) {
  __m256 macc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= G; g += 8)
    macc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + g))),
                           _mm256_loadu_ps(xs + g), macc);
  float mterm = hasten_tiles::hsum(macc);
  for (; g < G; ++g) mterm += half_to_float(mins[g]) * xs[g];
  return mterm;
}
#endif

// ---- x rounded to int8 per 32 k (llama.cpp's Q8 scheme), for the int8-activation kernels ------------
#if defined(__AVX2__)
// the largest of a's 8 lanes
inline float hmax8(__m256 a) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

// the sum of v's 8 int32 lanes
inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
#endif

// max |x[i]| over n (a multiple of 8) values
inline float abs_max(const float* x, int64_t n) {
#if defined(__AVX2__)
  __m256 a = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) a = _mm256_max_ps(a, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(x + i)));
  return hmax8(a);
#else
  float a = 0.0f;
  for (int64_t i = 0; i < n; ++i) a = std::max(a, std::abs(x[i]));
  return a;
#endif
}

// The smallest power of two >= d (d itself where it is one, 0 for 0): a scale the kernels can apply as
// an exponent shift (vscalefps) instead of a multiply.
inline float pow2_at_least(float d) {
  if (!(d > 0.0f)) return 0.0f;
  uint32_t bits;
  std::memcpy(&bits, &d, sizeof(bits));
  if (bits & 0x7FFFFFu) bits = ((bits >> 23) + 1u) << 23;  // a mantissa left: the next exponent, mantissa 0
  std::memcpy(&d, &bits, sizeof(bits));
  return d;
}

// share > 1: runs of `share` 32-runs share one scale (the largest of their absmax), each run's d still
// stored (C / share distinct values per row); C must be a multiple of share. pow2: each d rounded up
// to a power of two (codes then span 64 .. 127 of the int8 range instead of 127).
inline void quantize_x_q8_rows(const float* x, int64_t m_begin, int64_t m_end, int64_t K, int64_t group, int8_t* xq,
                               float* xd, float* xs, int64_t share = 1, bool pow2 = false) {
  // group sums (xs) of the rounded x, below; a group is whole 32-runs, or (grouped int8 weights) 16 k
  const int64_t C = K / kChunk, per_group = group % kChunk == 0 ? group / kChunk : 0;
  std::vector<float> shared_amax(share > 1 ? C / share : 0);
  std::vector<int32_t> run_sum(C);  // this row's integer sum of q per 32-run, taken as q is rounded
  for (int64_t m = m_begin; m < m_end; ++m) {
    const float* xr = x + m * K;
    if (share > 1) {
      for (int64_t g = 0; g < C / share; ++g) shared_amax[g] = abs_max(xr + g * share * kChunk, share * kChunk);
    }
    for (int64_t c = 0; c < C; ++c) {
      const float* xc = xr + c * kChunk;
      int8_t* q = xq + m * K + c * kChunk;
#if defined(__AVX2__)
      // the same arithmetic 8 lanes at a time (vcvtps2dq rounds to nearest even, as nearbyint)
      __m256 v[4];
      for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(xc + 8 * j);
      const float amax = share > 1 ? shared_amax[c / share] : abs_max(xc, kChunk);
      const float d = pow2 ? pow2_at_least(amax / 127.0f) : amax / 127.0f;
      const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
      // run order: the even k of the 32 first, then the odd ones. shuffle_ps picks them per 128-bit
      // lane; swapping the middle 64-bit quarters puts them in k order.
      auto pick = [](__m256 lo, __m256 hi, int odd) {
        const __m256 t = odd ? _mm256_shuffle_ps(lo, hi, 0xDD) : _mm256_shuffle_ps(lo, hi, 0x88);
        return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(t), 0xD8));
      };
      const __m256i e0 = _mm256_cvtps_epi32(_mm256_mul_ps(pick(v[0], v[1], 0), inv));
      const __m256i e1 = _mm256_cvtps_epi32(_mm256_mul_ps(pick(v[2], v[3], 0), inv));
      const __m256i o0 = _mm256_cvtps_epi32(_mm256_mul_ps(pick(v[0], v[1], 1), inv));
      const __m256i o1 = _mm256_cvtps_epi32(_mm256_mul_ps(pick(v[2], v[3], 1), inv));
      // int32 -> int8 (|value| <= 127: no saturation); packs work per 128-bit lane, the permute
      // restores the order e0, e1, o0, o1
      run_sum[c] = hsum8_epi32(_mm256_add_epi32(_mm256_add_epi32(e0, e1), _mm256_add_epi32(o0, o1)));
      const __m256i w16a = _mm256_packs_epi32(e0, e1), w16b = _mm256_packs_epi32(o0, o1);
      const __m256i w8 = _mm256_packs_epi16(w16a, w16b);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                          _mm256_permutevar8x32_epi32(w8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
      const float amax = share > 1 ? shared_amax[c / share] : abs_max(xc, kChunk);
      const float d = pow2 ? pow2_at_least(amax / 127.0f) : amax / 127.0f;
      const float inv = d > 0.0f ? 1.0f / d : 0.0f;
      run_sum[c] = 0;
      for (int64_t i = 0; i < kChunk / 2; ++i) {
        q[i] = static_cast<int8_t>(std::nearbyint(xc[2 * i] * inv));
        q[kChunk / 2 + i] = static_cast<int8_t>(std::nearbyint(xc[2 * i + 1] * inv));
        run_sum[c] += q[i] + q[kChunk / 2 + i];
      }
#endif
      xd[m * C + c] = d;
    }
    // The group sums of the ROUNDED x (d x the run's integer sum): a kernel's min term, min x xs, then
    // completes sum_k xq_k (d q_k + min) = xq . w. With x's exact float sums, x's rounding error times
    // q's mean (half a group's range, never centered) stayed in every output, as the 8-bit GEMM
    // measured (gemm_u8_cpu.cpp); llama.cpp's Q8_1 blocks keep this sum for the same reason.
    const int8_t* qr = xq + m * K;
    for (int64_t g = 0; g < K / group; ++g) {
      float s = 0.0f;
      if (per_group > 0) {
        for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) s += xd[m * C + c] * static_cast<float>(run_sum[c]);
      } else {  // group of 16 k: k sits at run-order position k / 2 (even k) or 16 + k / 2 (odd k) of its run
        for (int64_t k = g * group; k < (g + 1) * group; ++k) {
          const int64_t c = k / kChunk, i = k % kChunk;
          s += xd[m * C + c] * static_cast<float>(qr[c * kChunk + (i % 2 ? kChunk / 2 + i / 2 : i / 2)]);
        }
      }
      xs[m * (K / group) + g] = s;
    }
  }
}

// x is quantized per 32 k to int8 with its own scale d (round to nearest, |q| <= 127), in the same
// even/odd order as the codes; then each 32-run is one u8 x s8 multiply-add. The min term uses the
// group sums of the rounded x. Trades a relative error of about 1/254 per activation for ~3x fewer
// instructions per weight than the float path. Rows split across threads when there are many.
inline void quantize_x_q8(const float* x, int64_t M, int64_t K, int64_t group, int8_t* xq, float* xd, float* xs,
                          int64_t share = 1, bool pow2 = false) {
  const int64_t grain = std::max<int64_t>(1, 8192 / K);
  if (M <= grain) {
    quantize_x_q8_rows(x, 0, M, K, group, xq, xd, xs, share, pow2);
    return;
  }
  at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
    quantize_x_q8_rows(x, begin, end, K, group, xq, xd, xs, share, pow2);
  });
}

// x [M, K] (contiguous float32) rounded by quantize_x_q8 into tensors that live for one call:
// q int8 [M, K] (run order), d float32 [M, K / 32], sums float32 [M, K / group].
struct QuantizedX {
  at::Tensor q, d, sums;
  QuantizedX(const at::Tensor& x, int64_t group, int64_t share = 1, bool pow2 = false)
      : q(at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kChar))),
        d(at::empty({x.size(0), x.size(1) / kChunk}, x.options())),
        sums(at::empty({x.size(0), x.size(1) / group}, x.options())) {
    quantize_x_q8(x.data_ptr<float>(), x.size(0), x.size(1), group, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                  sums.data_ptr<float>(), share, pow2);
  }
};

// Calls tile(n, m, rows) for every weight row n and every tile of up to 4 rows of x starting at m,
// weight rows split across threads (64 at least per task, so the parallel region pays off).
template <typename Tile>
inline void over_tiles(int64_t N, int64_t M, const Tile& tile) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m = 0; m < M; m += 4) tile(n, m, std::min<int64_t>(4, M - m));
  });
}

// Batch-1 paths: calls rows(std::integral_constant<int, R>{}, n) for every block of R <= 4 weight
// rows starting at n (R = 4 but for the last block), blocks split across threads.
template <typename Rows>
inline void over_row_quads(int64_t N, const Rows& rows) {
  at::parallel_for(0, (N + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      const int64_t n = q * 4;
      switch (std::min<int64_t>(4, N - n)) {
        case 4: rows(std::integral_constant<int, 4>{}, n); break;
        case 3: rows(std::integral_constant<int, 3>{}, n); break;
        case 2: rows(std::integral_constant<int, 2>{}, n); break;
        default: rows(std::integral_constant<int, 1>{}, n); break;
      }
    }
  });
}

inline void check_args(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "codes must be contiguous uint8 [N, K / 2]");
  const int64_t K = x.size(1), N = codes.size(0);
  TORCH_CHECK(codes.size(1) * 2 == K, "codes hold ", codes.size(1) * 2, " values per row, x has K = ", K);
  TORCH_CHECK(group > 0 && group % kChunk == 0 && K % group == 0, "group size must be a multiple of 32 dividing K");
  for (const auto* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == K / group,
                "scales and mins must be contiguous float16 [N, K / group]");
}

}  // namespace hasten_int4
