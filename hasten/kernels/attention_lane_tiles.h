// Prefill attention with the query rows in the vector lanes (attention_lane_tiles in hasten.config):
// a tile of query tokens of one sequence against every key it may see, 8 query rows per 256-bit
// register. Included by paged_attention_cpu.cpp (after attention_math.h), AVX2 + FMA builds.
//
// update_rows_avx2 (attention_math.h) puts d in the lanes: each score is a dot product finished by
// horizontal adds, each cache value is converted to float once per token that reads it, and each
// block costs every row a running max, an exp and a rescale of its D accumulators on its own. Here a
// tile's R = tokens x G rows are transposed once (qt: [D][RP], RP = R rounded up to 8) and each block of
// keys is widened to float32 once for the whole tile (int8 codes times their row's scale). Then
//   scores  st[j][r] = sum_d qt[d][r] * k[j][d]        one broadcast of k[j][d] feeds 8 rows per FMA
//   softmax per key j, elementwise over the rows        (no horizontal operation anywhere)
//   P V     acct[d][r] += st[j][r] * v[j][d]            one broadcast of v[j][d] feeds 8 rows per FMA
// so that, apart from the widening and the exps, the work is fused multiply-adds with one operand
// from a register and one broadcast from L1. acct is transposed back into the caller's rows at the end.
// The sums run in another order than update_rows_avx2's, so results differ from it in the last bits.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace hasten_attention {

#if defined(__AVX2__) && defined(__FMA__)
#define HASTEN_LANE_TILES 1

constexpr int64_t kLaneMaxRows = 64;  // query rows of one tile (tokens x G), at most
constexpr int64_t kLaneMaxD = 256;     // head_dim, at most
constexpr int64_t kLaneKeys = 64;      // keys per online-softmax step (rounded to whole cache blocks)

// Tokens per tile for G query rows per token: as many as fit kLaneMaxRows, fewer if that makes the rows a
// multiple of 16 (the kernels take row vectors in pairs; 16 tokens of 3 rows, not 21 of 3); 0 if G is too large.
inline int64_t lane_tile_tokens(int64_t G) {
  const int64_t most = kLaneMaxRows / G;
  for (int64_t t = most; t >= 1; --t)
    if (t * G % 16 == 0) return t;
  return most;
}

// whether queries of type Q over a cache of type C take the tiles: the cache types they widen, in a
// dtype other than the queries' own (a cache in q's dtype, float32 above all, keeps update_rows' exact
// order of sums)
template <typename Q, typename C>
constexpr bool lane_tiles_take() {
  return !std::is_same_v<C, Q> &&
         (std::is_same_v<C, int8_t> || std::is_same_v<C, at::Half> || std::is_same_v<C, at::BFloat16>);
}

// Per-thread buffers of the lane tiles (grown on demand, reused by every item of the thread).
struct LaneScratch {
  std::vector<float> qt, acct, st, kf, vf, pos, m, l;
  void fit(int64_t rp, int64_t D, int64_t bs) {
    if (static_cast<int64_t>(qt.size()) < rp * D) {
      qt.resize(rp * D);
      acct.resize(rp * D);
    }
    if (static_cast<int64_t>(st.size()) < rp * bs) st.resize(rp * bs);
    if (static_cast<int64_t>(kf.size()) < bs * D) {
      kf.resize(bs * D);
      vf.resize(bs * D);
    }
    if (static_cast<int64_t>(pos.size()) < rp) {
      pos.resize(rp);
      m.resize(rp);
      l.resize(rp);
    }
  }
};

// The 8 x 8 floats at src[r] + c (r, c < 8) into dst[c][r] (dst rows `ld` floats apart).
inline void transpose8(const float* const* src, float* dst, int64_t ld) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src[i]);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// n cache rows (`stride` elements apart) as float32 rows of D: int8 codes times their row's scale.
template <typename C>
inline void widen_rows(const C* src, int64_t stride, int64_t n, int64_t D, float* dst) {
  for (int64_t j = 0; j < n; ++j) {
    const C* row = src + j * stride;
    float* out = dst + j * D;
    if constexpr (std::is_same_v<C, int8_t>) {
      const __m256 scale = _mm256_set1_ps(int8_row_scale(row, D));
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + d, _mm256_mul_ps(load8(row + d), scale));
    } else {
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + d, load8(row + d));
    }
  }
}

// x and y held in registers: left to itself GCC folds their load into each of the four multiply-adds
// that use them, 12 loads per 8 multiply-adds instead of 6
inline void in_register(__m256& x, __m256& y) { __asm__("" : "+x"(x), "+x"(y)); }

// a += x * k and, with two row vectors, b += y * k
template <int NV>
__attribute__((always_inline)) inline void fma_rows(__m256 x, __m256 y, __m256 k, __m256& a, __m256& b) {
  a = _mm256_fmadd_ps(x, k, a);
  if constexpr (NV == 2) b = _mm256_fmadd_ps(y, k, b);
}

// a0..a3 to p, p + ld, p + 2 ld, p + 3 ld and, with two row vectors, b0..b3 8 floats after each
template <int NV>
__attribute__((always_inline)) inline void store_rows(float* p, int64_t ld, __m256 a0, __m256 a1, __m256 a2, __m256 a3,
                                                      __m256 b0, __m256 b1, __m256 b2, __m256 b3) {
  _mm256_storeu_ps(p, a0);
  _mm256_storeu_ps(p + ld, a1);
  _mm256_storeu_ps(p + 2 * ld, a2);
  _mm256_storeu_ps(p + 3 * ld, a3);
  if constexpr (NV == 2) {
    _mm256_storeu_ps(p + 8, b0);
    _mm256_storeu_ps(p + ld + 8, b1);
    _mm256_storeu_ps(p + 2 * ld + 8, b2);
    _mm256_storeu_ps(p + 3 * ld + 8, b3);
  }
}

// st[j][v] = sum_d qt[d][v] * kf[j][d] for the 4 keys from kf and NV (1 or 2) row vectors from qt, stored
// from st (key j at st + j * rp). Named accumulators rather than an array: GCC keeps an array of eight
// 256-bit vectors on the stack (past its scalarization limit), a store after every multiply-add.
template <int NV>
__attribute__((noinline)) void lane_scores4(const float* qt, int64_t rp, const float* kf, int64_t D, float* st) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  for (int64_t d = 0; d < D; ++d) {
    __m256 x = _mm256_loadu_ps(qt + d * rp);
    __m256 y = NV == 2 ? _mm256_loadu_ps(qt + d * rp + 8) : x;
    in_register(x, y);
    fma_rows<NV>(x, y, _mm256_broadcast_ss(kf + d), a0, b0);
    fma_rows<NV>(x, y, _mm256_broadcast_ss(kf + D + d), a1, b1);
    fma_rows<NV>(x, y, _mm256_broadcast_ss(kf + 2 * D + d), a2, b2);
    fma_rows<NV>(x, y, _mm256_broadcast_ss(kf + 3 * D + d), a3, b3);
  }
  store_rows<NV>(st, rp, a0, a1, a2, a3, b0, b1, b2, b3);
}

// The same for one key (a block's last n % 4 keys).
inline void lane_scores1(const float* qt, int64_t rp, int64_t nv, const float* kf, int64_t D, float* st) {
  for (int64_t v = 0; v < nv; ++v) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) a = _mm256_fmadd_ps(_mm256_loadu_ps(qt + d * rp + 8 * v), _mm256_broadcast_ss(kf + d), a);
    _mm256_storeu_ps(st + 8 * v, a);
  }
}

