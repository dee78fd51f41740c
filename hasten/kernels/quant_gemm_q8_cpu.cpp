// int8-activation GEMMs for 2+ rows of x (batched decode, prefill): int4 weights (GGUF Q4_0 / Q4_1,
// hasten-q8 layers) and int8 weights (GGUF Q8_0 rows), x quantized per 32 k to int8 by
// quantize_x_q8 (int4_common.h), as for int4_linear_q8.
//
// quantize_x_q8 stores each 32-run of x in "run order": position p < 16 holds k = 2p, position
// 16 + p holds k = 2p + 1 (the order of a run of int4 codes: low nibbles, then high ones). The
// packed weights below use the same positions, so x and w meet position by position.
#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#include "float_tiles.h"
#include "int4_common.h"
#include "quant_gemm_q8_loops.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

using namespace hasten_int4;

namespace {

// ---- int4 weights -------------------------------------------------------------------------------
// The weight is repacked once (int4_pack_rows8) so that 8 weight rows sit side by side: byte
// (nb, kb, r, j) of `packed` [N8, K / 8, 8, 4] holds row 8 nb + r's code at position 8 kb + j in its
// low nibble and at position 8 kb + 4 + j in its high one; scales and mins become float32
// [N8, G, 8]. One 32-byte load is then 4 consecutive positions of 8 weight rows (one row per 32-bit
// lane), and a u8 x s8 multiply-add against 4 bytes of x broadcast to every lane yields 8 output
// columns at once. Each 32-run's integer sums are scaled once (weight scale x activation scale),
// the min term uses the group sums of the rounded x.
// With AVX-VNNI / AVX512-VNNI one instruction does the u8 x s8 multiply-add into int32; plain
// AVX2 uses maddubs into int16 (a run's 8 partial sums stay below 8 * 2 * 15 * 127 < 2^15).

#if defined(__AVX2__) && defined(__FMA__)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HASTEN_Q8_VNNI 1
inline __m256i dot_u8s8(__m256i acc, __m256i w, __m256i x) { return _mm256_dpbusd_epi32(acc, w, x); }
#elif defined(__AVXVNNI__)
#define HASTEN_Q8_VNNI 1
inline __m256i dot_u8s8(__m256i acc, __m256i w, __m256i x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
#endif

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

// the first `cols` (<= 8) lanes of v to out
inline void store_cols(float* out, __m256 v, int64_t cols) {
  if (cols == 8) {
    _mm256_storeu_ps(out, v);
    return;
  }
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  std::copy(tmp, tmp + cols, out);
}

// MR rows of x (starting at xq, xd, xs) against the 8 weight rows of one packed block. ahead (> 0):
// how many blocks further on this thread's next weights lie, for the tile to request their codes (one
// 64-byte line per two k-steps), scales and mins while it computes; 0 in tiles whose block is cached.
// Without it a call of one row (batch-1 decode) waits on memory: SmolLM2's 30 layers of int4
// projections from memory on one Zen 3 core, 7.3 -> 5.7-6.0 ms with the blocks two ahead.
template <int MR>
inline void q8_gemm_tile(const int8_t* xq, const float* xd, const float* xs, int64_t K, int64_t G, int64_t per_group,
                         const uint8_t* w, const float* s8, const float* m8, float* out, int64_t ldo, int64_t cols,
                         int64_t ahead = 0) {
  const int64_t C = K / kChunk;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const uint8_t* next = w + ahead * K * 4;  // a block is K / 8 steps of 32 bytes
  if (ahead)
    for (int64_t i = 0; i < G * 8; i += 16) {  // 16 floats per line
      __builtin_prefetch(s8 + ahead * G * 8 + i);
      __builtin_prefetch(m8 + ahead * G * 8 + i);
    }
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    __m256i run[MR];
    for (int r = 0; r < MR; ++r) run[r] = _mm256_setzero_si256();
    if (ahead) {
      __builtin_prefetch(next + c * 128);
      __builtin_prefetch(next + c * 128 + 64);
    }
    for (int64_t kb = 4 * c; kb < 4 * c + 4; ++kb) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kb * 32));
      const __m256i lo = _mm256_and_si256(v, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      for (int r = 0; r < MR; ++r) {
        const int8_t* xr = xq + r * K + kb * 8;
#if defined(HASTEN_Q8_VNNI)
        run[r] = dot_u8s8(dot_u8s8(run[r], lo, broadcast4(xr)), hi, broadcast4(xr + 4));
#else
        run[r] = _mm256_add_epi16(run[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(xr)),
                                                           _mm256_maddubs_epi16(hi, broadcast4(xr + 4))));
#endif
      }
    }
    const __m256 sv = _mm256_loadu_ps(s8 + (per_group == 1 ? c : c / per_group) * 8);
    for (int r = 0; r < MR; ++r) {
#if defined(HASTEN_Q8_VNNI)
      const __m256i sums = run[r];
#else
      const __m256i sums = _mm256_madd_epi16(run[r], _mm256_set1_epi16(1));
#endif
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(sv, _mm256_set1_ps(xd[r * C + c])), acc[r]);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const __m256 mv = _mm256_loadu_ps(m8 + g * 8);
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[r * G + g]), acc[r]);
  }
  for (int r = 0; r < MR; ++r) store_cols(out + r * ldo, acc[r], cols);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// AVX-512: MR (<= 8) rows of x against TWO packed blocks at once, as one 512-bit register of 16 weight
