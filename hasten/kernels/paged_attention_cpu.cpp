// Paged attention on the CPU: every new query token attends over its own sequence's keys and
// values, read in place from the block pool (no gather into padded tensors, no mask tensors).
//
// Layout (all contiguous):
//   q            [T, H, D]                 new tokens of all sequences, sequence after sequence
//   k/v_cache    [num_blocks, BS, KVH, D]  the block pool of one layer (new tokens already written);
//                                          q's dtype, or float16 / bfloat16 (a narrower KV cache),
//                                          or int8 [.., KVH, D + 4]: each head's row is D codes and
//                                          its float32 scale (attention_math.h, quantize_int8_row)
//   block_tables [S, max_blocks] int32     cache blocks of each sequence
//   query_start  [S + 1] int64             rows of q owned by sequence s: query_start[s] .. [s+1]
//   context_lens [S] int64                 tokens in the cache for s, counting its new tokens
// Query token i of a sequence with n new tokens and context c sits at position p = c - n + i and
// sees keys 0 .. p (causal), or with window > 0 only the last `window` of them, p - window + 1 .. p
// (sliding-window attention; Hugging Face's `kv_idx > q_idx - sliding_window`). softcap > 0
// replaces each scaled score x by softcap * tanh(x / softcap) (Gemma 2). Returns [T, H * D].
//
// Work is split into (sequence, tile of query tokens, kv head) items; the query heads that share
// a kv head are processed together so each key/value row is loaded once per item. Decode
// sequences whose tables begin with the same blocks (a shared prompt prefix) form one item of up
// to `max_group` sequences that reads each shared block once (see Item; max_group < 2: off). Threads take
// items from a shared counter, so one long prefill cannot stall a thread full of short decodes.
// Softmax is computed online, block by block (running max and sum), in float32 for any dtype; the
// arithmetic is in attention_math.h. Calls with a window or a soft cap take a general path (each
// tile starts at the first block its window reaches; no prefix groups); plain causal calls keep a
// path of their own, written as before windows existed: decode attention is memory-bound and was
// ~20 % slower when the compiler saw the window arithmetic in the shared loop, even at window 0.
//
// wide_rows > 0 (bfloat16 attention for long query runs): a sequence with at least that many new
// tokens (a prefill chunk), no soft cap and a window that reaches key 0, is computed instead by
// at::scaled_dot_product_attention on bfloat16 copies of its q and of its keys/values gathered
// from the pool (oneDNN / AMX tiles where the CPU has them); the rest take the kernel above.

#include "cpu_kernels.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "attention_amx.h"
#include "attention_groups.h"
#include "attention_int8_decode.h"
#include "attention_int8_scores.h"
#include "attention_math.h"
#include "attention_lane_tiles.h"
#include "attention_prefetch.h"

#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 2
#endif

