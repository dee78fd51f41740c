// The decoder's layer loop in C++ (DecoderLoop), and the Python bindings of every CPU kernel.
//
// A batch-1 decode step of a small model is ~300 kernel calls; driven from Python each one pays
// for the interpreter, the binding and the tensor wrappers around it (~1-2 ms per step for
// SmolLM2-135M, measured). DecoderLoop holds the model's weights once and runs the same calls, in
// the same order and with the same kernels, as Decoder._forward_fused in hasten/model/decoder.py,
// so its outputs are bit-identical to the Python loop's.
//
// A projection is a Linear: float32 (at::linear), the float32 register tiles, hasten's int4 (exact
// or int8-activation) or int8 kernels, or any Python callable (called with the GIL held: layers
// the loop has no native path for, e.g. oneDNN's packed weights).

#include <torch/extension.h>

#include <array>
#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "cpu_kernels.h"

namespace {

enum class LinearKind { kDense, kTiled, kInt4, kInt4Q8, kInt8, kInt8G, kPython };

struct Linear {
  LinearKind kind = LinearKind::kDense;
  at::Tensor w, scales, mins;  // dense/tiled: w [N, K]; int4: codes, scales, mins; int8: qweight, scales
  std::optional<at::Tensor> packed8, scales8, mins8;  // int4_q8: the int8 GEMM's layout (int4_pack_rows8)
  int64_t group = 0;
  int64_t out_features = 0;  // int8g: N (the packed layout rounds it up to a multiple of 8)
  int64_t gemm_min_rows = 2;  // int4: rows from which the blocked GEMM path runs (Int4HastenLinear's)
  // QuantLinear.enable_bf16_gemm: from bf16_min_rows rows of x on, x in bfloat16 times this bfloat16
  // copy of the weight (5-D: bf16_tiles_pack's tile order, hasten's AMX kernel bf16_tiles_linear; 2-D:
  // row-major, at::linear, i.e. oneDNN); a python linear keeps
  // it only to tell the loop which rows it takes in bfloat16 (the callable does the multiply)
  std::optional<at::Tensor> bf16_weight;
  int64_t bf16_min_rows = 0;
  bool bf16_stream = true;  // bf16_tiles_linear's stream (quant_bf16_gemm_stream)
  // QuantLinear.enable_u8_gemm: from u8_min_rows rows of x on, u8_linear_q8_gemm over this 8-bit copy
  // of the weight (u8_pack_rows16's packed, step, offset; out_features rows)
  std::optional<std::vector<at::Tensor>> u8_weight;
  int64_t u8_min_rows = 0, u8_x_runs = 1;
  bool u8_pow2_x_scales = false;
  bool rounds_input = false;  // the layer rounds x (int8 or bfloat16 activations): not float32-exact anyway
  std::optional<at::Tensor> bias, inv_input_scale;
  py::object callable;

  // whether a call with `rows` rows of x takes the bfloat16 path
  bool takes_bf16(int64_t rows) const { return bf16_weight && rows >= bf16_min_rows; }
  bool takes_u8(int64_t rows) const { return u8_weight && rows >= u8_min_rows; }
  // whether such a call runs bf16_tiles_linear itself, with nothing after it (so its output tiles may
  // go straight into silu_mul: bf16_tiles_linear_silu)
  bool takes_bf16_tiles(int64_t rows) const {
    return kind != LinearKind::kPython && takes_bf16(rows) && bf16_weight->dim() == 5 && !bias && !inv_input_scale;
  }
  // the same for u8_linear_q8_gemm (u8_linear_q8_gemm_silu), a call the bfloat16 path does not take
  bool takes_u8_alone(int64_t rows) const {
    return kind != LinearKind::kPython && !takes_bf16(rows) && takes_u8(rows) && !bias && !inv_input_scale;
  }
  // the same for int4_linear_q8_gemm (int4_linear_q8_gemm_silu), a call neither path above takes
  bool takes_int4_gemm_alone(int64_t rows) const {
    return (kind == LinearKind::kInt4 || kind == LinearKind::kInt4Q8) && packed8 && rows >= gemm_min_rows &&
           !takes_bf16(rows) && !takes_u8(rows) && !bias && !inv_input_scale;
  }

