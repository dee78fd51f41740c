"""GGUF's 5-, 6- and 8-bit blocks as `GroupedInt8Weight`: each block's integer codes unchanged, its
scales and mins in float32 as ggml's dequantizers compute them (no requantization).

Block formats (ggml, little-endian):
  Q8_0: 32 weights: fp16 d, 32 int8 q                            -> w = q * d
  Q5_0: 32 weights: fp16 d, 32 high bits, 16 bytes of nibbles    -> w = (q - 16) * d
  Q5_1: 32 weights: fp16 d, fp16 m, 32 high bits, 16 nibble bytes -> w = q * d + m
  Q5_K: 256 weights: fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) pairs (as Q4_K), 32 bytes
        of high bits, 128 bytes of nibbles; sub-blocks of 32     -> w = q * (d * sc) - dmin * m
  Q6_K: 256 weights: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, fp16 d;
        sub-blocks of 16                                          -> w = (q - 32) * (d * sc)
In Q5_0 / Q5_1 element j's fifth bit is bit j of the 32-bit word; nibble j holds element j (low)
and j + 16 (high). Q5_K's 64-weight chunk c holds its two sub-blocks in the low and high nibbles
of 32 bytes, sub-block s taking bit s of high-bit byte l. Q6_K, per 128 weights: element l + 32 t
(t = 0..3) is nibble (t >= 2) of ql[l + 32 (t % 2)] with bits 2t, 2t+1 of qh[l] on top.
"""

from __future__ import annotations

import numpy as np
import torch

from hasten.quant.formats import GroupedInt8Weight, Int4Weight, Int8Weight

QK_K = 256
GROUPED_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")


def f16(raw: np.ndarray) -> torch.Tensor:
    """uint8 [..., 2] little-endian halves -> float32 [...]."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def _u8(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw)).to(torch.int32)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """int32 [..., 4] bytes of a little-endian 32-bit word -> its bits [..., 32] (bit j at j)."""
    bytes_bits = (qh[..., :, None] >> torch.arange(8)) & 1  # [..., 4, 8]
    return bytes_bits.reshape(*qh.shape[:-1], 32)


def q8_0_to_grouped(data: np.ndarray, n: int, k: int) -> GroupedInt8Weight:
    blocks = np.asarray(data, dtype=np.uint8).reshape(n, k // 32, 34)
    q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:34]).view(np.int8)).reshape(n, k)
    return GroupedInt8Weight(q.contiguous(), f16(blocks[..., 0:2]).contiguous(), None, 32)


def _q5_codes(qh: np.ndarray, qs: np.ndarray) -> torch.Tensor:
    """Q5_0 / Q5_1: high-bit words uint8 [N, B, 4] and nibbles [N, B, 16] -> codes int32 [N, B, 32] in 0..31."""
    q = _u8(qs)
    low = torch.cat((q & 0x0F, q >> 4), dim=-1)  # element j low nibble, j + 16 high
    return low | (_bits32(_u8(qh)) << 4)


def q5_0_to_grouped(data: np.ndarray, n: int, k: int) -> GroupedInt8Weight:
    blocks = np.asarray(data, dtype=np.uint8).reshape(n, k // 32, 22)
    codes = _q5_codes(blocks[..., 2:6], blocks[..., 6:22]) - 16
    return GroupedInt8Weight(codes.reshape(n, k).to(torch.int8), f16(blocks[..., 0:2]).contiguous(), None, 32)


def q5_1_to_grouped(data: np.ndarray, n: int, k: int) -> GroupedInt8Weight:
    blocks = np.asarray(data, dtype=np.uint8).reshape(n, k // 32, 24)
    codes = _q5_codes(blocks[..., 4:8], blocks[..., 8:24])
    return GroupedInt8Weight(codes.reshape(n, k).to(torch.int8), f16(blocks[..., 0:2]).contiguous(),
                             f16(blocks[..., 2:4]).contiguous(), 32)


def k_scales_mins(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes [..., 12] -> the 8 sub-blocks' 6-bit scales and mins (ggml's get_scale_min_k4)."""
    b = _u8(raw)
    sc = torch.cat([b[..., 0:4] & 63, (b[..., 8:12] & 0xF) | ((b[..., 0:4] >> 6) << 4)], dim=-1)
    m = torch.cat([b[..., 4:8] & 63, (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 6) << 4)], dim=-1)
    return sc, m