// acct[d][v] = acct[d][v] * corr[v] + sum_j st[j][v] * vf[j][d] for the 4 d from vf's (and acct's) first and
// NV (1 or 2) row vectors (from corr, st, acct), over n keys (vf: rows of D floats).
template <int NV>
__attribute__((noinline)) void lane_pv4(const float* st, int64_t rp, const float* vf, int64_t D, int64_t n,
                                        const float* corr, float* acct) {
  const __m256 cx = _mm256_loadu_ps(corr), cy = NV == 2 ? _mm256_loadu_ps(corr + 8) : cx;
  __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(acct), cx), a1 = _mm256_mul_ps(_mm256_loadu_ps(acct + rp), cx);
  __m256 a2 = _mm256_mul_ps(_mm256_loadu_ps(acct + 2 * rp), cx), a3 = _mm256_mul_ps(_mm256_loadu_ps(acct + 3 * rp), cx);
  __m256 b0 = a0, b1 = a1, b2 = a2, b3 = a3;
  if constexpr (NV == 2) {
    b0 = _mm256_mul_ps(_mm256_loadu_ps(acct + 8), cy);
    b1 = _mm256_mul_ps(_mm256_loadu_ps(acct + rp + 8), cy);
    b2 = _mm256_mul_ps(_mm256_loadu_ps(acct + 2 * rp + 8), cy);
    b3 = _mm256_mul_ps(_mm256_loadu_ps(acct + 3 * rp + 8), cy);
  }
  for (int64_t j = 0; j < n; ++j) {
    __m256 x = _mm256_loadu_ps(st + j * rp);
    __m256 y = NV == 2 ? _mm256_loadu_ps(st + j * rp + 8) : x;
    in_register(x, y);
    const float* v = vf + j * D;
    fma_rows<NV>(x, y, _mm256_broadcast_ss(v), a0, b0);
    fma_rows<NV>(x, y, _mm256_broadcast_ss(v + 1), a1, b1);
    fma_rows<NV>(x, y, _mm256_broadcast_ss(v + 2), a2, b2);
    fma_rows<NV>(x, y, _mm256_broadcast_ss(v + 3), a3, b3);
  }
  store_rows<NV>(acct, rp, a0, a1, a2, a3, b0, b1, b2, b3);
}