  at::Tensor operator()(const at::Tensor& x_in) const {
    if (kind == LinearKind::kPython) {
      py::gil_scoped_acquire gil;
      return callable(x_in).cast<at::Tensor>();
    }
    at::Tensor x = x_in;
    if (inv_input_scale) x = x * inv_input_scale->to(x.scalar_type());
    at::Tensor y;
    if (takes_bf16(x.size(0))) {
      y = bf16_weight->dim() == 5 ? bf16_tiles_linear(x.contiguous(), *bf16_weight, bf16_stream)
                                  : at::linear(x.to(at::kBFloat16), *bf16_weight).to(x.scalar_type());
      if (bias) y += bias->to(y.scalar_type());
      return y;
    }
    if (takes_u8(x.size(0))) {
      const auto& u8 = *u8_weight;
      y = u8_linear_q8_gemm(x.contiguous(), u8[0], u8[1], u8[2], out_features, u8_x_runs, u8_pow2_x_scales);
      if (bias) y += bias->to(y.scalar_type());
      return y;
    }
    switch (kind) {
      case LinearKind::kDense:
        return at::linear(x, w, bias);  // bias inside, as F.linear
      case LinearKind::kTiled:
        y = float_linear(x.contiguous(), w);
        if (bias) y += *bias;
        return y;
      case LinearKind::kInt4:
      case LinearKind::kInt4Q8: {
        const at::Tensor xc = x.contiguous();
        if (x.size(0) >= gemm_min_rows && packed8)
          y = int4_linear_q8_gemm(xc, *packed8, *scales8, *mins8, group, w.size(0));
        else if (x.size(0) >= gemm_min_rows)
          y = int4_linear_gemm(xc, w, scales, mins, group);
        else
          y = kind == LinearKind::kInt4Q8 ? int4_linear_q8(xc, w, scales, mins, group)
                                          : int4_linear(xc, w, scales, mins, group);
        break;
      }
      case LinearKind::kInt8:
        y = int8_linear(x.contiguous(), w, scales);
        break;
      case LinearKind::kInt8G:  // w, scales, mins: int8g_pack_rows8's layout
        y = int8g_linear_q8_gemm(x.contiguous(), w, scales, mins, group, out_features);
        break;
      default:
        TORCH_CHECK(false, "unknown linear kind");
    }
    if (bias) y = y + bias->to(y.scalar_type());
    return y;
  }
};

Linear make_linear(const std::string& kind, std::vector<at::Tensor> tensors, int64_t group,
                   std::optional<at::Tensor> bias, std::optional<at::Tensor> inv_input_scale, py::object callable,
                   int64_t gemm_min_rows, int64_t out_features, std::optional<at::Tensor> bf16_weight,
                   int64_t bf16_min_rows, bool rounds_input, std::optional<std::vector<at::Tensor>> u8_weight,
                   int64_t u8_min_rows, int64_t u8_x_runs, bool u8_pow2_x_scales, bool bf16_stream) {
  Linear l;
  static const std::vector<std::pair<std::string, LinearKind>> kinds = {
      {"dense", LinearKind::kDense}, {"tiled", LinearKind::kTiled}, {"int4", LinearKind::kInt4},
      {"int4_q8", LinearKind::kInt4Q8}, {"int8", LinearKind::kInt8}, {"int8g", LinearKind::kInt8G},
      {"python", LinearKind::kPython}};
  bool found = false;
  for (const auto& [name, k] : kinds)
    if (name == kind) {
      l.kind = k;
      found = true;
    }
  TORCH_CHECK(found, "unknown linear kind ", kind);
  const size_t want = l.kind == LinearKind::kPython                                       ? 0
                      : l.kind == LinearKind::kInt4Q8 && tensors.size() == 6             ? 6
                      : l.kind == LinearKind::kInt4 || l.kind == LinearKind::kInt4Q8     ? 3
                      : l.kind == LinearKind::kInt8                                      ? 2
                      : l.kind == LinearKind::kInt8G                                     ? 3
                                                                                         : 1;
  TORCH_CHECK(tensors.size() == want, kind, " linear takes ", want, " tensors, got ", tensors.size());
  if (want >= 1) l.w = tensors[0];
  if (want >= 2) l.scales = tensors[1];
  if (want >= 3) l.mins = tensors[2];
  if (want == 6) {
    l.packed8 = tensors[3];
    l.scales8 = tensors[4];
    l.mins8 = tensors[5];
  }
  TORCH_CHECK(l.kind == LinearKind::kPython || !callable || callable.is_none(), "only python linears take a callable");
  TORCH_CHECK(l.kind != LinearKind::kPython || (callable && !callable.is_none()), "a python linear needs a callable");
  l.group = group;
  l.gemm_min_rows = gemm_min_rows;
  l.out_features = out_features;
  TORCH_CHECK(l.kind != LinearKind::kInt8G || out_features > 0, "an int8g linear needs out_features");
  TORCH_CHECK(!bf16_weight || (bf16_weight->scalar_type() == at::kBFloat16 &&
                                (bf16_weight->dim() == 2 || bf16_weight->dim() == 5) && bf16_min_rows >= 1),
              "bf16_weight: a 2-D bfloat16 tensor or bf16_tiles_pack's 5-D one, with bf16_min_rows >= 1");
  l.bf16_weight = std::move(bf16_weight);
  l.bf16_min_rows = bf16_min_rows;
  l.bf16_stream = bf16_stream;
  TORCH_CHECK(!u8_weight || (u8_weight->size() == 3 && u8_min_rows >= 1 && out_features > 0),
              "u8_weight: u8_pack_rows16's three tensors, with u8_min_rows >= 1 and out_features");
  l.u8_weight = std::move(u8_weight);
  l.u8_min_rows = u8_min_rows;
  l.u8_x_runs = u8_x_runs;
  l.u8_pow2_x_scales = u8_pow2_x_scales;
  l.rounds_input = rounds_input;
  l.bias = std::move(bias);
  l.inv_input_scale = std::move(inv_input_scale);
  l.callable = std::move(callable);
  return l;
}

struct Layer {
  at::Tensor input_norm, post_norm;
  std::optional<at::Tensor> q_norm, k_norm;
  Linear qkv, o, gate_up, down;
  int64_t window;  // sliding-window attention over the last `window` keys (0: every key)
};

at::Tensor contiguous(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

// Per-step time of each part of the loop, kept only while profiling is on (benchmarks read it: the
// calls inside the loop are invisible to Python profilers).
enum Part { kQkv, kRope, kAttention, kO, kGateUp, kSiluMul, kDown, kNorms, kNumParts };
constexpr std::array<const char*, kNumParts> kPartNames = {"qkv_proj", "rope_and_cache", "paged_attention", "o_proj",
                                                           "gate_up_proj", "silu_mul", "down_proj", "norms"};

class PartTimer {
 public:
  explicit PartTimer(std::array<double, kNumParts>* totals) : totals_(totals) {
    if (totals_) last_ = std::chrono::steady_clock::now();
  }
  // charges the time since the previous mark to `part`
  void mark(Part part) {
    if (!totals_) return;
    const auto now = std::chrono::steady_clock::now();
    (*totals_)[part] += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  std::array<double, kNumParts>* totals_;
  std::chrono::steady_clock::time_point last_;
};

class DecoderLoop {
 public:
  DecoderLoop(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale, at::Tensor embed,
              at::Tensor final_norm, at::Tensor cos, at::Tensor sin)
      : heads_(heads), kv_heads_(kv_heads), d_(head_dim), eps_(eps), scale_(scale), embed_(std::move(embed)),
        final_norm_(std::move(final_norm)), cos_(std::move(cos)), sin_(std::move(sin)) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm, Linear qkv, Linear o, Linear gate_up, Linear down,
                 int64_t window) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together");
    layers_.push_back({std::move(input_norm), std::move(post_norm), std::move(q_norm), std::move(k_norm),
                       std::move(qkv), std::move(o), std::move(gate_up), std::move(down), window});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // input_ids, positions, slots: [T] int64; caches: one (k, v) pair per layer. Returns the
  // final-norm hidden states [T, hidden]. rows (out_rows [R], and the attention metadata of those rows
  // as one-token sequences: block tables, query starts 0 .. R, context lengths): the last layer
  // writes every row's keys and values, then runs attention, o_proj and the MLP for these rows only,
  // and the result is their hidden states [R, hidden] (llama.cpp's output-row selection).
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slots,
                     const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& context_lens,
                     std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                     std::optional<std::vector<at::Tensor>> rows) const {
    const int64_t L = num_layers();
    TORCH_CHECK(L > 0, "no layers");
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == L && static_cast<int64_t>(v_caches.size()) == L,
                "one k and one v cache per layer expected");
    TORCH_CHECK(!rows || rows->size() == 4, "rows: out_rows, block_tables, query_start, context_lens");
    const int64_t qd = heads_ * d_, kd = kv_heads_ * d_;
    PartTimer timer(profiling_ ? &totals_ : nullptr);
    at::Tensor h = embed_.index_select(0, input_ids);  // the residual stream, updated in place
    // a norm whose rows go to one call on bf16_tiles_linear with stream hands them over in its tile order
    auto tiles_in = [](const Linear& lin, int64_t rows) { return lin.bf16_stream && lin.takes_bf16_tiles(rows); };
    at::Tensor x = tiles_in(layers_[0].qkv, h.size(0)) ? rms_norm_tiles(h, std::nullopt, layers_[0].input_norm, eps_)
                                                       : rms_norm(h, layers_[0].input_norm, eps_);
    timer.mark(kNorms);
    for (int64_t i = 0; i < L; ++i) {
      const Layer& lw = layers_[i];
      at::Tensor qkv = x.dim() == 4 ? bf16_tiles_linear(x, *lw.qkv.bf16_weight, true).narrow(0, 0, h.size(0))
                                    : contiguous(lw.qkv(x));
      if (lw.q_norm) {  // Qwen3: per-head RMSNorm of q and k before RoPE
        const int64_t t = qkv.size(0);
        at::Tensor q = rms_norm(qkv.slice(1, 0, qd).reshape({-1, d_}), *lw.q_norm, eps_).view({t, qd});
        at::Tensor k = rms_norm(qkv.slice(1, qd, qd + kd).reshape({-1, d_}), *lw.k_norm, eps_).view({t, kd});
        qkv = at::cat({q, k, qkv.slice(1, qd + kd)}, 1);
      }
      timer.mark(kQkv);
      at::Tensor q = rope_and_cache(qkv, cos_, sin_, positions, slots, k_caches[i], v_caches[i], heads_, kv_heads_);
      const bool picked = rows && i + 1 == L;  // the last layer, for the out rows only
      if (picked) {
        q = q.index_select(0, (*rows)[0]);
        h = h.index_select(0, (*rows)[0]);
      }
      timer.mark(kRope);
      at::Tensor attn = paged_attention(contiguous(q), k_caches[i], v_caches[i], picked ? (*rows)[1] : block_tables,
                                        picked ? (*rows)[2] : query_start, picked ? (*rows)[3] : context_lens, scale_, 8,
                                        attention_group_, lw.window, 0.0, wide_attention_rows_, int8_attention_rows_,
                                        bf16_pv_, int8_tiles_, int8_decode_, lane_tokens_,
                                        spread_prefetch_);
      timer.mark(kAttention);
      at::Tensor o = contiguous(lw.o(attn));
      timer.mark(kO);
      const int64_t rows = h.size(0);
      const bool fast = lw.down.takes_bf16(rows) || (fast_silu_ && lw.down.rounds_input);
      const Linear& gu = lw.gate_up;
      const bool silu_tiles = gemm_silu_ && fast && gu.takes_bf16_tiles(rows);
      x = silu_tiles && gu.bf16_stream ? rms_norm_tiles(h, o, lw.post_norm, eps_) : add_rms_norm(h, o, lw.post_norm, eps_);
      timer.mark(kNorms);
      at::Tensor act;
      bool handed = false;  // act is down's x, in tile order
      if (silu_tiles) {
        // down on the same tiles, both with stream: gate_up hands it its x already rounded and in tile order
        handed = gu.bf16_stream && lw.down.bf16_stream && lw.down.takes_bf16_tiles(rows) &&
                 lw.down.bf16_weight->size(1) * 32 == gu.bf16_weight->size(0) * 8;
        act = bf16_tiles_linear_silu(contiguous(x), *gu.bf16_weight, gu.bf16_stream, handed);  // the same values,
        if (x.dim() == 4 && !handed) act = act.narrow(0, 0, rows);                             // one pass
        timer.mark(kGateUp);
      } else if (u8_silu_ && fast && gu.takes_u8_alone(x.size(0)) && gu.out_features % 32 == 0) {
        const auto& u8 = *gu.u8_weight;  // the same values, one pass
        act = u8_linear_q8_gemm_silu(contiguous(x), u8[0], u8[1], u8[2], gu.out_features, gu.u8_x_runs,
                                     gu.u8_pow2_x_scales);
        timer.mark(kGateUp);
      } else if (int4_silu_ && fast && gu.takes_int4_gemm_alone(x.size(0)) && gu.w.size(0) % 16 == 0) {
        act = int4_linear_q8_gemm_silu(contiguous(x), *gu.packed8, *gu.scales8, *gu.mins8, gu.group, gu.w.size(0));
        timer.mark(kGateUp);  // the same values, one pass
      } else {
        act = contiguous(lw.gate_up(x));
        timer.mark(kGateUp);
        act = silu_mul(act, fast);
      }
      timer.mark(kSiluMul);
      at::Tensor down = handed ? bf16_tiles_linear(act, *lw.down.bf16_weight, true).narrow(0, 0, rows)
                               : contiguous(lw.down(act));
      timer.mark(kDown);
      x = i + 1 < L && tiles_in(layers_[i + 1].qkv, rows) ? rms_norm_tiles(h, down, layers_[i + 1].input_norm, eps_)
                                                          : add_rms_norm(h, down, i + 1 < L ? layers_[i + 1].input_norm
                                                                                            : final_norm_, eps_);
      timer.mark(kNorms);
    }
    if (profiling_) ++profiled_calls_;
    return x;
  }