// rows (w1: the second block's bytes). One u8 x s8 instruction then does 64 multiply-adds, each
// broadcast of x feeds 16 weight rows, and the MR integer sums are independent chains (the 8-row tile
// above keeps MR <= 4 chains of dependent multiply-adds, too few to hide their latency: it reached
// about half of the VNNI peak on prefill-sized M).
inline __m512i load_pair(const uint8_t* w0, const uint8_t* w1) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1)), 1);
}
inline __m512 load_pair_ps(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}
// One 64-byte line of each block of the NEXT pair into L2, while the first tile of x passes over this
// pair (`ahead`: the bytes from this pair to the next; 0 in later tiles, whose weights are cached).
// With the weights coming from memory this took a 16-row decode batch over SmolLM2's 30 layers of
// int4 projections from ~9.9 to ~8.7 ms (into L1 instead it was slower than no prefetch at all).
inline void prefetch_pair_line(const void* a, const void* b) {
  __builtin_prefetch(a, 0, 2);
  __builtin_prefetch(b, 0, 2);
}
inline __m512i broadcast4_512(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

template <int MR>
inline void q8_gemm_tile16(const int8_t* xq, const float* xd, const float* xs, int64_t K, int64_t G, int64_t per_group,
                           const uint8_t* w0, const uint8_t* w1, const float* s0, const float* s1, const float* m0,
                           const float* m1, float* out, int64_t ldo, int64_t cols1, int64_t ahead) {
  const int64_t C = K / kChunk;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    __m512i run[MR];
    for (int r = 0; r < MR; ++r) run[r] = _mm512_setzero_si512();
    for (int64_t kb = 4 * c; kb < 4 * c + 4; ++kb) {
      if (ahead && (kb & 1) == 0) prefetch_pair_line(w0 + ahead + kb * 32, w1 + ahead + kb * 32);
      const __m512i v = load_pair(w0 + kb * 32, w1 + kb * 32);
      const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      for (int r = 0; r < MR; ++r) {
        const int8_t* xr = xq + r * K + kb * 8;
        run[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(run[r], lo, broadcast4_512(xr)), hi, broadcast4_512(xr + 4));
      }
    }
    const int64_t g = per_group == 1 ? c : c / per_group;  // a GGUF's group 32: no division per run
    const __m512 sv = load_pair_ps(s0 + g * 8, s1 + g * 8);
    for (int r = 0; r < MR; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(run[r]), _mm512_mul_ps(sv, _mm512_set1_ps(xd[r * C + c])), acc[r]);
  }
  for (int64_t g = 0; g < G; ++g) {
    const __m512 mv = load_pair_ps(m0 + g * 8, m1 + g * 8);
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * G + g]), acc[r]);
  }
  const __mmask16 tail = static_cast<__mmask16>((1u << (8 + cols1)) - 1u);
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + r * ldo, tail, acc[r]);
}
#define HASTEN_Q8_TILE2 1
#endif
#endif

