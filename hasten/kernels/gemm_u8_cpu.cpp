// The wide int8 GEMM (u8_linear_q8_gemm): prefill chunks and wide decode batches of a quantized
// layer, over a second copy of its weight rounded to 8 bits per row.
//
// Each weight row n is stored as unsigned codes u (0..255) with a float step s[n] and offset o[n]:
// w ~ s[n] * u + o[n] (the row's minimum and (max - min) / 255; for GGUF blocks the codes come from
// the dequantized block values). x is rounded per 32 k as for the other int8-activation kernels
// (quantize_x_q8: int8 q with scale d per 32-run, in run order; x_runs > 1 lets up to that many
// consecutive 32-runs share one scale, so that their integer sums are converted to float once). Then
//     y[m][n] = s[n] * sum_runs d[m][run] * (sum over the run of u * q) + o[n] * sum_k d[m][run of k] q[m][k]
// The integer run sums are u8 x s8 VNNI multiply-adds with the weight codes in the lanes, 16 rows per
// 512-bit register; unlike the int4 tiles (quant_gemm_q8_cpu.cpp) there is no nibble unpacking and no
// per-run weight scale or min, so per run and row of x only one conversion and one multiply-add
// remain besides the integer work. With pow2 x scales (every d a power of two, quantize_x_q8's pow2)
// that multiply-add becomes an exponent shift and an add (vscalefps, vaddps): on Zen 4 the VNNI
// multiply-adds share their issue slots with the float multiplies and FMAs but not with the conversion,
// scalef and add (benchmarks/vnni_ports.py: 12 vpdpbusd keep 0.80 of their rate beside 3 FMAs, the full
// rate beside 3 or 6 scalef, cvt or add), so the epilogue no longer takes VNNI issue slots. The product of an
// integer and a power of two is exact, so the result is the same as the multiply-add's.
//
// u8_linear_q8_gemm_silu is the gate_up form of the same product (the C++ layer loop's switch
// quant_u8_gemm_silu): each tile pairs a block of 16 gate rows with the matching up block and writes
// silu(gate) * up of their outputs, so the [M, 2 I] output is never written and read back.
//
// Layout: packed uint8 [N16, K / 4, 16, 4]: byte (nb, kb, r, j) is row 16 nb + r's code at run-order
// position 4 kb + j (rows past N are zero, with step and offset 0). One 64-byte load is 4 positions of
// 16 rows.
#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_math.h"
#include "int4_common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define HASTEN_U8_GEMM 1
#endif

using namespace hasten_int4;

