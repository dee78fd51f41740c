"""hasten's C++ int4 linear against a float64 reference on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from hasten.kernels import quant_linear as int4_linear
from hasten.quant.formats import Int4Weight, pack_nibbles
from hasten.quant.kernels import Int4HastenLinear, make_layer, resolve_int4_kernel

pytestmark = pytest.mark.skipif(int4_linear.load() is None, reason="C++ int4 kernel cannot be built here")


@pytest.fixture
def restore_wide_rows():
    yield
    int4_linear.set_q8_gemm_wide_rows(8)


def random_weight(gen, n, k, group):
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.1 + 0.01).half()
    mins = (torch.randn(n, k // group, generator=gen) * 0.3).half()
    return codes, scales, mins


def reference(x, codes, scales, mins, group):
    n, k = codes.shape
    w = codes.double().view(n, k // group, group) * scales.double()[..., None] + mins.double()[..., None]
    return x.double() @ w.view(n, k).t()


def q8_reference(x, codes, scales, mins, group):
    """Exact result of the int8-activation scheme: x rounded per 32 values, the min term from the group
    sums of the rounded x."""
    m, k = x.shape
    runs = x.float().view(m, k // 32, 32)  # the kernel's float32 steps: d = amax / 127, q = round(x * (1 / d))
    d = runs.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1.0 / d.clamp_min(1e-30), torch.zeros_like(d))
    xq = torch.round(runs * inv).double() * d.double()
    n = codes.shape[0]
    w_codes = codes.double().view(n, k // group, group) * scales.double()[..., None]
    main = xq.view(m, k) @ w_codes.view(n, k).t()
    sums = xq.view(m, k // group, group).sum(-1)
    return main + sums @ mins.double().t()


def q8_gemm(x, packed_codes, scales, mins, group):
    """int4_linear_q8_gemm over the weight repacked 8 rows side by side."""
    rows8 = int4_linear.int4_pack_rows8(packed_codes, scales, mins, group)
    return int4_linear.int4_linear_q8_gemm(x, *rows8, group, packed_codes.shape[0])


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 11])
@pytest.mark.parametrize("n,k,group", [(33, 64, 32), (100, 576, 32), (64, 1536, 64), (7, 256, 128), (5, 96, 32)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("variant", ["float", "q8", "gemm", "q8gemm"])
def test_int4_kernel_matches_reference(m, n, k, group, threads, variant):
    gen = torch.Generator().manual_seed(m * 1000 + n + k + group)
    codes, scales, mins = random_weight(gen, n, k, group)
    x = torch.randn(m, k, generator=gen)
    op = {"float": int4_linear.int4_linear, "q8": int4_linear.int4_linear_q8, "gemm": int4_linear.int4_linear_gemm,
          "q8gemm": q8_gemm}[variant]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = op(x, pack_nibbles(codes), scales, mins, group)
    finally:
        torch.set_num_threads(before)
    q8 = variant in ("q8", "q8gemm")
    want = (q8_reference if q8 else reference)(x, codes, scales, mins, group)
    err = (y.double() - want).abs().max().item() / want.abs().max().item()
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert err < 1e-5
    if q8:  # and it stays close to the float result
        exact = reference(x, codes, scales, mins, group)
        assert (y.double() - exact).abs().max().item() / exact.abs().max().item() < 2e-2


@pytest.mark.parametrize("wide_rows", [0, 1, 8])
@pytest.mark.parametrize("m", [1, 7, 8, 12, 13, 23, 64, 65, 131])
@pytest.mark.parametrize("n,k,group", [(8, 64, 32), (16, 576, 32), (24, 96, 32), (33, 576, 32), (100, 1536, 64),
                                       (200, 256, 128)])
def test_int4_q8_gemm_wide_tiles_match_reference(m, n, k, group, wide_rows):
    """The AVX-512 16-row tiles (two packed blocks per register, up to 8 rows of x, x in panels of 64
    rows) against the float64 reference and against the 8-row tiles: an odd last block, a partial
    last block, row counts around every tile and panel edge, runs of x that are all zero, 2 threads."""
    gen = torch.Generator().manual_seed(m * 7919 + n * 31 + k + group)
    codes, scales, mins = random_weight(gen, n, k, group)
    x = torch.randn(m, k, generator=gen) * 3
    x[:, :32] = 0.0  # a zero run: scale 0
    y = torch.full((m, n), float("nan"))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        int4_linear.set_q8_gemm_wide_rows(wide_rows)
        y = q8_gemm(x, pack_nibbles(codes), scales, mins, group)
        int4_linear.set_q8_gemm_wide_rows(0)
        narrow = q8_gemm(x, pack_nibbles(codes), scales, mins, group)
    finally:
        int4_linear.set_q8_gemm_wide_rows(8)
        torch.set_num_threads(before)
    want = q8_reference(x, codes, scales, mins, group)
    assert not torch.isnan(y).any()
    assert (y.double() - want).abs().max().item() / want.abs().max().item() < 1e-5
    assert torch.allclose(y, narrow, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_wide_tile_switch_is_checked():
    with pytest.raises(RuntimeError, match=">= 0"):
        int4_linear.set_q8_gemm_wide_rows(-1)
    assert isinstance(int4_linear.q8_gemm_has_wide_tiles(), bool)


@pytest.mark.parametrize("m,n,k", [(2, 50, 576), (12, 64, 576), (40, 130, 576), (97, 200, 576), (16, 100, 1536),
                                   (260, 60, 1536), (300, 50, 576)])
def test_int4_gemm_path_many_rows(m, n, k):
    """The blocked dequantize + GEMM path: several 48-row weight blocks, a ragged last one, 2 threads;
    K = 1536 is cut into k-slices (and from 256 rows on goes to the library GEMM)."""
    gen = torch.Generator().manual_seed(m + n)
    codes, scales, mins = random_weight(gen, n, k, 32)
    x = torch.randn(m, k, generator=gen)
    with torch.inference_mode():  # as in the engine: worker threads are not in inference mode
        y = int4_linear.int4_linear_gemm(x, pack_nibbles(codes), scales, mins, 32)
    want = reference(x, codes, scales, mins, 32)
    assert (y.double() - want).abs().max().item() / want.abs().max().item() < 1e-5


@pytest.mark.parametrize("m", [1, 2, 4, 5, 16, 70, 260])
@pytest.mark.parametrize("n,k", [(50, 64), (97, 576), (130, 1536), (5, 20)])
def test_float_linear_matches_reference(m, n, k):
    """The float32 register-tile GEMM on W's own rows: 4x3 tiles (assembly) and the ragged edge
    tiles, k-slices (K = 1536), the library path for tall x with long rows, K not a multiple of 8."""
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen)
    with torch.inference_mode():
        y = int4_linear.float_linear(x, w)
    want = x.double() @ w.double().t()
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert (y.double() - want).abs().max().item() / want.abs().max().item() < 1e-5


def test_tiled_linear_layer():
    from hasten.model.linear import TiledLinear, float_linear_factory, tiled_factory

    gen = torch.Generator().manual_seed(11)
    w, b = torch.randn(40, 96, generator=gen), torch.randn(40, generator=gen)
    layer = TiledLinear(w, b)
    for shape in ((1, 96), (7, 96), (2, 3, 96)):
        x = torch.randn(*shape, generator=gen)
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, w, b), atol=1e-5)
    assert float_linear_factory("hasten", torch.float32) is tiled_factory
    assert float_linear_factory("auto", torch.float32) is not tiled_factory  # oneDNN: level end to end
    with pytest.raises(ValueError, match="float32"):
        float_linear_factory("hasten", torch.bfloat16)


def test_int4_kernel_rejects_bad_shapes():
    gen = torch.Generator().manual_seed(0)
    codes, scales, mins = random_weight(gen, 8, 64, 32)
    packed = pack_nibbles(codes)
    with pytest.raises(RuntimeError, match="float32"):
        int4_linear.int4_linear(torch.randn(2, 64).double(), packed, scales, mins, 32)
    with pytest.raises(RuntimeError, match="values per row"):
        int4_linear.int4_linear(torch.randn(2, 96), packed, scales, mins, 32)
    with pytest.raises(RuntimeError, match="group size"):
        int4_linear.int4_linear(torch.randn(2, 64), packed, scales, mins, 16)
    with pytest.raises(RuntimeError, match="float16"):
        int4_linear.int4_linear(torch.randn(2, 64), packed, scales.float(), mins, 32)


def test_layer_uses_kernel_and_matches_its_dequantized_weight():
    """The layer (AWQ input scale, bias, both row-count paths) equals x @ dequantize()^T."""
    gen = torch.Generator().manual_seed(3)
    codes, scales, mins = random_weight(gen, 48, 128, 32)
    qw = Int4Weight(pack_nibbles(codes), scales.float(), mins.float(), 32, bias=torch.randn(48, generator=gen),
                    input_scale=torch.rand(128, generator=gen) + 0.5)
    layer = make_layer(qw, max_kernel_rows=4, int4_kernel="hasten")
    assert isinstance(layer, Int4HastenLinear) and not layer.int8_activations
    for rows in (1, 4, 9, layer.gemm_min_rows, 70):  # the dot kernel below gemm_min_rows, blocked GEMM above
        x = torch.randn(rows, 128, generator=gen)
        want = x.double() @ layer.dequantize().double().t() + qw.bias.double()
        assert torch.allclose(layer(x).double(), want, atol=1e-4, rtol=1e-5)
    assert layer.calls == {"kernel": 5, "dequant": 0, "bf16": 0, "u8": 0}  # never a whole-weight dequantize
    assert resolve_int4_kernel("torch", 32) == "torch"
    assert resolve_int4_kernel("auto", 32) in ("hasten", "hasten-q8")
    assert make_layer(qw, int4_kernel="hasten-q8").int8_activations
    assert make_layer(qw, int4_kernel="hasten-q8", q8_gemm=False).rows8 is None
    with pytest.raises(ValueError):
        resolve_int4_kernel("fast", 32)


def test_q8_layer_runs_every_row_count_in_int8():
    """hasten-q8 layers: one row through the dot kernel, 2+ rows through the int8 GEMM; both are the
    int8-activation scheme exactly (AWQ input scale and bias included)."""
    gen = torch.Generator().manual_seed(4)
    codes, scales, mins = random_weight(gen, 45, 192, 64)
    qw = Int4Weight(pack_nibbles(codes), scales.float(), mins.float(), 64, bias=torch.randn(45, generator=gen),
                    input_scale=torch.rand(192, generator=gen) + 0.5)
    layer = make_layer(qw, int4_kernel="hasten-q8")
    assert layer.rows8 is not None and layer.nbytes > make_layer(qw, int4_kernel="hasten-q8", q8_gemm=False).nbytes
    for rows in (1, 2, 5, 16, 33):
        x = torch.randn(rows, 192, generator=gen)
        want = q8_reference(x * layer.inv_input_scale, codes, scales, mins, 64) + qw.bias.double()
        assert (layer(x).double() - want).abs().max().item() < 1e-4 * want.abs().max().item()
    with pytest.raises(RuntimeError, match="int4_pack_rows8"):
        int4_linear.int4_linear_q8_gemm(torch.randn(2, 192), layer.rows8[0], layer.rows8[1], layer.rows8[2], 64, 60)


@pytest.mark.parametrize("mode", ["on", "off", "auto"])
def test_q8_gemm_one_row_switch(mode):
    """quant_q8_gemm_one_row: one row of x through the int8 GEMM's tiles (the same row as in any batch,
    bit for bit) or through the one-row dot kernel; both the int8-activation scheme. auto takes the
    tiles where they lack VNNI. A layer without the GEMM copy keeps the dot kernel."""
    from hasten.kernels.cpu_features import resolve_q8_gemm_one_row

    gen = torch.Generator().manual_seed(5)
    codes, scales, mins = random_weight(gen, 61, 576, 32)  # 8 blocks: the tiles request blocks ahead
    qw = Int4Weight(pack_nibbles(codes), scales.float(), mins.float(), 32, bias=torch.randn(61, generator=gen))
    layer = make_layer(qw, int4_kernel="hasten-q8", q8_gemm_one_row=mode)
    on = mode == "on" or (mode == "auto" and not int4_linear.q8_gemm_has_vnni())
    assert resolve_q8_gemm_one_row(mode) == on and layer.gemm_min_rows == (1 if on else 2)
    x = torch.randn(5, 576, generator=gen)
    one = torch.cat([layer(x[i : i + 1]) for i in range(5)])
    want = q8_reference(x, codes, scales, mins, 32) + qw.bias.double()
    assert (one.double() - want).abs().max().item() < 1e-5 * want.abs().max().item()
    if on:  # each row alone as in the batch of five
        assert torch.equal(one, layer(x))
    assert make_layer(qw, int4_kernel="hasten-q8", q8_gemm=False, q8_gemm_one_row=mode).gemm_min_rows == 2
    with pytest.raises(ValueError, match="quant_q8_gemm_one_row"):
        make_layer(qw, int4_kernel="hasten-q8", q8_gemm_one_row="fast")


@pytest.mark.parametrize("m", [1, 3, 16, 70])
@pytest.mark.parametrize("n,k", [(50, 64), (97, 576), (5, 20)])
def test_int8_kernel_matches_reference(m, n, k):
    """int8 weights, per-row scales: every row-count path (tiles, library GEMM), a K that is not a
    multiple of 8, ragged weight blocks; under inference mode as in the engine."""
    gen = torch.Generator().manual_seed(m * 100 + n + k)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, generator=gen) * 0.02 + 0.001
    x = torch.randn(m, k, generator=gen)
    with torch.inference_mode():
        y = int4_linear.int8_linear(x, q, scales)
    want = x.double() @ (q.double() * scales.double()[:, None]).t()
    assert y.shape == (m, n)
    assert (y.double() - want).abs().max().item() / want.abs().max().item() < 1e-5


def q8_runs(x):
    """x rounded to int8 per 32 values, as the kernels do (values, not codes), in float64."""
    m, k = x.shape
    runs = x.float().view(m, k // 32, 32)  # the kernels' float32 steps, as q8_reference
    d = runs.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1.0 / d.clamp_min(1e-30), torch.zeros_like(d))
    return (torch.round(runs * inv).double() * d.double()).view(m, k)


@pytest.mark.parametrize("m", [1, 3, 4, 5, 16, 13, 40])
@pytest.mark.parametrize("n,k", [(50, 64), (97, 576), (8, 96), (3, 32), (24, 64)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("wide_rows", [0, 8])
def test_int8_q8_gemm_matches_reference(m, n, k, threads, wide_rows, restore_wide_rows):
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)  # -128 included: the extremes
    scales = torch.rand(n, generator=gen) * 0.02 + 0.001
    x = torch.randn(m, k, generator=gen) * 3
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    int4_linear.set_q8_gemm_wide_rows(wide_rows)  # 8: from 8 rows the 16-row AVX-512 tiles
    try:
        y = int4_linear.int8_linear_q8_gemm(x, *int4_linear.int8_pack_rows8(q, scales), n)
    finally:
        torch.set_num_threads(before)
    want = q8_runs(x) @ (q.double() * scales.double()[:, None]).t()
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert (y.double() - want).abs().max().item() / want.abs().max().item() < 1e-5
    exact = x.double() @ (q.double() * scales.double()[:, None]).t()
    assert (y.double() - exact).abs().max().item() / exact.abs().max().item() < 2e-2


def test_int8_layer_kernels_agree():
    from hasten.quant.formats import quantize_int8
    from hasten.quant.kernels import Int8Linear, resolve_int8_kernel

    gen = torch.Generator().manual_seed(5)
    qw = quantize_int8(torch.randn(40, 96, generator=gen), bias=torch.randn(40, generator=gen))
    ours = make_layer(qw)
    assert isinstance(ours, Int8Linear) and ours.kernel == "hasten"
    theirs = make_layer(qw, int8_kernel="torch")
    assert theirs.kernel == "torch"
    x = torch.randn(6, 96, generator=gen)
    want = x.double() @ ours.dequantize().double().t() + qw.bias.double()
    assert torch.allclose(ours(x).double(), want, atol=1e-4, rtol=1e-5)  # exact float32 path
    assert torch.allclose(theirs(x).double(), want, atol=0.1, rtol=0.02)  # bfloat16 activations
    q8 = make_layer(qw, int8_kernel="hasten-q8")
    assert q8.kernel == "hasten-q8" and q8.rows8 is not None
    assert torch.allclose(q8(x).double(), q8_runs(x) @ ours.dequantize().double().t() + qw.bias.double(),
                          atol=1e-4, rtol=1e-5)
    assert make_layer(qw, int8_kernel="auto", int8_auto="hasten-q8").kernel == "hasten-q8"
    odd = quantize_int8(torch.randn(8, 40, generator=gen))  # K not a multiple of 32: the exact kernel
    assert make_layer(odd, int8_kernel="hasten-q8").kernel == "hasten"
    with pytest.raises(ValueError):
        resolve_int8_kernel("fast")


@pytest.mark.parametrize("m", [3, 29, 64, 131, 300])
@pytest.mark.parametrize("n,k", [(48, 576), (32, 1536), (16, 96)])
@pytest.mark.parametrize("threads", [1, 2])
def test_x_panels_change_no_bit(m, n, k, threads):
    """quant_q8_gemm_x_panel: the 8-row tiles' blocks pass over x in panels of rows (several panels and a
    ragged last one here, 1 KB forcing many) with the same bits as all rows at once, for the int4, int4
    SiLU, int8 and grouped int8 GEMMs."""
    gen = torch.Generator().manual_seed(m + n + k)
    codes, scales, mins = random_weight(gen, n, k, 32)
    int4_rows8 = int4_linear.int4_pack_rows8(pack_nibbles(codes), scales, mins, 32)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    int8_rows8 = int4_linear.int8_pack_rows8(q, torch.rand(n, generator=gen) * 0.02 + 0.001)
    int8g_rows8 = int4_linear.int8g_pack_rows8(q, torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001,
                                               torch.randn(n, k // 32, generator=gen) * 0.1, 32)
    x = torch.randn(m, k, generator=gen) * 3
    calls = {
        "int4": lambda: int4_linear.int4_linear_q8_gemm(x, *int4_rows8, 32, n),
        "int4 silu": lambda: int4_linear.int4_linear_q8_gemm_silu(x, *int4_rows8, 32, n),
        "int8": lambda: int4_linear.int8_linear_q8_gemm(x, *int8_rows8, n),
        "int8g": lambda: int4_linear.int8g_linear_q8_gemm(x, *int8g_rows8, 32, n),
    }
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    int4_linear.set_q8_gemm_wide_rows(0)  # the 8-row tiles (a build with the AVX-512 16-row tiles too)
    try:
        for name, call in calls.items():
            got = {}
            for panel in (0, 1024, 16384):
                int4_linear.set_q8_gemm_x_panel(panel)
                got[panel] = call()
            assert torch.equal(got[0], got[1024]) and torch.equal(got[0], got[16384]), name
    finally:
        int4_linear.set_q8_gemm_x_panel(16384)
        int4_linear.set_q8_gemm_wide_rows(8)
        torch.set_num_threads(before)


def test_x_panel_switch_is_checked():
    with pytest.raises(RuntimeError):
        int4_linear.set_q8_gemm_x_panel(-1)
