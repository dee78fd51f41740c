"""The C++ paged-attention kernel (paged_attention_cpu.cpp); see hasten.kernels.build."""

from __future__ import annotations

from types import ModuleType

import torch

from hasten.kernels.build import CPU_KERNELS

_ext = CPU_KERNELS


def load() -> ModuleType | None:
    """The compiled module, or None when it cannot be built here (reason in load_error())."""
    return _ext.load()


def load_error() -> str | None:
    return _ext.error


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    q_tile: int = 8,
    max_group: int = 8,
    window: int = 0,
    softcap: float = 0.0,
    wide_rows: int = 0,
    int8_rows: int = 0,
    int8_bf16_pv: bool = False,
    int8_tiles: bool = False,
    int8_decode: bool = False,
    lane_tokens: int = 0,
    spread_prefetch: bool = True,
) -> torch.Tensor:
    """See paged_attention_cpu.cpp for the layout. Raises RuntimeError if the kernel is unavailable.

    max_group: decode sequences whose block tables start with the same blocks (prefix-cache hits)
    are served by one work item of up to this many sequences that reads each shared block once;
    the result is bit-identical to max_group=1 (off).
    window > 0: each query token sees only its last `window` keys (sliding-window attention; no
    prefix groups then). softcap > 0: each scaled score x becomes softcap * tanh(x / softcap).
    wide_rows > 0: a sequence with that many new tokens (no soft cap, a window reaching key 0) attends
    through SDPA in bfloat16 over its gathered keys and values instead (AMX tiles where present).
    int8_rows > 0 (an int8 cache, head_dim 64 / 96 / 128, a build with AVX-512 VNNI; no soft cap, a
    window reaching key 0): a sequence with that many new tokens has each query row rounded to int8
    (one absmax scale) and its scores taken as integer dot products with the key codes
    (attention_int8_scores.h); elsewhere it is ignored. int8_bf16_pv: those sequences' softmax weights,
    times the value scales, are rounded to bfloat16 and P V taken as bfloat16 dot products with the
    value codes (AVX512-BF16 builds; elsewhere ignored). int8_tiles: those sequences on AMX tiles
    (attention_amx.h: TDPBUSD scores, TDPBF16PS P V with the weights of int8_bf16_pv, which it implies;
    head_dim 64 or 128, a CPU with AMX-INT8 and AMX-BF16; elsewhere ignored). int8_decode (an int8
    cache, head_dim a multiple of 32 up to 256, a build with AVX-512 VNNI; elsewhere ignored): the other
    sequences without a soft cap or a window short of key 0 (decodes, chunks under int8_rows) have their
    query rows rounded the same way and score against the key codes read in place from the pool
    (attention_int8_decode.h: no packing), P V in float32. lane_tokens > 0 (an int8, float16 or bfloat16
    cache, a build with AVX2 + FMA; elsewhere ignored): sequences without a soft cap or a window short of
    key 0 attend in tiles of that many new tokens or more with their query rows in the vector lanes
    (attention_lane_tiles.h), widening each block of keys and values once per tile. spread_prefetch: a walk
    over a sequence's blocks requests the block two ahead a few cache lines per step of its score and value
    loops instead of all at once (attention_prefetch.h; no bit of the result changes)."""
    mod = _ext.module or load()
    if mod is None:
        raise RuntimeError(f"C++ paged attention unavailable: {_ext.error}")
    return mod.paged_attention(q, k_cache, v_cache, block_tables, query_start, context_lens, scale, q_tile, max_group,
                               window, softcap, wide_rows, int8_rows, int8_bf16_pv, int8_tiles, int8_decode,
                               lane_tokens, spread_prefetch)


def amx_attention_available() -> bool:
    """Whether this build and CPU take paged_attention's int8_tiles (AMX-INT8 and AMX-BF16)."""
    mod = _ext.module or load()
    return mod is not None and bool(mod.attention_amx_available())


def bf16_pv_available() -> bool:
    """Whether this build has the AVX512-BF16 P V of paged_attention's int8_bf16_pv."""
    mod = _ext.module or load()
    return mod is not None and bool(mod.attention_bf16_pv_has_tiles())


def int8_scores_available() -> bool:
    """Whether this build has the VNNI path of paged_attention's int8_rows."""
    mod = _ext.module or load()
    return mod is not None and bool(mod.attention_int8_has_tiles())


def int8_decode_available() -> bool:
    """Whether this build has paged_attention's int8_decode path (AVX-512 VNNI, or AVX2 + FMA)."""
    mod = _ext.module or load()
    return mod is not None and bool(mod.attention_int8_decode_has_tiles())


def lane_tiles_available() -> bool:
    """Whether this build has paged_attention's lane_tokens path (AVX2 + FMA)."""
    mod = _ext.module or load()
    return mod is not None and bool(mod.attention_lane_tiles_built())