  // the paged-attention kernel's max_group (decode sequences sharing prefix blocks; < 2: off)
  void set_attention_group(int64_t n) { attention_group_ = n; }

  // paged_attention's wide_rows: sequences with this many new tokens attend in bfloat16 SDPA (0: off)
  void set_wide_attention_rows(int64_t n) { wide_attention_rows_ = n; }

  // paged_attention's int8_rows: sequences with this many new tokens score in int8 (0: off)
  void set_int8_attention_rows(int64_t n) { int8_attention_rows_ = n; }

  // paged_attention's int8_bf16_pv: those sequences' P V in bfloat16 dot products
  void set_bf16_pv(bool on) { bf16_pv_ = on; }

  // paged_attention's int8_tiles: those sequences on AMX tiles
  void set_int8_tiles(bool on) { int8_tiles_ = on; }

  // paged_attention's int8_decode: the other sequences over an int8 cache score in int8, in place
  void set_int8_decode(bool on) { int8_decode_ = on; }
  // paged_attention's spread_prefetch: the block ahead requested a few lines per step of the loops
  void set_spread_prefetch(bool on) { spread_prefetch_ = on; }

  // paged_attention's lane_tokens: tiles of this many new tokens over a narrower cache, query rows in the lanes
  void set_lane_tokens(int64_t n) { lane_tokens_ = n; }

