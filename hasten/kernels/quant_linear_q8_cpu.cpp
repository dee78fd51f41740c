// int4 linears with int8 activations (as llama.cpp's Q4 x Q8 dot products): y = x W^T, the weight
// layout of quant_linear_cpu.cpp; x is quantized per 32 k to int8 on entry.
#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "float_tiles.h"
#include "int4_common.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

using namespace hasten_int4;

namespace {

#if defined(__AVX2__) && defined(__FMA__)
using hasten_tiles::hsum;
#endif

float dot_row_q8_generic(const int8_t* xq, const float* xd, const float* xs, const uint8_t* codes,
                         const at::Half* scales, const at::Half* mins, int64_t K, int64_t group) {
  float total = 0.0f;
  for (int64_t c = 0; c < K / kChunk; ++c) {
    const uint8_t* b = codes + c * kChunk / 2;
    const int8_t* q = xq + c * kChunk;
    int32_t acc = 0;
    for (int64_t i = 0; i < kChunk / 2; ++i) acc += (b[i] & 0x0F) * q[i] + (b[i] >> 4) * q[kChunk / 2 + i];
    total += static_cast<float>(acc) * xd[c] * half_to_float(scales[c * kChunk / group]);
  }
  for (int64_t g = 0; g < K / group; ++g) total += half_to_float(mins[g]) * xs[g];
  return total;
}

#if defined(__AVX2__) && defined(__FMA__)
// One 32-run of codes (chunk c) times MR rows of int8 x, scaled, added to acc[r].
template <int MR>
inline void q8_chunk(const uint8_t* codes, const int8_t* xq, const float* xd, int64_t K, int64_t C, int64_t c,
                     float scale, __m256* acc, int stride) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + c * kChunk / 2));
  // 32 codes: even k (low nibbles), then odd k (high nibbles)
  const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(0x0F));
  for (int r = 0; r < MR; ++r) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + c * kChunk));
    const __m256i prod = _mm256_madd_epi16(_mm256_maddubs_epi16(w, q), _mm256_set1_epi16(1));
    acc[r * stride] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(prod), _mm256_set1_ps(scale * xd[r * C + c]), acc[r * stride]);
  }
}

