// float32 register-tiled products y[m, n] = x[m] . w[n] over K (both row-major, rows of length K),
// shared by the quantized linears (w = a dequantized block, in cache) and the float32 linear
// (w = the weight itself). Included by quant_linear_cpu.cpp and (for hsum) paged_attention_cpu.cpp;
// see hasten/kernels/build.py.
//
// Tiles of 4 x-rows by 3 w-rows keep 12 accumulators in registers: per k-step of 8 floats they
// need 7 loads for 12 fused multiply-adds, so the two FMA pipes, not the loads, set the pace.
// GCC does not see that: with 16 vector registers in play it folds a load into every FMA (16 loads
// per 12 FMAs, ~60 % of peak). The full 4 x 3 tile's k-loop is therefore written in assembly (x86-64,
// AVX2 + FMA, GCC/Clang syntax): ~90 % of the FMA peak on this machine's Zen 3 cores against
// ~60 %. The edge tiles (fewer rows) keep the intrinsics. The arithmetic is the same in both (one
// accumulator per output, k in order, then the same horizontal sum), so results are identical.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace hasten_tiles {

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 a) {
  const __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 y = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(y, _mm_shuffle_ps(y, y, 1)));
}

// out[r * ldo + j] (+)= x[r] . w[j] over K (a multiple of 8) for MR rows of x (stride ldk) and NR
// rows of w (same stride); add says whether to add to out (a later slice of k) or to set it.
template <int MR, int NR>
inline void tile_dot(const float* x, const float* w, int64_t ldk, int64_t K, float* out, int64_t ldo, bool add) {
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + j * ldk + k);
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldk + k);
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) out[r * ldo + j] = hsum(acc[r][j]) + (add ? out[r * ldo + j] : 0.0f);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define HASTEN_TILE43_ASM 1
// The full tile: ymm0-11 accumulate (row r, w-row j in ymm[3r + j]), ymm12-14 hold the three
// w vectors of the step, ymm15 one x vector at a time. K >= 8.
inline void tile43(const float* x, const float* w, int64_t ldk, int64_t K, float* out, int64_t ldo, bool add) {
  alignas(32) float acc[96];
  const float *x1 = x + ldk, *x2 = x + 2 * ldk, *x3 = x + 3 * ldk, *w1 = w + ldk, *w2 = w + 2 * ldk;
  int64_t k = 0;
  asm volatile(
      "vxorps %%ymm0, %%ymm0, %%ymm0\n\t"
      "vxorps %%ymm1, %%ymm1, %%ymm1\n\t"
      "vxorps %%ymm2, %%ymm2, %%ymm2\n\t"
      "vxorps %%ymm3, %%ymm3, %%ymm3\n\t"
      "vxorps %%ymm4, %%ymm4, %%ymm4\n\t"
      "vxorps %%ymm5, %%ymm5, %%ymm5\n\t"
      "vxorps %%ymm6, %%ymm6, %%ymm6\n\t"
      "vxorps %%ymm7, %%ymm7, %%ymm7\n\t"
      "vxorps %%ymm8, %%ymm8, %%ymm8\n\t"
      "vxorps %%ymm9, %%ymm9, %%ymm9\n\t"
      "vxorps %%ymm10, %%ymm10, %%ymm10\n\t"
      "vxorps %%ymm11, %%ymm11, %%ymm11\n\t"
      "1:\n\t"
      "vmovups (%[w0], %[k], 4), %%ymm12\n\t"
      "vmovups (%[w1], %[k], 4), %%ymm13\n\t"
      "vmovups (%[w2], %[k], 4), %%ymm14\n\t"
      "vmovups (%[x0], %[k], 4), %%ymm15\n\t"
      "vfmadd231ps %%ymm12, %%ymm15, %%ymm0\n\t"
      "vfmadd231ps %%ymm13, %%ymm15, %%ymm1\n\t"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm2\n\t"
      "vmovups (%[x1], %[k], 4), %%ymm15\n\t"
      "vfmadd231ps %%ymm12, %%ymm15, %%ymm3\n\t"
      "vfmadd231ps %%ymm13, %%ymm15, %%ymm4\n\t"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm5\n\t"
      "vmovups (%[x2], %[k], 4), %%ymm15\n\t"
      "vfmadd231ps %%ymm12, %%ymm15, %%ymm6\n\t"
      "vfmadd231ps %%ymm13, %%ymm15, %%ymm7\n\t"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm8\n\t"
      "vmovups (%[x3], %[k], 4), %%ymm15\n\t"
      "vfmadd231ps %%ymm12, %%ymm15, %%ymm9\n\t"
      "vfmadd231ps %%ymm13, %%ymm15, %%ymm10\n\t"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm11\n\t"
      "add $8, %[k]\n\t"
      "cmp %[K], %[k]\n\t"
      "jl 1b\n\t"
      "vmovaps %%ymm0, (%[acc])\n\t"
      "vmovaps %%ymm1, 32(%[acc])\n\t"
      "vmovaps %%ymm2, 64(%[acc])\n\t"
      "vmovaps %%ymm3, 96(%[acc])\n\t"
      "vmovaps %%ymm4, 128(%[acc])\n\t"
      "vmovaps %%ymm5, 160(%[acc])\n\t"
      "vmovaps %%ymm6, 192(%[acc])\n\t"
      "vmovaps %%ymm7, 224(%[acc])\n\t"
      "vmovaps %%ymm8, 256(%[acc])\n\t"
      "vmovaps %%ymm9, 288(%[acc])\n\t"
      "vmovaps %%ymm10, 320(%[acc])\n\t"
      "vmovaps %%ymm11, 352(%[acc])\n\t"
      : [k] "+r"(k)
      : [w0] "r"(w), [w1] "r"(w1), [w2] "r"(w2), [x0] "r"(x), [x1] "r"(x1), [x2] "r"(x2), [x3] "r"(x3),
        [K] "r"(K), [acc] "r"(acc)
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
        "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < 3; ++j)
      out[r * ldo + j] = hsum(_mm256_load_ps(acc + 8 * (3 * r + j))) + (add ? out[r * ldo + j] : 0.0f);
}
#endif

template <int MR>
inline void tile_dot_nr(int nr, const float* x, const float* w, int64_t ldk, int64_t K, float* out, int64_t ldo,
                        bool add) {
  switch (nr) {
    case 3:
#ifdef HASTEN_TILE43_ASM
      if (MR == 4 && K >= 8) return tile43(x, w, ldk, K, out, ldo, add);
#endif
      return tile_dot<MR, 3>(x, w, ldk, K, out, ldo, add);
    case 2: return tile_dot<MR, 2>(x, w, ldk, K, out, ldo, add);
    default: return tile_dot<MR, 1>(x, w, ldk, K, out, ldo, add);
  }
}

// At most this many k per pass, so a tile's 4 x-rows and 3 w-rows (7 * 4 * 640 bytes = 17.5 KiB)
// stay in the 32 KiB L1 while the tile is swept along the block's w-rows; longer rows (the MLP's
// down projection, K = 1536) are cut into equal slices whose partial sums add up in y.
constexpr int64_t kMaxSliceK = 640;

// y[m, j] (row stride ldy) = x[m] . w[j] for all M rows of x and `rows` rows of w; K % 8 == 0.
inline void block_gemm(const float* x, int64_t M, int64_t K, const float* w, int64_t rows, float* y, int64_t ldy) {
  const int64_t slices = (K + kMaxSliceK - 1) / kMaxSliceK;
  const int64_t slice = ((K / slices + 7) / 8) * 8;
  for (int64_t k0 = 0; k0 < K; k0 += slice) {
    const int64_t kn = std::min(slice, K - k0);
    for (int64_t m = 0; m < M; m += 4) {
      const int mr = static_cast<int>(std::min<int64_t>(4, M - m));
      for (int64_t j = 0; j < rows; j += 3) {
        const int nr = static_cast<int>(std::min<int64_t>(3, rows - j));
        const float* xr = x + m * K + k0;
        const float* wr = w + j * K + k0;
        float* out = y + m * ldy + j;
        switch (mr) {
          case 4: tile_dot_nr<4>(nr, xr, wr, K, kn, out, ldy, k0 > 0); break;
          case 3: tile_dot_nr<3>(nr, xr, wr, K, kn, out, ldy, k0 > 0); break;
          case 2: tile_dot_nr<2>(nr, xr, wr, K, kn, out, ldy, k0 > 0); break;
          default: tile_dot_nr<1>(nr, xr, wr, K, kn, out, ldy, k0 > 0); break;
        }
      }
    }
  }
}
#endif

}  // namespace hasten_tiles
