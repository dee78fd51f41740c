// The int8-activation GEMM over grouped int8 weights (int8g_pack_rows8, int8g_linear_q8_gemm). Part of
// quant_gemm_q8_cpu.cpp, which includes it once at its end: it uses that file's tiles, loops and
// helpers (QuantizedX, over_blocks8, over_block_pairs, broadcast4, store_cols, pack_int8_rows8), as one
// translation unit.
#pragma once

// ---- grouped int8 weights (GGUF Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0 in their own arithmetic) ---------
// w[n][k] = q * scale[n][k / group] + min[n][k / group] with signed codes q (|q| <= 127), group 16
// or 32, scales and mins float32 (no mins: all zero). Packed as the int8 weights above, scales and
// mins as float32 [N8, G, 8]. Each group's integer sum is scaled by its own scale (group 16: a
// 32-run holds two groups, k < 16 at positions 0-7 and 16-23, i.e. 4-byte steps kb = 0, 1, 4, 5 of
// the run, k >= 16 at kb = 2, 3, 6, 7); the min term uses the group sums of the rounded x. The product
// takes |q| (unsigned) times x carrying q's sign, as the AVX2 int8 path above (pairs below 2^15).

namespace {

#if defined(__AVX2__) && defined(__FMA__)
template <int MR, bool Half>
inline void q8g_gemm_tile(const int8_t* xq, const float* xd, const float* xs, int64_t K, int64_t G, const int8_t* w,
                          const float* s8, const float* m8, float* out, int64_t ldo, int64_t cols) {
  const int64_t C = K / kChunk;
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    __m256i run[2][MR];
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < MR; ++r) run[h][r] = _mm256_setzero_si256();
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t kb = 8 * c + j;
      const int h = Half && (j & 2) ? 1 : 0;
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kb * 32));
      const __m256i a = _mm256_abs_epi8(v);
      for (int r = 0; r < MR; ++r) {
        const __m256i xsn = _mm256_sign_epi8(broadcast4(xq + r * K + kb * 4), v);
#if defined(HASTEN_Q8_VNNI)
        run[h][r] = dot_u8s8(run[h][r], a, xsn);
#else
        run[h][r] = _mm256_add_epi32(run[h][r], _mm256_madd_epi16(_mm256_maddubs_epi16(a, xsn), _mm256_set1_epi16(1)));
#endif
      }
    }
    const __m256 sa = _mm256_loadu_ps(s8 + (Half ? 2 * c : c) * 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 d = _mm256_set1_ps(xd[r * C + c]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(run[0][r]), _mm256_mul_ps(sa, d), acc[r]);
      if (Half) {
        const __m256 sb = _mm256_loadu_ps(s8 + (2 * c + 1) * 8);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(run[1][r]), _mm256_mul_ps(sb, d), acc[r]);
      }
    }
  }
  if (m8 != nullptr)
    for (int64_t g = 0; g < G; ++g) {
      const __m256 mv = _mm256_loadu_ps(m8 + g * 8);
      for (int r = 0; r < MR; ++r) acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[r * G + g]), acc[r]);
    }
  for (int r = 0; r < MR; ++r) store_cols(out + r * ldo, acc[r], cols);
}
#endif