namespace {

constexpr int64_t kRows = 16;  // weight rows per packed block

// k of run-order position p (quantize_x_q8's order: per 32-run the even k, then the odd ones)
inline int64_t k_of_position(int64_t p) {
  const int64_t c = p / kChunk, i = p % kChunk;
  return c * kChunk + (i < kChunk / 2 ? 2 * i : 2 * (i - kChunk / 2) + 1);
}

#if defined(HASTEN_U8_GEMM)
inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

// MR rows of x against NW packed blocks (16 NW weight rows). xd: the scale per row and 32-run of x, or
// with Pow2 its base-2 exponent. xtot: each row's sum of x. ahead: the bytes from these blocks to the
// next ones a thread takes, for the first tile of a panel to prefetch them into L2 (else 0): 30
// SmolLM2 layers of weights from memory, 16 rows of x, 9.8 -> 8.3 ms.
// pair: the blocks from one of the tile's blocks to the next (1; with Silu, gate's block to up's: I / 16),
// and Silu: out gets silu(gate) * up of the two blocks' outputs (silu_mul_fast16) instead of both.
template <int MR, int NW, bool Pow2, bool Silu = false>
inline void u8_tile(const int8_t* xq, const float* xd, const float* xtot, int64_t K, int64_t share, const uint8_t* w,
                    int64_t block_bytes, int64_t pair, const float* step, const float* offset, float* out, int64_t ldo,
                    int64_t cols, int64_t ahead) {
  static_assert(!Silu || NW == 2, "a SiLU tile is one gate block and its up block");
  const int64_t C = K / kChunk;
  __m512 acc[MR][NW];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NW; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; c += share) {  // `share` 32-runs of one scale of x: one integer sum
    __m512i run[MR][NW];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NW; ++j) run[r][j] = _mm512_setzero_si512();
    for (int64_t kb = 8 * c; kb < 8 * (c + share); ++kb) {
      __m512i wv[NW];
      for (int j = 0; j < NW; ++j) {
        if (ahead) __builtin_prefetch(w + ahead + j * pair * block_bytes + kb * 64, 0, 2);
        wv[j] = _mm512_loadu_si512(w + j * pair * block_bytes + kb * 64);
      }
      for (int r = 0; r < MR; ++r) {
        const __m512i xb = broadcast4(xq + r * K + kb * 4);
        for (int j = 0; j < NW; ++j) run[r][j] = _mm512_dpbusd_epi32(run[r][j], wv[j], xb);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 d = _mm512_set1_ps(xd[r * C + c]);
      for (int j = 0; j < NW; ++j) {
        if constexpr (Pow2) acc[r][j] = _mm512_add_ps(acc[r][j], _mm512_scalef_ps(_mm512_cvtepi32_ps(run[r][j]), d));
        else acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(run[r][j]), d, acc[r][j]);
      }
    }
  }
  if constexpr (Silu) {  // the same sums and multiply-adds as two outputs, then silu_mul's fast lanes
    const __m512 sg = _mm512_loadu_ps(step), og = _mm512_loadu_ps(offset);
    const __m512 su = _mm512_loadu_ps(step + pair * kRows), ou = _mm512_loadu_ps(offset + pair * kRows);
    for (int r = 0; r < MR; ++r) {
      const __m512 t = _mm512_set1_ps(xtot[r]);
      const __m512 gate = _mm512_fmadd_ps(acc[r][0], sg, _mm512_mul_ps(og, t));
      const __m512 up = _mm512_fmadd_ps(acc[r][1], su, _mm512_mul_ps(ou, t));
      _mm512_storeu_ps(out + r * ldo, hasten_attention::silu_mul_fast16(gate, up));
    }
    return;
  }
  for (int j = 0; j < NW; ++j) {
    const int64_t left = cols - j * kRows;
    if (left <= 0) break;
    const __mmask16 mask = left >= kRows ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
    const __m512 s = _mm512_loadu_ps(step + j * kRows), o = _mm512_loadu_ps(offset + j * kRows);
    for (int r = 0; r < MR; ++r)
      _mm512_mask_storeu_ps(out + r * ldo + j * kRows, mask,
                            _mm512_fmadd_ps(acc[r][j], s, _mm512_mul_ps(o, _mm512_set1_ps(xtot[r]))));
  }
}
#endif

// The runs of x per scale for K: the largest divisor of K / 32 up to x_runs.
inline int64_t runs_per_scale(int64_t K, int64_t x_runs) {
  const int64_t C = K / kChunk;
  for (int64_t share = std::min(C, x_runs); share > 1; --share)
    if (C % share == 0) return share;
  return 1;
}

// The same sums in plain C++: one x row against one packed block.
void u8_row_generic(const int8_t* xq, const float* xd, float xtot, int64_t K, const uint8_t* w, const float* step,
                    const float* offset, float* out, int64_t cols) {
  const int64_t C = K / kChunk;
  float acc[kRows] = {};
  for (int64_t c = 0; c < C; ++c) {
    int32_t run[kRows] = {};
    for (int64_t kb = 8 * c; kb < 8 * c + 8; ++kb)
      for (int64_t r = 0; r < kRows; ++r)
        for (int64_t j = 0; j < 4; ++j) run[r] += w[kb * 64 + r * 4 + j] * xq[kb * 4 + j];
    for (int64_t r = 0; r < kRows; ++r) acc[r] += static_cast<float>(run[r]) * xd[c];
  }
  for (int64_t r = 0; r < cols; ++r) out[r] = acc[r] * step[r] + offset[r] * xtot;
}

}  // namespace

bool u8_gemm_has_tiles() {
#if defined(HASTEN_U8_GEMM)
  return true;
#else
  return false;
#endif
}