namespace {
using namespace hasten_attention;

// Blocks ahead whose lines a walk requests while it computes (attention_prefetch.h).
constexpr int64_t kPrefetchAhead = PREFETCH_AHEAD;

// One work item: a tile of query tokens of one sequence for a range of kv heads, or a *group* of
// decode sequences (one new token each) whose block tables start with the same `shared` blocks:
// those blocks are the same memory (a prefix-cache hit), so the group walks them block-major (each
// block is fetched from memory once and stays in L1 for every member) before each member finishes
// its own blocks. Every row sees the same keys in the same order with the same arithmetic either
// way, so grouping changes speed, never a bit of the result.
struct Item {
  int64_t seq, q_begin, q_end, head_begin, head_end;
  int64_t member_begin = 0, member_end = 0, shared = 0;  // a group: members[member_begin, member_end)
};

struct Scratch {
  std::vector<float> q, acc, scores, m, l, k, v;
  std::vector<int8_t> qc;  // int8_decode: the rows' codes and scales (D + 4 bytes each)
  std::vector<float> qs;
#if defined(HASTEN_LANE_TILES)
  LaneScratch lanes;  // attention_lane_tiles.h's buffers
#endif
  Scratch(int64_t rows, int64_t bs, int64_t width)  // width: floats of one key row over the item's heads
      : q(rows * width), acc(rows * width), scores(rows * bs), m(rows), l(rows), k(bs * width), v(bs * width) {}
};

struct Shape {
  int64_t H, KVH, G, D, BS, max_blocks;
  float scale;
  int64_t window;  // > 0: each query sees its last `window` keys only
  float softcap;   // > 0: scores soft-capped (both: the general path, attend_item<..., true>)
  bool int8_decode = false;  // int8 cache, plain causal path: scores in integers (attention_int8_decode.h)
  int64_t lane_tokens = 0;   // > 0: plain causal tiles of this many tokens or more take attention_lane_tiles.h
  bool spread_prefetch = true;  // walks request the block ahead a few lines per step (attention_prefetch.h)
};

// One sequence's part of an item: query tokens [q_begin, q_end), whose rows start at scratch row `row0`.
struct Segment {
  int64_t seq, q_begin, q_end, row0;
};

template <typename scalar_t, typename cache_t, bool kGeneral, bool kCap>
void attend_item(const Item& it, const int64_t* members, const scalar_t* qp, const cache_t* kp, const cache_t* vp,
                 const int32_t* tables, const int64_t* qstart, const int64_t* ctx_lens, scalar_t* outp,
                 const Shape& sh, Scratch& sc) {
  const int64_t G = sh.G, D = sh.D, BS = sh.BS, H = sh.H;
  const int64_t nh = it.head_end - it.head_begin;
  const int64_t token_rows = nh * G;  // rows per token: r = row0 + t * token_rows + (head - head_begin) * G + g
  Segment one{it.seq, it.q_begin, it.q_end, 0};
  std::vector<Segment> group;
  for (int64_t i = it.member_begin; i < it.member_end; ++i)
    group.push_back({members[i], 0, 1, (i - it.member_begin) * token_rows});
  const Segment* segs = group.empty() ? &one : group.data();
  const int64_t nseg = group.empty() ? 1 : static_cast<int64_t>(group.size());

  int64_t rows = 0;
  for (int64_t si = 0; si < nseg; ++si) {
    const Segment& sg = segs[si];
    for (int64_t t = 0; t < sg.q_end - sg.q_begin; ++t) {
      const scalar_t* src = qp + ((qstart[sg.seq] + sg.q_begin + t) * H + it.head_begin * G) * D;
      float* dst = sc.q.data() + (sg.row0 + t * token_rows) * D;
      for (int64_t i = 0; i < token_rows * D; ++i) dst[i] = static_cast<float>(src[i]) * sh.scale;
    }
    rows = std::max(rows, sg.row0 + (sg.q_end - sg.q_begin) * token_rows);
  }
  // a prefill tile (one sequence, enough tokens, every row's G query heads in the lanes' reach)
#if defined(HASTEN_LANE_TILES)
  const bool lanes = lane_tiles_take<scalar_t, cache_t>() && !kGeneral && sh.lane_tokens > 0 && nseg == 1 && it.q_end - it.q_begin >= sh.lane_tokens &&
                     (it.q_end - it.q_begin) * G <= kLaneMaxRows && D % 8 == 0 && D <= kLaneMaxD;
#else
  constexpr bool lanes = false;
#endif
#if defined(HASTEN_INT8_DECODE)
  if constexpr (std::is_same_v<cache_t, int8_t> && !kGeneral) {
    if (sh.int8_decode && !lanes) quantize_rows_int8(sc.q.data(), rows, D, sc.qc, sc.qs);
  }
#endif
  if (!lanes) {  // the lane tiles write every row's sums and normalizer themselves
    std::fill(sc.acc.begin(), sc.acc.begin() + rows * D, 0.0f);
    std::fill(sc.m.begin(), sc.m.begin() + rows, -1e30f);
    std::fill(sc.l.begin(), sc.l.begin() + rows, 0.0f);
  }

  const int64_t P = head_row<cache_t>(D);  // elements of one head's row of one key in the cache
  const int64_t cache_row = sh.KVH * P;    // elements between consecutive keys of a block
  auto block_base = [&](const Segment& sg, int64_t b) {
    return (static_cast<int64_t>(tables[sg.seq * sh.max_blocks + b]) * BS * sh.KVH + it.head_begin) * P;
  };
  auto last_key = [&](const Segment& sg) {  // newest key any row of the segment may see
    return ctx_lens[sg.seq] - (qstart[sg.seq + 1] - qstart[sg.seq]) + sg.q_end - 1;
  };
  auto first_block = [&](const Segment& sg) {  // oldest block any row of the segment may see
    if (sh.window <= 0) return int64_t{0};
    const int64_t first_key = ctx_lens[sg.seq] - (qstart[sg.seq + 1] - qstart[sg.seq]) + sg.q_begin - sh.window + 1;
    return std::max<int64_t>(0, first_key) / BS;
  };
  LineQueue lines;  // a block further on, requested while this one is computed on (see walk)
  // Block b of one segment: every token of it attends over the keys it may see in the block.
  auto attend = [&](const Segment& sg, int64_t b) {
    const int64_t first_pos = ctx_lens[sg.seq] - (qstart[sg.seq + 1] - qstart[sg.seq]);
    const int64_t key0 = b * BS;
    const int64_t in_block = std::min<int64_t>(BS, last_key(sg) + 1 - key0);
    const int64_t base = block_base(sg, b);
    // krows/vrows: the block's first key/value row; `stride` elements between keys, `hs` between heads
    auto attend_block = [&](const auto* krows, const auto* vrows, int64_t stride, int64_t hs) {
      for (int64_t t = 0; t < sg.q_end - sg.q_begin; ++t) {
        if constexpr (!kGeneral) {
          // keys this token may see inside the block (causal limit)
          const int64_t visible = std::min<int64_t>(in_block, first_pos + sg.q_begin + t - key0 + 1);
          if (visible <= 0) continue;
          for (int64_t h = 0; h < nh; ++h) {
            const int64_t r = sg.row0 + t * token_rows + h * G;
            update_rows<false>(sc.q.data() + r * D, G, krows + h * hs, vrows + h * hs, stride, visible, D,
                               sc.scores.data() + r * BS, BS, sc.m.data() + r, sc.l.data() + r, sc.acc.data() + r * D,
                               0.0f, &lines);
          }
        } else {
          // keys [skip, visible) of the block are the ones this token may see (window, causal limit)
          const int64_t pos = first_pos + sg.q_begin + t;
          const int64_t visible = std::min<int64_t>(in_block, pos - key0 + 1);
          const int64_t skip = sh.window > 0 ? std::max<int64_t>(0, pos - sh.window + 1 - key0) : 0;
          const int64_t n = visible - skip;
          if (n <= 0) continue;
          const int64_t off = skip * stride;
          for (int64_t h = 0; h < nh; ++h) {
            const int64_t r = sg.row0 + t * token_rows + h * G;
            update_rows<kCap>(sc.q.data() + r * D, G, krows + off + h * hs, vrows + off + h * hs, stride, n, D,
                              sc.scores.data() + r * BS, BS, sc.m.data() + r, sc.l.data() + r, sc.acc.data() + r * D,
                              sh.softcap, &lines);
          }
        }
      }
    };
    if constexpr (reads_in_place<cache_t>()) {
      if (std::is_same_v<cache_t, float> || D % 8 == 0) {
        attend_block(kp + base, vp + base, cache_row, P);
        return;
      }
    }
    // portable path over another cache type: widen this block first
    for (int64_t j = 0; j < in_block; ++j) {
      if constexpr (std::is_same_v<cache_t, int8_t>) {
        for (int64_t h = 0; h < nh; ++h) {
          int8_row_to_float(kp + base + j * cache_row + h * P, sc.k.data() + (j * nh + h) * D, D);
          int8_row_to_float(vp + base + j * cache_row + h * P, sc.v.data() + (j * nh + h) * D, D);
        }
      } else {
        to_float(kp + base + j * cache_row, sc.k.data() + j * nh * D, nh * D);
        to_float(vp + base + j * cache_row, sc.v.data() + j * nh * D, nh * D);
      }
    }
    attend_block(sc.k.data(), sc.v.data(), nh * D, D);
  };
  // Walk blocks [b0, nblocks) of `sg`, calling `body(b)` on each while requesting the block
  // kPrefetchAhead on: spread over the block's computation (`lines`) where the item covers every kv
  // head (one contiguous run per block), else in one burst (attention_prefetch.h).
  const bool spread = sh.spread_prefetch && nh == sh.KVH;
  auto walk = [&](const Segment& sg, int64_t b0, int64_t nblocks, auto&& body) {
    for (int64_t a = 1; a < kPrefetchAhead && b0 + a < nblocks; ++a)
      prefetch_block(kp, vp, block_base(sg, b0 + a), BS, cache_row, nh * P);
    for (int64_t b = b0; b < nblocks; ++b) {
      if (b + kPrefetchAhead < nblocks) {
        const int64_t ahead = block_base(sg, b + kPrefetchAhead);
        if (spread) lines.start(kp + ahead, vp + ahead, BS * cache_row * static_cast<int64_t>(sizeof(cache_t)));
        else prefetch_block(kp, vp, ahead, BS, cache_row, nh * P);
      }
      body(b);
    }
    lines.finish();
  };
  bool walked = false;
#if defined(HASTEN_LANE_TILES)
  if constexpr (lane_tiles_take<scalar_t, cache_t>()) {
    if (lanes) {  // per kv head: its G query rows of every token of the tile (attention_lane_tiles.h)
      const Segment& sg = segs[0];
      const int64_t first_pos = ctx_lens[sg.seq] - (qstart[sg.seq + 1] - qstart[sg.seq]) + sg.q_begin;
      for (int64_t h = 0; h < nh; ++h) {
        auto row = [&](int64_t i) { return (i / G) * token_rows + h * G + i % G; };  // tile row -> scratch row
        attend_lane_tile<cache_t>(
            (sg.q_end - sg.q_begin) * G, [&](int64_t i) { return sc.q.data() + row(i) * D; },
            [&](int64_t i) { return first_pos + i / G; }, last_key(sg), BS,
            [&](int64_t b) {
              const int64_t base = block_base(sg, b) + h * P;
              return std::pair<const cache_t*, const cache_t*>(kp + base, vp + base);
            },
            cache_row, D,
            [&](int64_t i) { return std::pair<float*, float*>(sc.acc.data() + row(i) * D, sc.l.data() + row(i)); },
            sc.lanes);
      }
      walked = true;
    }
  }
#endif
#if defined(HASTEN_INT8_DECODE)
  if constexpr (std::is_same_v<cache_t, int8_t> && !kGeneral) {
    if (sh.int8_decode && !walked) {  // each token's rows over the keys it sees, read in place (attention_int8_decode.h);
      // a group's members one by one (the same arithmetic as alone: grouping changes no bit)
      for (int64_t si = 0; si < nseg; ++si) {
        const Segment& sg = segs[si];
        const int64_t first_pos = ctx_lens[sg.seq] - (qstart[sg.seq + 1] - qstart[sg.seq]);
        const KeyRows kr{kp, vp, tables + sg.seq * sh.max_blocks, BS, cache_row, it.head_begin * P};
        for (int64_t t = 0; t < sg.q_end - sg.q_begin; ++t) {
          const int64_t r = sg.row0 + t * token_rows;
          attend_heads_int8(sc.qc.data() + r * (D + kInt8ScaleBytes), D + kInt8ScaleBytes, sc.qs.data() + r, G, nh, P,
                            kr, first_pos + sg.q_begin + t + 1, D, sc.m.data() + r, sc.l.data() + r, sc.acc.data() + r * D);
        }
      }
      walked = true;
    }
  }
#endif
  if (!walked) {
    walk(segs[0], 0, it.shared, [&](int64_t b) {
      for (int64_t si = 0; si < nseg; ++si) attend(segs[si], b);
    });
    for (int64_t si = 0; si < nseg; ++si)
      walk(segs[si], kGeneral ? std::max(it.shared, first_block(segs[si])) : it.shared, last_key(segs[si]) / BS + 1,
           [&](int64_t b) { attend(segs[si], b); });
  }

  for (int64_t si = 0; si < nseg; ++si) {
    const Segment& sg = segs[si];
    for (int64_t t = 0; t < sg.q_end - sg.q_begin; ++t) {
      scalar_t* dst = outp + ((qstart[sg.seq] + sg.q_begin + t) * H + it.head_begin * G) * D;
      for (int64_t r = 0; r < token_rows; ++r) {
        const int64_t row = sg.row0 + t * token_rows + r;
        const float inv = 1.0f / sc.l[row];
        const float* acc = sc.acc.data() + row * D;
        for (int64_t d = 0; d < D; ++d) dst[r * D + d] = static_cast<scalar_t>(acc[d] * inv);
      }
    }
  }
}

#if defined(HASTEN_INT8_SCORES)
// Query tokens [q_begin, q_end) of sequence `seq` (n new tokens, context ctx; q [T, H, D], rows of
// sequence seq from q0) for kv heads [head_begin, head_end), over the sequence's packed units
// (`units`: KVH runs of `count` units each). Writes the rows' outputs to out [T, H * D]. amx: the
// rows on AMX tiles (attention_amx.h; the units' value pairs in KVH runs after them), else
// attend_int8_rows.
template <typename scalar_t>
void attend_tile_int8(const scalar_t* q, int64_t q0, int64_t n, int64_t ctx, int64_t q_begin, int64_t q_end,
                      int64_t head_begin, int64_t head_end, int64_t H, int64_t G, int64_t D, float scale,
                      bool bf16_pv, bool amx, const uint8_t* units, int64_t count, scalar_t* out) {
  const int64_t rows = (q_end - q_begin) * G;
  const int64_t padded = (rows + 15) / 16 * 16;  // the tiles take 16 rows at a time
  // per-thread buffers, reused from item to item (no allocation or zero fill per item)
  thread_local std::vector<uint8_t> codes;
  thread_local std::vector<float> sq, res;
  thread_local std::vector<int64_t> last;
  thread_local std::vector<const uint8_t*> qc;
  thread_local std::vector<float*> dst;
  if (static_cast<int64_t>(sq.size()) < padded) {
    sq.resize(padded);
    last.resize(padded);
    qc.resize(padded);
    dst.resize(padded);
  }
  if (static_cast<int64_t>(codes.size()) < padded * D) {
    codes.resize(padded * D);
    res.resize(padded * D);
  }
  for (int64_t h = head_begin; h < head_end; ++h) {
    for (int64_t t = 0; t < q_end - q_begin; ++t) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = t * G + g;
        sq[r] = quantize_query_u8(q + ((q0 + q_begin + t) * H + h * G + g) * D, scale, D, codes.data() + r * D);
        qc[r] = codes.data() + r * D;
        last[r] = ctx - n + q_begin + t;
        dst[r] = res.data() + r * D;
      }
    }
#if defined(HASTEN_AMX_ATTENTION)
    if (amx) {  // the codes of whole 16-row passes are read (rows past `rows`: not used)
      const int64_t ub = amx_unit_bytes(D), kvh = H / G;
      const uint8_t* pairs = units + kvh * count * ub + h * count * amx_pair_bytes(D);
      attend_int8_rows_amx(codes.data(), sq.data(), last.data(), rows, D, units + h * count * ub, ub,
                           reinterpret_cast<const uint16_t*>(pairs), dst.data());
    } else
#endif
    {
      const int64_t ub = int8_unit_bytes(D, bf16_pv);
      attend_int8_rows(qc.data(), sq.data(), last.data(), rows, D, bf16_pv, units + h * count * ub, ub, dst.data());
    }
    for (int64_t t = 0; t < q_end - q_begin; ++t) {
      scalar_t* o = out + ((q0 + q_begin + t) * H + h * G) * D;
      const float* r = res.data() + t * G * D;
      for (int64_t i = 0; i < G * D; ++i) o[i] = static_cast<scalar_t>(r[i]);
    }
  }
}
#endif