// The same sums in plain C++ (no AVX2): one x row against one packed block.
void q8_gemm_row_generic(const int8_t* xq, const float* xd, const float* xs, int64_t K, int64_t G, int64_t per_group,
                         const uint8_t* w, const float* s8, const float* m8, float* out, int64_t cols) {
  const int64_t C = K / kChunk;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t c = 0; c < C; ++c) {
    int32_t run[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t kb = 4 * c; kb < 4 * c + 4; ++kb)
      for (int r = 0; r < 8; ++r)
        for (int j = 0; j < 4; ++j) {
          const uint8_t b = w[kb * 32 + r * 4 + j];
          run[r] += (b & 0x0F) * xq[kb * 8 + j] + (b >> 4) * xq[kb * 8 + 4 + j];
        }
    for (int r = 0; r < 8; ++r) acc[r] += static_cast<float>(run[r]) * (s8[(c / per_group) * 8 + r] * xd[c]);
  }
  for (int64_t g = 0; g < G; ++g)
    for (int r = 0; r < 8; ++r) acc[r] += m8[g * 8 + r] * xs[g];
  std::copy(acc, acc + cols, out);
}

}  // namespace

void set_q8_gemm_x_panel(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "x panel bytes must be >= 0 (0: off), got ", bytes);
  g_x_panel_bytes.store(bytes, std::memory_order_relaxed);
}

void set_q8_gemm_wide_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, "wide rows must be >= 0 (0: off), got ", rows);
  g_wide_rows.store(rows, std::memory_order_relaxed);
}

bool q8_gemm_has_wide_tiles() {
#if defined(HASTEN_Q8_TILE2)
  return true;
#else
  return false;
#endif
}

bool q8_gemm_has_vnni() {
#if defined(HASTEN_Q8_VNNI)
  return true;
#else
  return false;
#endif
}

std::vector<at::Tensor> int4_pack_rows8(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                                        int64_t group) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "codes must be contiguous uint8 [N, K / 2]");
  const int64_t N = codes.size(0), K = codes.size(1) * 2;
  TORCH_CHECK(group > 0 && group % kChunk == 0 && K % group == 0, "group size must be a multiple of 32 dividing K");
  const int64_t G = K / group, N8 = (N + 7) / 8;
  for (const auto* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == G,
                "scales and mins must be contiguous float16 [N, K / group]");
  auto packed = at::zeros({N8, K / 8, 8, 4}, codes.options());
  auto s8 = at::zeros({N8, G, 8}, scales.options().dtype(at::kFloat));
  auto m8 = at::zeros({N8, G, 8}, scales.options().dtype(at::kFloat));
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  uint8_t* pp = packed.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* mp = mins.data_ptr<at::Half>();
  float* s8p = s8.data_ptr<float>();
  float* m8p = m8.data_ptr<float>();
  auto code = [&](int64_t n, int64_t pos) -> uint8_t {  // the code at run-order position pos
    const int64_t p = pos % kChunk;
    const uint8_t b = cp[n * (K / 2) + (pos - p) / 2 + p % 16];
    return p < 16 ? b & 0x0F : b >> 4;
  };
  for (int64_t n = 0; n < N; ++n) {
    const int64_t nb = n / 8, r = n % 8;
    for (int64_t kb = 0; kb < K / 8; ++kb)
      for (int64_t j = 0; j < 4; ++j)
        pp[((nb * (K / 8) + kb) * 8 + r) * 4 + j] =
            static_cast<uint8_t>(code(n, 8 * kb + j) | (code(n, 8 * kb + 4 + j) << 4));
    for (int64_t g = 0; g < G; ++g) {
      s8p[(nb * G + g) * 8 + r] = half_to_float(sp[n * G + g]);
      m8p[(nb * G + g) * 8 + r] = half_to_float(mp[n * G + g]);
    }
  }
  return {packed, s8, m8};
}

#include "quant_gemm_q8_silu.h"  // the gate_up form: int4_linear_q8_gemm_silu

