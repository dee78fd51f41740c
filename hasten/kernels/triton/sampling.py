"""One uniform random number per row for batched sampling, in Triton.

`uniform_rows(seed, offset)` takes int64 tensors [n] and returns float64 u [n] in [0, 1). Row i
runs Philox-4x32-10 (Triton's `tl.randint4x`) with key = seed[i] (its low and high 32 bits) and
counter = (offset[i] low 32 bits, offset[i] high 32 bits, 0, 0). Philox is counter based, so a
row's draw depends only on its own (seed, offset), never on the batch it shares or its position
in it: a seeded request passes its seed and its number of generated tokens, and gets the same
number in any batch.

u is float64 with 53 random bits, (r0 >> 5) * 2**26 + (r1 >> 6) scaled by 2**-53 (r0, r1 the
first two 32-bit Philox outputs), so it takes every multiple of 2**-53 in [0, 1) with equal odds
and never reaches 1. A float32 u has only 24 bits, too coarse for the inverse-CDF draw of
hasten.engine.sampler.draw_with_uniforms over a large vocabulary (tokens of probability below
2**-24 would come out with the wrong odds); the draw computes its target u * total in float64.

`philox_reference` / `uniform_rows_reference` compute the same numbers in plain PyTorch (int64
arithmetic on 32-bit words), bit for bit; the tests check the kernel against them.
The kernel is defined on first use, so importing this module does not import Triton.
"""

from __future__ import annotations

import functools

import torch

_BLOCK = 128  # rows per program

_MASK32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57  # Philox-4x32 multipliers
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85  # Philox-4x32 key increments (Weyl sequence)
_ROUNDS = 10


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def uniform_rows_kernel(seed_ptr, offset_ptr, out_ptr, n, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = rows < n
        seed = tl.load(seed_ptr + rows, mask=ok, other=0)
        offset = tl.load(offset_ptr + rows, mask=ok, other=0)
        r0, r1, _, _ = tl.randint4x(seed, offset)
        hi = (r0.to(tl.uint32, bitcast=True) >> 5).to(tl.float64)  # 27 bits
        lo = (r1.to(tl.uint32, bitcast=True) >> 6).to(tl.float64)  # 26 bits
        u = (hi * 67108864.0 + lo) * 1.1102230246251565e-16  # (hi * 2**26 + lo) * 2**-53, exact
        tl.store(out_ptr + rows, u, mask=ok)

    return triton, uniform_rows_kernel


def uniform_rows(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """float64 u [n] in [0, 1): row i from Philox keyed by seed[i] at counter offset[i]."""
    assert seed.shape == offset.shape and seed.dim() == 1, (seed.shape, offset.shape)
    triton, kernel = _kernel()
    seed = seed.to(torch.int64).contiguous()
    offset = offset.to(device=seed.device, dtype=torch.int64).contiguous()
    n = seed.shape[0]
    out = torch.empty(n, dtype=torch.float64, device=seed.device)
    if n:
        kernel[(triton.cdiv(n, _BLOCK),)](seed, offset, out, n, BLOCK=_BLOCK)
    return out


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of a * b (a < 2**32, b holding 32-bit words) without overflowing
    int64: b is split into 16-bit halves, so no partial product exceeds 2**49."""
    p0 = a * (b & 0xFFFF)
    p1 = a * (b >> 16)
    lo = (p0 + ((p1 & 0xFFFF) << 16)) & _MASK32
    hi = (((p0 >> 16) + p1) >> 16) & _MASK32
    return hi, lo


def philox_reference(seed: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The four 32-bit outputs (as int64 holding 0 .. 2**32 - 1) of tl.randint4x(seed, offset),
    in plain PyTorch."""
    seed, offset = seed.to(torch.int64), offset.to(torch.int64)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    c0, c1 = offset & _MASK32, (offset >> 32) & _MASK32
    c2 = c3 = torch.zeros_like(c0)
    for _ in range(_ROUNDS):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def uniform_rows_reference(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """What uniform_rows returns, in plain PyTorch (on any device)."""
    r0, r1, _, _ = philox_reference(seed, offset)
    return ((r0 >> 5) * 2**26 + (r1 >> 6)).double() * 2.0**-53


def as_int64_seed(seed: int) -> int:
    """Any Python int as the int64 whose 64 bits are the seed's low 64 bits (two's complement)."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed
