// Weight-only int4 and int8 linears on the CPU: y = x W^T with float32 activations.
//
// int8 (hasten.quant.formats.Int8Weight, also GGUF Q8_0 rows): qweight int8 [N, K], scales float32
// [N]: w[n, k] = q[n, k] * scale[n]; a dot-product kernel for one row of x, else the blocked path
// below (int8_linear).
//
// Weight layout (hasten.quant.formats.Int4Weight, also GGUF Q4_0/Q4_1 after conversion):
//   codes  uint8 [N, K / 2]   value k of row n in nibble k % 2 (low nibble first) of byte k / 2
//   scales half  [N, K / g]   w[n, k] = codes[n, k] * scale[n, k / g] + min[n, k / g]
//   mins   half  [N, K / g]
// so  y[m, n] = sum_g scale[n, g] * (x[m, group g] . codes[n, group g]) + min[n, g] * sum(x[m, group g]).
//
// Each 16-byte run of codes holds 32 consecutive k; its low nibbles are the even k and its high
// nibbles the odd k. Rather than shuffling the weights, x is permuted once per call into the same
// order (evens then odds for every 32 k), so the unpacked nibbles line up with x directly.
// Rows of W are split across threads; up to 4 rows of x share every unpacked weight vector.

#include "cpu_kernels.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "float_tiles.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX2__) && defined(__FMA__)
using hasten_tiles::hsum;
#endif

constexpr int64_t kChunk = 32;  // k values per 16 bytes of codes

inline float half_to_float(at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// x [M, K] -> xp [M, K] with every 32-run reordered to (even k, odd k); xs [M, G] group sums.
void prepare_x(const float* x, int64_t M, int64_t K, int64_t group, float* xp, float* xs) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float* pr = xp + m * K;
    for (int64_t c = 0; c < K; c += kChunk) {
      for (int64_t i = 0; i < kChunk / 2; ++i) {
        pr[c + i] = xr[c + 2 * i];
        pr[c + kChunk / 2 + i] = xr[c + 2 * i + 1];
      }
    }
    for (int64_t g = 0; g < K / group; ++g) {
      float s = 0.0f;
      for (int64_t i = 0; i < group; ++i) s += xr[g * group + i];
      xs[m * (K / group) + g] = s;
    }
  }
}

// Portable path: one output value.
float dot_row_generic(const float* xp, const float* xs, const uint8_t* codes, const at::Half* scales,
                      const at::Half* mins, int64_t K, int64_t group) {
  float total = 0.0f;
  for (int64_t g = 0; g < K / group; ++g) {
    float acc = 0.0f;
    for (int64_t c = g * group; c < (g + 1) * group; c += kChunk) {
      const uint8_t* b = codes + c / 2;
      const float* xc = xp + c;
      for (int64_t i = 0; i < kChunk / 2; ++i) {
        acc += xc[i] * static_cast<float>(b[i] & 0x0F);
        acc += xc[kChunk / 2 + i] * static_cast<float>(b[i] >> 4);
      }
    }
    total += acc * half_to_float(scales[g]) + half_to_float(mins[g]) * xs[g];
  }
  return total;
}

#if defined(__AVX2__) && defined(__FMA__)
// The 32 codes of one 16-byte run as four vectors of 8 int32 in x's permuted order (even k of the
// run's two halves, then odd k): bytes widened to 32-bit lanes straight from memory, nibbles split
// by a mask and a shift (~1.5x fewer cycles than splitting them in a 128-bit register and widening
// each quarter; measured on one core).
inline void unpack_run(const uint8_t* b, __m256i q[4]) {
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8)));
  q[0] = _mm256_and_si256(a, low4);
  q[1] = _mm256_and_si256(d, low4);
  q[2] = _mm256_srli_epi32(a, 4);
  q[3] = _mm256_srli_epi32(d, 4);
}

