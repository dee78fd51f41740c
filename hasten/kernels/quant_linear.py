"""The C++ int4 / int8 weight-only linears (quant_linear_cpu.cpp); see hasten.kernels.build."""

from __future__ import annotations

from types import ModuleType

import torch

from hasten.kernels.build import CPU_KERNELS

_ext = CPU_KERNELS


def load() -> ModuleType | None:
    return _ext.load()


def load_error() -> str | None:
    return _ext.error


def _module() -> ModuleType:
    """The compiled module; RuntimeError (with the build error) when it cannot be built here."""
    mod = _ext.module or load()
    if mod is None:
        raise RuntimeError(f"C++ quantized-linear kernels unavailable: {_ext.error}")
    return mod


def int4_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int) -> torch.Tensor:
    """y [M, N] = x [M, K] W^T, W[n, k] = code * scale + min (codes uint8 [N, K // 2], float16 [N, K // group])."""
    return _module().int4_linear(x, codes, scales, mins, group)


def int4_linear_q8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int) -> torch.Tensor:
    """As int4_linear with x rounded to int8 per 32 values (llama.cpp's Q4 x Q8 scheme): ~3x fewer
    instructions per weight, activation error about 1/254 of each 32-run's largest value."""
    return _module().int4_linear_q8(x, codes, scales, mins, group)


def set_q8_gemm_wide_rows(rows: int) -> None:
    """From `rows` rows of x on, the int8-activation GEMMs (int4_linear_q8_gemm, int8_linear_q8_gemm,
    int8g_linear_q8_gemm) multiply 16 weight rows per AVX-512 register
    (two packed blocks per tile, up to 8 rows of x: independent integer chains); 0: always the 8-row
    tiles. Process-wide (EngineConfig.quant_q8_gemm_wide_rows); a build without AVX-512 VNNI ignores it."""
    mod = _ext.module or load()
    if mod is not None:
        mod.set_q8_gemm_wide_rows(int(rows))


def set_q8_gemm_x_panel(nbytes: int) -> None:
    """The int8-activation GEMMs' 8-row tiles take x in panels of about `nbytes` bytes of int8 rows (0: off,
    all rows at once): every block of a task passes over one panel, held in L1, before the next panel, so
    each block comes from L2 once per panel instead of all of x streaming past each block. Process-wide;
    the results do not change (EngineConfig.quant_q8_gemm_x_panel)."""
    mod = _ext.module or load()
    if mod is not None:
        mod.set_q8_gemm_x_panel(int(nbytes))


def q8_gemm_has_wide_tiles() -> bool:
    """Whether this build of the kernels has the AVX-512 16-row tiles (set_q8_gemm_wide_rows)."""
    mod = _ext.module or load()
    return mod is not None and bool(mod.q8_gemm_has_wide_tiles())


def q8_gemm_has_vnni() -> bool:
    """Whether this build's int8-activation GEMM tiles multiply-add with VNNI (AVX-512 VNNI or AVX-VNNI);
    without it (plain AVX2) they take vpmaddubsw into int16 sums."""
    mod = _ext.module or load()
    return mod is not None and bool(mod.q8_gemm_has_vnni())


def int4_pack_rows8(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int) -> list[torch.Tensor]:
    """The weight in int4_linear_q8_gemm's layout: (packed uint8 [ceil(N/8), K/8, 8, 4], scales and
    mins float32 [ceil(N/8), K/group, 8]); 8 weight rows side by side (quant_gemm_q8_cpu.cpp)."""
    return _module().int4_pack_rows8(codes, scales, mins, group)


def int4_linear_q8_gemm(x: torch.Tensor, packed: torch.Tensor, scales8: torch.Tensor, mins8: torch.Tensor,
                        group: int, n: int) -> torch.Tensor:
    """int4_linear_q8's arithmetic for many rows of x (x rounded to int8 per 32 values), as integer
    multiply-adds over 8 weight rows at once (VNNI where the CPU has it); the weight from int4_pack_rows8."""
    return _module().int4_linear_q8_gemm(x, packed, scales8, mins8, group, n)


