// The wide bfloat16 GEMM on AMX tiles (bf16_tiles_linear): prefill chunks and wide decode batches of a
// quantized layer with quant_bf16_gemm, over a bfloat16 copy of its weight packed once into tile order.
//
// oneDNN's GEMM behind at::linear takes the row-major bfloat16 weight and reorders it for its AMX kernel
// on every call (the default model's gate_up weight is 3.5 MB: more than a core's L2). Here the weight is
// stored in the order the tiles load it, so a call only converts x to bfloat16 and runs the tiles:
//     y[m][n] = sum_k bf16(x[m][k]) * w[n][k]   (float32 sums in the tiles, as oneDNN's)
//
// Layout (bf16_tiles_pack): bfloat16 [N / 16, K / 32, 16, 16, 2]: element (nb, kb, p, c, e) is
// w[16 nb + c][32 kb + 2 p + e], so that one 1 KB tile load (16 rows of 64 bytes) is the B operand of
// TDPBF16PS for 16 outputs and 32 k. Each thread takes pairs of 16-output blocks and runs every 32 rows
// of x against them (2 x 2 tiles of 16 x 16 float32 sums: tmm0-3; x in tmm4-5; the weight in tmm6-7),
// so that a pair's 2 x K weight tiles stay near the core while x streams past from L2.
//
// x goes to a bfloat16 copy with its rows padded with zeros to a multiple of 32. With `stream` (the
// default; quant_bf16_gemm_stream in hasten.config) that copy is in tile order, [M / 16, K / 32, 16,
// 32], so that each x tile is one contiguous 1 KB run rather than 16 lines K * 2 bytes apart, and
// while a pair's tiles run the thread requests the lines of its next pair a few per k step (into L2),
// so that a pair's first pass over x does not wait on memory for its weight (from kAheadMinRows rows
// of x). Without it x is row-major and nothing is requested ahead. The tiles and their order are the
// same either way: the outputs are bit-identical.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <cstdint>

#include "amx_tiles.h"
#include "attention_math.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__)
#define HASTEN_AMX_BF16 1
#endif

namespace {

constexpr int64_t kTileRows = 16;  // rows of x per tile, and outputs per weight tile
constexpr int64_t kTileK = 32;     // k per tile (64 bytes of bfloat16)
// rows of x from which the next blocks' lines are requested ahead: with one pass of 32 rows per block
// they went out in bursts beside the current blocks' own misses and the calls were ~4 % slower
// (benchmarks/bf16_tiles.py at 32 rows), from 64 rows on they gain
constexpr int64_t kAheadMinRows = 64;

#if defined(HASTEN_AMX_BF16)

bool amx_ready() { return hasten_amx::amx_ready(hasten_amx::kAmxBf16); }

// The lines of the weight blocks a thread takes next (two runs of `lines` lines each), requested a
// few per k step of the current blocks' tiles, so that they are in L2 when their turn comes.
struct NextBlocks {
  const char* a = nullptr;
  const char* b = nullptr;
  int64_t lines = 0, next = 0, per_step = 0;