// Two accumulators per row, fed by alternating chunks, so consecutive fused multiply-adds do not
// wait on each other (their latency, not the arithmetic, would otherwise set the pace).
template <int MR>
inline void dot_rows_q8_avx2(const int8_t* xq, const float* xd, int64_t K, const float* xs, int64_t G,
                             const uint8_t* codes, const at::Half* scales, const at::Half* mins, int64_t group,
                             float* out, int64_t ldo) {
  const int64_t C = K / kChunk, per_group = group / kChunk;
  __m256 even[MR], odd[MR];
  for (int r = 0; r < MR; ++r) even[r] = odd[r] = _mm256_setzero_ps();
  int64_t g = 0, left = per_group;
  float sg = half_to_float(scales[0]);
  auto next_scale = [&]() {
    const float s = sg;
    if (--left == 0 && ++g < G) {
      left = per_group;
      sg = half_to_float(scales[g]);
    }
    return s;
  };
  int64_t c = 0;
  for (; c + 1 < C; c += 2) {
    const float s0 = next_scale();
    const float s1 = next_scale();
    q8_chunk<MR>(codes, xq, xd, K, C, c, s0, even, 1);
    q8_chunk<MR>(codes, xq, xd, K, C, c + 1, s1, odd, 1);
  }
  if (c < C) q8_chunk<MR>(codes, xq, xd, K, C, c, next_scale(), even, 1);
  for (int r = 0; r < MR; ++r) {
    float mterm = 0.0f;
    for (int64_t i = 0; i < G; ++i) mterm += half_to_float(mins[i]) * xs[r * G + i];
    out[r * ldo] = hsum(_mm256_add_ps(even[r], odd[r])) + mterm;
  }
}
#if defined(__F16C__)
// One row of int8 x (batch-1 decode) against NR weight rows, as dot1_rows_avx2: x's 32-run is
// loaded once for all NR rows, and each run's integer product is scaled straight into the row's
// total (scale[g] * d[run] widened 8 groups at a time), so the NR chains interleave.
template <int NR>
inline void dot1_rows_q8_avx2(const int8_t* xq, const float* xd, const float* xs, int64_t K, int64_t G,
                              const uint8_t* codes, const at::Half* scales, const at::Half* mins, int64_t group,
                              float* out) {
  const int64_t C = K / kChunk, per_group = group / kChunk;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 total[NR];
  for (int j = 0; j < NR; ++j) total[j] = _mm256_setzero_ps();
  alignas(32) float sc[NR][8];  // scale of the run's group times the run's d, 8 runs at a time
  prefetch_next_quad_groups(scales, mins, NR * G);
  for (int64_t c0 = 0; c0 < C; c0 += 8) {
    const int64_t cn = std::min<int64_t>(8, C - c0);
    for (int j = 0; j < NR; ++j) {
      if (per_group == 1 && cn == 8) {  // group 32: one scale per run
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + j * G + c0));
        _mm256_store_ps(sc[j], _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_loadu_ps(xd + c0)));
      } else {
        for (int64_t i = 0, g = c0 / per_group, left = per_group - c0 % per_group; i < cn; ++i) {
          sc[j][i] = half_to_float(scales[j * G + g]) * xd[c0 + i];
          if (--left == 0) {
            ++g;
            left = per_group;
          }
        }
      }
    }
    for (int64_t c = c0; c < c0 + cn; ++c) {
      __builtin_prefetch(codes + NR * (K / 2) + c * 2 * kChunk);  // the next quad's codes (see int4_common.h)
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * kChunk));
      for (int j = 0; j < NR; ++j) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j * (K / 2) + c * kChunk / 2));
        const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), low4);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
        total[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&sc[j][c - c0]), total[j]);
      }
    }
  }
  for (int j = 0; j < NR; ++j) out[j] = hsum(total[j]) + min_term(mins + j * G, xs, G);
}
#endif  // __F16C__
#endif

}  // namespace

at::Tensor int4_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const at::Tensor& mins, int64_t group) {
  check_args(x, codes, scales, mins, group);
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = K / group, C = K / kChunk;
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const QuantizedX xq(x, group);
  const int8_t* xqp = xq.q.data_ptr<int8_t>();
  const float* xdp = xq.d.data_ptr<float>();
  const float* xsp = xq.sums.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* mp = mins.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if (M == 1) {  // batch-1 decode: 4 weight rows per pass
    over_row_quads(N, [&](auto rows, int64_t n) {
      dot1_rows_q8_avx2<decltype(rows)::value>(xqp, xdp, xsp, K, G, cp + n * (K / 2), sp + n * G, mp + n * G, group,
                                               yp + n);
    });
    return y;
  }
#endif
  over_tiles(N, M, [&](int64_t n, int64_t m, int64_t rows) {
    const uint8_t* cr = cp + n * (K / 2);
    const at::Half* sr = sp + n * G;
    const at::Half* mr = mp + n * G;
    float* out = yp + m * N + n;
#if defined(__AVX2__) && defined(__FMA__)
    const int8_t* xr = xqp + m * K;
    const float* dr = xdp + m * C;
    const float* sumr = xsp + m * G;
    switch (rows) {
      case 4: return dot_rows_q8_avx2<4>(xr, dr, K, sumr, G, cr, sr, mr, group, out, N);
      case 3: return dot_rows_q8_avx2<3>(xr, dr, K, sumr, G, cr, sr, mr, group, out, N);
      case 2: return dot_rows_q8_avx2<2>(xr, dr, K, sumr, G, cr, sr, mr, group, out, N);
      default: return dot_rows_q8_avx2<1>(xr, dr, K, sumr, G, cr, sr, mr, group, out, N);
    }
#else
    for (int64_t r = 0; r < rows; ++r)
      out[r * N] = dot_row_q8_generic(xqp + (m + r) * K, xdp + (m + r) * C, xsp + (m + r) * G, cr, sr, mr, K, group);
#endif
  });
  return y;
}