// int4_linear_q8_gemm, or with silu its gate_up form int4_linear_q8_gemm_silu ([M, N / 2])
static at::Tensor int4_q8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales8,
                               const at::Tensor& mins8, int64_t group, int64_t N, bool silu) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N8 = (N + 7) / 8;
  TORCH_CHECK(group > 0 && group % kChunk == 0 && K % group == 0, "group size must be a multiple of 32 dividing K");
  const int64_t G = K / group, C = K / kChunk, per_group = group / kChunk;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(0) == N8 && packed.size(1) * 8 == K && packed.size(2) == 8 && packed.size(3) == 4,
              "packed must be the uint8 [ceil(N / 8), K / 8, 8, 4] of int4_pack_rows8");
  for (const auto* t : {&scales8, &mins8})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == N8 &&
                    t->size(1) == G && t->size(2) == 8,
                "scales8 and mins8 must be the float32 [ceil(N / 8), K / group, 8] of int4_pack_rows8");
  TORCH_CHECK(!silu || N % 16 == 0, "int4_linear_q8_gemm_silu: N = 2 I with I a multiple of 8, got N = ", N);
  if (silu && !int4_silu_from_tiles(M)) return silu_mul(int4_q8_gemm(x, packed, scales8, mins8, group, N, false), true);
  auto y = at::empty({M, silu ? N / 2 : N}, x.options());
  if (M == 0 || N == 0) return y;
  const QuantizedX xq(x, group);
  const int8_t* xqp = xq.q.data_ptr<int8_t>();
  const float* xdp = xq.d.data_ptr<float>();
  const float* xsp = xq.sums.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales8.data_ptr<float>();
  const float* mp = mins8.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#if defined(__AVX2__) && defined(__FMA__)
  if (silu) {
    int4_silu_tiles(M, N / 2, K, G, per_group, xqp, xdp, xsp, wp, sp, mp, yp);
    return y;
  }
#endif
  const int64_t bytes = (K / 8) * 32;  // one packed block
  // the 8-row tiles over block nb, rows m .. m + R of x
  auto narrow = [&](auto rows, int64_t nb, int64_t m) {
    constexpr int R = decltype(rows)::value;
    const uint8_t* w = wp + nb * bytes;
    const float* s8 = sp + nb * G * 8;
    const float* m8 = mp + nb * G * 8;
    const int64_t cols = std::min<int64_t>(8, N - nb * 8);
    const int8_t* xr = xqp + m * K;
    const float* dr = xdp + m * C;
    const float* sr = xsp + m * G;
    float* out = yp + m * N + nb * 8;
#if defined(__AVX2__) && defined(__FMA__)
    q8_gemm_tile<R>(xr, dr, sr, K, G, per_group, w, s8, m8, out, N, cols, m == 0 && nb + kAheadBlocks < N8 ? kAheadBlocks : 0);
#else
    for (int r = 0; r < R; ++r)
      q8_gemm_row_generic(xr + r * K, dr + r * C, sr + r * G, K, G, per_group, w, s8, m8, out + r * N, cols);
#endif
  };
#if defined(HASTEN_Q8_TILE2)
  if (takes_wide_tiles(M)) {
    over_block_pairs(N8, M, bytes, [&](auto rows, int64_t nb, int64_t m, int64_t ahead) {
      constexpr int R = decltype(rows)::value;
      q8_gemm_tile16<R>(xqp + m * K, xdp + m * C, xsp + m * G, K, G, per_group, wp + nb * bytes, wp + (nb + 1) * bytes,
                        sp + nb * G * 8, sp + (nb + 1) * G * 8, mp + nb * G * 8, mp + (nb + 1) * G * 8,
                        yp + m * N + nb * 8, N, std::min<int64_t>(8, N - nb * 8 - 8), ahead);
    }, narrow);
    return y;
  }
#endif
  over_blocks8(N8, M, K, narrow);
  return y;
}

at::Tensor int4_linear_q8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales8,
                               const at::Tensor& mins8, int64_t group, int64_t N) {
  return int4_q8_gemm(x, packed, scales8, mins8, group, N, false);
}

at::Tensor int4_linear_q8_gemm_silu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales8,
                                    const at::Tensor& mins8, int64_t group, int64_t N) {
  return int4_q8_gemm(x, packed, scales8, mins8, group, N, true);
}

// ---- int8 weights (per-row scale) ---------------------------------------------------------------
// Packed as int4 above but one byte per value: byte (nb, kb, r, j) of [N8, K / 4, 8, 4] is row
// 8 nb + r's value at run-order position 4 kb + j. y[m][n] = scale[n] * sum_runs d[m][run] * (integer run sum). VNNI
// multiplies unsigned by signed bytes, so the weight goes in as w + 128 and 128 * (x's run sum) comes
// off again; plain AVX2 multiplies |w| by x carrying w's sign (pairs below 2 * 128 * 127 < 2^15).