// MR rows of x against one weight row n: out[r * ldo] = y[r, n]. NA independent accumulators per
// row keep the fused multiply-adds from waiting on each other (their latency, not the arithmetic,
// would otherwise set the pace).
template <int MR>
inline void dot_rows_avx2(const float* xp, int64_t K, const float* xs, int64_t G, const uint8_t* codes,
                          const at::Half* scales, const at::Half* mins, int64_t group, float* out, int64_t ldo) {
  constexpr int NA = MR <= 2 ? 4 : 2;
  __m256 total[MR];
  for (int r = 0; r < MR; ++r) total[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[MR][NA];
    for (int r = 0; r < MR; ++r)
      for (int a = 0; a < NA; ++a) acc[r][a] = _mm256_setzero_ps();
    for (int64_t c = g * group; c < (g + 1) * group; c += kChunk) {
      __m256i q[4];
      unpack_run(codes + c / 2, q);
      const __m256 w[4] = {_mm256_cvtepi32_ps(q[0]), _mm256_cvtepi32_ps(q[1]), _mm256_cvtepi32_ps(q[2]),
                           _mm256_cvtepi32_ps(q[3])};
      for (int r = 0; r < MR; ++r) {
        const float* xc = xp + r * K + c;
        for (int j = 0; j < 4; ++j) acc[r][j % NA] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xc + 8 * j), acc[r][j % NA]);
      }
    }
    const __m256 s = _mm256_set1_ps(half_to_float(scales[g]));
    for (int r = 0; r < MR; ++r) {
      __m256 sum = acc[r][0];
      for (int a = 1; a < NA; ++a) sum = _mm256_add_ps(sum, acc[r][a]);
      total[r] = _mm256_fmadd_ps(sum, s, total[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    float mterm = 0.0f;
    for (int64_t g = 0; g < G; ++g) mterm += half_to_float(mins[g]) * xs[r * G + g];
    out[r * ldo] = hsum(total[r]) + mterm;
  }
}
#endif


// One row of x (batch-1 decode) against NR weight rows at once. Each 32-run's product is a fresh
// chain (4 multiply-adds) scaled into the row's total, so the only chain carried from run to run
// is one fused multiply-add per row, and NR rows interleave: the loop is bound by throughput,
// not by FMA latency (one weight row at a time waited on its chain: ~3x slower). The 4 vectors of
// x are loaded once per run for all NR rows.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// sum_g min[g] * xs[g] (xs: x's group sums) for one weight row, 8 groups per step (a scalar chain
// over the groups cost as much as the codes themselves at K = 1536)
inline float min_term(const at::Half* mins, const float* xs, int64_t G) {
  __m256 macc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= G; g += 8)
    macc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + g))),
                           _mm256_loadu_ps(xs + g), macc);
  float mterm = hsum(macc);
  for (; g < G; ++g) mterm += half_to_float(mins[g]) * xs[g];
  return mterm;
}

template <int NR>
inline void dot1_rows_avx2(const float* xp, const float* xs, int64_t G, const uint8_t* codes, int64_t code_stride,
                           const at::Half* scales, const at::Half* mins, int64_t group, float* out) {
  __m256 total[NR];
  for (int j = 0; j < NR; ++j) total[j] = _mm256_setzero_ps();
  alignas(32) float sc[NR][8];  // this block of 8 groups' scales, widened 8 at a time
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    const int64_t gn = std::min<int64_t>(8, G - g0);
    for (int j = 0; j < NR; ++j) {
      if (gn == 8) {
        _mm256_store_ps(sc[j], _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + j * G + g0))));
      } else {
        for (int64_t i = 0; i < gn; ++i) sc[j][i] = half_to_float(scales[j * G + g0 + i]);
      }
    }
    for (int64_t g = g0; g < g0 + gn; ++g) {
      __m256 part[NR];
      for (int64_t c = g * group; c < (g + 1) * group; c += kChunk) {
        const __m256 x0 = _mm256_loadu_ps(xp + c), x1 = _mm256_loadu_ps(xp + c + 8);
        const __m256 x2 = _mm256_loadu_ps(xp + c + 16), x3 = _mm256_loadu_ps(xp + c + 24);
        for (int j = 0; j < NR; ++j) {
          __m256i q[4];
          unpack_run(codes + j * code_stride + c / 2, q);
          __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(q[0]), x0);
          p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[1]), x1, p);
          p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[2]), x2, p);
          p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[3]), x3, p);
          part[j] = c == g * group ? p : _mm256_add_ps(part[j], p);
        }
      }
      for (int j = 0; j < NR; ++j) total[j] = _mm256_fmadd_ps(part[j], _mm256_broadcast_ss(&sc[j][g - g0]), total[j]);
    }
  }
  for (int j = 0; j < NR; ++j) out[j] = hsum(total[j]) + min_term(mins + j * G, xs, G);
}
#endif