// One tile: R query rows (row_of(i): D floats, already scaled) at positions pos_of(i), against keys
// 0 .. last_key of their sequence (each row only up to its own position). block_of(b): the first key row
// and the first value row of cache block b (BS keys, `stride` elements apart; rows of D values, or int8
// rows of D codes and their scale). out_of(i): where row i's unnormalized output (D floats) and its
// softmax sum go; the caller divides.
template <typename C, typename RowOf, typename PosOf, typename BlockOf, typename OutOf>
void attend_lane_tile(int64_t R, const RowOf& row_of, const PosOf& pos_of, int64_t last_key, int64_t BS,
                      const BlockOf& block_of, int64_t stride, int64_t D, const OutOf& out_of, LaneScratch& sc) {
  const int64_t rp = (R + 7) / 8 * 8, nv = rp / 8;
  // keys per softmax step: whole cache blocks, about kLaneKeys (each step rescales every accumulator once)
  const int64_t span = std::max<int64_t>(1, kLaneKeys / BS) * BS;
  sc.fit(rp, D, span);
  float* qt = sc.qt.data();
  float* acct = sc.acct.data();
  float* st = sc.st.data();
  alignas(32) static const float zeros[kLaneMaxD] = {};
  for (int64_t i0 = 0; i0 < rp; i0 += 8) {  // qt = the rows transposed, 8 x 8 at a time
    const float* rows[8];
    for (int64_t r = 0; r < 8; ++r) rows[r] = i0 + r < R ? row_of(i0 + r) : zeros;
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      const float* src[8];
      for (int64_t r = 0; r < 8; ++r) src[r] = rows[r] + (rows[r] == zeros ? 0 : d0);
      transpose8(src, qt + d0 * rp + i0, rp);
    }
  }
  for (int64_t i = 0; i < rp; ++i) {
    sc.pos[i] = i < R ? static_cast<float>(pos_of(i)) : 3.0e38f;  // padding rows see every key
    sc.m[i] = -1.0e30f;
    sc.l[i] = 0.0f;
  }
  std::fill(acct, acct + rp * D, 0.0f);
  float first_pos = sc.pos[0];
  for (int64_t i = 1; i < R; ++i) first_pos = std::min(first_pos, sc.pos[i]);
  const __m256 masked = _mm256_set1_ps(-1.0e30f);
  alignas(32) float corr[kLaneMaxRows];
  for (int64_t key0 = 0; key0 <= last_key; key0 += span) {
    const int64_t n = std::min<int64_t>(span, last_key + 1 - key0);
    for (int64_t b0 = 0; b0 < n; b0 += BS) {
      const auto [kb, vb] = block_of((key0 + b0) / BS);
      widen_rows(kb, stride, std::min<int64_t>(BS, n - b0), D, sc.kf.data() + b0 * D);
      widen_rows(vb, stride, std::min<int64_t>(BS, n - b0), D, sc.vf.data() + b0 * D);
    }
    const float* kf = sc.kf.data();
    int64_t k0 = 0;
    for (; k0 + 4 <= n; k0 += 4)
      for (int64_t v0 = 0; v0 < nv; v0 += 2)
        v0 + 1 < nv ? lane_scores4<2>(qt + 8 * v0, rp, kf + k0 * D, D, st + k0 * rp + 8 * v0)
                    : lane_scores4<1>(qt + 8 * v0, rp, kf + k0 * D, D, st + k0 * rp + 8 * v0);
    for (; k0 < n; ++k0) lane_scores1(qt, rp, nv, kf + k0 * D, D, st + k0 * rp);
    // online softmax over the block's keys, 8 rows per vector; keys after a row's position are masked
    const bool causal = static_cast<float>(key0 + n - 1) > first_pos;
    for (int64_t v = 0; v < nv; ++v) {
      const __m256 pos = _mm256_loadu_ps(sc.pos.data() + 8 * v);
      __m256 mx = _mm256_loadu_ps(sc.m.data() + 8 * v);
      const __m256 m_old = mx;
      for (int64_t j = 0; j < n; ++j) {
        __m256 s = _mm256_loadu_ps(st + j * rp + 8 * v);
        if (causal) {
          s = _mm256_blendv_ps(s, masked, _mm256_cmp_ps(_mm256_set1_ps(static_cast<float>(key0 + j)), pos, _CMP_GT_OQ));
          _mm256_storeu_ps(st + j * rp + 8 * v, s);
        }
        mx = _mm256_max_ps(mx, s);
      }
      const __m256 c = exp_nonpositive8(_mm256_sub_ps(m_old, mx));
      __m256 sum = _mm256_setzero_ps();
      for (int64_t j = 0; j < n; ++j) {
        const __m256 s = _mm256_loadu_ps(st + j * rp + 8 * v);
        // a masked key's weight is 0 (exp_nonpositive8 stops at e^-87, not 0)
        const __m256 p = _mm256_and_ps(exp_nonpositive8(_mm256_sub_ps(s, mx)), _mm256_cmp_ps(s, masked, _CMP_GT_OQ));
        _mm256_storeu_ps(st + j * rp + 8 * v, p);
        sum = _mm256_add_ps(sum, p);
      }
      _mm256_storeu_ps(sc.l.data() + 8 * v, _mm256_fmadd_ps(_mm256_loadu_ps(sc.l.data() + 8 * v), c, sum));
      _mm256_storeu_ps(sc.m.data() + 8 * v, mx);
      _mm256_storeu_ps(corr + 8 * v, c);
    }
    for (int64_t v0 = 0; v0 < nv; v0 += 2)
      for (int64_t d0 = 0; d0 < D; d0 += 4)
        v0 + 1 < nv ? lane_pv4<2>(st + 8 * v0, rp, sc.vf.data() + d0, D, n, corr + 8 * v0, acct + d0 * rp + 8 * v0)
                    : lane_pv4<1>(st + 8 * v0, rp, sc.vf.data() + d0, D, n, corr + 8 * v0, acct + d0 * rp + 8 * v0);
  }
  alignas(32) float block[64];
  for (int64_t i0 = 0; i0 < R; i0 += 8) {  // acct transposed back into the rows, 8 x 8 at a time
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      const float* src[8];
      for (int64_t c = 0; c < 8; ++c) src[c] = acct + (d0 + c) * rp + i0;
      transpose8(src, block, 8);
      for (int64_t r = 0; r < 8 && i0 + r < R; ++r) _mm256_storeu_ps(out_of(i0 + r).first + d0, _mm256_load_ps(block + 8 * r));
    }
  }
  for (int64_t i = 0; i < R; ++i) *out_of(i).second = sc.l[i];
}

#endif

}  // namespace hasten_attention