def int4_linear_q8_gemm_silu(x: torch.Tensor, packed: torch.Tensor, scales8: torch.Tensor, mins8: torch.Tensor,
                             group: int, n: int) -> torch.Tensor:
    """silu(gate) * up of [gate | up] = int4_linear_q8_gemm(x, ...) (n = 2 I, I a multiple of 8), taken
    from the output tiles: bit-identical to silu_mul(int4_linear_q8_gemm(x, ...), fast=True), [M, I]."""
    return _module().int4_linear_q8_gemm_silu(x, packed, scales8, mins8, group, n)


def int8_pack_rows8(qweight: torch.Tensor, scales: torch.Tensor) -> list[torch.Tensor]:
    """The weight in int8_linear_q8_gemm's layout: (packed int8 [ceil(N/8), K/4, 8, 4], scales float32
    [ceil(N/8) * 8]); 8 weight rows side by side (quant_gemm_q8_cpu.cpp)."""
    return _module().int8_pack_rows8(qweight, scales)


def int8_linear_q8_gemm(x: torch.Tensor, packed: torch.Tensor, scales8: torch.Tensor, n: int) -> torch.Tensor:
    """y = x W^T for int8 weights with x rounded to int8 per 32 values (llama.cpp's Q8_0 scheme),
    as integer multiply-adds over 8 weight rows at once; the weight from int8_pack_rows8."""
    return _module().int8_linear_q8_gemm(x, packed, scales8, n)


def int8g_pack_rows8(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                     group: int) -> list[torch.Tensor]:
    """A grouped int8 weight (int8 [N, K], float32 scales and mins [N, K / group], group 16 or 32) in
    int8g_linear_q8_gemm's layout: (packed int8 [ceil(N/8), K/4, 8, 4], scales8 and mins8 float32
    [ceil(N/8), K/group, 8]; mins8 empty when mins is None)."""
    empty = torch.empty(0, dtype=torch.float32)
    return _module().int8g_pack_rows8(qweight, scales, empty if mins is None else mins, group)


def int8g_linear_q8_gemm(x: torch.Tensor, packed: torch.Tensor, scales8: torch.Tensor, mins8: torch.Tensor,
                         group: int, n: int) -> torch.Tensor:
    """y = x W^T, W[n, k] = q * scale + min per group, with x rounded to int8 per 32 values (llama.cpp's
    scheme for its 5-, 6- and 8-bit blocks); the weight from int8g_pack_rows8."""
    return _module().int8g_linear_q8_gemm(x, packed, scales8, mins8, group, n)


def int4_linear_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int) -> torch.Tensor:
    """As int4_linear, computed by dequantizing 64 weight rows at a time to float32 (in cache) and
    running the float32 GEMM on each block: faster once x has more than a few rows."""
    return _module().int4_linear_gemm(x, codes, scales, mins, group)


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y [M, N] = x [M, K] W^T, W[n, k] = qweight[n, k] * scales[n] (int8 [N, K], float32 [N]); exact
    against the dequantized weight (float32 x, float32 arithmetic)."""
    return _module().int8_linear(x, qweight, scales)


def float_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y [M, N] = x [M, K] W^T for float32 x and W [N, K] (contiguous), through the same register
    tiles as the quantized GEMMs, run on W's rows in place (the library GEMM for very tall x)."""
    return _module().float_linear(x, weight)


def u8_gemm_has_tiles() -> bool:
    """Whether this build of the kernels has u8_linear_q8_gemm's AVX-512 VNNI tiles (elsewhere it runs
    a plain C++ loop: correct, slow)."""
    mod = load()
    return mod is not None and bool(mod.u8_gemm_has_tiles())