#if defined(HASTEN_Q8_TILE2)
// The grouped tile above over two packed blocks at once (16 weight rows per 512-bit register), up
// to 8 rows of x. AVX-512 has no byte sign instruction, so the signed codes go in as w + 128 and
// 128 times x's integer sum over each group's positions comes off again (xsum: per row, run and
// group half).
template <int MR, bool Half>
inline void q8g_gemm_tile16(const int8_t* xq, const float* xd, const float* xs, const int32_t* xsum, int64_t K,
                            int64_t G, const int8_t* w0, const int8_t* w1, const float* s0, const float* s1,
                            const float* m0, const float* m1, float* out, int64_t ldo, int64_t cols1,
                            int64_t ahead) {
  const int64_t C = K / kChunk;
  constexpr int NH = Half ? 2 : 1;
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    __m512i run[NH][MR];
    for (int h = 0; h < NH; ++h)
      for (int r = 0; r < MR; ++r) run[h][r] = _mm512_setzero_si512();
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t kb = 8 * c + j;
      const int h = Half && (j & 2) ? 1 : 0;
      if (ahead && (kb & 1) == 0) prefetch_pair_line(w0 + ahead + kb * 32, w1 + ahead + kb * 32);
      const __m512i u = _mm512_xor_si512(load_pair(reinterpret_cast<const uint8_t*>(w0 + kb * 32),
                                                   reinterpret_cast<const uint8_t*>(w1 + kb * 32)), bias);
      for (int r = 0; r < MR; ++r) run[h][r] = _mm512_dpbusd_epi32(run[h][r], u, broadcast4_512(xq + r * K + kb * 4));
    }
    for (int h = 0; h < NH; ++h) {
      const int64_t g = Half ? 2 * c + h : c;
      const __m512 sv = load_pair_ps(s0 + g * 8, s1 + g * 8);
      for (int r = 0; r < MR; ++r) {
        const __m512i sums = _mm512_sub_epi32(run[h][r], _mm512_set1_epi32(128 * xsum[(r * C + c) * NH + h]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(sv, _mm512_set1_ps(xd[r * C + c])), acc[r]);
      }
    }
  }
  if (m0 != nullptr)
    for (int64_t g = 0; g < G; ++g) {
      const __m512 mv = load_pair_ps(m0 + g * 8, m1 + g * 8);
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * G + g]), acc[r]);
    }
  const __mmask16 tail = static_cast<__mmask16>((1u << (8 + cols1)) - 1u);
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + r * ldo, tail, acc[r]);
}
#endif

void q8g_gemm_row_generic(const int8_t* xq, const float* xd, const float* xs, int64_t K, int64_t G, bool half,
                          const int8_t* w, const float* s8, const float* m8, float* out, int64_t cols) {
  const int64_t C = K / kChunk;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t c = 0; c < C; ++c) {
    int32_t run[2][8] = {{0, 0, 0, 0, 0, 0, 0, 0}, {0, 0, 0, 0, 0, 0, 0, 0}};
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t kb = 8 * c + j;
      const int h = half && (j & 2) ? 1 : 0;
      for (int r = 0; r < 8; ++r)
        for (int i = 0; i < 4; ++i) run[h][r] += w[kb * 32 + r * 4 + i] * xq[kb * 4 + i];
    }
    for (int r = 0; r < 8; ++r) {
      acc[r] += static_cast<float>(run[0][r]) * (s8[(half ? 2 * c : c) * 8 + r] * xd[c]);
      if (half) acc[r] += static_cast<float>(run[1][r]) * (s8[(2 * c + 1) * 8 + r] * xd[c]);
    }
  }
  if (m8 != nullptr)
    for (int64_t g = 0; g < G; ++g)
      for (int r = 0; r < 8; ++r) acc[r] += m8[g * 8 + r] * xs[g];
  std::copy(acc, acc + cols, out);
}

// float32 [N, G] -> [N8, G, 8] (rows past N zero)
at::Tensor rows8_of(const at::Tensor& t, int64_t N8) {
  const int64_t N = t.size(0), G = t.size(1);
  auto out = at::zeros({N8 * 8, G}, t.options());
  out.narrow(0, 0, N).copy_(t);
  return out.view({N8, 8, G}).transpose(1, 2).contiguous();
}

void check_group(int64_t K, int64_t group) {
  TORCH_CHECK((group == 16 || group == 32) && K % kChunk == 0, "grouped int8 weights take group 16 or 32 and K a "
              "multiple of 32, got group ", group, " and K = ", K);
}

}  // namespace

std::vector<at::Tensor> int8g_pack_rows8(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
                                         int64_t group) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "qweight must be contiguous int8 [N, K]");
  const int64_t N = qweight.size(0), K = qweight.size(1), N8 = (N + 7) / 8;
  check_group(K, group);
  const int64_t G = K / group;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.size(0) == N && scales.size(1) == G,
              "scales must be float32 [N, K / group]");
  TORCH_CHECK(mins.numel() == 0 || (mins.scalar_type() == at::kFloat && mins.dim() == 2 && mins.size(0) == N &&
                                    mins.size(1) == G),
              "mins must be float32 [N, K / group], or empty for none");
  return {pack_int8_rows8(qweight), rows8_of(scales, N8), mins.numel() ? rows8_of(mins, N8) : at::empty({0}, scales.options())};
}