  void start(const void* run_a, const void* run_b, int64_t bytes, int64_t steps) {
    a = static_cast<const char*>(run_a);
    b = static_cast<const char*>(run_b);
    lines = bytes / 64;
    next = 0;
    per_step = (lines + steps - 1) / steps;
  }
  __attribute__((always_inline)) void request() {
    for (int64_t i = 0; i < per_step && next < lines; ++i, ++next) {
      _mm_prefetch(a + 64 * next, _MM_HINT_T1);
      _mm_prefetch(b + 64 * next, _MM_HINT_T1);
    }
  }
};

// 32 rows of x (two tiles of 16 rows: the k-th at x0 + kb * x_kstep and x1 + kb * x_kstep, rows
// x_stride bytes apart) against NB weight blocks of 16 outputs (w0, w1: their K / 32 tiles in a row)
// -> y (row stride y_stride bytes); `ahead` (or null) requests a few lines of the next blocks per k step
template <int NB>
void tile_block(const char* x0, const char* x1, int64_t x_kstep, int64_t x_stride, const at::BFloat16* w0,
                const at::BFloat16* w1, int64_t k_tiles, float* y, int64_t y_stride, NextBlocks* ahead) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (NB == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < k_tiles; ++kb) {
    if (ahead) ahead->request();
    _tile_loadd(4, x0 + kb * x_kstep, x_stride);
    _tile_loadd(5, x1 + kb * x_kstep, x_stride);
    _tile_loadd(6, w0 + kb * kTileRows * kTileK, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if constexpr (NB == 2) {
      _tile_loadd(7, w1 + kb * kTileRows * kTileK, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  char* y0 = reinterpret_cast<char*>(y);
  _tile_stored(0, y0, y_stride);
  _tile_stored(1, y0 + kTileRows * y_stride, y_stride);
  if constexpr (NB == 2) {
    _tile_stored(2, y0 + 64, y_stride);
    _tile_stored(3, y0 + 64 + kTileRows * y_stride, y_stride);
  }
}

// Where the tiles of x's 32 rows from `r` are: a bfloat16 copy made by tile_rows_of, in tile order
// (stream) or row-major
struct XTiles {
  const char* base;
  int64_t k_tiles;
  bool stream;

  int64_t kstep() const { return stream ? kTileRows * 64 : 64; }
  int64_t stride() const { return stream ? 64 : k_tiles * 64; }
  const char* rows(int64_t r) const { return base + r * k_tiles * 64; }  // the same offset in both layouts
  const char* second(int64_t r) const { return rows(r + kTileRows); }
};
#endif

}  // namespace

bool bf16_tiles_available() {
#if defined(HASTEN_AMX_BF16)
  return amx_ready();
#else
  return false;
#endif
}

at::Tensor bf16_tiles_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "bf16_tiles_pack: a 2-D weight [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n > 0 && n % kTileRows == 0 && k > 0 && k % kTileK == 0,
              "bf16_tiles_pack: N a multiple of 16 and K of 32, got [", n, ", ", k, "]");
  return weight.to(at::kBFloat16)
      .reshape({n / kTileRows, kTileRows, k / kTileK, kTileK / 2, 2})
      .permute({0, 2, 3, 1, 4})
      .contiguous();
}

namespace {

// `fn`'s check that `packed` is bf16_tiles_pack's [N / 16, K / 32, 16, 16, 2] bfloat16 tensor
void check_packed(const at::Tensor& packed, const char* fn) {
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kBFloat16 && packed.size(2) == kTileK / 2 &&
                  packed.size(3) == kTileRows && packed.size(4) == 2 && packed.is_contiguous(),
              fn, ": packed is bf16_tiles_pack's [N / 16, K / 32, 16, 16, 2] bfloat16 tensor");
}

// `fn`'s check of x (float32 [M, K]) and of the tiles, then x as the tiles read it: bfloat16 with M
// rounded up to 32, the padding rows zero; [M, K] row-major, or with `stream` [M / 16, K / 32, 16, 32].
// An x already in that tile order (4-D bfloat16, M a multiple of 32) is taken as it is.
at::Tensor tile_rows_of(const at::Tensor& x, int64_t k, bool stream, const char* fn) {
  if (x.dim() == 4) {  // already in tile order (bf16_tiles_linear_silu's tiles_out)
    TORCH_CHECK(stream && x.scalar_type() == at::kBFloat16 && x.size(0) % 2 == 0 && x.size(1) * kTileK == k &&
                    x.size(2) == kTileRows && x.size(3) == kTileK && x.is_contiguous(),
                fn, ": x in tile order is bfloat16 [M / 16, ", k / kTileK, ", 16, 32] with M a multiple of 32 (and stream), got ",
                x.sizes(), " ", x.scalar_type());
    return x;
  }
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kFloat, fn, ": float32 x [M, ", k, "], got ",
              x.sizes(), " ", x.scalar_type());
#if defined(HASTEN_AMX_BF16)
  TORCH_CHECK(amx_ready(), fn, ": this CPU (or the OS) offers no AMX bfloat16 tiles");
#else
  TORCH_CHECK(false, fn, ": this build has no AMX bfloat16 tiles");
#endif
  const int64_t m = x.size(0), m_pad = (m + 2 * kTileRows - 1) / (2 * kTileRows) * (2 * kTileRows);
  at::Tensor xb = at::empty({m_pad, k}, x.options().dtype(at::kBFloat16));
  if (!stream) {
    xb.narrow(0, 0, m).copy_(x);
    if (m_pad > m) xb.narrow(0, m, m_pad - m).zero_();
    return xb;
  }
#if defined(HASTEN_AMX_BF16)
  const at::Tensor xc = x.contiguous();
  const float* xf = xc.data_ptr<float>();
  uint16_t* xo = reinterpret_cast<uint16_t*>(xb.data_ptr<at::BFloat16>());
  const int64_t k_tiles = k / kTileK;
  at::parallel_for(0, m_pad / kTileRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t rb = begin; rb < end; ++rb)
      for (int64_t i = 0; i < kTileRows; ++i) {
        const int64_t row = rb * kTileRows + i;
        for (int64_t kb = 0; kb < k_tiles; ++kb) {
          uint16_t* o = xo + bf16_tile_row(row, k_tiles) + kb * kTileRows * kTileK;
          __m512i v = _mm512_setzero_si512();
          if (row < m) {  // round to nearest even, as at::Tensor's conversion
            const float* src = xf + row * k + kb * kTileK;
            v = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src)));
          }
          _mm512_store_si512(o, v);
        }
      }
  });
