"""hasten's bfloat16 GEMM on AMX tiles (bf16_tiles_linear, quant_bf16_gemm_tiles): the tile-order
layout, the kernel against a float64 reference on ragged shapes (within the float32 summation bound),
the layers' choice between it and oneDNN's GEMM, SiLU-multiply from its output tiles
(bf16_tiles_linear_silu, quant_bf16_gemm_silu) against the two calls it replaces, and the kernels'
stream (x in tile order, the next weight blocks requested ahead: quant_bf16_gemm_stream) against
their row-major x, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hasten.kernels import quant_linear
from hasten.quant.formats import quantize_int8
from hasten.quant.kernels import make_layer

needs_kernels = pytest.mark.skipif(quant_linear.load() is None, reason="C++ kernels cannot be built here")
needs_tiles = pytest.mark.skipif(quant_linear.load() is None or not quant_linear.bf16_tiles_available(),
                                 reason="no AMX-BF16 tiles on this CPU / build")


@needs_kernels
def test_pack_puts_each_tile_in_load_order():
    gen = torch.Generator().manual_seed(3)
    n, k = 48, 96
    w = torch.randn(n, k, generator=gen)
    packed = quant_linear.bf16_tiles_pack(w)
    assert packed.shape == (n // 16, k // 32, 16, 16, 2) and packed.dtype == torch.bfloat16
    wb = w.to(torch.bfloat16)
    for nb, kb, p, c, e in [(0, 0, 0, 0, 0), (2, 1, 15, 3, 1), (1, 2, 7, 15, 0), (2, 2, 15, 15, 1)]:
        assert packed[nb, kb, p, c, e] == wb[16 * nb + c, 32 * kb + 2 * p + e]
    with pytest.raises(RuntimeError, match="multiple of 16"):
        quant_linear.bf16_tiles_pack(torch.randn(40, 64))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        quant_linear.bf16_tiles_pack(torch.randn(48, 48))
    assert quant_linear.bf16_tiles_fit(48, 96) and not quant_linear.bf16_tiles_fit(40, 96)


@needs_tiles
@pytest.mark.parametrize("n,k", [(16, 32), (48, 64), (80, 160), (576, 1536)])
@pytest.mark.parametrize("m", [1, 15, 17, 32, 33, 300])
def test_tiles_match_float64_within_the_summation_bound(m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen) * 3
    w = torch.randn(n, k, generator=gen) * 0.05
    y = quant_linear.bf16_tiles_linear(x, quant_linear.bf16_tiles_pack(w))
    assert y.shape == (m, n) and y.dtype == torch.float32 and y.is_contiguous()
    xb, wb = x.to(torch.bfloat16).double(), w.to(torch.bfloat16).double()
    ref = xb @ wb.T  # the bfloat16 products are exact in float32; only the float32 sums round
    bound = k * 2.0 ** -24 * (xb.abs() @ wb.abs().T) + 1e-30
    assert ((y.double() - ref).abs() <= bound).all()


@needs_tiles
def test_rejects_what_it_cannot_take():
    packed = quant_linear.bf16_tiles_pack(torch.randn(16, 64))
    with pytest.raises(RuntimeError, match=r"x \[M, 64\]"):
        quant_linear.bf16_tiles_linear(torch.randn(4, 32), packed)
    with pytest.raises(RuntimeError, match="float32 x"):
        quant_linear.bf16_tiles_linear(torch.randn(4, 64).double(), packed)
    with pytest.raises(RuntimeError, match="bf16_tiles_pack"):
        quant_linear.bf16_tiles_linear(torch.randn(4, 64), torch.randn(16, 64).to(torch.bfloat16))


@needs_tiles
@pytest.mark.parametrize("m,k,inter", [(1, 32, 16), (31, 64, 48), (33, 96, 32), (300, 576, 1536)])
def test_silu_from_the_tiles_is_the_two_calls_bit_for_bit(m, k, inter):
    from hasten.kernels import decoder_ops

    gen = torch.Generator().manual_seed(m + k + inter)
    x = torch.randn(m, k, generator=gen) * 3
    packed = quant_linear.bf16_tiles_pack(torch.randn(2 * inter, k, generator=gen) * 0.1)
    y = quant_linear.bf16_tiles_linear_silu(x, packed)
    gate_up = quant_linear.bf16_tiles_linear(x, packed)
    assert y.shape == (m, inter) and torch.equal(y, decoder_ops.load().silu_mul(gate_up.contiguous(), True))
    ref = F.silu(gate_up[:, :inter].double()) * gate_up[:, inter:].double()  # and it is SiLU-multiply
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="N = 2 I"):
        quant_linear.bf16_tiles_linear_silu(x, quant_linear.bf16_tiles_pack(torch.randn(48, k)))


@needs_tiles
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (17, 80, 160), (33, 960, 576), (300, 176, 1536), (512, 576, 576)])
def test_stream_is_the_row_major_path_bit_for_bit(m, n, k):
    gen = torch.Generator().manual_seed(m + 7 * n + k)
    x = torch.randn(m, k, generator=gen) * 3
    x[0, :3] = torch.tensor([float("inf"), -1e-40, 3e38])  # rounding at the edges of bfloat16's range
    packed = quant_linear.bf16_tiles_pack(torch.randn(n, k, generator=gen) * 0.05)
    streamed = quant_linear.bf16_tiles_linear(x, packed)  # the default
    torch.testing.assert_close(streamed, quant_linear.bf16_tiles_linear(x, packed, stream=False), rtol=0, atol=0,
                               equal_nan=True)
    wide = torch.zeros(m, k + 32)  # x as a strided view: the same rows are read
    wide[:, 16:16 + k] = x
    torch.testing.assert_close(quant_linear.bf16_tiles_linear(wide[:, 16:16 + k], packed), streamed, rtol=0, atol=0,
                               equal_nan=True)
    if n % 32 == 0:
        torch.testing.assert_close(quant_linear.bf16_tiles_linear_silu(x, packed),
                                   quant_linear.bf16_tiles_linear_silu(x, packed, stream=False), rtol=0, atol=0,
                                   equal_nan=True)


@needs_tiles
@pytest.mark.parametrize("m,k,inter", [(1, 32, 32), (31, 64, 96), (64, 96, 64), (300, 576, 1536)])
def test_silu_hands_down_its_x_in_tile_order(m, k, inter):
    gen = torch.Generator().manual_seed(m * 7 + k + inter)
    x = torch.randn(m, k, generator=gen) * 3
    gate_up = quant_linear.bf16_tiles_pack(torch.randn(2 * inter, k, generator=gen) * 0.1)
    down = quant_linear.bf16_tiles_pack(torch.randn(48, inter, generator=gen) * 0.1)
    act = quant_linear.bf16_tiles_linear_silu(x, gate_up)
    tiles = quant_linear.bf16_tiles_linear_silu(x, gate_up, tiles_out=True)
    m_pad = (m + 31) // 32 * 32
    assert tiles.shape == (m_pad // 16, inter // 32, 16, 32) and tiles.dtype == torch.bfloat16
    # the values are act's own rounding, rows past m zero
    rows = tiles.permute(0, 2, 1, 3).reshape(m_pad, inter)
    assert torch.equal(rows[:m], act.to(torch.bfloat16)) and not rows[m:].any()
    y = quant_linear.bf16_tiles_linear(tiles, down)
    assert y.shape == (m_pad, 48) and torch.equal(y[:m], quant_linear.bf16_tiles_linear(act, down))
    with pytest.raises(RuntimeError, match="tile order"):
        quant_linear.bf16_tiles_linear(tiles, down, stream=False)
    with pytest.raises(RuntimeError, match="tile order"):
        quant_linear.bf16_tiles_linear(tiles[:1].contiguous(), down)  # 16 rows
    if inter % 32 == 0:
        with pytest.raises(RuntimeError, match="tiles_out needs stream"):
            quant_linear.bf16_tiles_linear_silu(x, gate_up, stream=False, tiles_out=True)


@needs_kernels
def test_layers_pass_the_stream_switch_on():
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(64, 96, generator=gen) * 0.05
    on = make_layer(quantize_int8(w), int8_kernel="hasten-q8", bf16_gemm="on", bf16_gemm_min_rows=4)
    off = make_layer(quantize_int8(w), int8_kernel="hasten-q8", bf16_gemm="on", bf16_gemm_min_rows=4,
                     bf16_gemm_stream=False)
    assert on.bf16_stream and not off.bf16_stream
    x = torch.randn(40, 96, generator=gen)
    assert torch.equal(on(x), off(x))


@needs_kernels
def test_without_tiles_the_kernel_refuses_cleanly():
    if quant_linear.bf16_tiles_available():
        pytest.skip("this CPU has the tiles")
    packed = quant_linear.bf16_tiles_pack(torch.randn(16, 64))
    with pytest.raises(RuntimeError, match="AMX"):
        quant_linear.bf16_tiles_linear(torch.randn(4, 64), packed)
    with pytest.raises(RuntimeError, match="AMX"):
        quant_linear.bf16_tiles_linear_silu(torch.randn(4, 64), quant_linear.bf16_tiles_pack(torch.randn(32, 64)))


@needs_kernels
@pytest.mark.parametrize("tiles", [True, False])
def test_layers_take_the_tiles_where_they_fit(tiles):
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(48, 96, generator=gen) * 0.05
    bias = torch.randn(48, generator=gen)
    layer = make_layer(quantize_int8(w, bias), int8_kernel="hasten-q8", bf16_gemm="on", bf16_gemm_min_rows=4,
                       bf16_gemm_tiles=tiles)
    on_tiles = tiles and quant_linear.bf16_tiles_available()
    assert layer.bf16_weight.dim() == (5 if on_tiles else 2)
    assert layer.nbytes == make_layer(quantize_int8(w, bias), int8_kernel="hasten-q8").nbytes + 48 * 96 * 2
    x = torch.randn(37, 96, generator=gen)
    deq = layer.dequantize_codes().to(torch.bfloat16)
    want = (quant_linear.bf16_tiles_linear(x, quant_linear.bf16_tiles_pack(deq)) if on_tiles
            else F.linear(x.to(torch.bfloat16), deq).float()) + bias
    assert torch.equal(layer(x), want)
    # a shape the tiles do not take keeps the row-major copy
    odd = make_layer(quantize_int8(torch.randn(40, 96, generator=gen)), int8_kernel="hasten-q8", bf16_gemm="on",
                     bf16_gemm_tiles=tiles)
    assert odd.bf16_weight.dim() == 2
