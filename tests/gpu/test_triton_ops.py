"""The Triton decoder-layer glue (hasten/kernels/triton/ops.py) in Triton's interpreter on the CPU,
against PyTorch written the way Hugging Face transformers computes it.

Exactness asserted here:
  * RoPE + cache writes, KV writes, the in-place residual add: bit-identical (torch.equal), float32
    and float16: the kernels round at the same points as eager PyTorch and float32 mul + add is not
    fused.
  * rms_norm / add_rms_norm, silu_mul, gelu_tanh_mul in float16: at least 99% of the elements
    bit-identical, the rest within 2 ulp. The intermediate that is rounded to float16 (the
    normalized row; the activation) comes from a float32 value that differs from PyTorch's in its
    last bits (the mean of squares summed in another order; another float32 exp), so it can round
    to the neighbouring float16, and a 1-ulp change of one factor moves the rounded product by up
    to 2 ulp.
  * The same ops in float32: within 8 ulp (the same float32 differences, then one or two roundings).
  * gelu_tanh_mul also allows an absolute 2^-21 |gate * up| where tanh saturates (gate < about -5):
    PyTorch's float32 tanh reaches -1 slightly before the kernel's, so 1 + tanh differs by 2^-24.
Each run draws fresh inputs; the seed is in every assertion message.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hasten.kernels.triton as hk
from hasten.kernels.triton import ops
from hasten.model.rope import RotaryEmbedding, apply_rope
from hasten.model.rope_params import RopeSpec

pytestmark = pytest.mark.skipif(not hk.usable_on("cpu"), reason=hk.unusable_reason("cpu"))

DTYPES = [torch.float32, torch.float16]
NAN = float("nan")


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def _seed(g: torch.Generator) -> str:
    return f"seed {g.initial_seed()}"


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-element distance in units in the last place (+0 and -0 coincide)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    bits, top = {torch.float32: (torch.int32, 1 << 31), torch.float16: (torch.int16, 1 << 15)}[a.dtype]

    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(bits).long()
        return torch.where(i < 0, -(i + top), i)

    return (ordered(a) - ordered(b)).abs()


def _allowed(dtype: torch.dtype) -> tuple[int, float]:
    """(max ulp, min fraction of bit-identical elements) for the ops with a float32 intermediate
    that PyTorch computes differently in the last bits (see the module docstring)."""
    return (2, 0.99) if dtype == torch.float16 else (8, 0.0)


def _close(a: torch.Tensor, b: torch.Tensor, g: torch.Generator, what: str, ok: torch.Tensor | None = None) -> None:
    max_ulps, min_exact = _allowed(a.dtype)
    assert not a.isnan().any(), f"{what}: nan in the output ({_seed(g)})"
    d = _ulps(a, b)
    good = d <= max_ulps if ok is None else (d <= max_ulps) | ok
    exact = float((d == 0).double().mean())
    assert bool(good.all()), f"{what}: {int((~good).sum())} elements off, max {int(d.max())} ulp ({_seed(g)})"
    assert exact >= min_exact, f"{what}: only {exact:.1%} bit-identical ({_seed(g)})"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_contiguous_and_row_strided(dtype, gen):
    T, N = 7, 96
    w = _randn(gen, N, dtype=dtype)
    x = _randn(gen, T, N, dtype=dtype, scale=3.0)
    out = torch.full((T, N), NAN, dtype=dtype)
    assert ops.rms_norm(x, w, 1e-6, out=out) is out
    _close(out, ops.rms_norm_reference(x, w, 1e-6), gen, "rms_norm")
    wide = _randn(gen, T, 3 * N + 5, dtype=dtype)
    view = wide[:, N + 3 : 2 * N + 3]  # row stride 3N + 5
    before = wide.clone()
    _close(ops.rms_norm(view, w, 1e-5), ops.rms_norm_reference(view, w, 1e-5), gen, "strided")
    assert torch.equal(wide, before)


def test_rms_norm_of_a_wide_row_in_one_block(gen):
    x = _randn(gen, 2, 16384, dtype=torch.float16)
    w = _randn(gen, 16384, dtype=torch.float16)
    _close(ops.rms_norm(x, w, 1e-6), ops.rms_norm_reference(x, w, 1e-6), gen, "rms_norm 16384")


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_residual_in_place(dtype, gen):
    T, N = 5, 80
    h = _randn(gen, T, N, dtype=dtype, scale=4.0)
    delta = _randn(gen, T, N, dtype=dtype)
    w = _randn(gen, N, dtype=dtype)
    expect_h = h.clone()
    expect = ops.add_rms_norm_reference(expect_h, delta, w, 1e-6)
    ptr = h.data_ptr()
    got = ops.add_rms_norm(h, delta, w, 1e-6)
    assert h.data_ptr() == ptr and torch.equal(h, expect_h), f"residual not h + delta ({_seed(gen)})"
    assert got.data_ptr() != h.data_ptr()
    _close(got, expect, gen, "add_rms_norm")


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
CASES = {  # id: (scaling, theta, heads, kv_heads, head_dim, rotary_dim, qkv dtype, cache dtype)
    "default-f32-gqa": (None, 10000.0, 4, 2, 16, 16, torch.float32, torch.float32),
    "default-f16-gqa": (None, 10000.0, 8, 2, 32, 32, torch.float16, torch.float16),
    "linear-f16-mqa": ({"rope_type": "linear", "factor": 4.0}, 10000.0, 4, 1, 16, 16, torch.float16, torch.float16),
    "llama3-f32-mha": (LLAMA3, 500000.0, 2, 2, 64, 64, torch.float32, torch.float32),
    "llama3-f16": (LLAMA3, 500000.0, 4, 2, 64, 64, torch.float16, torch.float16),
    "partial-f16": (None, 10000.0, 4, 2, 32, 8, torch.float16, torch.float16),
    "partial-f32": (None, 10000.0, 2, 1, 24, 12, torch.float32, torch.float32),
    "f32-qkv-f16-cache": (None, 10000.0, 4, 2, 16, 16, torch.float32, torch.float16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rope_and_cache_matches_apply_rope_and_index_copy(case, gen):
    scaling, theta, heads, kvh, d, rd, dtype, cache_dtype = CASES[case]
    T, max_len, blocks, bs = 6, 200, 4, 4
    rope = RotaryEmbedding(RopeSpec(theta, rd, scaling), max_len, dtype)
    width = (heads + 2 * kvh) * d
    qkv = _randn(gen, T, width + 8, dtype=dtype)[:, 4 : width + 4]  # a row-strided view
    positions = torch.randint(0, max_len, (T,), generator=gen)
    slots = torch.randperm(blocks * bs, generator=gen)[:T]
    slots[torch.randperm(T, generator=gen)[:2]] = -1  # padding rows: nothing cached
    k_cache = torch.full((blocks, bs, kvh, d), NAN, dtype=cache_dtype)
    v_cache = k_cache.clone()
    q = ops.rope_and_cache(qkv, rope.cos, rope.sin, positions, slots, k_cache, v_cache, heads, kvh)

    cos, sin = rope.lookup(positions)
    qk = apply_rope(qkv[:, : (heads + kvh) * d].reshape(T, heads + kvh, d), cos, sin)
    keep = slots >= 0
    want_k = torch.full_like(k_cache, NAN)
    want_v = torch.full_like(v_cache, NAN)
    want_k.view(-1, kvh, d).index_copy_(0, slots[keep], qk[keep, heads:].to(cache_dtype))
    want_v.view(-1, kvh, d).index_copy_(0, slots[keep], qkv[keep, (heads + kvh) * d :].reshape(-1, kvh, d).to(cache_dtype))
    msg = f"{case}, {_seed(gen)}"
    assert q.shape == (T, heads, d) and torch.equal(q, qk[:, :heads]), f"q differs: {msg}"
    torch.testing.assert_close(k_cache, want_k, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"k: {msg}\n{m}")
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"v: {msg}\n{m}")
    written = (~k_cache.view(-1, kvh * d).isnan()).all(1)
    assert int(written.sum()) == int(keep.sum()), f"slots outside `slots` touched: {msg}"


def test_kv_write_of_strided_views_into_a_narrower_cache(gen):
    T, kvh, d, blocks, bs = 5, 2, 16, 3, 4
    src = _randn(gen, T, 4 * kvh * d + 3, dtype=torch.float32)
    k = src[:, 3 : 3 + kvh * d].unflatten(1, (kvh, d))
    v = src[:, 3 + 2 * kvh * d : 3 + 3 * kvh * d].unflatten(1, (kvh, d))
    slots = torch.randperm(blocks * bs, generator=gen)[:T]
    slots[1] = -1
    for cache_dtype in (torch.float32, torch.float16):
        k_cache = torch.full((blocks, bs, kvh, d), NAN, dtype=cache_dtype)
        v_cache = k_cache.clone()
        want_k, want_v = k_cache.clone(), v_cache.clone()
        ops.kv_write(k, v, slots, k_cache, v_cache)
        ops.kv_write_reference(k, v, slots, want_k, want_v)
        for got, want in ((k_cache, want_k), (v_cache, want_v)):
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{_seed(gen)}\n{m}")


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp(-x) = inf is meant
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_activations(act, dtype, gen):
    T, inter = 3, 1500  # two column blocks of 1024, the second one partial
    gate_up = _randn(gen, T, 2 * inter + 6, dtype=dtype, scale=3.0)[:, 2 : 2 * inter + 2]  # row-strided
    fn, ref = {"silu": (ops.silu_mul, ops.silu_mul_reference),
               "gelu_tanh": (ops.gelu_tanh_mul, ops.gelu_tanh_mul_reference)}[act]
    got, want = fn(gate_up), ref(gate_up)
    assert got.shape == (T, inter) and got.is_contiguous()
    ok = None
    if act == "gelu_tanh":  # where tanh saturates (see the module docstring)
        gu = (gate_up[:, :inter].double() * gate_up[:, inter:].double()).abs()
        ok = (got.double() - want.double()).abs() <= 2.0**-21 * gu
    _close(got, want, gen, f"{act} {dtype}", ok)


def test_silu_mul_of_a_large_intermediate_size(gen):
    gate_up = _randn(gen, 1, 2 * 28672, dtype=torch.float16, scale=2.0)
    _close(ops.silu_mul(gate_up), ops.silu_mul_reference(gate_up), gen, "silu_mul 28672")


def test_bad_arguments_raise_value_errors():
    x = torch.zeros(2, 8)
    caches = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    table = torch.zeros(16, 8)
    idx = torch.zeros(2, dtype=torch.int64)
    qkv = torch.zeros(2, 24)
    bad = [
        (lambda: ops.rms_norm(x, torch.zeros(7), 1e-6), "weight"),
        (lambda: ops.rms_norm(x, torch.zeros(8, dtype=torch.float16), 1e-6), "weight"),
        (lambda: ops.rms_norm(x.t(), torch.zeros(2), 1e-6), "contiguous rows"),
        (lambda: ops.add_rms_norm(x, torch.zeros(3, 8), torch.zeros(8), 1e-6), "delta"),
        (lambda: ops.rope_and_cache(torch.zeros(2, 25), table, table, idx, idx, *caches, 1, 1), "width"),
        (lambda: ops.rope_and_cache(qkv, table, table, idx.int(), idx, *caches, 1, 1), "positions"),
        (lambda: ops.rope_and_cache(qkv, table[:, :3].contiguous(), table[:, :3].contiguous(), idx, idx, *caches, 1, 1),
         "rotary dim"),
        (lambda: ops.rope_and_cache(qkv, table.half(), table.half(), idx, idx, *caches, 1, 1), "dtype"),
        (lambda: ops.rope_and_cache(qkv, table, table, idx, idx, caches[0], caches[1].half(), 1, 1), "caches"),
        (lambda: ops.kv_write(torch.zeros(2, 1, 8), torch.zeros(2, 1, 8), idx[:1], *caches), "slots"),
        (lambda: ops.silu_mul(torch.zeros(2, 7)), "odd width"),
    ]
    for call, words in bad:
        with pytest.raises(ValueError, match=words):
            call()


def test_importing_the_ops_does_not_import_triton():
    code = "import sys, hasten.kernels.triton.ops; assert 'triton' not in sys.modules, 'triton imported'"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