def q5_k_to_grouped(data: np.ndarray, n: int, k: int) -> GroupedInt8Weight:
    nb = k // QK_K
    blocks = np.asarray(data, dtype=np.uint8).reshape(n, nb, 176)
    d = f16(blocks[..., 0:2])[..., None]
    dmin = f16(blocks[..., 2:4])[..., None]
    sc, m = k_scales_mins(blocks[..., 4:16])
    qh = _u8(blocks[..., 16:48])  # [N, nb, 32]
    ql = _u8(blocks[..., 48:176]).reshape(n, nb, 4, 32)
    low = torch.stack((ql & 0x0F, ql >> 4), dim=3).reshape(n, nb, 8, 32)  # sub-block s = 2 chunk + nibble
    high = (qh[:, :, None, :] >> torch.arange(8)[:, None]) & 1  # [N, nb, 8, 32]: bit s of byte l
    codes = (low | (high << 4)).reshape(n, k)
    scales = (d * sc.float()).reshape(n, nb * 8)
    mins = (-(dmin * m.float())).reshape(n, nb * 8)
    return GroupedInt8Weight(codes.to(torch.int8), scales.contiguous(), mins.contiguous(), 32)


def q6_k_to_grouped(data: np.ndarray, n: int, k: int) -> GroupedInt8Weight:
    nb = k // QK_K
    blocks = np.asarray(data, dtype=np.uint8).reshape(n, nb, 210)
    ql = _u8(blocks[..., 0:128]).reshape(n, nb, 2, 2, 32)  # [.., half, t % 2, l]
    qh = _u8(blocks[..., 128:192]).reshape(n, nb, 2, 32)  # [.., half, l]
    sc = torch.from_numpy(np.ascontiguousarray(blocks[..., 192:208]).view(np.int8)).float()  # [N, nb, 16]
    d = f16(blocks[..., 208:210])[..., None]
    low = torch.stack((ql[:, :, :, 0] & 0x0F, ql[:, :, :, 1] & 0x0F, ql[:, :, :, 0] >> 4, ql[:, :, :, 1] >> 4), dim=3)
    high = (qh[:, :, :, None, :] >> (2 * torch.arange(4))[:, None]) & 3  # [.., half, t, l]
    codes = ((low | (high << 4)) - 32).reshape(n, k)
    return GroupedInt8Weight(codes.to(torch.int8), (d * sc).reshape(n, nb * 16).contiguous(), None, 16)


CONVERTERS = {"Q5_0": q5_0_to_grouped, "Q5_1": q5_1_to_grouped, "Q5_K": q5_k_to_grouped, "Q6_K": q6_k_to_grouped,
              "Q8_0": q8_0_to_grouped}


def to_grouped(qw: GroupedInt8Weight | Int4Weight | Int8Weight, group: int) -> GroupedInt8Weight:
    """Any of our layouts as a grouped int8 weight of `group` (16 or 32, at most its own group):
    the same codes, scales and mins repeated per group (exact)."""
    if isinstance(qw, Int8Weight):  # one scale per row
        n, k = qw.shape
        return GroupedInt8Weight(qw.qweight, qw.scales.float()[:, None].expand(n, k // group).contiguous(), None, group)
    if isinstance(qw, Int4Weight):
        codes, scales, mins, own = qw.unpack().to(torch.int8), qw.scales.float(), qw.mins.float(), qw.group_size
    else:
        codes, scales, mins, own = qw.qweight, qw.scales, qw.mins, qw.group_size
    if own % group:
        raise ValueError(f"cannot express group {own} as groups of {group}")
    rep = own // group
    return GroupedInt8Weight(codes, scales.repeat_interleave(rep, dim=1),
                             None if mins is None else mins.repeat_interleave(rep, dim=1), group)


def concat_grouped(parts: list[GroupedInt8Weight | Int4Weight | Int8Weight]) -> GroupedInt8Weight:
    """Rows of mixed layouts (a fused qkv whose v is Q8_0 and q, k Q5_0, ...) as one grouped int8 weight."""
    group = min(16 if isinstance(p, GroupedInt8Weight) and p.group_size == 16 else 32 for p in parts)
    grouped = [to_grouped(p, group) for p in parts]
    any_mins = any(g.mins is not None for g in grouped)
    mins = [g.mins if g.mins is not None else torch.zeros_like(g.scales) for g in grouped] if any_mins else None
    return GroupedInt8Weight(torch.cat([g.qweight for g in grouped]), torch.cat([g.scales for g in grouped]),
                             torch.cat(mins) if mins is not None else None, group)
