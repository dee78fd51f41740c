"""The 8-bit wide path of quantized layers (quant_u8_gemm): wide calls multiply x, rounded to int8 per
32 values, by an 8-bit-per-row copy of the dequantized weight (u8_linear_q8_gemm); narrow calls keep
the packed kernels. The kernel against a float64 reference over the same rounded operands, the layer
and the engine switch, the C++ layer loop against the Python loop (bit-identical)."""

from __future__ import annotations

import pytest
import torch

from hasten import LLM
from hasten.kernels import cpu_features, quant_linear
from hasten.quant.evaluate import sequence_logits
from hasten.quant.formats import quantize_int4, quantize_int8
from hasten.quant.kernels import make_layer
from tests.quant.wide_paths import IDS, assert_loops_agree, native_and_python, small_engine

needs_kernels = pytest.mark.skipif(quant_linear.load() is None, reason="C++ kernels cannot be built here")


def k_of_position(k: int) -> torch.Tensor:
    """k of each run-order position (per 32: the even k, then the odd ones)."""
    p = torch.arange(k) % 32
    return torch.arange(k) - p + torch.where(p < 16, 2 * p, 2 * (p - 16) + 1)


def unpacked(packed: torch.Tensor, step: torch.Tensor, offset: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [n, k] in k order, the float64 weight step * codes + offset)."""
    n16, k4 = packed.shape[:2]
    k = k4 * 4
    by_position = packed.permute(0, 2, 1, 3).reshape(n16 * 16, k)[:n]
    codes = torch.empty_like(by_position)
    codes[:, k_of_position(k)] = by_position
    return codes, codes.double() * step[:n, None].double() + offset[:n, None].double()


def rounded_x(x: torch.Tensor, share: int = 1, pow2: bool = False) -> torch.Tensor:
    """x as the int8-activation kernels round it: per 32 values (per 32 * share with x_runs), d = amax / 127
    (pow2: rounded up to a power of two), q = round(x / d)."""
    m, k = x.shape
    runs = x.float().view(m, k // (32 * share), 32 * share)
    d = runs.abs().amax(-1, keepdim=True) / 127
    if pow2:
        mantissa, exponent = torch.frexp(d)  # d = mantissa 2^exponent, mantissa in [0.5, 1)
        d = torch.where(mantissa == 0.5, d, torch.ldexp(torch.ones_like(d), exponent))
    inv = torch.where(d > 0, 1.0 / d.clamp_min(1e-30), torch.zeros_like(d))
    return (torch.round(runs * inv).double() * d.double()).view(m, k)


def test_packing_rounds_each_row_to_256_levels():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(37, 96, generator=gen) * 0.05
    w[5] = 0.25  # a constant row: step 0
    w[6, 7] = 4.0  # an outlier widens its row's step
    packed, step, offset = quant_linear.u8_pack_rows16(w)
    assert packed.shape == (3, 24, 16, 4) and packed.dtype == torch.uint8
    assert step.shape == offset.shape == (48,) and torch.all(step[37:] == 0) and torch.all(offset[37:] == 0)
    codes, dequant = unpacked(packed, step, offset, 37)
    assert torch.all(packed[2, :, 5:] == 0)  # rows past N
    assert step[5] == 0 and offset[5] == 0.25 and torch.all(codes[5] == 0)
    assert torch.allclose(offset[:37], w.min(1).values) and torch.allclose(step[:37] * 255, w.max(1).values - w.min(1).values)
    assert ((dequant - w.double()).abs() <= step[:37, None].double() * 0.5 + 1e-7).all()
    assert codes.min() == 0 and codes.max() == 255


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 12, 63, 64, 65, 131])
@pytest.mark.parametrize("n,k", [(16, 32), (17, 64), (40, 96), (100, 576), (33, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_u8_gemm_matches_reference(m, n, k, threads):
    """Every tile shape (6, 4, 2, 1 rows of x; one or two blocks of 16 weight rows, a partial last one),
    panels of 64 rows, a zero run of x (scale 0), 1 and 2 threads: within float32 summation of the
    float64 product of the rounded operands."""
    gen = torch.Generator().manual_seed(m * 7919 + n * 31 + k + threads)
    w = torch.randn(n, k, generator=gen) * 0.05 - 0.02
    x = torch.randn(m, k, generator=gen) * 3
    x[:, 32:64] = 0.0
    packed, step, offset = quant_linear.u8_pack_rows16(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = quant_linear.u8_linear_q8_gemm(x, packed, step, offset, n)
    finally:
        torch.set_num_threads(before)
    _, w8 = unpacked(packed, step, offset, n)
    want = rounded_x(x) @ w8.t()
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert (y.double() - want).abs().max().item() / want.abs().max().item() < 1e-5
    exact = x.double() @ w.double().t()  # and close to the float product
    assert (y.double() - exact).abs().max().item() / exact.abs().max().item() < 2e-2


@needs_kernels
@pytest.mark.parametrize("x_runs,k,share", [(8, 576, 6), (8, 1536, 8), (4, 576, 3), (2, 96, 1), (5, 320, 5), (3, 32, 1)])
@pytest.mark.parametrize("m", [1, 7, 65])
def test_u8_gemm_x_runs_share_one_scale(x_runs, k, share, m):
    """x_runs: the largest count of 32-runs up to x_runs that divides K / 32 shares one scale."""
    gen = torch.Generator().manual_seed(m * 131 + k + x_runs)
    w = torch.randn(40, k, generator=gen) * 0.05
    x = torch.randn(m, k, generator=gen) * 3
    x[:, :32] *= 20  # one loud run sets its whole group's scale
    packed, step, offset = quant_linear.u8_pack_rows16(w)
    y = quant_linear.u8_linear_q8_gemm(x, packed, step, offset, 40, x_runs)
    _, w8 = unpacked(packed, step, offset, 40)
    want = rounded_x(x, share) @ w8.t()
    assert (y.double() - want).abs().max().item() / want.abs().max().item() < 1e-5
    if share > 1:  # and not the per-32 rounding
        per32 = rounded_x(x) @ w8.t()
        assert (y.double() - per32).abs().max().item() / want.abs().max().item() > 1e-4


@needs_kernels
@pytest.mark.parametrize("m", [1, 7, 65])
@pytest.mark.parametrize("n,k", [(17, 96), (100, 576), (33, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("x_runs,share", [(1, 1), (3, 3)])
def test_u8_gemm_pow2_x_scales(m, n, k, threads, x_runs, share):
    """pow2_x_scales: each scale of x rounded up to a power of two, applied by the tiles as an exponent
    shift: the float64 product of those rounded operands (a run of zeros, a run whose scale is a power
    of two already, a loud run), and not the per-32 float rounding."""
    gen = torch.Generator().manual_seed(m * 7 + n * 13 + k + threads + x_runs)
    w = torch.randn(n, k, generator=gen) * 0.05 - 0.02
    x = torch.randn(m, k, generator=gen) * 3
    x[:, :32] = 0.0
    x[:, 32:96] = x[:, 32:96].clamp(-1.0, 1.0)
    x[:, 40] = 127 * 2.0**-3  # that run's d = 2^-3 exactly (an amax of at most 1 elsewhere in it)
    x[:, -1] *= 50.0
    packed, step, offset = quant_linear.u8_pack_rows16(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = quant_linear.u8_linear_q8_gemm(x, packed, step, offset, n, x_runs, True)
    finally:
        torch.set_num_threads(before)
    _, w8 = unpacked(packed, step, offset, n)
    want = rounded_x(x, share, pow2=True) @ w8.t()
    assert (y.double() - want).abs().max().item() / want.abs().max().item() < 1e-5
    per_run = rounded_x(x, share) @ w8.t()
    assert (y.double() - per_run).abs().max().item() / want.abs().max().item() > 1e-4


@needs_kernels
@pytest.mark.parametrize("m", [1, 5, 6, 7, 64, 65, 131])
@pytest.mark.parametrize("k,inter", [(32, 16), (96, 48), (576, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("x_runs,pow2", [(1, False), (3, False), (1, True)])
def test_silu_from_the_tiles_is_the_two_calls_bit_for_bit(m, k, inter, threads, x_runs, pow2):
    """u8_linear_q8_gemm_silu (quant_u8_gemm_silu): silu(gate) * up from each tile of a gate block and its
    up block, the same bits as silu_mul(u8_linear_q8_gemm(...), fast=True) over every tile height, panel
    edge, thread count and scale kind; and it is SiLU-multiply of the product."""
    from hasten.kernels import decoder_ops

    gen = torch.Generator().manual_seed(m * 17 + k + inter + threads + x_runs)
    x = torch.randn(m, k, generator=gen) * 3
    x[:, :32] = 0.0  # a run of zeros (scale 0)
    packed, step, offset = quant_linear.u8_pack_rows16(torch.randn(2 * inter, k, generator=gen) * 0.1 - 0.01)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = quant_linear.u8_linear_q8_gemm_silu(x, packed, step, offset, 2 * inter, x_runs, pow2)
        gate_up = quant_linear.u8_linear_q8_gemm(x, packed, step, offset, 2 * inter, x_runs, pow2)
    finally:
        torch.set_num_threads(before)
    assert y.shape == (m, inter) and torch.equal(y, decoder_ops.load().silu_mul(gate_up, True))
    ref = torch.nn.functional.silu(gate_up[:, :inter].double()) * gate_up[:, inter:].double()
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-6)


@needs_kernels
def test_silu_from_the_tiles_needs_whole_blocks():
    packed, step, offset = quant_linear.u8_pack_rows16(torch.randn(48, 64))
    with pytest.raises(RuntimeError, match="N = 2 I"):
        quant_linear.u8_linear_q8_gemm_silu(torch.randn(3, 64), packed, step, offset, 48)  # I = 24
    assert quant_linear.u8_linear_q8_gemm_silu(torch.randn(0, 64), *quant_linear.u8_pack_rows16(torch.randn(64, 64)),
                                               64).shape == (0, 32)


@needs_kernels
def test_u8_gemm_rejects_bad_shapes():
    packed, step, offset = quant_linear.u8_pack_rows16(torch.randn(20, 64))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        quant_linear.u8_pack_rows16(torch.randn(4, 48))
    with pytest.raises(RuntimeError, match="not finite"):
        quant_linear.u8_pack_rows16(torch.tensor([[float("nan")] * 32]))
    with pytest.raises(RuntimeError, match="u8_pack_rows16"):
        quant_linear.u8_linear_q8_gemm(torch.randn(3, 96), packed, step, offset, 20)  # K differs
    with pytest.raises(RuntimeError, match="u8_pack_rows16"):
        quant_linear.u8_linear_q8_gemm(torch.randn(3, 64), packed, step, offset, 40)  # N differs
    assert quant_linear.u8_linear_q8_gemm(torch.randn(0, 64), packed, step, offset, 20).shape == (0, 20)


@needs_kernels
def test_wide_calls_take_the_u8_copy_narrow_calls_keep_the_kernel():
    gen = torch.Generator().manual_seed(5)
    n, k = 40, 96
    qw = quantize_int4(torch.randn(n, k, generator=gen) * 0.05, 32, bias=torch.randn(n, generator=gen))
    plain = make_layer(qw, int4_kernel="hasten-q8")
    wide = make_layer(qw, int4_kernel="hasten-q8", u8_gemm="on", u8_gemm_min_rows=5)
    assert wide.u8_weight is not None and plain.u8_weight is None
    assert wide.nbytes == plain.nbytes + 48 * k + 2 * 48 * 4
    for m in (1, 4):
        x = torch.randn(m, k, generator=gen)
        assert torch.equal(wide(x), plain(x))
    for m in (5, 37):
        x = torch.randn(m, k, generator=gen)
        want = quant_linear.u8_linear_q8_gemm(x, *quant_linear.u8_pack_rows16(plain.dequantize_codes()), n) + plain.bias
        assert torch.equal(wide(x), want)
        ref = plain(x)
        assert torch.allclose(wide(x), ref, rtol=0.02, atol=0.02 * ref.abs().max().item())
    assert wide.calls["u8"] == 4 and wide.calls["kernel"] == 2
    with pytest.raises(ValueError, match="min rows must be >= 1"):
        plain.enable_u8_gemm(0)
    with pytest.raises(ValueError, match="x runs must be 1 .. 8"):
        plain.enable_u8_gemm(16, 9)
    with pytest.raises(RuntimeError, match="1 .. 8"):
        quant_linear.u8_linear_q8_gemm(torch.randn(3, k), *wide.u8_weight, n, 0)


def test_modes_and_validation(monkeypatch):
    resolve = cpu_features.resolve_u8_rows
    monkeypatch.setattr(quant_linear, "u8_gemm_has_tiles", lambda: True)
    assert resolve("auto", 16) == 16
    assert resolve("auto", 16, auto_applies=False) == 0
    assert resolve("off", 16) == 0
    assert resolve("on", 4, auto_applies=False) == 4
    monkeypatch.setattr(quant_linear, "u8_gemm_has_tiles", lambda: False)
    assert resolve("auto", 16) == 0
    assert resolve("on", 16) == 16  # on: the plain C++ loop where the tiles are missing
    with pytest.raises(ValueError, match="quant_u8_gemm must be one of"):
        resolve("fast", 16)
    with pytest.raises(ValueError, match="quant_u8_gemm_min_rows must be >= 1"):
        resolve("on", 0)


@needs_kernels
def test_auto_takes_only_four_bit_layers_with_int8_activations(monkeypatch):
    monkeypatch.setattr(quant_linear, "u8_gemm_has_tiles", lambda: True)
    w = torch.randn(40, 64) * 0.05
    assert make_layer(quantize_int4(w, 32), int4_kernel="hasten-q8", u8_gemm="auto").u8_weight is not None
    assert make_layer(quantize_int4(w, 32), int4_kernel="hasten", u8_gemm="auto").u8_weight is None  # exact
    assert make_layer(quantize_int8(w), int8_kernel="hasten-q8", u8_gemm="auto").u8_weight is None


def engine(model: str, **options) -> LLM:
    return small_engine(model, **({"quant_int4_kernel": "hasten-q8", "quant_u8_gemm_min_rows": 6,
                                   "quant_bf16_gemm": "off"} | options))


@needs_kernels
@pytest.mark.parametrize("x_runs,pow2,silu", [(1, False, True), (4, False, True), (1, True, True), (1, False, False)])
def test_the_cpp_loop_takes_the_u8_path_bit_identically(tiny_model, x_runs, pow2, silu):
    """(The C++ loop's gate_up calls take SiLU from their output tiles unless quant_u8_gemm_silu is off;
    the Python loop never does: the same bits either way.)"""
    options = {"quant_u8_gemm": "on", "quant_u8_gemm_x_runs": x_runs, "quant_u8_gemm_pow2_x_scales": pow2,
               "quant_u8_gemm_silu": silu}
    native, python = native_and_python(engine, tiny_model, **options)
    assert_loops_agree(native, python)
    layer = python.engine.model.layers[0].gate_up_proj
    assert layer.u8_weight is not None and layer.calls["u8"] > 0


@needs_kernels
def test_u8_path_adds_little_next_to_quantization(tiny_model):
    def logprobs(llm: LLM) -> torch.Tensor:
        return torch.log_softmax(sequence_logits(llm.engine.model, IDS), -1)

    on = logprobs(engine(tiny_model, quant_u8_gemm="on"))
    off_llm = engine(tiny_model, quant_u8_gemm="off")
    assert off_llm.engine.model.layers[0].qkv_proj.u8_weight is None
    off = logprobs(off_llm)
    full = logprobs(engine(tiny_model, quantization=None))
    assert (on - off).abs().mean().item() < 0.25 * (off - full).abs().mean().item()


def test_a_bad_mode_is_a_clear_error(tiny_model):
    with pytest.raises(ValueError, match="quant_u8_gemm must be one of"):
        engine(tiny_model, quant_u8_gemm="always")
    with pytest.raises(ValueError, match="quant_u8_gemm_x_runs must be an integer between 1 and 8"):
        engine(tiny_model, quant_u8_gemm_x_runs=16)


@needs_kernels
def test_engine_passes_x_runs_and_pow2_scales_to_each_layer(tiny_model):
    llm = engine(tiny_model, quant_u8_gemm="on", quant_u8_gemm_x_runs=4)
    layer = llm.engine.model.layers[0].down_proj
    assert layer.u8_weight is not None and layer.u8_x_runs == 4 and not layer.u8_pow2_x_scales
    llm = engine(tiny_model, quant_u8_gemm="on", quant_u8_gemm_pow2_x_scales=True)
    layer = llm.engine.model.layers[0].down_proj
    assert layer.u8_weight is not None and layer.u8_x_runs == 1 and layer.u8_pow2_x_scales


def test_eval_ppl_checks_its_engine_options(capsys):
    from hasten.quant.cli import main

    assert main(["--engine-option", "quant_u8_gemm"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
    assert main(["-O", "no_such_option=1"]) == 2
    assert "no_such_option" in capsys.readouterr().err