  // silu_mul's vectorized exp (~2 ulp) for every call whose down projection rounds its input anyway
  void set_fast_silu(bool on) { fast_silu_ = on; }

  // gate_up calls on hasten's AMX bfloat16 kernel with the fast SiLU apply it to their own output
  // tiles (bf16_tiles_linear_silu: bit-identical to the two calls)
  void set_gemm_silu(bool on) { gemm_silu_ = on; }

  // the same for gate_up calls on the 8-bit GEMM (u8_linear_q8_gemm_silu: bit-identical to the two calls)
  void set_u8_silu(bool on) { u8_silu_ = on; }

  // and for gate_up calls on the int4 int8-activation GEMM (int4_linear_q8_gemm_silu: bit-identical)
  void set_int4_silu(bool on) { int4_silu_ = on; }

  // Profiling: per-part seconds summed over the forward calls since it was switched on.
  void set_profiling(bool on) {
    profiling_ = on;
    totals_.fill(0.0);
    profiled_calls_ = 0;
  }

  py::dict timings() const {
    py::dict out;
    for (int p = 0; p < kNumParts; ++p) out[kPartNames[p]] = totals_[p];
    out["calls"] = profiled_calls_;
    return out;
  }

 private:
  int64_t heads_, kv_heads_, d_;
  double eps_, scale_;
  at::Tensor embed_, final_norm_, cos_, sin_;
  std::vector<Layer> layers_;
  bool profiling_ = false;
  int64_t attention_group_ = 8;
  int64_t wide_attention_rows_ = 0;
  int64_t int8_attention_rows_ = 0;
  bool fast_silu_ = false;
  bool gemm_silu_ = false;
  bool u8_silu_ = false;
  bool int4_silu_ = false;
  bool bf16_pv_ = false;
  bool int8_tiles_ = false;
  bool int8_decode_ = false;
  bool spread_prefetch_ = true;
  int64_t lane_tokens_ = 0;
  mutable std::array<double, kNumParts> totals_{};
  mutable int64_t profiled_calls_ = 0;
};

}  // namespace

