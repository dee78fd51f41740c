// The gate_up form of the int4 int8-activation GEMM (int4_linear_q8_gemm_silu; the C++ layer loop's
// switch quant_int4_gemm_silu): each task pairs gate's block nb of 8 weight rows with up's block
// nb + I / 8, runs the same 8-row tiles over both into a small buffer and writes silu(gate) * up of
// them (silu_mul_fast8), so the [M, 2 I] output is never written and read back by silu_mul. Part of
// quant_gemm_q8_cpu.cpp, which includes it before int4_linear_q8_gemm: it uses that file's tiles and
// loops (q8_gemm_tile, over_blocks8, takes_wide_tiles).
#pragma once

#include "attention_math.h"

namespace {

// Whether a call of M rows takes the fused tiles: builds with the AVX2 8-row tiles, except calls that
// take the AVX-512 two-block tiles (those run the two calls).
inline bool int4_silu_from_tiles(int64_t M) {
#if defined(__AVX2__) && defined(__FMA__)
#if defined(HASTEN_Q8_TILE2)
  if (takes_wide_tiles(M)) return false;
#endif
  (void)M;
  return true;
#else
  (void)M;
  return false;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
// y [M, I] = silu(gate) * up for x quantized (xq, xd, xs) against the packed [gate | up] (2 I rows).
// Each value is q8_gemm_tile's, then silu_mul's fast lanes: the same bits as the two calls.
inline void int4_silu_tiles(int64_t M, int64_t I, int64_t K, int64_t G, int64_t per_group, const int8_t* xqp,
                            const float* xdp, const float* xsp, const uint8_t* wp, const float* sp, const float* mp,
                            float* yp) {
  const int64_t C = K / kChunk, I8 = I / 8, bytes = (K / 8) * 32;
  over_blocks8(I8, M, K, [&](auto rows, int64_t nb, int64_t m) {
    constexpr int R = decltype(rows)::value;
    alignas(32) float gate[R * 8];
    alignas(32) float up[R * 8];
    const int64_t ahead = m == 0 && nb + kAheadBlocks < I8 ? kAheadBlocks : 0;
    for (const auto& [block, out] : {std::pair<int64_t, float*>{nb, gate}, std::pair<int64_t, float*>{nb + I8, up}})
      q8_gemm_tile<R>(xqp + m * K, xdp + m * C, xsp + m * G, K, G, per_group, wp + block * bytes, sp + block * G * 8,
                      mp + block * G * 8, out, 8, 8, ahead);
    for (int r = 0; r < R; ++r)
      _mm256_storeu_ps(yp + (m + r) * I + nb * 8,
                       hasten_attention::silu_mul_fast8(_mm256_load_ps(gate + r * 8), _mm256_load_ps(up + r * 8)));
  });
}
#endif

}  // namespace
