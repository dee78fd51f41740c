"""Quantized weight layouts and the round-to-nearest math that fills them.

Two layouts, both weight-only and row-major over the output channels N:

* `Int8Weight`: int8 [N, K] with one float scale per output row (symmetric): w = q * scale[n].
* `Int4Weight`: values 0..15 packed two per byte, uint8 [N, K // 2] (low nibble = even k),
  with one (scale, min) pair per group of `group_size` consecutive k: w = q * scale + min.
  The symmetric variant is the same layout with min = -8 * scale, so one kernel serves both,
  and GGUF Q4_0 (w = (q - 8) d) and Q4_1 (w = q d + m) map onto it exactly.

Both may carry `input_scale` [K] (AWQ): the layer computes (x / input_scale) @ dequant(q)^T,
where q was quantized from W * input_scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP_SIZES = (32, 64, 128)


@dataclass
class Int8Weight:
    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N]
    bias: torch.Tensor | None = None  # [N] in any float dtype
    input_scale: torch.Tensor | None = None  # float32 [K] (AWQ), None = 1

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.qweight.shape[0]), int(self.qweight.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] this layout stands for (input scaling folded back in)."""
        w = self.qweight.float() * self.scales.float()[:, None]
        return w / self.input_scale[None, :] if self.input_scale is not None else w


@dataclass
class Int4Weight:
    qweight: torch.Tensor  # uint8 [N, K // 2], element k in nibble k % 2 (low first) of byte k // 2
    scales: torch.Tensor  # float32 [N, K // group_size]
    mins: torch.Tensor  # float32 [N, K // group_size]: value of q = 0
    group_size: int
    bias: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.qweight.shape[0]), int(self.qweight.shape[1]) * 2)

    def unpack(self) -> torch.Tensor:
        """The 4-bit values as uint8 [N, K] in 0..15."""
        return unpack_nibbles(self.qweight)

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        g = self.group_size
        q = self.unpack().float().view(n, k // g, g)
        w = (q * self.scales.float()[..., None] + self.mins.float()[..., None]).view(n, k)
        return w / self.input_scale[None, :] if self.input_scale is not None else w


@dataclass
class GroupedInt8Weight:
    """Signed codes int8 [N, K] with a (scale, min) pair per group of 16 or 32 consecutive k:
    w = q * scale + min. GGUF's 5-, 6- and 8-bit blocks (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) map onto it
    with their codes unchanged (see hasten/quant/gguf_kquants.py); mins None: all zero."""

    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N, K // group_size]
    mins: torch.Tensor | None  # float32 [N, K // group_size] or None
    group_size: int
    bias: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.qweight.shape[0]), int(self.qweight.shape[1]))

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        g = self.group_size
        w = self.qweight.float().view(n, k // g, g) * self.scales.float()[..., None]
        if self.mins is not None:
            w = w + self.mins.float()[..., None]
        w = w.view(n, k)
        return w / self.input_scale[None, :] if self.input_scale is not None else w


QuantizedWeight = Int8Weight | Int4Weight


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8/int [N, K] values 0..15 -> uint8 [N, K // 2] (even k in the low nibble)."""
    if q.shape[-1] % 2:
        raise ValueError("K must be even to pack 4-bit values")
    q = q.to(torch.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).view(*packed.shape[:-1], packed.shape[-1] * 2)


def int8_scales(weight: torch.Tensor) -> torch.Tensor:
    """Per-output-channel symmetric int8 scales: max|w_n| / 127."""
    return (weight.float().abs().amax(dim=1) / 127.0).clamp(min=1e-10)


def quantize_int8(weight: torch.Tensor, bias: torch.Tensor | None = None,
                  scales: torch.Tensor | None = None) -> Int8Weight:
    """Per-output-channel symmetric int8: scale = max|w_n| / 127 (or the given `scales`, e.g. the full
    rows' of a column slice), q in [-127, 127]."""
    w = weight.float()
    if scales is None:
        scales = int8_scales(w)
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scales.contiguous(), bias)


def pick_group_size(k: int, requested: int) -> int:
    """`requested` if it divides K, else the largest supported group that does (error if none)."""
    if requested not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, not {requested}")
    for g in sorted(INT4_GROUP_SIZES, reverse=True):
        if g <= requested and k % g == 0:
            return g
    raise ValueError(f"no int4 group size in {INT4_GROUP_SIZES} divides K={k}")


def int4_params(w: torch.Tensor, group_size: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, mins) [N, K // g] for round-to-nearest of float32 w [N, K]."""
    n, k = w.shape
    wg = w.view(n, k // group_size, group_size)
    if symmetric:
        # q - 8 in [-8, 7]: map the largest magnitude to +-8 on the side where it lies
        amax = wg.amax(dim=-1)
        amin = wg.amin(dim=-1)
        big = torch.where(amax >= -amin, amax / 7.0, amin / -8.0)
        scales = big.clamp(min=1e-10)
        return scales, -8.0 * scales
    lo = wg.amin(dim=-1).clamp(max=0.0)
    hi = wg.amax(dim=-1).clamp(min=0.0)
    scales = ((hi - lo) / 15.0).clamp(min=1e-10)
    return scales, lo


def int4_codes(w: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> torch.Tensor:
    """Round-to-nearest codes uint8 [N, K] in 0..15 for given per-group (scales, mins)."""
    n, k = w.shape
    wg = w.view(n, k // group_size, group_size)
    q = torch.round((wg - mins[..., None]) / scales[..., None]).clamp_(0, 15)
    return q.view(n, k).to(torch.uint8)


def quantize_int4(
    weight: torch.Tensor,
    group_size: int,
    symmetric: bool = False,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> Int4Weight:
    """Group-wise int4 by round-to-nearest; with `input_scale` quantizes W * input_scale (AWQ)."""
    w = weight.float()
    if input_scale is not None:
        w = w * input_scale.float()[None, :]
    g = pick_group_size(w.shape[1], group_size)
    scales, mins = int4_params(w, g, symmetric)
    q = int4_codes(w, scales, mins, g)
    return Int4Weight(pack_nibbles(q), scales.contiguous(), mins.contiguous(), g, bias, input_scale)


def fake_quantize_int4(w: torch.Tensor, group_size: int, symmetric: bool) -> torch.Tensor:
    """quantize then dequantize float32 w [N, K] (used by the AWQ search)."""
    scales, mins = int4_params(w, group_size, symmetric)
    q = int4_codes(w, scales, mins, group_size).float()
    n, k = w.shape
    return (q.view(n, k // group_size, group_size) * scales[..., None] + mins[..., None]).view(n, k)


def fake_quantize_int8(w: torch.Tensor) -> torch.Tensor:
    scales = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-10)
    return torch.round(w / scales).clamp_(-127, 127) * scales


def weight_nbytes(qw: QuantizedWeight) -> int:
    """Bytes of the stored layout (codes + scales/mins as the kernels hold them in bf16 + input scale)."""
    n, k = qw.shape
    if isinstance(qw, Int8Weight):
        total = n * k + n * 2
    else:
        total = n * k // 2 + 2 * n * (k // qw.group_size) * 2
    if qw.input_scale is not None:
        total += k * 4
    if qw.bias is not None:
        total += qw.bias.numel() * qw.bias.element_size()
    return total
