"""Rotary position embeddings: inverse frequencies (default, linear, llama3, longrope), cos/sin tables,
and the rotation itself (rotate-half convention, optionally on the first `rotary_dim` dims only)."""

from __future__ import annotations

import math

import torch

from hasten.model.rope_params import RopeSpec, rope_kind


def longrope_uses_long_factors(spec: RopeSpec, max_len: int) -> bool:
    """LongRoPE keeps two sets of factors. Hugging Face switches to the long ones once a sequence
    outgrows original_max_position_embeddings (and recomputes its cache); a server holding KV for
    many sequences picks one set for all positions instead: the long factors when the engine's
    max_model_len exceeds the original context (as llama.cpp does with its context size), else the
    short ones, which are exact for every sequence that fits."""
    assert spec.scaling is not None
    return max_len > int(spec.scaling["original_max_position_embeddings"])


def rope_inv_freq(spec: RopeSpec, max_len: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2], attention factor applied to cos and sin)."""
    dim = spec.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (spec.theta**exponents)
    scaling = spec.scaling
    kind = rope_kind(scaling)
    if kind == "default":
        return inv_freq, 1.0
    assert scaling is not None
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "longrope":
        original = int(scaling["original_max_position_embeddings"])
        factor = scaling.get("factor") or spec.max_position_embeddings / original
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        key = "long_factor" if longrope_uses_long_factors(spec, max_len) else "short_factor"
        ext = torch.tensor(scaling[key], dtype=torch.float32)
        return 1.0 / (ext * spec.theta**exponents), float(attention)
    raise ValueError(f"unsupported rope scaling {kind!r}")


class RotaryEmbedding:
    """cos/sin tables [max_len, rotary_dim] for every position up to max_len, looked up by position ids."""

    def __init__(self, spec: RopeSpec, max_len: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        inv_freq, attention = rope_inv_freq(spec, max_len)
        self.rotary_dim = spec.rotary_dim
        t = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if attention != 1.0:  # LongRoPE's attention factor scales q and k through the tables
            cos, sin = cos * attention, sin * attention
        self.cos = cos.to(device, dtype)
        self.sin = sin.to(device, dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; rotate-half convention (HF) over the first cos.shape[-1] dims, the
    rest passed through (partial rotary)."""
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