// ---- int8-activation variant (as llama.cpp's Q4 x Q8 dot products) --------------------------
// x is quantized per 32 k to int8 with its own scale d (round to nearest, |q| <= 127), in the same
// even/odd order as the codes; then each 32-run is one u8 x s8 multiply-add. The min term uses the
// exact float group sums. Trades a relative error of about 1/254 per activation for ~3x fewer
// instructions per weight than the float path.
void quantize_x_q8(const float* x, int64_t M, int64_t K, int64_t group, int8_t* xq, float* xd, float* xs) {
  const int64_t C = K / kChunk;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    for (int64_t c = 0; c < C; ++c) {
      const float* xc = xr + c * kChunk;
      int8_t* q = xq + m * K + c * kChunk;
#if defined(__AVX2__)
      // the same arithmetic 8 lanes at a time (vcvtps2dq rounds to nearest even, as nearbyint)
      __m256 v[4], a = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(xc + 8 * j);
        a = _mm256_max_ps(a, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[j]));
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
      const float d = amax / 127.0f;
      const float inv = d > 0.0f ? 1.0f / d : 0.0f;
      alignas(32) int32_t r[kChunk];
      for (int j = 0; j < 4; ++j)
        _mm256_store_si256(reinterpret_cast<__m256i*>(r + 8 * j),
                           _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv))));
      for (int64_t i = 0; i < kChunk / 2; ++i) {
        q[i] = static_cast<int8_t>(r[2 * i]);
        q[kChunk / 2 + i] = static_cast<int8_t>(r[2 * i + 1]);
      }
#else
      float amax = 0.0f;
      for (int64_t i = 0; i < kChunk; ++i) amax = std::max(amax, std::abs(xc[i]));
      const float d = amax / 127.0f;
      const float inv = d > 0.0f ? 1.0f / d : 0.0f;
      for (int64_t i = 0; i < kChunk / 2; ++i) {
        q[i] = static_cast<int8_t>(std::nearbyint(xc[2 * i] * inv));
        q[kChunk / 2 + i] = static_cast<int8_t>(std::nearbyint(xc[2 * i + 1] * inv));
      }
#endif
      xd[m * C + c] = d;
    }
    for (int64_t g = 0; g < K / group; ++g) {
      float s = 0.0f;
      for (int64_t i = 0; i < group; ++i) s += xr[g * group + i];
      xs[m * (K / group) + g] = s;
    }
  }
}

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

// Calls tile(n, m, rows) for every weight row n and every tile of up to 4 rows of x starting at m,
// weight rows split across threads (64 at least per task, so the parallel region pays off).
template <typename Tile>
void over_tiles(int64_t N, int64_t M, const Tile& tile) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m = 0; m < M; m += 4) tile(n, m, std::min<int64_t>(4, M - m));
  });
}