#endif
  return xb;
}

}  // namespace

at::Tensor bf16_tiles_linear(const at::Tensor& x, const at::Tensor& packed, bool stream) {
  check_packed(packed, "bf16_tiles_linear");
  const int64_t n_blocks = packed.size(0), k_tiles = packed.size(1);
  const int64_t n = n_blocks * kTileRows, k = k_tiles * kTileK;
  const at::Tensor xb = tile_rows_of(x, k, stream, "bf16_tiles_linear");
  const int64_t m_pad = x.dim() == 4 ? x.size(0) * kTileRows : xb.size(0), m = x.dim() == 4 ? m_pad : x.size(0);
#if defined(HASTEN_AMX_BF16)
  at::Tensor y = at::empty({m_pad, n}, x.options().dtype(at::kFloat));
  const XTiles xt{reinterpret_cast<const char*>(xb.data_ptr<at::BFloat16>()), k_tiles, stream};
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  float* yp = y.data_ptr<float>();
  const int64_t y_stride = n * 4, block = k_tiles * kTileRows * kTileK;
  const int64_t pairs = (n_blocks + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    hasten_amx::configure_16x64_tiles();  // C: 16 float32 sums per row; x: 32 bfloat16; weight: 16 pairs
    NextBlocks next;
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t nb = 2 * pair;
      const at::BFloat16* w0 = wp + nb * block;
      // the next pair is a whole one, and x has rows enough to spread its lines over (kAheadMinRows)
      const bool ahead = stream && m_pad >= kAheadMinRows && pair + 1 < end && nb + 3 < n_blocks;
      if (ahead) next.start(w0 + 2 * block, w0 + 3 * block, block * 2, m_pad / (2 * kTileRows) * k_tiles);
      for (int64_t r = 0; r < m_pad; r += 2 * kTileRows) {
        float* yr = yp + r * n + nb * kTileRows;
        if (nb + 1 < n_blocks)
          tile_block<2>(xt.rows(r), xt.second(r), xt.kstep(), xt.stride(), w0, w0 + block, k_tiles, yr, y_stride,
                        ahead ? &next : nullptr);
        else
          tile_block<1>(xt.rows(r), xt.second(r), xt.kstep(), xt.stride(), w0, nullptr, k_tiles, yr, y_stride,
                        nullptr);
      }
    }
    _tile_release();
  });
  return y.narrow(0, 0, m);
#else
  return at::Tensor();  // (tile_rows_of has refused)
#endif
}

