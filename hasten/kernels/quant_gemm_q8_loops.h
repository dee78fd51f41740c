// The loops of the int8-activation GEMM tiles (quant_gemm_q8_cpu.cpp and the headers it includes): which
// tile runs over which packed block and which rows of x, across threads.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

namespace {

// Calls tile(std::integral_constant<int, R>{}, nb, m) for every block nb of 8 weight rows and every
// tile of R <= kNarrowTileRows rows of x starting at m; blocks split across threads (8 at least per task), each
// block's weights staying in L1 while every tile of x passes over them.
// Rows of x per tile: each tile unpacks the block's nibbles once for all its rows, so a call of 5-7
// rows (a speculative verification of 4-6 drafts, a small decode batch) split 4 + 1..3 paid the unpacking
// twice. Where AVX-512 gives 32 vector registers the tiles take up to 8 rows (the accumulators of 8 rows
// fit): 30 SmolLM2 layers from memory at 5 / 6 / 7 rows 4.59 / 5.08 / 5.51 -> 3.83 / 4.36 / 4.80 ms
// (benchmarks/int8_gemm_tiles.py, 2 Zen 4 cores, the two builds alternating). Each row's arithmetic
// is the same in any tile.
#if defined(__AVX512VL__)
constexpr int64_t kNarrowTileRows = 8;
#else
constexpr int64_t kNarrowTileRows = 4;
#endif
// Bytes of int8 x per panel of the 8-row tiles (0: no panels; set_q8_gemm_x_panel). A task's blocks
// pass over one panel of x's rows after another: the panel stays in L1 while each block comes from L2
// once per panel, instead of all of x streaming through L1 once per block. Each row's arithmetic is
// the same either way (a panel is whole tiles).
inline std::atomic<int64_t> g_x_panel_bytes{16384};

template <typename Tile>
inline void over_blocks8(int64_t N8, int64_t M, int64_t K, const Tile& tile) {
  const int64_t bytes = g_x_panel_bytes.load(std::memory_order_relaxed);
  const int64_t panel = bytes > 0 ? std::max<int64_t>(kNarrowTileRows, bytes / K / kNarrowTileRows * kNarrowTileRows) : M;
  at::parallel_for(0, N8, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += panel) {
      const int64_t m1 = std::min(M, m0 + panel);
      for (int64_t nb = begin; nb < end; ++nb)
        for (int64_t m = m0; m < m1; m += kNarrowTileRows) {
          switch (std::min<int64_t>(kNarrowTileRows, m1 - m)) {
#if defined(__AVX512VL__)
            case 8: tile(std::integral_constant<int, 8>{}, nb, m); break;
            case 7: tile(std::integral_constant<int, 7>{}, nb, m); break;
            case 6: tile(std::integral_constant<int, 6>{}, nb, m); break;
            case 5: tile(std::integral_constant<int, 5>{}, nb, m); break;
#endif
            case 4: tile(std::integral_constant<int, 4>{}, nb, m); break;
            case 3: tile(std::integral_constant<int, 3>{}, nb, m); break;
            case 2: tile(std::integral_constant<int, 2>{}, nb, m); break;
            default: tile(std::integral_constant<int, 1>{}, nb, m); break;
          }
        }
    }
  });
}

// Blocks ahead whose weights the first tile over a block requests (q8_gemm_tile's `ahead`).
constexpr int64_t kAheadBlocks = 2;

// From this many rows of x on, the AVX-512 two-block tiles (0: never; set_q8_gemm_wide_rows). Below
// ~8 rows the 8-row tiles were faster (30 SmolLM2 layers, weights from memory, 2 EPYC cores).
inline std::atomic<int64_t> g_wide_rows{8};

// Whether a call with M rows of x takes the two-block tiles (builds that have them).
inline bool takes_wide_tiles(int64_t M) {
  const int64_t rows = g_wide_rows.load(std::memory_order_relaxed);
  return rows > 0 && M >= rows;
}

// Pairs of blocks (16 weight rows) for the two-block tiles: pair(R, nb, m, ahead) for blocks nb, nb + 1,
// single(R, nb, m) (a call of the 8-row tiles) for a last odd block; x in panels of kPanelRows rows,
// so that a panel stays in the core's cache while every pair of this thread's blocks passes over it.
// `ahead` (block_bytes: one packed block's size) is the distance to the next pair's weights in the
// first tile of a panel, for the tile to prefetch them, else 0.
constexpr int64_t kPanelRows = 64;
template <typename Pair, typename Single>
inline void over_block_pairs(int64_t N8, int64_t M, int64_t block_bytes, const Pair& pair, const Single& single) {
  const int64_t P = (N8 + 1) / 2;
  at::parallel_for(0, P, 4, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kPanelRows) {
      const int64_t m1 = std::min(M, m0 + kPanelRows);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t nb = 2 * p;
        for (int64_t m = m0; m < m1;) {
          const int64_t left = m1 - m;
          auto call = [&](auto R) {
            if (nb + 1 < N8) pair(R, nb, m, m == m0 && nb + 3 < N8 ? 2 * block_bytes : 0);
            else single(R, nb, m);
            m += decltype(R)::value;
          };
          if (left >= 8) call(std::integral_constant<int, 8>{});
          else if (left >= 4) call(std::integral_constant<int, 4>{});
          else if (left >= 2) call(std::integral_constant<int, 2>{});
          else call(std::integral_constant<int, 1>{});
        }
      }
    }
  });
}

}  // namespace
