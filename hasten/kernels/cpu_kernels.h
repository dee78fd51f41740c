// The CPU kernels of hasten_cpu_kernels, one module built from several sources (see build.py):
// the entry points each source defines, so that the C++ decoder loop (decoder_loop_cpu.cpp) can
// call them without going back through Python. Shapes and layouts are documented at each source.
#pragma once

#include <ATen/ATen.h>

// quant_linear_cpu.cpp: weight-only int4 / int8 linears and the float32 register-tile linear;
// quant_linear_q8_cpu.cpp: int4_linear_q8 (int8 activations); quant_gemm_q8_cpu.cpp: the int8-activation
// GEMMs (weights repacked 8 rows side by side by the *_pack_rows8 functions)
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                       int64_t group);
at::Tensor int4_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const at::Tensor& mins, int64_t group);
at::Tensor int4_linear_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                            const at::Tensor& mins, int64_t group);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales);
void set_q8_gemm_wide_rows(int64_t rows);
void set_q8_gemm_x_panel(int64_t bytes);
bool q8_gemm_has_wide_tiles();
bool q8_gemm_has_vnni();
std::vector<at::Tensor> int4_pack_rows8(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                                        int64_t group);
at::Tensor int4_linear_q8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales8,
                               const at::Tensor& mins8, int64_t group, int64_t N);
// silu(gate) * up of [gate | up] = int4_linear_q8_gemm(x, ...) (N = 2 I, I a multiple of 8), [M, I]
at::Tensor int4_linear_q8_gemm_silu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales8,
                                    const at::Tensor& mins8, int64_t group, int64_t N);
std::vector<at::Tensor> int8_pack_rows8(const at::Tensor& qweight, const at::Tensor& scales);
at::Tensor int8_linear_q8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales8, int64_t N);
std::vector<at::Tensor> int8g_pack_rows8(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
                                         int64_t group);
at::Tensor int8g_linear_q8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales8,
                                const at::Tensor& mins8, int64_t group, int64_t N);
at::Tensor float_linear(const at::Tensor& x, const at::Tensor& weight);
// gemm_u8_cpu.cpp: the wide int8 GEMM over an 8-bit-per-row copy of a quantized weight
std::vector<at::Tensor> u8_pack_rows16(const at::Tensor& weight);
at::Tensor u8_linear_q8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& step,
                             const at::Tensor& offset, int64_t N, int64_t x_runs = 1, bool pow2_x_scales = false);
at::Tensor u8_linear_q8_gemm_silu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& step,
                                  const at::Tensor& offset, int64_t N, int64_t x_runs = 1, bool pow2_x_scales = false);
bool u8_gemm_has_tiles();
// gemm_bf16_amx_cpu.cpp: the wide bfloat16 GEMM on AMX tiles over a tile-ordered copy of a weight
at::Tensor bf16_tiles_pack(const at::Tensor& weight);
at::Tensor bf16_tiles_linear(const at::Tensor& x, const at::Tensor& packed, bool stream);
at::Tensor bf16_tiles_linear_silu(const at::Tensor& x, const at::Tensor& packed, bool stream, bool tiles_out);
bool bf16_tiles_available();
// bf16_tiles_linear's x in tile order, bfloat16 [M / 16, K / 32, 16, 32] (written by its own stream copy,
// rms_norm_tiles and bf16_tiles_linear_silu's tiles_out): the element offset of row r's first 32 values;
// those of k tile kb lie kb * 512 further on
inline int64_t bf16_tile_row(int64_t r, int64_t k_tiles) { return ((r / 16) * k_tiles * 16 + r % 16) * 32; }

// paged_attention_cpu.cpp (window > 0: sliding-window attention; softcap > 0: soft-capped scores;
// wide_rows > 0: sequences with that many new tokens in bfloat16 SDPA; int8_rows > 0: sequences with
// that many new tokens over an int8 cache score q rounded to int8 against the key codes, VNNI;
// int8_bf16_pv: their P V in bfloat16 dot products, AVX512-BF16; int8_tiles: those rows on AMX tiles,
// TDPBUSD scores and TDPBF16PS P V, where the CPU has AMX-INT8 and AMX-BF16; int8_decode: the other
// sequences over an int8 cache (decodes, short chunks) score q rounded to int8 against the key codes
// read in place, VNNI; lane_tokens > 0: tiles of that many new tokens or more over an int8, float16 or
// bfloat16 cache with their query rows in the vector lanes, attention_lane_tiles.h, AVX2; spread_prefetch:
// the block ahead requested a few lines per step of the loops, else in one burst, attention_prefetch.h)
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start,
                           const at::Tensor& context_lens, double scale, int64_t q_tile,
                           int64_t max_group, int64_t window = 0, double softcap = 0.0, int64_t wide_rows = 0,
                           int64_t int8_rows = 0, bool int8_bf16_pv = false, bool int8_tiles = false,
                           bool int8_decode = false, int64_t lane_tokens = 0, bool spread_prefetch = true);
bool attention_int8_has_tiles();
bool attention_int8_decode_has_tiles();
bool attention_lane_tiles_built();
bool attention_amx_available();
bool attention_bf16_pv_has_tiles();

// decoder_ops_cpu.cpp: the glue between a layer's matmuls
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor add_rms_norm(at::Tensor& h, const at::Tensor& delta, const at::Tensor& w, double eps);
at::Tensor rms_norm_tiles(at::Tensor& h, const std::optional<at::Tensor>& delta, const at::Tensor& w, double eps);
at::Tensor rope_and_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& positions, const at::Tensor& slots, at::Tensor& k_cache,
                          at::Tensor& v_cache, int64_t heads, int64_t kv_heads);
at::Tensor silu_mul(const at::Tensor& gate_up, bool fast = false);
