"""Kernels against a float reference on fresh random inputs, per format and path."""

from __future__ import annotations

import pytest
import torch

from hasten.quant.formats import (
    Int4Weight,
    pack_nibbles,
    pick_group_size,
    quantize_int4,
    quantize_int8,
    unpack_nibbles,
)
from hasten.quant.kernels import (
    Int4Linear,
    Int8Linear,
    int4_kernel_layout_known,
    pack_int4_for_kernel,
    unpack_int4_kernel_layout,
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_nibble_pack_round_trip():
    q = torch.randint(0, 16, (7, 34), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(q)), q)


@pytest.mark.parametrize("n,k", [(64, 96), (960, 576), (32, 1536), (96, 64), (608, 128)])
def test_kernel_layout_is_understood(n, k):
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    assert int4_kernel_layout_known()
    assert torch.equal(unpack_int4_kernel_layout(pack_int4_for_kernel(codes), n, k), codes)


def test_group_size_falls_back_when_it_does_not_divide_k():
    assert pick_group_size(576, 128) == 64
    assert pick_group_size(1536, 128) == 128
    with pytest.raises(ValueError):
        pick_group_size(576, 48)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_quantization_error_is_bounded(group, symmetric):
    w = torch.randn(96, 256)
    qw = quantize_int4(w, group, symmetric)
    assert qw.group_size == group
    # uniform 4-bit noise on Gaussian groups: well under 12% relative, larger groups worse
    assert rel_err(qw.dequantize(), w) < 0.12
    codes = qw.unpack()
    assert int(codes.max()) <= 15


def test_int8_quantization_error_is_bounded():
    w = torch.randn(96, 256)
    assert rel_err(quantize_int8(w).dequantize(), w) < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16, 40])
@pytest.mark.parametrize("n,k,group", [(96, 128, 32), (100, 192, 64), (64, 256, 128)])
def test_int4_layer_matches_float_reference(dtype, rows, n, k, group):
    torch.manual_seed(rows * 7 + n)
    w, b = torch.randn(n, k), torch.randn(n)
    qw = quantize_int4(w, group, symmetric=False, bias=b)
    layer = Int4Linear(qw, max_kernel_rows=16)  # rows 40 takes the dequantize path
    x = torch.randn(rows, k).to(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (rows, n)
    ref = x.float() @ qw.dequantize().t() + b
    assert rel_err(y, ref) < (0.02 if dtype == torch.bfloat16 else 0.01)
    assert layer.calls["kernel" if rows <= 16 else "dequant"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 40])
def test_int8_layer_matches_float_reference(dtype, rows):
    torch.manual_seed(rows)
    w = torch.randn(80, 160)
    qw = quantize_int8(w)
    layer = Int8Linear(qw, max_kernel_rows=16)
    x = torch.randn(rows, 160).to(dtype)
    ref = x.float() @ qw.dequantize().t()
    y = layer(x)
    assert y.dtype == dtype
    assert rel_err(y, ref) < (0.02 if dtype == torch.bfloat16 else 0.01)
    # and against the unquantized weight: int8 noise is small
    assert rel_err(y, x.float() @ w.t()) < 0.03


def test_kernel_and_dequant_paths_agree():
    w = torch.randn(128, 256)
    x = torch.randn(8, 256)
    for qw in (quantize_int4(w, 64), quantize_int8(w)):
        fast = (Int4Linear if isinstance(qw, Int4Weight) else Int8Linear)(qw, max_kernel_rows=64)
        slow = (Int4Linear if isinstance(qw, Int4Weight) else Int8Linear)(qw, max_kernel_rows=0)
        assert rel_err(fast(x), slow(x)) < 0.01


def test_awq_input_scale_is_undone_inside_the_layer():
    w = torch.randn(64, 128)
    s = torch.rand(128) * 1.5 + 0.5
    qw = quantize_int4(w, 32, input_scale=s)
    x = torch.randn(4, 128)
    for rows in (0, 16):  # dequantize path and kernel path
        layer = Int4Linear(qw, max_kernel_rows=rows)
        assert rel_err(layer(x), x @ qw.dequantize().t()) < 0.02
        assert rel_err(layer(x), x @ w.t()) < 0.15
    assert rel_err(layer.dequantize(), qw.dequantize()) < 0.01


def test_int4_layer_reports_compact_bytes():
    w = torch.randn(256, 512)
    layer = Int4Linear(quantize_int4(w, 32))
    dense_bf16 = w.numel() * 2
    assert layer.nbytes < dense_bf16 / 3  # 4 bits + bf16 (scale, zero) per 32 = 5 bits/weight
