"""hasten's fused decoder ops against the PyTorch code they replace, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hasten.kernels import decoder_ops
from hasten.model.layers import apply_rope, rms_norm

ops = decoder_ops.load()
pytestmark = pytest.mark.skipif(ops is None, reason="C++ decoder ops cannot be built here")

DTYPES = [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)]


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 576), (37, 64), (300, 128)])
def test_rms_norm_and_residual(dtype, tol, rows, width):
    gen = torch.Generator().manual_seed(rows + width)
    x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    w = (torch.rand(width, generator=gen) + 0.5).to(dtype)
    want = rms_norm(x, w, 1e-5)
    got = ops.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    h = x.clone()
    delta = torch.randn(rows, width, generator=gen).to(dtype)
    got = ops.add_rms_norm(h, delta, w, 1e-5)
    assert torch.equal(h, x + delta)  # the residual stream is updated in place
    assert torch.allclose(got.float(), rms_norm(x + delta, w, 1e-5).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("rows,width", [(1, 32), (31, 64), (33, 576), (300, 128)])
def test_rms_norm_into_tiles_is_the_norm_rounded_to_bfloat16(rows, width):
    """rms_norm_tiles: add_rms_norm's (or rms_norm's) float32 values rounded to bfloat16 in
    bf16_tiles_linear's tile order, rows past the last zero, the residual updated the same way."""
    gen = torch.Generator().manual_seed(rows * width)
    x = torch.randn(rows, width, generator=gen) * 3
    w = torch.rand(width, generator=gen) + 0.5
    delta = torch.randn(rows, width, generator=gen)
    pad = (rows + 31) // 32 * 32

    def rows_of(tiles: torch.Tensor) -> torch.Tensor:
        assert tiles.shape == (pad // 16, width // 32, 16, 32) and tiles.dtype == torch.bfloat16
        return tiles.permute(0, 2, 1, 3).reshape(pad, width)

    plain = rows_of(ops.rms_norm_tiles(x.clone(), w, 1e-5))
    assert torch.equal(plain[:rows], ops.rms_norm(x, w, 1e-5).to(torch.bfloat16)) and not plain[rows:].any()
    h1, h2 = x.clone(), x.clone()
    added = rows_of(ops.rms_norm_tiles(h1, w, 1e-5, delta))
    want = ops.add_rms_norm(h2, delta, w, 1e-5)
    assert torch.equal(h1, h2) and torch.equal(added[:rows], want.to(torch.bfloat16)) and not added[rows:].any()
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.rms_norm_tiles(torch.randn(4, 48), torch.ones(48), 1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        ops.rms_norm_tiles(x.to(torch.bfloat16), w.to(torch.bfloat16), 1e-5)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,tokens", [(9, 3, 64, 5), (4, 4, 16, 33), (8, 1, 128, 1)])
def test_rope_and_cache(dtype, tol, heads, kv_heads, head_dim, tokens):
    gen = torch.Generator().manual_seed(heads * tokens)
    max_len, blocks, bs = 256, 12, 16
    angles = torch.rand(max_len, head_dim // 2, generator=gen) * 6
    cos = torch.cat([angles.cos(), angles.cos()], 1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], 1).to(dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, max_len, (tokens,), generator=gen)
    slots = torch.randperm(blocks * bs, generator=gen)[:tokens]
    k_cache = torch.zeros(blocks, bs, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    q = ops.rope_and_cache(qkv, cos, sin, positions, slots, k_cache, v_cache, heads, kv_heads)

    qk = qkv[:, : (heads + kv_heads) * head_dim].reshape(tokens, heads + kv_heads, head_dim)
    rotated = apply_rope(qk, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    assert torch.allclose(q.float(), rotated[:, :heads].float(), rtol=tol, atol=tol)
    k_flat, v_flat = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    assert torch.allclose(k_flat[slots].float(), rotated[:, heads:].float(), rtol=tol, atol=tol)
    v = qkv[:, (heads + kv_heads) * head_dim :].reshape(tokens, kv_heads, head_dim)
    assert torch.equal(v_flat[slots], v)
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots] = False
    assert not k_flat[untouched].any() and not v_flat[untouched].any()


@pytest.mark.parametrize("heads,kv_heads,head_dim,tokens", [(9, 3, 64, 37), (2, 1, 48, 5), (3, 1, 128, 9), (2, 2, 8, 3)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_float32_rope_is_the_pytorch_rounding_bit_for_bit(heads, kv_heads, head_dim, tokens, cache_dtype):
    """float32: q and k rotated with the same products and sums as apply_rope (the AVX-512 lanes and
    the scalar tail for head_dim / 2 not a multiple of 16), into a float32 cache or rounded once into
    a float16 one."""
    gen = torch.Generator().manual_seed(heads * 131 + head_dim + tokens)
    angles = torch.rand(64, head_dim // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos(), angles.cos()], 1), torch.cat([angles.sin(), angles.sin()], 1)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 5
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    slots = torch.randperm(4 * 16, generator=gen)[:tokens]
    qkv[0, -1] = 1e-6  # values below float16's normal range: in v, and a rotated pair of k
    qkv[0, heads * head_dim], qkv[0, heads * head_dim + head_dim // 2] = 1e-6, -2e-6
    k_cache = torch.zeros(4, 16, kv_heads, head_dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    q = ops.rope_and_cache(qkv, cos, sin, positions, slots, k_cache, v_cache, heads, kv_heads)
    qk = qkv[:, : (heads + kv_heads) * head_dim].reshape(tokens, heads + kv_heads, head_dim)
    rotated = apply_rope(qk, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    assert torch.equal(q, rotated[:, :heads])
    assert torch.equal(k_cache.view(-1, kv_heads, head_dim)[slots], rotated[:, heads:].to(cache_dtype))
    v = qkv[:, (heads + kv_heads) * head_dim :].reshape(tokens, kv_heads, head_dim)
    assert torch.equal(v_cache.view(-1, kv_heads, head_dim)[slots], v.to(cache_dtype))


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_rope_into_a_narrow_cache(cache_dtype):
    """A float32 model writing a float16/bfloat16 KV cache: the float32 result, rounded once."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, d, tokens, bs = 9, 3, 64, 7, 16
    angles = torch.rand(128, d // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen)
    positions = torch.randint(0, 128, (tokens,), generator=gen)
    slots = torch.randperm(4 * bs, generator=gen)[:tokens]
    k32, v32 = torch.zeros(4, bs, kv_heads, d), torch.zeros(4, bs, kv_heads, d)
    q32 = ops.rope_and_cache(qkv, cos, sin, positions, slots, k32, v32, heads, kv_heads)
    k16, v16 = k32.new_zeros(k32.shape, dtype=cache_dtype), v32.new_zeros(v32.shape, dtype=cache_dtype)
    q16 = ops.rope_and_cache(qkv, cos, sin, positions, slots, k16, v16, heads, kv_heads)
    assert torch.equal(q16, q32)
    assert torch.equal(k16, k32.to(cache_dtype)) and torch.equal(v16, v32.to(cache_dtype))
    with pytest.raises(RuntimeError, match="caches"):
        ops.rope_and_cache(qkv, cos, sin, positions, slots, k16, v32, heads, kv_heads)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_silu_mul(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(19, 2 * 96, generator=gen) * 4).to(dtype)
    want = F.silu(gate_up[:, :96]) * gate_up[:, 96:]
    got = ops.silu_mul(gate_up)
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("rows,inter", [(1, 8), (13, 1536), (40, 37)])
def test_fast_silu_mul_stays_close_to_float64(rows, inter):
    """fast=True (rows the down projection takes in bfloat16): the attention kernels' vectorized exp
    keeps silu(g) * u within 1e-5 relative over the whole range (|g| x 6e-8: its range reduction is in
    float32; bfloat16 then rounds to 4e-3),
    saturating cleanly at the extremes."""
    gen = torch.Generator().manual_seed(rows * inter)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 6
    gate_up[0, :4] = torch.tensor([-200.0, -88.0, 0.0, 120.0])[: min(4, inter)]
    want = (F.silu(gate_up[:, :inter].double()) * gate_up[:, inter:].double())
    got = ops.silu_mul(gate_up, True)
    assert torch.isfinite(got).all()
    assert ((got.double() - want).abs() <= 1e-5 * want.abs() + 1e-30).all()  # silu(-200) -> -1e-36, not -3e-85
    assert torch.equal(ops.silu_mul(gate_up.to(torch.bfloat16), True), ops.silu_mul(gate_up.to(torch.bfloat16)))


def test_fast_silu_mul_lanes_match_the_scalar_loop():
    """The 16- and 8-lane loops run sigmoid_fast's operations in its order: every column equals the same
    value computed alone (a one-column call takes the scalar loop)."""
    gen = torch.Generator().manual_seed(8)
    inter = 45  # two 16-lane passes, one 8-lane pass, a scalar tail of 5
    gate_up = torch.randn(7, 2 * inter, generator=gen) * 6
    got = ops.silu_mul(gate_up, True)
    for j in range(inter):
        alone = ops.silu_mul(gate_up[:, [j, inter + j]].contiguous(), True)
        assert torch.equal(alone[:, 0], got[:, j]), j


def test_bad_inputs_raise():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(x, torch.ones(7), 1e-5)
    cache = torch.zeros(2, 4, 1, 4)
    cos = torch.ones(8, 4)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.rope_and_cache(torch.randn(1, 12), cos, cos, torch.tensor([0]), torch.tensor([99]), cache, cache.clone(), 1, 1)
    with pytest.raises(RuntimeError, match="rotary table"):
        ops.rope_and_cache(torch.randn(1, 12), cos, cos, torch.tensor([8]), torch.tensor([0]), cache, cache.clone(), 1, 1)