template <typename scalar_t, typename cache_t>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
         const at::Tensor& qstart, const at::Tensor& ctx_lens, double scale, int64_t q_tile, int64_t max_group,
         int64_t window, double softcap, const std::vector<char>& wide, int64_t int8_rows, bool bf16_pv,
         bool int8_tiles, bool int8_decode, int64_t lane_tokens, bool spread_prefetch, at::Tensor& out) {
  const int64_t S = ctx_lens.size(0);
  const int64_t* cl = ctx_lens.data_ptr<int64_t>();
  if (window > 0 && S > 0 && window >= *std::max_element(cl, cl + S)) window = 0;  // all see back to key 0
  Shape sh{q.size(1), k_cache.size(2), q.size(1) / k_cache.size(2), q.size(2), k_cache.size(1), tables.size(1),
           static_cast<float>(scale), window, static_cast<float>(softcap)};
  sh.spread_prefetch = spread_prefetch;
#if defined(HASTEN_INT8_DECODE)
  sh.int8_decode = std::is_same_v<cache_t, int8_t> && int8_decode && int8_decode_take(sh.D);
#endif
  int64_t lane_q_tile = 0;  // query tokens per lane tile
#if defined(HASTEN_LANE_TILES)
  if constexpr (lane_tiles_take<scalar_t, cache_t>()) {
    lane_q_tile = lane_tile_tokens(sh.G);
    sh.lane_tokens = lane_q_tile > 0 ? lane_tokens : 0;
  }
#endif
  const int64_t* qs = qstart.data_ptr<int64_t>();
  const int64_t threads = at::get_num_threads();
  // sequences whose scores are integer dot products (attention_int8_scores.h): their keys and values
  // are packed once here, and their tiles read the packed units
  std::vector<int64_t> unit_offset(S, -1), unit_count(S, 0);
  std::unique_ptr<uint8_t[]> units;  // every byte is written by pack_unit: no zero fill
#if defined(HASTEN_AMX_ATTENTION)
  const bool amx = int8_tiles && amx_attention_take(sh.D) && amx_attention_ready();
  if (amx) bf16_pv = true;  // the tiles read the units' bfloat16 value pairs
#else
  const bool amx = false;
#endif
  // the tiles take 16 query rows at a time: 16 tokens' rows (16 G) fill whole passes
  const int64_t int8_q_tile = amx ? std::max<int64_t>(q_tile, 16) : q_tile;
#if defined(HASTEN_INT8_SCORES)
  if constexpr (std::is_same_v<cache_t, int8_t>) {
    // with amx, each sequence's units without their value pairs, then KVH runs of the pairs
    const int64_t ub = amx ? amx_unit_bytes(sh.D) : int8_unit_bytes(sh.D, bf16_pv);
    const int64_t pb = amx ? amx_pair_bytes(sh.D) : 0;
    int64_t bytes = 0;
    std::vector<std::array<int64_t, 3>> jobs;  // sequence, kv head, unit
    if (int8_rows > 0 && softcap == 0.0 && int8_scores_take(sh.D)) {
      for (int64_t s = 0; s < S; ++s) {
        if (wide[s] || qs[s + 1] - qs[s] < std::max<int64_t>(int8_rows, 2) || (window > 0 && cl[s] > window)) continue;
        unit_offset[s] = bytes;
        unit_count[s] = (cl[s] + kUnitKeys - 1) / kUnitKeys;
        if (amx) unit_count[s] += unit_count[s] % 2;  // the tiles take the pairs of two units at once
        for (int64_t h = 0; h < sh.KVH; ++h)
          for (int64_t u = 0; u < unit_count[s]; ++u) jobs.push_back({s, h, u});
        bytes += sh.KVH * unit_count[s] * (ub + pb);
      }
    }
    if (bytes > 0) {  // decode-only calls allocate and pack nothing
      units.reset(new uint8_t[bytes]);
      at::parallel_for(0, static_cast<int64_t>(jobs.size()), 16, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const auto [s, h, u] = jobs[i];
          uint8_t* seq = units.get() + unit_offset[s];
          uint8_t* pairs = amx ? seq + sh.KVH * unit_count[s] * ub + (h * unit_count[s] + u) * pb : nullptr;
          pack_unit(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), tables.data_ptr<int32_t>() + s * sh.max_blocks,
                    cl[s], u, h, sh.BS, sh.KVH, sh.D, bf16_pv, seq + (h * unit_count[s] + u) * ub,
                    reinterpret_cast<uint16_t*>(pairs));
        }
      });
    }
  }