std::vector<at::Tensor> u8_pack_rows16(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "weight must be contiguous float32 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1), N16 = (N + kRows - 1) / kRows;
  TORCH_CHECK(K > 0 && K % kChunk == 0, "K must be a positive multiple of 32, got ", K);
  auto packed = at::zeros({N16, K / 4, kRows, 4}, weight.options().dtype(at::kByte));
  auto step = at::zeros({N16 * kRows}, weight.options());
  auto offset = at::zeros({N16 * kRows}, weight.options());
  const float* wp = weight.data_ptr<float>();
  uint8_t* pp = packed.data_ptr<uint8_t>();
  float* sp = step.data_ptr<float>();
  float* op = offset.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* row = wp + n * K;
      const auto [lo_it, hi_it] = std::minmax_element(row, row + K);
      const float lo = *lo_it, s = (*hi_it - lo) / 255.0f;
      TORCH_CHECK(std::isfinite(lo) && std::isfinite(s), "weight row ", n, " is not finite");
      const float inv = s > 0.0f ? 1.0f / s : 0.0f;
      sp[n] = s;
      op[n] = lo;
      const int64_t nb = n / kRows, r = n % kRows;
      for (int64_t p = 0; p < K; ++p) {
        const float u = std::nearbyint((row[k_of_position(p)] - lo) * inv);
        pp[((nb * (K / 4) + p / 4) * kRows + r) * 4 + p % 4] = static_cast<uint8_t>(std::clamp(u, 0.0f, 255.0f));
      }
    }
  });
  return {packed, step, offset};
}

namespace {

// u8_linear_q8_gemm, or with silu its gate_up form (u8_linear_q8_gemm_silu)
at::Tensor u8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& step, const at::Tensor& offset,
                   int64_t N, int64_t x_runs, bool pow2_x_scales, bool silu) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N16 = (N + kRows - 1) / kRows, C = K / kChunk;
  TORCH_CHECK(K > 0 && K % kChunk == 0, "K must be a positive multiple of 32, got ", K);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(0) == N16 && packed.size(1) * 4 == K && packed.size(2) == kRows && packed.size(3) == 4,
              "packed must be the uint8 [ceil(N / 16), K / 4, 16, 4] of u8_pack_rows16");
  for (const auto* t : {&step, &offset})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 1 && t->size(0) == N16 * kRows,
                "step and offset must be the float32 [16 ceil(N / 16)] of u8_pack_rows16");
  TORCH_CHECK(!silu || N % (2 * kRows) == 0, "u8_linear_q8_gemm_silu: N = 2 I with I a multiple of 16, got N = ", N);
#if !defined(HASTEN_U8_GEMM)
  if (silu) return silu_mul(u8_gemm(x, packed, step, offset, N, x_runs, pow2_x_scales, false), true);
#endif
  const int64_t I = N / 2;
  auto y = at::empty({M, silu ? I : N}, x.options());
  if (M == 0 || N == 0) return y;
  TORCH_CHECK(x_runs >= 1 && x_runs <= 8, "x runs per scale must be 1 .. 8, got ", x_runs);
  const int64_t share = runs_per_scale(K, x_runs);
  const QuantizedX xq(x, kChunk, share, pow2_x_scales);
  const int8_t* xqp = xq.q.data_ptr<int8_t>();
  const float* xdp = xq.d.data_ptr<float>();
  // the sum of the ROUNDED x (quantize_x_q8's run sums): with it the offset term completes
  // sum_k xq * (step * u + offset), so the result is the rounded x times the 8-bit weight. The exact
  // float sum left x's rounding error times the offset (about the row's min, larger than most weights)
  // in every output: the GGUF's perplexity +3.0 % instead of +0.71 %.
  const float* run_sums = xq.sums.data_ptr<float>();
  std::vector<float> xtot(M);
  for (int64_t m = 0; m < M; ++m) {
    float s = 0.0f;
    for (int64_t c = 0; c < C; ++c) s += run_sums[m * C + c];
    xtot[m] = s;
  }
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = step.data_ptr<float>();
  const float* op = offset.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t bytes = (K / 4) * 64;  // one packed block