namespace {

#if defined(__AVX2__) && defined(__FMA__)
template <int MR>
inline void q8_gemm_tile_int8(const int8_t* xq, const float* xd, const int32_t* xsum, int64_t K, const int8_t* w,
                              const float* scales, float* out, int64_t ldo, int64_t cols) {
  const int64_t C = K / kChunk;
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    __m256i run[MR];
    for (int r = 0; r < MR; ++r) run[r] = _mm256_setzero_si256();
    for (int64_t kb = 8 * c; kb < 8 * c + 8; ++kb) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kb * 32));
#if defined(HASTEN_Q8_VNNI)
      const __m256i u = _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80)));  // w + 128
      for (int r = 0; r < MR; ++r) run[r] = dot_u8s8(run[r], u, broadcast4(xq + r * K + kb * 4));
#else
      const __m256i a = _mm256_abs_epi8(v);
      for (int r = 0; r < MR; ++r) {
        const __m256i xs = _mm256_sign_epi8(broadcast4(xq + r * K + kb * 4), v);
        run[r] = _mm256_add_epi32(run[r], _mm256_madd_epi16(_mm256_maddubs_epi16(a, xs), _mm256_set1_epi16(1)));
      }
#endif
    }
    for (int r = 0; r < MR; ++r) {
#if defined(HASTEN_Q8_VNNI)
      const __m256i sums = _mm256_sub_epi32(run[r], _mm256_set1_epi32(128 * xsum[r * C + c]));
#else
      const __m256i sums = run[r];
#endif
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(xd[r * C + c]), acc[r]);
    }
  }
  const __m256 sv = _mm256_loadu_ps(scales);
  for (int r = 0; r < MR; ++r) store_cols(out + r * ldo, _mm256_mul_ps(acc[r], sv), cols);
}
#endif

#if defined(HASTEN_Q8_TILE2)
// The int8 tile above over two packed blocks at once (16 weight rows per 512-bit register), up to 8
// rows of x: as q8_gemm_tile16 for int4 weights.
template <int MR>
inline void q8_gemm_tile16_int8(const int8_t* xq, const float* xd, const int32_t* xsum, int64_t K, const int8_t* w0,
                                const int8_t* w1, const float* s0, const float* s1, float* out, int64_t ldo,
                                int64_t cols1, int64_t ahead) {
  const int64_t C = K / kChunk;
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    __m512i run[MR];
    for (int r = 0; r < MR; ++r) run[r] = _mm512_setzero_si512();
    for (int64_t kb = 8 * c; kb < 8 * c + 8; ++kb) {
      if (ahead && (kb & 1) == 0) prefetch_pair_line(w0 + ahead + kb * 32, w1 + ahead + kb * 32);
      const __m512i u = _mm512_xor_si512(load_pair(reinterpret_cast<const uint8_t*>(w0 + kb * 32),
                                                   reinterpret_cast<const uint8_t*>(w1 + kb * 32)), bias);  // w + 128
      for (int r = 0; r < MR; ++r) run[r] = _mm512_dpbusd_epi32(run[r], u, broadcast4_512(xq + r * K + kb * 4));
    }
    for (int r = 0; r < MR; ++r) {
      const __m512i sums = _mm512_sub_epi32(run[r], _mm512_set1_epi32(128 * xsum[r * C + c]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(xd[r * C + c]), acc[r]);
    }
  }
  const __m512 sv = load_pair_ps(s0, s1);
  const __mmask16 tail = static_cast<__mmask16>((1u << (8 + cols1)) - 1u);
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + r * ldo, tail, _mm512_mul_ps(acc[r], sv));
}
#endif

void q8_gemm_row_int8_generic(const int8_t* xq, const float* xd, int64_t K, const int8_t* w, const float* scales,
                              float* out, int64_t cols) {
  const int64_t C = K / kChunk;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t c = 0; c < C; ++c) {
    int32_t run[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t kb = 8 * c; kb < 8 * c + 8; ++kb)
      for (int r = 0; r < 8; ++r)
        for (int j = 0; j < 4; ++j) run[r] += w[kb * 32 + r * 4 + j] * xq[kb * 4 + j];
    for (int r = 0; r < 8; ++r) acc[r] += static_cast<float>(run[r]) * xd[c];
  }
  for (int64_t r = 0; r < cols; ++r) out[r] = acc[r] * scales[r];
}

