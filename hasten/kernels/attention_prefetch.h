// Requests for the cache blocks that paged decode attention reads next (paged_attention_cpu.cpp's
// walk). A sequence's blocks are scattered over the pool, so the hardware prefetcher cannot guess
// them: the walk asks for the block kPrefetchAhead blocks on while it computes on the current one.
//
// All at once (prefetch_block) puts a block's ~100-200 line requests in one burst: far more than a
// core's outstanding misses, and on 2 Zen 3 cores the walk still waited on memory for most of each
// block. Spread (LineQueue; paged_attention's spread_prefetch, on by default): the walk hands the block's
// lines to a queue, and the score and value loops computing on the current block request a few per
// step (scores_avx2, accumulate_rows_avx2 in attention_math.h), so the requests trickle out at about
// the pace the computation leaves room for. Neither changes what is computed, only when lines arrive.
#pragma once

#include <cstdint>

namespace hasten_attention {

// Every line of a block's rows for heads [0, width) (width elements of each of bs rows `row` apart), K and V.
template <typename scalar_t>
inline void prefetch_block(const scalar_t* kp, const scalar_t* vp, int64_t base, int64_t bs, int64_t row, int64_t width) {
  constexpr int64_t line = 64 / sizeof(scalar_t);
  for (int64_t j = 0; j < bs; ++j) {
    for (int64_t i = 0; i < width; i += line) {
      __builtin_prefetch(kp + base + j * row + i, 0, 2);
      __builtin_prefetch(vp + base + j * row + i, 0, 2);
    }
  }
}

// The lines of one contiguous key run and its value run (a whole block: every kv head), requested
// `n` at a time by request(); finish() requests whatever is left.
struct LineQueue {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t lines = 0, next = 0;

  void start(const void* keys, const void* values, int64_t bytes) {
    finish();
    k = static_cast<const char*>(keys);
    v = static_cast<const char*>(values);
    lines = (bytes + 63) / 64;
    next = 0;
  }
  __attribute__((always_inline)) void request(int64_t n) {
    for (; n > 0 && next < lines; --n, ++next) {
      __builtin_prefetch(k + 64 * next, 0, 3);
      __builtin_prefetch(v + 64 * next, 0, 3);
    }
  }
  void finish() { request(lines); }
};

}  // namespace hasten_attention
