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
// The int8-activation variant is in quant_linear_q8_cpu.cpp, the pieces both use in int4_common.h.

#include "cpu_kernels.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <type_traits>

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
template <int NR>
inline void dot1_rows_avx2(const float* xp, const float* xs, int64_t G, const uint8_t* codes, int64_t code_stride,
                           const at::Half* scales, const at::Half* mins, int64_t group, float* out) {
  __m256 total[NR];
  for (int j = 0; j < NR; ++j) total[j] = _mm256_setzero_ps();
  alignas(32) float sc[NR][8];  // this block of 8 groups' scales, widened 8 at a time
  prefetch_next_quad_groups(scales, mins, NR * G);
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
        __builtin_prefetch(codes + NR * code_stride + c * 2);  // the next quad's codes (see int4_common.h)
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

}  // namespace

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