// int8 [N, K] -> [ceil(N / 8), K / 4, 8, 4]: byte (nb, kb, r, j) is row 8 nb + r's value at run-order
// position 4 kb + j (rows past N are zero)
at::Tensor pack_int8_rows8(const at::Tensor& qweight) {
  const int64_t N = qweight.size(0), K = qweight.size(1), N8 = (N + 7) / 8;
  auto packed = at::zeros({N8, K / 4, 8, 4}, qweight.options());
  const int8_t* qp = qweight.data_ptr<int8_t>();
  int8_t* pp = packed.data_ptr<int8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t nb = n / 8, r = n % 8;
    for (int64_t pos = 0; pos < K; ++pos) {
      const int64_t p = pos % kChunk, k = pos - p + (p < 16 ? 2 * p : 2 * (p - 16) + 1);
      pp[((nb * (K / 4) + pos / 4) * 8 + r) * 4 + pos % 4] = qp[n * K + k];
    }
  }
  return packed;
}

}  // namespace

std::vector<at::Tensor> int8_pack_rows8(const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "qweight must be contiguous int8 [N, K]");
  const int64_t N = qweight.size(0), K = qweight.size(1), N8 = (N + 7) / 8;
  TORCH_CHECK(K % kChunk == 0, "K must be a multiple of 32, got ", K);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
              "scales must be contiguous float32 [N]");
  auto packed = pack_int8_rows8(qweight);
  auto s8 = at::zeros({N8 * 8}, scales.options());
  std::memcpy(s8.data_ptr<float>(), scales.data_ptr<float>(), N * sizeof(float));
  return {packed, s8};
}

at::Tensor int8_linear_q8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales8, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N8 = (N + 7) / 8, C = K / kChunk;
  TORCH_CHECK(K % kChunk == 0, "K must be a multiple of 32, got ", K);
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(0) == N8 && packed.size(1) * 4 == K && packed.size(2) == 8 && packed.size(3) == 4,
              "packed must be the int8 [ceil(N / 8), K / 4, 8, 4] of int8_pack_rows8");
  TORCH_CHECK(scales8.scalar_type() == at::kFloat && scales8.is_contiguous() && scales8.numel() == N8 * 8,
              "scales8 must be the float32 [ceil(N / 8) * 8] of int8_pack_rows8");
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const QuantizedX xq(x, K);  // one group: the sums are not needed (no min term)
  std::vector<int32_t> xsum(M * C);  // integer sum of each int8 run of x
  const int8_t* xqp = xq.q.data_ptr<int8_t>();
  for (int64_t i = 0; i < M * C; ++i) {
    int32_t s = 0;
    for (int64_t j = 0; j < kChunk; ++j) s += xqp[i * kChunk + j];
    xsum[i] = s;
  }
  const float* xdp = xq.d.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scales8.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t bytes = (K / 4) * 32;  // one packed block
  // the 8-row tiles over block nb, rows m .. m + R of x
  auto narrow = [&](auto rows, int64_t nb, int64_t m) {
    constexpr int R = decltype(rows)::value;
    const int8_t* w = wp + nb * bytes;
    const float* s8 = sp + nb * 8;
    const int64_t cols = std::min<int64_t>(8, N - nb * 8);
    const int8_t* xr = xqp + m * K;
    const float* dr = xdp + m * C;
    float* out = yp + m * N + nb * 8;
#if defined(__AVX2__) && defined(__FMA__)
    q8_gemm_tile_int8<R>(xr, dr, xsum.data() + m * C, K, w, s8, out, N, cols);
#else
    for (int r = 0; r < R; ++r) q8_gemm_row_int8_generic(xr + r * K, dr + r * C, K, w, s8, out + r * N, cols);
#endif
  };
#if defined(HASTEN_Q8_TILE2)
  if (takes_wide_tiles(M)) {
    over_block_pairs(N8, M, bytes, [&](auto rows, int64_t nb, int64_t m, int64_t ahead) {
      constexpr int R = decltype(rows)::value;
      q8_gemm_tile16_int8<R>(xqp + m * K, xdp + m * C, xsum.data() + m * C, K, wp + nb * bytes, wp + (nb + 1) * bytes,
                             sp + nb * 8, sp + nb * 8 + 8, yp + m * N + nb * 8, N, std::min<int64_t>(8, N - nb * 8 - 8),
                             ahead);
    }, narrow);
    return y;
  }
#endif
  over_blocks8(N8, M, K, narrow);
  return y;
}

#include "quant_gemm_q8_grouped.h"  // grouped int8 weights (GGUF Q5 / Q6_K / Q8_0)