#endif
  int64_t decodes = 0;
  for (int64_t s = 0; s < S; ++s) decodes += qs[s + 1] - qs[s] == 1;  // wide sequences are never decodes
  // at most max_group members, and groups small enough that every thread gets two or more; none
  // under a window (a member would walk shared blocks its window may not reach)
  const int64_t max_members = window > 0 ? 1 : std::min(max_group, (decodes + 2 * threads - 1) / (2 * threads));
  const Groups groups = find_groups(tables.data_ptr<int32_t>(), qs, ctx_lens.data_ptr<int64_t>(), S, sh.BS,
                                    sh.max_blocks, max_members);
  // query tokens per tile of sequence s (the integer-score sequences' own on the AMX tiles)
  // sequences whose tiles take the lane tiles: plain causal ones with enough new tokens
  auto lanes_of = [&](int64_t s) {
    return sh.lane_tokens > 0 && softcap == 0.0 && !(window > 0 && cl[s] > window) && qs[s + 1] - qs[s] >= sh.lane_tokens;
  };
  auto tile_of = [&](int64_t s) { return unit_offset[s] >= 0 ? int8_q_tile : lanes_of(s) ? lane_q_tile : q_tile; };
  int64_t tiles = static_cast<int64_t>(groups.spans.size());
  for (int64_t s = 0; s < S; ++s)
    if (!groups.grouped[s] && !wide[s]) tiles += (qs[s + 1] - qs[s] + tile_of(s) - 1) / tile_of(s);
  // All kv heads in one item read each cache block as one contiguous run; split heads only when
  // there are too few tiles to keep every thread busy.
  const int64_t heads_per_item = tiles >= 4 * threads ? sh.KVH : 1;
  std::vector<Item> items;
  items.reserve(tiles * (sh.KVH / heads_per_item + 1));
  for (const auto& span : groups.spans)
    for (int64_t h = 0; h < sh.KVH; h += heads_per_item)
      items.push_back({groups.members[span[0]], 0, 1, h, std::min(sh.KVH, h + heads_per_item), span[0], span[1], span[2]});
  for (int64_t s = 0; s < S; ++s) {
    if (groups.grouped[s] || wide[s]) continue;
    const int64_t n = qs[s + 1] - qs[s];
    if (unit_offset[s] >= 0) {  // integer scores: the last tiles (the most keys) first, so no thread
      for (int64_t t0 = (n - 1) / tile_of(s) * tile_of(s); t0 >= 0; t0 -= tile_of(s))  // is left with a long
        for (int64_t h = 0; h < sh.KVH; h += heads_per_item)                         // one at the end
          items.push_back({s, t0, std::min(n, t0 + tile_of(s)), h, std::min(sh.KVH, h + heads_per_item)});
      continue;
    }
    for (int64_t t0 = 0; t0 < n; t0 += tile_of(s))
      for (int64_t h = 0; h < sh.KVH; h += heads_per_item)
        items.push_back({s, t0, std::min(n, t0 + tile_of(s)), h, std::min(sh.KVH, h + heads_per_item)});
  }
  const int64_t total = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min(threads, total));
  const int64_t rows = std::max({q_tile, max_members, sh.lane_tokens > 0 ? lane_q_tile : 0}) * heads_per_item * sh.G;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(rows, sh.BS, heads_per_item * sh.D);
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) {
        // the plain causal path compiles as it did before windows and soft caps existed (its speed is
        // sensitive to the compiler's view of it); a soft cap, or a window shorter than the item's
        // context, takes the general one
#if defined(HASTEN_INT8_SCORES)
        if (const Item& it = items[i]; unit_offset[it.seq] >= 0) {
          attend_tile_int8(q.data_ptr<scalar_t>(), qs[it.seq], qs[it.seq + 1] - qs[it.seq], cl[it.seq], it.q_begin,
                           it.q_end, it.head_begin, it.head_end, sh.H, sh.G, sh.D, sh.scale, bf16_pv, amx,
                           units.get() + unit_offset[it.seq], unit_count[it.seq], out.data_ptr<scalar_t>());
          continue;
        }
#endif
        auto item = softcap > 0.0 ? attend_item<scalar_t, cache_t, true, true>
                    : window > 0 && cl[items[i].seq] > window ? attend_item<scalar_t, cache_t, true, false>
                                                              : attend_item<scalar_t, cache_t, false, false>;
        item(items[i], groups.members.data(), q.data_ptr<scalar_t>(), k_cache.data_ptr<cache_t>(),
             v_cache.data_ptr<cache_t>(), tables.data_ptr<int32_t>(), qs, ctx_lens.data_ptr<int64_t>(),
             out.data_ptr<scalar_t>(), sh, scratch);
      }
    }
  });
}