at::Tensor int8g_linear_q8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales8,
                                const at::Tensor& mins8, int64_t group, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N8 = (N + 7) / 8, C = K / kChunk;
  check_group(K, group);
  const int64_t G = K / group;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(0) == N8 && packed.size(1) * 4 == K && packed.size(2) == 8 && packed.size(3) == 4,
              "packed must be the int8 [ceil(N / 8), K / 4, 8, 4] of int8g_pack_rows8");
  for (const auto* t : {&scales8, &mins8})
    TORCH_CHECK((t == &mins8 && t->numel() == 0) ||
                    (t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == N8 &&
                     t->size(1) == G && t->size(2) == 8),
                "scales8 and mins8 must be the float32 [ceil(N / 8), K / group, 8] of int8g_pack_rows8");
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const QuantizedX xq(x, group);
  const int8_t* xqp = xq.q.data_ptr<int8_t>();
  const float* xdp = xq.d.data_ptr<float>();
  const float* xsp = xq.sums.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scales8.data_ptr<float>();
  const float* mp = mins8.numel() ? mins8.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const bool half = group == 16;
  const int64_t bytes = (K / 4) * 32;  // one packed block
  // the 8-row tiles over block nb, rows m .. m + R of x
  auto narrow = [&](auto rows, int64_t nb, int64_t m) {
    constexpr int R = decltype(rows)::value;
    const int8_t* w = wp + nb * bytes;
    const float* s8 = sp + nb * G * 8;
    const float* m8 = mp != nullptr ? mp + nb * G * 8 : nullptr;
    const int64_t cols = std::min<int64_t>(8, N - nb * 8);
    const int8_t* xr = xqp + m * K;
    const float* dr = xdp + m * C;
    const float* sr = xsp + m * G;
    float* out = yp + m * N + nb * 8;
#if defined(__AVX2__) && defined(__FMA__)
    if (half)
      q8g_gemm_tile<R, true>(xr, dr, sr, K, G, w, s8, m8, out, N, cols);
    else
      q8g_gemm_tile<R, false>(xr, dr, sr, K, G, w, s8, m8, out, N, cols);
#else
    for (int r = 0; r < R; ++r)
      q8g_gemm_row_generic(xr + r * K, dr + r * C, sr + r * G, K, G, half, w, s8, m8, out + r * N, cols);
#endif
  };
#if defined(HASTEN_Q8_TILE2)
  if (takes_wide_tiles(M)) {
    // x's integer sums per run (group 16: per half, the 4-byte steps j with j & 2 clear or set)
    const int64_t NH = half ? 2 : 1;
    std::vector<int32_t> xsum(M * C * NH, 0);
    for (int64_t i = 0; i < M * C; ++i)
      for (int64_t p = 0; p < kChunk; ++p) xsum[i * NH + (half && (p & 8) ? 1 : 0)] += xqp[i * kChunk + p];
    over_block_pairs(N8, M, bytes, [&](auto rows, int64_t nb, int64_t m, int64_t ahead) {
      constexpr int R = decltype(rows)::value;
      const int8_t* w0 = wp + nb * bytes;
      const float* m0 = mp != nullptr ? mp + nb * G * 8 : nullptr;
      const float* m1 = mp != nullptr ? mp + (nb + 1) * G * 8 : nullptr;
      const int64_t cols1 = std::min<int64_t>(8, N - nb * 8 - 8);
      if (half)
        q8g_gemm_tile16<R, true>(xqp + m * K, xdp + m * C, xsp + m * G, xsum.data() + m * C * NH, K, G, w0, w0 + bytes,
                                 sp + nb * G * 8, sp + (nb + 1) * G * 8, m0, m1, yp + m * N + nb * 8, N, cols1, ahead);
      else
        q8g_gemm_tile16<R, false>(xqp + m * K, xdp + m * C, xsp + m * G, xsum.data() + m * C * NH, K, G, w0, w0 + bytes,
                                  sp + nb * G * 8, sp + (nb + 1) * G * 8, m0, m1, yp + m * N + nb * 8, N, cols1, ahead);
    }, narrow);
    return y;
  }
#endif
  over_blocks8(N8, M, K, narrow);
  return y;
}
