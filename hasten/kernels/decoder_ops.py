"""Fused decoder-layer glue (decoder_ops_cpu.cpp): RMSNorm, residual add + RMSNorm, RoPE + KV cache
write, SiLU-and-multiply. See hasten.kernels.build for how it is compiled."""

from __future__ import annotations

from types import ModuleType

from hasten.kernels.build import CPU_KERNELS

_ext = CPU_KERNELS


def load() -> ModuleType | None:
    return _ext.load()


def load_error() -> str | None:
    return _ext.error