// silu(gate) * up of y = [gate | up] = x W^T (W packed by bf16_tiles_pack, N = 2 I): each thread takes
// 16-output blocks of gate with the matching blocks of up (I / 16 further on), runs 32 rows of x
// against the two (tile_block, as bf16_tiles_linear does: the same sums) into a 32 x 32 buffer, and
// writes silu_mul_fast16 of each row's 16 pairs. So the result is silu_mul(bf16_tiles_linear(x, W),
// fast=true) bit for bit, without writing the [M, 2 I] output or reading it back. tiles_out (with
// stream, I a multiple of 32): the result rounded to bfloat16 straight into the tile order that
// bf16_tiles_linear reads x in, [M_pad / 16, I / 32, 16, 32] with M_pad = M rounded up to 32 (rows past
// M are zero), for a down projection on the same tiles: the values its own conversion would make.
at::Tensor bf16_tiles_linear_silu(const at::Tensor& x, const at::Tensor& packed, bool stream, bool tiles_out) {
  check_packed(packed, "bf16_tiles_linear_silu");
  const int64_t n_blocks = packed.size(0), k_tiles = packed.size(1), k = k_tiles * kTileK;
  TORCH_CHECK(n_blocks % 2 == 0, "bf16_tiles_linear_silu: N = 2 I with I a multiple of 16, got N = ",
              n_blocks * kTileRows);
  const at::Tensor xb = tile_rows_of(x, k, stream, "bf16_tiles_linear_silu");
  const int64_t m_pad = x.dim() == 4 ? x.size(0) * kTileRows : xb.size(0), m = x.dim() == 4 ? m_pad : x.size(0);
  const int64_t inter_blocks = n_blocks / 2, inter = inter_blocks * kTileRows;
  TORCH_CHECK(!tiles_out || (stream && inter % kTileK == 0),
              "bf16_tiles_linear_silu: tiles_out needs stream and I a multiple of 32, got I = ", inter);
#if defined(HASTEN_AMX_BF16)
  at::Tensor y = tiles_out ? at::empty({m_pad / kTileRows, inter / kTileK, kTileRows, kTileK}, x.options().dtype(at::kBFloat16))
                           : at::empty({m_pad, inter}, x.options().dtype(at::kFloat));
  const XTiles xt{reinterpret_cast<const char*>(xb.data_ptr<at::BFloat16>()), k_tiles, stream};
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  float* yp = tiles_out ? nullptr : y.data_ptr<float>();
  uint16_t* yt = tiles_out ? reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()) : nullptr;
  const int64_t y_k_tiles = inter / kTileK;
  const int64_t block = k_tiles * kTileRows * kTileK;
  at::parallel_for(0, inter_blocks, 1, [&](int64_t begin, int64_t end) {
    hasten_amx::configure_16x64_tiles();  // C: 16 float32 sums per row; x: 32 bfloat16; weight: 16 pairs
    NextBlocks next;
    alignas(64) float sums[2 * kTileRows][2 * kTileRows];  // per row: 16 of gate, then 16 of up
    for (int64_t nb = begin; nb < end; ++nb) {
      const at::BFloat16* gate = wp + nb * block;
      const at::BFloat16* up = wp + (nb + inter_blocks) * block;
      const bool ahead = stream && m_pad >= kAheadMinRows && nb + 1 < end;
      if (ahead) next.start(gate + block, up + block, block * 2, m_pad / (2 * kTileRows) * k_tiles);
      for (int64_t r = 0; r < m_pad; r += 2 * kTileRows) {
        tile_block<2>(xt.rows(r), xt.second(r), xt.kstep(), xt.stride(), gate, up, k_tiles, sums[0], sizeof(sums[0]),
                      ahead ? &next : nullptr);
        if (yt) {  // rows r .. r + 31 of k tile nb / 2 of down's x, half nb % 2 of each row's 32 values
          for (int64_t i = 0; i < 2 * kTileRows; ++i) {
            const int64_t row = r + i;
            uint16_t* o = yt + bf16_tile_row(row, y_k_tiles) + nb / 2 * kTileRows * kTileK + nb % 2 * kTileRows;
            const __m512 v = hasten_attention::silu_mul_fast16(_mm512_load_ps(sums[i]), _mm512_load_ps(sums[i] + 16));
            _mm256_store_si256(reinterpret_cast<__m256i*>(o), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
          }
          continue;
        }
        float* out = yp + r * inter + nb * kTileRows;
        for (int64_t i = 0; i < 2 * kTileRows; ++i)
          _mm512_storeu_ps(out + i * inter,
                           hasten_attention::silu_mul_fast16(_mm512_load_ps(sums[i]), _mm512_load_ps(sums[i] + 16)));
      }
    }
    _tile_release();
  });
  return tiles_out ? y : y.narrow(0, 0, m);
#else
  return at::Tensor();  // (tile_rows_of has refused)
#endif
}