// Batch-1 paths: calls rows(std::integral_constant<int, R>{}, n) for every block of R <= 4 weight
// rows starting at n (R = 4 but for the last block), blocks split across threads.
template <typename Rows>
void over_row_quads(int64_t N, const Rows& rows) {
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

void check_args(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
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

at::Tensor int4_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const at::Tensor& mins, int64_t group) {
  check_args(x, codes, scales, mins, group);
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = K / group, C = K / kChunk;
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  auto xq = at::empty({M, K}, x.options().dtype(at::kChar));
  auto xd = at::empty({M, C}, x.options());
  auto xs = at::empty({M, G}, x.options());
  quantize_x_q8(x.data_ptr<float>(), M, K, group, xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<float>());
  const int8_t* xqp = xq.data_ptr<int8_t>();
  const float* xdp = xd.data_ptr<float>();
  const float* xsp = xs.data_ptr<float>();
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

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                       int64_t group) {
  check_args(x, codes, scales, mins, group);
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = K / group;
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  auto xp = at::empty({M, K}, x.options());
  auto xs = at::empty({M, G}, x.options());
  prepare_x(x.data_ptr<float>(), M, K, group, xp.data_ptr<float>(), xs.data_ptr<float>());
  const float* xpp = xp.data_ptr<float>();
  const float* xsp = xs.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* mp = mins.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if (M == 1) {  // batch-1 decode: 4 weight rows per pass
    over_row_quads(N, [&](auto rows, int64_t n) {
      dot1_rows_avx2<decltype(rows)::value>(xpp, xsp, G, cp + n * (K / 2), K / 2, sp + n * G, mp + n * G, group, yp + n);
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
    const float* xr = xpp + m * K;
    const float* sumr = xsp + m * G;
    switch (rows) {
      case 4: return dot_rows_avx2<4>(xr, K, sumr, G, cr, sr, mr, group, out, N);
      case 3: return dot_rows_avx2<3>(xr, K, sumr, G, cr, sr, mr, group, out, N);
      case 2: return dot_rows_avx2<2>(xr, K, sumr, G, cr, sr, mr, group, out, N);
      default: return dot_rows_avx2<1>(xr, K, sumr, G, cr, sr, mr, group, out, N);
    }
#else
    for (int64_t r = 0; r < rows; ++r)
      out[r * N] = dot_row_generic(xpp + (m + r) * K, xsp + (m + r) * G, cr, sr, mr, K, group);
#endif
  });
  return y;
}

// Two or more rows of x (batched decode, prefill): the dot-product kernels above are bound by their
// loads of x, so instead each task dequantizes a block of 48 weight rows to float32 (in x's permuted
// order; the block stays in cache) and multiplies it by x with register tiles of 4 x-rows by 3
// weight rows (7 loads per 12 fused multiply-adds), or from 64 rows on with the library's float32
// GEMM, single-threaded inside the parallel region. Same values as dequantize-then-matmul, without
// ever writing the whole float32 weight to memory.
namespace {
constexpr int64_t kGemmBlock = 48;  // weight rows per task (16 tiles of 3)
// From this many rows of x on, and rows longer than one k-slice (hasten_tiles::kMaxSliceK), the
// library's float32 GEMM (packed, cache-blocked) beats the register tiles (measured: K = 1536,
// 256 rows 168 vs 140 GFLOP/s; at K = 576 the tiles stay ahead at 512 rows).
constexpr int64_t kLibraryGemmRows = 256;

#if defined(__AVX2__) && defined(__FMA__)
// Whether an M x K product runs on the register tiles (else the library GEMM).
inline bool tiles_take(int64_t M, int64_t K) {
  return K % 8 == 0 && (M < kLibraryGemmRows || K <= hasten_tiles::kMaxSliceK);
}
#endif

void dequant_rows(const uint8_t* codes, const at::Half* scales, const at::Half* mins, int64_t rows, int64_t K,
                  int64_t group, float* w) {
  const int64_t G = K / group;
  for (int64_t n = 0; n < rows; ++n) {
    const uint8_t* cr = codes + n * (K / 2);
    float* wr = w + n * K;
    for (int64_t g = 0; g < G; ++g) {
      const float s = half_to_float(scales[n * G + g]), mn = half_to_float(mins[n * G + g]);
      for (int64_t c = g * group; c < (g + 1) * group; c += kChunk) {
#if defined(__AVX2__) && defined(__FMA__)
        __m256i q[4];  // q * scale + min in one multiply-add
        unpack_run(cr + c / 2, q);
        const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(mn);
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(wr + c + 8 * j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[j]), vs, vm));
#else
        for (int64_t i = 0; i < kChunk / 2; ++i) {
          wr[c + i] = static_cast<float>(cr[c / 2 + i] & 0x0F) * s + mn;
          wr[c + kChunk / 2 + i] = static_cast<float>(cr[c / 2 + i] >> 4) * s + mn;
        }
#endif
      }
    }
  }
}
// y [M, N] = x W^T, W produced kGemmBlock rows at a time by dequant(n0, rows, w) into a float32
// buffer per task (in x's k order), multiplied by the register tiles or, from kLibraryGemmRows
// rows of x on, the library GEMM. Tensors made in the tasks are ordinary ones even when the
// caller is in inference mode (that mode is per thread), so y is filled by memcpy, not by torch.
template <typename Dequant>
void gemm_over_blocks(const at::Tensor& x, int64_t N, float* yp, const Dequant& dequant) {
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t blocks = (N + kGemmBlock - 1) / kGemmBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    auto w = at::empty({kGemmBlock, K}, x.options());
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kGemmBlock, rows = std::min(kGemmBlock, N - n0);
      dequant(n0, rows, w.data_ptr<float>());
#if defined(__AVX2__) && defined(__FMA__)
      if (tiles_take(M, K)) {
        hasten_tiles::block_gemm(x.data_ptr<float>(), M, K, w.data_ptr<float>(), rows, yp + n0, N);
        continue;
      }
#endif
      const auto part = at::mm(x, w.narrow(0, 0, rows).t()).contiguous();  // [M, rows]
      const float* pp = part.data_ptr<float>();
      for (int64_t m = 0; m < M; ++m) std::memcpy(yp + m * N + n0, pp + m * rows, rows * sizeof(float));
    }
  });
}
}  // namespace