#if defined(HASTEN_U8_GEMM)
  std::vector<float> exponents;  // pow2: log2 of each scale, as vscalefps takes it (0 for a run of zeros)
  if (pow2_x_scales) {
    exponents.resize(M * C);
    for (int64_t i = 0; i < M * C; ++i) {  // a normal power of two: its biased exponent field less 127
      uint32_t bits;
      std::memcpy(&bits, xdp + i, sizeof(bits));
      exponents[i] = xdp[i] > 0.0f ? static_cast<float>(static_cast<int32_t>(bits >> 23) - 127) : 0.0f;
    }
    xdp = exponents.data();
  }
  constexpr int NW = 2;
  constexpr int64_t kPanel = 64;  // rows of x per panel: a panel stays in cache over a thread's blocks
  // a task: NW neighbouring blocks, or with silu gate's block t and up's block t + I / 16
  const int64_t tasks = silu ? I / kRows : (N16 + NW - 1) / NW, per_task = silu ? 1 : NW;
  const int64_t pair = silu ? I / kRows : 1, ldy = silu ? I : N;
  auto all_tiles = [&](auto pow2, auto with_silu) {  // the kinds as types: one tile instantiation per shape
    constexpr bool P = decltype(pow2)::value, S = decltype(with_silu)::value;
    at::parallel_for(0, tasks, 2, [&](int64_t begin, int64_t end) {
      for (int64_t m0 = 0; m0 < M; m0 += kPanel) {
        const int64_t m1 = std::min(M, m0 + kPanel);
        for (int64_t t = begin; t < end; ++t) {
          const int64_t nb = t * per_task, cols = std::min<int64_t>(NW * kRows, N - nb * kRows);
          const uint8_t* w = wp + nb * bytes;
          auto call = [&](auto rows, auto blocks, int64_t m) {
            constexpr int R = decltype(rows)::value, B = decltype(blocks)::value;
            u8_tile<R, B, P, S>(xqp + m * K, xdp + m * C, xtot.data() + m, K, share, w, bytes, pair, sp + nb * kRows,
                                op + nb * kRows, yp + m * ldy + nb * kRows, ldy, cols,
                                m == m0 && t + 1 < end ? per_task * bytes : 0);
          };
          for (int64_t m = m0; m < m1;) {
            const int64_t left = m1 - m;
            auto with_rows = [&](auto rows) {
              if constexpr (S) call(rows, std::integral_constant<int, 2>{}, m);
              else if (nb + 1 < N16) call(rows, std::integral_constant<int, 2>{}, m);
              else call(rows, std::integral_constant<int, 1>{}, m);
              m += decltype(rows)::value;
            };
            if (left >= 6) with_rows(std::integral_constant<int, 6>{});
            else if (left >= 4) with_rows(std::integral_constant<int, 4>{});
            else if (left >= 2) with_rows(std::integral_constant<int, 2>{});
            else with_rows(std::integral_constant<int, 1>{});
          }
        }
      }
    });
  };
  if (silu) {
    if (pow2_x_scales) all_tiles(std::true_type{}, std::true_type{});
    else all_tiles(std::false_type{}, std::true_type{});
  } else {
    if (pow2_x_scales) all_tiles(std::true_type{}, std::false_type{});
    else all_tiles(std::false_type{}, std::false_type{});
  }
#else
  at::parallel_for(0, N16, 4, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t m = 0; m < M; ++m)
        u8_row_generic(xqp + m * K, xdp + m * C, xtot[m], K, wp + nb * bytes, sp + nb * kRows, op + nb * kRows,
                       yp + m * N + nb * kRows, std::min<int64_t>(kRows, N - nb * kRows));
  });
#endif
  return y;
}

}  // namespace

at::Tensor u8_linear_q8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& step,
                             const at::Tensor& offset, int64_t N, int64_t x_runs, bool pow2_x_scales) {
  return u8_gemm(x, packed, step, offset, N, x_runs, pow2_x_scales, false);
}

// silu(gate) * up of y = [gate | up] = u8_linear_q8_gemm(x, ...) with N = 2 I: each tile runs a block of
// 16 gate rows and the matching up block and writes silu_mul_fast16 of their outputs, so the result is
// silu_mul(u8_linear_q8_gemm(x, ...), fast=true) bit for bit without the [M, 2 I] output
at::Tensor u8_linear_q8_gemm_silu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& step,
                                  const at::Tensor& offset, int64_t N, int64_t x_runs, bool pow2_x_scales) {
  return u8_gemm(x, packed, step, offset, N, x_runs, pow2_x_scales, true);
}
