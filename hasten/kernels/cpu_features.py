"""What this CPU offers the wide paths (quant_bf16_gemm, attention_bf16, quant_u8_gemm, attention_int8_scores
in hasten.config)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles and the AVX-512 bfloat16 instructions: there oneDNN's bfloat16
    GEMM and SDPA run on AMX, ~4x hasten's int8-activation kernels from 128 rows on (measured on a
    2-core Sapphire Rapids slice; docs/benchmarks.md)."""
    try:
        return bool(torch.cpu._is_amx_tile_supported()) and bool(torch.cpu._is_avx512_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def cpu_has_bf16_dot() -> bool:
    """Whether this CPU has the AVX-512 bfloat16 dot product (or AMX): there oneDNN's bfloat16 GEMMs
    outrun float32 ones (a distillation step of the default model 1.70x on 2 Zen 4 cores, embedding
    fixed as well: benchmarks/distill.py --step-cost)."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported()) or cpu_has_amx()
    except (AttributeError, RuntimeError):
        return False


BF16_MODES = ("auto", "on", "off")


def check_mode(option: str, mode: str) -> None:
    """A switch's mode (auto | on | off), refused with the option's name otherwise."""
    if mode not in BF16_MODES:
        raise ValueError(f"{option} must be one of {BF16_MODES}, not {mode!r}")


def check_switch(option: str, mode: str, min_rows: int, least_rows: int = 1, unit: str = "rows") -> None:
    """A wide-path switch (auto | on | off) and its `<option>_min_<unit>` threshold, refused with the
    option's name when out of range."""
    check_mode(option, mode)
    if min_rows < least_rows:
        raise ValueError(f"{option}_min_{unit} must be >= {least_rows}, not {min_rows}")


def resolve_bf16_rows(option: str, mode: str, min_rows: int, auto_applies: bool = True) -> int:
    """A bfloat16 switch (auto | on | off) and its row threshold -> the threshold in force (0: off).
    auto is on where the CPU has AMX and `auto_applies` (e.g. only for quantized models)."""
    check_switch(option, mode, min_rows)
    if mode == "off" or (mode == "auto" and not (auto_applies and cpu_has_amx())):
        return 0
    return min_rows


def resolve_u8_rows(mode: str, min_rows: int, auto_applies: bool = True) -> int:
    """quant_u8_gemm (auto | on | off) and its row threshold -> the threshold in force (0: off). auto
    is on where the kernels built with the u8 GEMM's AVX-512 VNNI tiles and `auto_applies`."""
    check_switch("quant_u8_gemm", mode, min_rows)
    if mode == "off" or (mode == "auto" and not auto_applies):
        return 0
    if mode == "auto":
        from hasten.kernels.quant_linear import u8_gemm_has_tiles

        if not u8_gemm_has_tiles():
            return 0
    return min_rows


def resolve_bf16_pv(mode: str, int8_rows: int) -> bool:
    """attention_bf16_pv (auto | on | off) -> paged_attention's int8_bf16_pv. It applies to the
    sequences attention_int8_scores takes (int8_rows > 0); auto is on where the kernels have the
    AVX512-BF16 path, on asks for it (an error where they lack it)."""
    check_mode("attention_bf16_pv", mode)
    if mode == "off":
        return False
    from hasten.kernels.cpu_attention import bf16_pv_available

    if bf16_pv_available():
        return int8_rows > 0
    if mode == "on":
        raise ValueError("attention_bf16_pv=on needs the C++ kernels built with AVX512-BF16 (this CPU or build "
                         "lacks it); use attention_bf16_pv=auto or off")
    return False


def resolve_amx_attention(mode: str, bf16_pv: bool) -> bool:
    """attention_amx (auto | on | off) -> paged_attention's int8_tiles. It applies to the sequences
    attention_int8_scores takes with attention_bf16_pv (the tiles' P V is bfloat16); auto is on where
    the kernels and the CPU have AMX-INT8 and AMX-BF16, on asks for them (an error where they lack them)."""
    check_mode("attention_amx", mode)
    if mode == "off":
        return False
    from hasten.kernels.cpu_attention import amx_attention_available

    if amx_attention_available():
        return bf16_pv
    if mode == "on":
        raise ValueError("attention_amx=on needs a CPU with AMX-INT8 and AMX-BF16 and the C++ kernels built for it "
                         "(this CPU or build lacks them); use attention_amx=auto or off")
    return False


def resolve_int8_decode(mode: str, int8_cache: bool) -> bool:
    """attention_int8_decode (auto | on | off) -> paged_attention's int8_decode. auto is on for an int8
    KV cache where the kernels built with the path (AVX-512 VNNI, or AVX2 + FMA); on asks for that path
    (an int8 cache is still needed for it to apply)."""
    check_mode("attention_int8_decode", mode)
    if mode == "off" or (mode == "auto" and not int8_cache):
        return False
    from hasten.kernels.cpu_attention import int8_decode_available

    if int8_decode_available():
        return True
    if mode == "on":
        raise ValueError("attention_int8_decode=on needs the C++ kernels built with AVX2 + FMA or AVX-512 VNNI (this build has "
                         "no such path); use auto or off")
    return False


def resolve_int8_attention_rows(mode: str, min_rows: int, int8_cache: bool) -> int:
    """attention_int8_scores (auto | on | off) and its row threshold -> paged_attention's int8_rows (0:
    off). auto is on for an int8 KV cache where the kernels built with the VNNI path; on asks for that
    path (an int8 cache is still needed for it to apply)."""
    check_switch("attention_int8_scores", mode, min_rows, least_rows=2)
    if mode == "off" or (mode == "auto" and not int8_cache):
        return 0
    from hasten.kernels.cpu_attention import int8_scores_available

    if int8_scores_available():
        return min_rows
    if mode == "on":
        raise ValueError("attention_int8_scores=on needs the C++ kernels built with AVX-512 VNNI (this build has "
                         "no such path); use auto or off")
    return 0


def resolve_lane_tiles(mode: str, min_tokens: int) -> int:
    """attention_lane_tiles (auto | on | off) and its token threshold -> paged_attention's lane_tokens (0:
    off). auto is on where the kernels have the lane tiles (AVX2 + FMA) but not attention_int8_scores'
    AVX-512 VNNI path, which takes an int8 cache's prefill chunks there; on asks for the lane tiles (an
    error where the build lacks them)."""
    check_switch("attention_lane_tiles", mode, min_tokens, unit="tokens")
    if mode == "off":
        return 0
    from hasten.kernels.cpu_attention import int8_scores_available, lane_tiles_available

    if not lane_tiles_available():
        if mode == "on":
            raise ValueError("attention_lane_tiles=on needs the C++ kernels built with AVX2 and FMA (this build has "
                             "no such path); use auto or off")
        return 0
    if mode == "auto" and int8_scores_available():
        return 0
    return min_tokens


def resolve_q8_gemm_one_row(mode: str) -> bool:
    """quant_q8_gemm_one_row (auto | on | off) -> whether one-row calls of int8-activation int4 layers take
    the GEMM tiles (int4_linear_q8_gemm, 8 weight rows per register, the next blocks prefetched) instead of
    the one-row dot-product kernel. auto: where the tiles lack VNNI (plain AVX2), where they were measured
    faster (batch-1 decode of the default GGUF on 2 Zen 3 cores: docs/benchmarks.md)."""
    check_mode("quant_q8_gemm_one_row", mode)
    if mode != "auto":
        return mode == "on"
    from hasten.kernels.quant_linear import q8_gemm_has_vnni

    return not q8_gemm_has_vnni()