// One sequence's rows of out by SDPA in bfloat16 (see wide_rows above): causal, aligned so that
// query i (position ctx - n + i) sees keys 0 .. ctx - n + i.
void attend_wide(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                 int64_t s, int64_t q0, int64_t n, int64_t ctx, double scale, at::Tensor& out) {
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), D = q.size(2), H = q.size(1);
  const at::Tensor ids = tables[s].slice(0, 0, (ctx + BS - 1) / BS).to(at::kLong);
  auto gather = [&](const at::Tensor& cache) {  // [1, KVH, ctx, D]
    at::Tensor rows = cache.index_select(0, ids).view({-1, KVH, cache.size(3)}).slice(0, 0, ctx);
    if (cache.scalar_type() == at::kChar)  // int8 codes times their row's scale
      rows = rows.narrow(2, 0, D).to(at::kFloat) * rows.narrow(2, D, kInt8ScaleBytes).contiguous().view(at::kFloat);
    return rows.to(at::kBFloat16).permute({1, 0, 2}).unsqueeze(0);
  };
  const at::Tensor qs = q.slice(0, q0, q0 + n).to(at::kBFloat16).permute({1, 0, 2}).unsqueeze(0);  // [1, H, n, D]
  std::optional<at::Tensor> mask;
  if (n != ctx)
    mask = at::arange(ctx).unsqueeze(0) <= at::arange(n).unsqueeze(1) + (ctx - n);
  const at::Tensor o = at::scaled_dot_product_attention(qs, gather(k_cache), gather(v_cache), mask, 0.0, n == ctx,
                                                        scale, /*enable_gqa=*/H != KVH);
  out.slice(0, q0, q0 + n).copy_(o.squeeze(0).permute({1, 0, 2}).reshape({n, H * D}));
}

}  // namespace