// The kernels touch no Python objects: let other Python threads (the server's event loop) run.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using py::arg;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("int4_linear", &int4_linear, nogil, "y = x W^T with 4-bit weights (codes, float16 scales and mins), float32 x");
  m.def("int4_linear_gemm", &int4_linear_gemm, nogil, "as int4_linear, through blocks of float32 weights and the float32 GEMM (many rows of x)");
  m.def("int8_linear", &int8_linear, nogil, "y = x W^T with int8 weights (per-row float32 scales), float32 x");
  m.def("float_linear", &float_linear, nogil, "y = x W^T, float32, through the register tiles");
  m.def("u8_pack_rows16", &u8_pack_rows16, nogil, "a float32 weight [N, K] as 8-bit codes per row (u8_linear_q8_gemm's layout)");
  m.def("u8_linear_q8_gemm", &u8_linear_q8_gemm, nogil, arg("x"), arg("packed"), arg("step"), arg("offset"), arg("n"),
        arg("x_runs") = 1, arg("pow2_x_scales") = false,
        "y = x W^T over u8_pack_rows16's layout, x rounded to int8 per 32 values (x_runs > 1: up to that many "
        "consecutive 32-runs share one scale; pow2_x_scales: each scale rounded up to a power of two)");
  m.def("u8_linear_q8_gemm_silu", &u8_linear_q8_gemm_silu, nogil, arg("x"), arg("packed"), arg("step"), arg("offset"),
        arg("n"), arg("x_runs") = 1, arg("pow2_x_scales") = false,
        "silu_mul(u8_linear_q8_gemm(x, ...), fast=True) for packed [gate | up] (n = 2 I), from the output tiles");
  m.def("bf16_tiles_pack", &bf16_tiles_pack, nogil, "a weight [N, K] as bfloat16 in AMX tile order (bf16_tiles_linear's layout)");
  m.def("bf16_tiles_linear", &bf16_tiles_linear, nogil, arg("x"), arg("packed"), arg("stream") = true,
        "y = x W^T with x rounded to bfloat16, over bf16_tiles_pack's layout, on AMX tiles (float32 sums); stream: "
        "x copied in tile order and the next weight blocks requested ahead (the same outputs)");
  m.def("bf16_tiles_linear_silu", &bf16_tiles_linear_silu, nogil, arg("x"), arg("packed"), arg("stream") = true,
        arg("tiles_out") = false,
        "silu_mul(bf16_tiles_linear(x, packed), fast=True) for packed [gate | up], from the output tiles");
  m.def("bf16_tiles_available", &bf16_tiles_available, "whether this build and CPU run bf16_tiles_linear (AMX-BF16)");
  m.def("u8_gemm_has_tiles", &u8_gemm_has_tiles, "whether this build has the AVX-512 VNNI tiles of u8_linear_q8_gemm");
  m.def("int4_linear_q8", &int4_linear_q8, nogil, "as int4_linear, with x quantized to int8 per 32 values");
  m.def("int8_pack_rows8", &int8_pack_rows8, nogil, "int8 weight and row scales -> the layout of int8_linear_q8_gemm");
  m.def("int8_linear_q8_gemm", &int8_linear_q8_gemm, nogil,
        "y = x W^T for int8 W with x quantized to int8 per 32 values: u8 x s8 multiply-adds over 8 weight rows at once");
  m.def("int8g_pack_rows8", &int8g_pack_rows8, nogil,
        "grouped int8 weight (codes, float32 scales and mins per 16 or 32 k) -> the layout of int8g_linear_q8_gemm");
  m.def("int8g_linear_q8_gemm", &int8g_linear_q8_gemm, nogil,
        "y = x W^T for grouped int8 W (scale and min per group) with x quantized to int8 per 32 values");
  m.def("set_q8_gemm_wide_rows", &set_q8_gemm_wide_rows, arg("rows"),
        "rows of x from which the int8-activation GEMMs take their AVX-512 16-row tiles (0: never)");
  m.def("set_q8_gemm_x_panel", &set_q8_gemm_x_panel, arg("bytes"),
        "bytes of int8 x per panel of the 8-row tiles, which every block of a task passes over in turn (0: off)");
  m.def("q8_gemm_has_wide_tiles", &q8_gemm_has_wide_tiles, "whether this build has the AVX-512 16-row tiles");
  m.def("q8_gemm_has_vnni", &q8_gemm_has_vnni, "whether the int8-activation GEMM tiles multiply-add with VNNI");
  m.def("int4_pack_rows8", &int4_pack_rows8, nogil, "int4 codes, scales, mins -> the layout of int4_linear_q8_gemm");
  m.def("int4_linear_q8_gemm", &int4_linear_q8_gemm, nogil,
        "int4_linear_q8 for many rows of x: u8 x s8 multiply-adds over 8 weight rows at once");
  m.def("int4_linear_q8_gemm_silu", &int4_linear_q8_gemm_silu, nogil,
        "silu_mul(int4_linear_q8_gemm(x, ...), fast=True) for packed [gate | up] (n = 2 I), from the output tiles");
  m.def("paged_attention", &paged_attention, nogil, arg("q"), arg("k_cache"), arg("v_cache"), arg("block_tables"),
        arg("query_start"), arg("context_lens"), arg("scale"), arg("q_tile") = 8, arg("max_group") = 8,
        arg("window") = 0, arg("softcap") = 0.0, arg("wide_rows") = 0, arg("int8_rows") = 0,
        arg("int8_bf16_pv") = false, arg("int8_tiles") = false, arg("int8_decode") = false, arg("lane_tokens") = 0,
        arg("spread_prefetch") = true,
        "Paged attention over a block pool (CPU)");
  m.def("attention_int8_decode_has_tiles", &attention_int8_decode_has_tiles,
        "whether this build scores decode rows over an int8 cache in integers (AVX-512 VNNI or AVX2 + FMA; "
        "paged_attention's int8_decode)");
  m.def("attention_lane_tiles_built", &attention_lane_tiles_built,
        "whether this build has the query-rows-in-lanes prefill tiles (AVX2 + FMA)");
  m.def("attention_int8_has_tiles", &attention_int8_has_tiles,
        "whether this build scores prefill rows over an int8 cache with AVX-512 VNNI (paged_attention's int8_rows)");
  m.def("attention_amx_available", &attention_amx_available,
        "whether this build and CPU take int8_rows on AMX tiles (paged_attention's int8_tiles)");
  m.def("attention_bf16_pv_has_tiles", &attention_bf16_pv_has_tiles,
        "whether this build takes int8_rows' P V in AVX512-BF16 dot products (paged_attention's int8_bf16_pv)");
  m.def("rms_norm", &rms_norm, nogil, "RMSNorm of each row");
  m.def("add_rms_norm", &add_rms_norm, nogil, "h += delta in place, then RMSNorm of each row of h");
  m.def(
      "rms_norm_tiles",
      [](at::Tensor h, const at::Tensor& w, double eps, std::optional<at::Tensor> delta) {
        return rms_norm_tiles(h, delta, w, eps);
      },
      nogil, arg("h"), arg("w"), arg("eps"), arg("delta") = py::none(),
      "RMSNorm of each float32 row of h (after h += delta in place, given delta), rounded to bfloat16 in "
      "bf16_tiles_linear's tile order [M_pad / 16, hidden / 32, 16, 32] (rows past M zero)");
  m.def("rope_and_cache", &rope_and_cache, nogil, "rotary embedding of q and k; k and v written to their cache slots");
  m.def("silu_mul", &silu_mul, nogil, arg("gate_up"), arg("fast") = false,
        "silu(gate) * up; fast: float32 with a vectorized exp (~2 ulp), for rows then rounded to bfloat16");

  py::class_<Linear>(m, "Linear", "one projection of DecoderLoop: kind, its tensors, bias, AWQ input scale");
  m.def("make_linear", &make_linear, arg("kind"), arg("tensors"), arg("group") = 0, arg("bias") = py::none(),
        arg("inv_input_scale") = py::none(), arg("callable") = py::none(), arg("gemm_min_rows") = 2, arg("out_features") = 0,
        arg("bf16_weight") = py::none(), arg("bf16_min_rows") = 0, arg("rounds_input") = false,
        arg("u8_weight") = py::none(), arg("u8_min_rows") = 0, arg("u8_x_runs") = 1, arg("u8_pow2_x_scales") = false,
        arg("bf16_stream") = true,
        "kind: dense [w] | tiled [w] | int4 / int4_q8 [codes, scales, mins] (+ group; int4_q8 may add int4_pack_rows8's "
        "three tensors for its int8 GEMM) | int8 [qweight, scales] | int8g [int8g_pack_rows8's three] (+ group, "
        "out_features) | python (callable); u8_weight: u8_pack_rows16's three tensors for calls of u8_min_rows "
        "rows or more (+ out_features; u8_x_runs, u8_pow2_x_scales as u8_linear_q8_gemm's x_runs, pow2_x_scales); "
        "bf16_stream: bf16_tiles_linear's stream");
  py::class_<DecoderLoop>(m, "DecoderLoop", "the decoder's layer loop in C++ (see decoder_loop_cpu.cpp)")
      .def(py::init<int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(),
           arg("heads"), arg("kv_heads"), arg("head_dim"), arg("eps"), arg("scale"), arg("embed"), arg("final_norm"),
           arg("cos"), arg("sin"))
      .def("add_layer", &DecoderLoop::add_layer, arg("input_norm"), arg("post_norm"), arg("q_norm"), arg("k_norm"),
           arg("qkv"), arg("o"), arg("gate_up"), arg("down"), arg("window") = 0,
           "one layer's weights; window > 0: sliding-window attention over its last `window` keys")
      .def("num_layers", &DecoderLoop::num_layers)
      .def("forward", &DecoderLoop::forward, nogil, arg("input_ids"), arg("positions"), arg("slots"),
           arg("block_tables"), arg("query_start"), arg("context_lens"), arg("k_caches"), arg("v_caches"),
           arg("rows") = py::none(),
           "rows: [out_rows, their block tables, query starts, context lengths]: the last layer for those rows only")
      .def("set_attention_group", &DecoderLoop::set_attention_group,
           "most decode sequences one attention item serves over their shared prefix blocks (< 2: off)")
      .def("set_wide_attention_rows", &DecoderLoop::set_wide_attention_rows,
           "sequences with this many new tokens attend in bfloat16 (paged_attention's wide_rows; 0: off)")
      .def("set_int8_attention_rows", &DecoderLoop::set_int8_attention_rows,
           "sequences with this many new tokens score in int8 over an int8 cache (paged_attention's int8_rows; 0: off)")
      .def("set_bf16_pv", &DecoderLoop::set_bf16_pv,
           "P V of the int8-scored sequences in bfloat16 dot products (paged_attention's int8_bf16_pv)")
      .def("set_int8_tiles", &DecoderLoop::set_int8_tiles,
           "the int8-scored sequences on AMX tiles (paged_attention's int8_tiles)")
      .def("set_int8_decode", &DecoderLoop::set_int8_decode,
           "the other sequences over an int8 cache score in int8, in place (paged_attention's int8_decode)")
      .def("set_spread_prefetch", &DecoderLoop::set_spread_prefetch,
           "the block ahead requested a few lines per step of the loops (paged_attention's spread_prefetch)")
      .def("set_lane_tokens", &DecoderLoop::set_lane_tokens,
           "tiles of this many new tokens over a narrower cache take the query rows in the lanes (paged_attention's "
           "lane_tokens; 0: off)")
      .def("set_gemm_silu", &DecoderLoop::set_gemm_silu,
           "gate_up calls on the AMX bfloat16 kernel apply the fast SiLU to their output tiles")
      .def("set_u8_silu", &DecoderLoop::set_u8_silu,
           "gate_up calls on the 8-bit GEMM apply the fast SiLU to their output tiles")
      .def("set_int4_silu", &DecoderLoop::set_int4_silu,
           "gate_up calls on the int4 int8-activation GEMM apply the fast SiLU to their output tiles")
      .def("set_fast_silu", &DecoderLoop::set_fast_silu,
           "SiLU with the vectorized exp where the down projection rounds its input (int8 / bfloat16 x)")
      .def("set_profiling", &DecoderLoop::set_profiling, "switch per-part timing on (and reset it) or off")
      .def("timings", &DecoderLoop::timings, "per-part seconds summed over the calls since profiling went on");
}
