"""The gate_up form of the int4 int8-activation GEMM (int4_linear_q8_gemm_silu, the C++ layer loop's
switch quant_int4_gemm_silu): silu(gate) * up from the output tiles of each gate block and its up
block, the same bits as silu_mul(int4_linear_q8_gemm(...), fast=True) and SiLU-multiply of the float64
reference; the C++ layer loop with the switch on and off against the Python loop (bit-identical)."""

from __future__ import annotations

import pytest
import torch

from hasten.kernels import quant_linear
from hasten.quant.formats import pack_nibbles
from tests.quant.test_quant_linear_kernel import q8_reference, random_weight
from tests.quant.wide_paths import assert_loops_agree, native_and_python, small_engine

pytestmark = pytest.mark.skipif(quant_linear.load() is None, reason="C++ kernels cannot be built here")


def _silu_mul(x: torch.Tensor, rows8: list[torch.Tensor], group: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    from hasten.kernels import decoder_ops

    fused = quant_linear.int4_linear_q8_gemm_silu(x, *rows8, group, n)
    two_calls = decoder_ops.load().silu_mul(quant_linear.int4_linear_q8_gemm(x, *rows8, group, n), True)
    return fused, two_calls


@pytest.mark.parametrize("m", [2, 3, 4, 5, 7, 8, 13, 64, 131])
@pytest.mark.parametrize("inter,k,group", [(8, 64, 32), (24, 96, 32), (96, 576, 32), (64, 1536, 64)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("wide_rows", [0, 8])
def test_silu_from_the_int4_tiles_is_the_two_calls_bit_for_bit(m, inter, k, group, threads, wide_rows):
    """Every tile height and row remainder, one block pair and many, 1 and 2 threads, a zero run of x;
    with the AVX-512 two-block tiles on (wide_rows 8) calls of 8+ rows run the two calls instead."""
    gen = torch.Generator().manual_seed(m * 131 + inter + k + group + threads)
    codes, scales, mins = random_weight(gen, 2 * inter, k, group)
    x = torch.randn(m, k, generator=gen) * 3
    x[:, 32:64] = 0.0  # a run of zeros (scale 0)
    rows8 = quant_linear.int4_pack_rows8(pack_nibbles(codes), scales, mins, group)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        quant_linear.set_q8_gemm_wide_rows(wide_rows)
        fused, two_calls = _silu_mul(x, rows8, group, 2 * inter)
    finally:
        quant_linear.set_q8_gemm_wide_rows(8)
        torch.set_num_threads(before)
    assert fused.shape == (m, inter) and torch.equal(fused, two_calls)
    gate_up = q8_reference(x, codes, scales, mins, group)
    want = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    assert (fused.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item() + 1e-6


def test_silu_from_the_int4_tiles_needs_whole_blocks():
    gen = torch.Generator().manual_seed(0)
    codes, scales, mins = random_weight(gen, 40, 64, 32)  # I = 20: not a multiple of 8
    rows8 = quant_linear.int4_pack_rows8(pack_nibbles(codes), scales, mins, 32)
    with pytest.raises(RuntimeError, match="N = 2 I"):
        quant_linear.int4_linear_q8_gemm_silu(torch.randn(3, 64), *rows8, 32, 40)
    codes, scales, mins = random_weight(gen, 32, 64, 32)
    rows8 = quant_linear.int4_pack_rows8(pack_nibbles(codes), scales, mins, 32)
    assert quant_linear.int4_linear_q8_gemm_silu(torch.zeros(0, 64), *rows8, 32, 32).shape == (0, 16)


@pytest.mark.parametrize("silu", [True, False])
def test_the_cpp_loop_takes_silu_from_the_int4_tiles_bit_identically(tiny_model, silu):
    """The int4 int8-activation GEMM for wide calls (no 8-bit copy, no bfloat16 path): the C++ loop's
    gate_up calls with SiLU from the tiles (or not) against the Python loop's two calls."""
    options = {"quant_int4_kernel": "hasten-q8", "quant_u8_gemm": "off", "quant_bf16_gemm": "off",
               "quant_int4_gemm_silu": silu}
    assert_loops_agree(*native_and_python(small_engine, tiny_model, **options))