// whether a header defined `macro` (to 1) for this build: the name expands to "1", else stays itself
#define HASTEN_STR(x) #x
#define HASTEN_BUILT(macro) (HASTEN_STR(macro)[0] == '1')

bool attention_int8_has_tiles() { return HASTEN_BUILT(HASTEN_INT8_SCORES); }

bool attention_int8_decode_has_tiles() { return HASTEN_BUILT(HASTEN_INT8_DECODE); }

bool attention_lane_tiles_built() { return HASTEN_BUILT(HASTEN_LANE_TILES); }

bool attention_amx_available() {
#if defined(HASTEN_AMX_ATTENTION)
  return amx_attention_ready();
#else
  return false;
#endif
}

bool attention_bf16_pv_has_tiles() { return HASTEN_BUILT(HASTEN_BF16_PV); }

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start,
                           const at::Tensor& context_lens, double scale, int64_t q_tile,
                           int64_t max_group, int64_t window, double softcap, int64_t wide_rows,
                           int64_t int8_rows, bool int8_bf16_pv, bool int8_tiles, bool int8_decode,
                           int64_t lane_tokens, bool spread_prefetch) {
#if !defined(HASTEN_BF16_PV)
  int8_bf16_pv = false;  // this build has no bfloat16 dot products: float32 P V
#endif
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "q must be [T,H,D], caches [N,BS,KVH,D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k and v caches differ in shape");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (q.scalar_type() == k_cache.scalar_type() || k_cache.scalar_type() == at::kHalf ||
                   k_cache.scalar_type() == at::kBFloat16 || k_cache.scalar_type() == at::kChar),
              "the caches must share q's dtype, or both be float16, bfloat16 or int8");
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(k_cache.size(3) == q.size(2) + (int8_cache ? kInt8ScaleBytes : 0),
              int8_cache ? "head_dim mismatch (an int8 cache row is head_dim + 4 bytes)" : "head_dim mismatch");
  TORCH_CHECK(!int8_cache || k_cache.size(1) <= kMaxKeys, "an int8 cache takes blocks of at most ", kMaxKeys,
              " tokens");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "block_tables must be contiguous int32 [S, max_blocks]");
  TORCH_CHECK(query_start.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "query_start and context_lens must be int64");
  TORCH_CHECK(q_tile >= 1, "q_tile must be >= 1");
  TORCH_CHECK(lane_tokens >= 0, "lane_tokens must be >= 0 (0: off)");
  const int64_t S = context_lens.size(0);
  TORCH_CHECK(query_start.numel() == S + 1 && block_tables.size(0) == S, "one row per sequence expected");
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  const int64_t BS = k_cache.size(1), NB = k_cache.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(qs[0] == 0 && qs[S] == q.size(0), "query_start must run from 0 to T");
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = qs[s + 1] - qs[s];
    TORCH_CHECK(n >= 0 && cl[s] >= n, "sequence ", s, ": context shorter than its new tokens");
    const int64_t used = (cl[s] + BS - 1) / BS;
    TORCH_CHECK(used <= max_blocks, "sequence ", s, ": context needs more blocks than its table has");
    for (int64_t b = 0; b < used; ++b)
      TORCH_CHECK(tp[s * max_blocks + b] >= 0 && tp[s * max_blocks + b] < NB, "block id out of range");
  }
  auto out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  if (q.size(0) == 0) return out;
  std::vector<char> wide(S, 0);
  bool any_wide = false;
  for (int64_t s = 0; s < S && wide_rows > 0 && softcap == 0.0; ++s) {
    wide[s] = qs[s + 1] - qs[s] >= std::max<int64_t>(wide_rows, 2) && (window <= 0 || window >= cl[s]);
    any_wide = any_wide || wide[s];
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    auto over = [&](auto cache) {
      run<scalar_t, decltype(cache)>(q, k_cache, v_cache, block_tables, query_start, context_lens, scale, q_tile,
                                     max_group, window, softcap, wide, int8_rows, int8_bf16_pv, int8_tiles, int8_decode,
                                     lane_tokens, spread_prefetch, out);
    };
    if (k_cache.scalar_type() == q.scalar_type()) over(scalar_t{});
    else if (k_cache.scalar_type() == at::kHalf) over(at::Half{});
    else if (int8_cache) over(int8_t{});
    else over(at::BFloat16{});
  });
  for (int64_t s = 0; s < S && any_wide; ++s)
    if (wide[s]) attend_wide(q, k_cache, v_cache, block_tables, s, qs[s], qs[s + 1] - qs[s], cl[s], scale, out);
  return out;
}