def u8_pack_rows16(weight: torch.Tensor) -> list[torch.Tensor]:
    """A float32 weight [N, K] (K a multiple of 32) as unsigned 8-bit codes per row, w ~ step[n] * u +
    offset[n] (the row's min and (max - min) / 255): (packed uint8 [ceil(N/16), K/4, 16, 4], step and
    offset float32 [16 ceil(N/16)]), 16 rows side by side (gemm_u8_cpu.cpp)."""
    return _module().u8_pack_rows16(weight)


def u8_linear_q8_gemm(x: torch.Tensor, packed: torch.Tensor, step: torch.Tensor, offset: torch.Tensor,
                      n: int, x_runs: int = 1, pow2_x_scales: bool = False) -> torch.Tensor:
    """y = x W^T over u8_pack_rows16's layout, x rounded to int8 per 32 values (as the other
    int8-activation kernels): integer multiply-adds over 16 weight rows at once. x_runs (1 .. 8) > 1:
    up to that many consecutive 32-runs of x share one scale (the largest count dividing K / 32), so
    their integer sums are converted to float once. pow2_x_scales: each scale rounded up to a power of
    two, which the AVX-512 tiles apply as an exponent shift instead of a multiply-add."""
    return _module().u8_linear_q8_gemm(x, packed, step, offset, n, x_runs, pow2_x_scales)


def u8_linear_q8_gemm_silu(x: torch.Tensor, packed: torch.Tensor, step: torch.Tensor, offset: torch.Tensor,
                           n: int, x_runs: int = 1, pow2_x_scales: bool = False) -> torch.Tensor:
    """silu(gate) * up of [gate | up] = u8_linear_q8_gemm(x, ...) (n = 2 I, I a multiple of 16), taken
    from the output tiles: bit-identical to silu_mul(u8_linear_q8_gemm(x, ...), fast=True), [M, I]."""
    return _module().u8_linear_q8_gemm_silu(x, packed, step, offset, n, x_runs, pow2_x_scales)


def bf16_tiles_available() -> bool:
    """Whether this build and CPU run bf16_tiles_linear (AMX-BF16 tiles; the OS grants the tile state)."""
    mod = load()
    return mod is not None and bool(mod.bf16_tiles_available())


def bf16_tiles_fit(n: int, k: int) -> bool:
    """Whether a weight [n, k] takes bf16_tiles_pack's layout (16 outputs by 32 k per tile)."""
    return n > 0 and k > 0 and n % 16 == 0 and k % 32 == 0


def bf16_tiles_pack(weight: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] (N a multiple of 16, K of 32) as bfloat16 in AMX tile order: [N/16, K/32, 16, 16, 2],
    element (nb, kb, p, c, e) = w[16 nb + c, 32 kb + 2 p + e] (gemm_bf16_amx_cpu.cpp)."""
    return _module().bf16_tiles_pack(weight)


def bf16_tiles_linear(x: torch.Tensor, packed: torch.Tensor, stream: bool = True) -> torch.Tensor:
    """y [M, N] = bf16(x) W^T over bf16_tiles_pack's layout on AMX tiles, float32 sums (float32 x and y).
    stream (quant_bf16_gemm_stream): x's bfloat16 copy in tile order (one contiguous 1 KB run per tile)
    and each thread's next weight blocks requested into L2 while the current ones run; the same outputs."""
    return _module().bf16_tiles_linear(x, packed, stream)


def bf16_tiles_linear_silu(x: torch.Tensor, packed: torch.Tensor, stream: bool = True,
                           tiles_out: bool = False) -> torch.Tensor:
    """silu(gate) * up of [gate | up] = bf16_tiles_linear(x, packed) (N = 2 I, I a multiple of 16), taken
    from the output tiles: bit-identical to silu_mul(bf16_tiles_linear(x, packed), fast=True), [M, I].
    tiles_out (stream, I a multiple of 32): rounded to bfloat16 in the tile order bf16_tiles_linear reads
    x in, [M_pad / 16, I / 32, 16, 32] (M_pad: M rounded up to 32; its extra rows zero), which
    bf16_tiles_linear takes as x as it is (its output then has M_pad rows)."""
    return _module().bf16_tiles_linear_silu(x, packed, stream, tiles_out)