at::Tensor int4_linear_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                            const at::Tensor& mins, int64_t group) {
  check_args(x, codes, scales, mins, group);
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = K / group;
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  auto xp = at::empty({M, K}, x.options());
  auto xs = at::empty({M, G}, x.options());
  prepare_x(x.data_ptr<float>(), M, K, group, xp.data_ptr<float>(), xs.data_ptr<float>());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* mp = mins.data_ptr<at::Half>();
  gemm_over_blocks(xp, N, y.data_ptr<float>(), [&](int64_t n0, int64_t rows, float* w) {
    dequant_rows(cp + n0 * (K / 2), sp + n0 * G, mp + n0 * G, rows, K, group, w);
  });
  return y;
}

// ---- int8 weights: same blocked scheme, natural k order ---------------------------------------
namespace {
void dequant_rows_int8(const int8_t* q, const float* scales, int64_t rows, int64_t K, float* w) {
  for (int64_t n = 0; n < rows; ++n) {
    const int8_t* qr = q + n * K;
    float* wr = w + n * K;
    const float s = scales[n];
    int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 vs = _mm256_set1_ps(s);
    for (; k + 8 <= K; k += 8) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qr + k));
      _mm256_storeu_ps(wr + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), vs));
    }
#endif
    for (; k < K; ++k) wr[k] = static_cast<float>(qr[k]) * s;
  }
}
}  // namespace

#if defined(__AVX2__) && defined(__FMA__)
// One row of x (batch-1 decode): each weight row is read once, widened in registers and dotted with
// x; 4 accumulators hide the FMA latency. No dequantized copy is written.
float int8_dot_row(const float* x, const int8_t* q, int64_t K) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t k = 0;
  for (; k + 32 <= K; k += 32)
    for (int j = 0; j < 4; ++j) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k + 8 * j));
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_loadu_ps(x + k + 8 * j), acc[j]);
    }
  float total = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  for (; k < K; ++k) total += static_cast<float>(q[k]) * x[k];
  return total;
}
#endif

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "qweight must be contiguous int8 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == K, "qweight has K = ", qweight.size(1), ", x has K = ", K);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
              "scales must be contiguous float32 [N]");
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const int8_t* qp = qweight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#if defined(__AVX2__) && defined(__FMA__)
  if (M == 1) {
    const float* xp = x.data_ptr<float>();
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) yp[n] = int8_dot_row(xp, qp + n * K, K) * sp[n];
    });
    return y;
  }
#endif
  gemm_over_blocks(x, N, yp, [&](int64_t n0, int64_t rows, float* w) {
    dequant_rows_int8(qp + n0 * K, sp + n0, rows, K, w);
  });
  return y;
}

// ---- float32 weights: the register tiles straight on W's rows (no copy) -----------------------
at::Tensor float_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "weight must be contiguous float32 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "weight has K = ", weight.size(1), ", x has K = ", K);
#if defined(__AVX2__) && defined(__FMA__)
  if (tiles_take(M, K)) {
    auto y = at::empty({M, N}, x.options());
    if (M == 0 || N == 0) return y;
    const float* xp = x.data_ptr<float>();
    const float* wp = weight.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, (N + kGemmBlock - 1) / kGemmBlock, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t n0 = b * kGemmBlock;
        hasten_tiles::block_gemm(xp, M, K, wp + n0 * K, std::min(kGemmBlock, N - n0), yp + n0, N);
      }
    });
    return y;
  }
#endif
  return at::mm(x, weight.t());
}
