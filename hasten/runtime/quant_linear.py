"""Quantized projections on the device path: int4 and int8 weights run through the Triton
weight-only matmuls (`hasten/kernels/triton_quant.py`), where the dequantized weight never exists
in memory.

The layouts are the CPU path's (`hasten.quant.formats`), so the quantized file one path writes
serves the other, and GGUF blocks map the same way:

- `Int4Weight` (RTN / AWQ int4, GGUF Q4_0 / Q4_1 / Q4_K) -> `TritonInt4Linear`;
- `Int8Weight` (int8 per row) -> `TritonInt8Linear`;
- `GroupedInt8Weight` (GGUF Q5 / Q6 / Q8_0 blocks) has no Triton kernel yet: it is dequantized
  once into a dense weight of the serving dtype (2 bytes a weight instead of ~1).

AWQ's per-input-channel scale is applied to x, as on the CPU (x / s @ (W s)^T = x @ W^T).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hasten.model.linear import DenseLinear, LinearLayer
from hasten.quant.formats import GroupedInt8Weight, Int4Weight, Int8Weight

logger = logging.getLogger(__name__)


class _TritonQuantLinear:
    def __init__(self, bias: torch.Tensor | None, input_scale: torch.Tensor | None, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.bias = bias.to(device, dtype) if bias is not None else None
        self.inv_input_scale = (1.0 / input_scale.float()).to(device, dtype) if input_scale is not None else None

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.inv_input_scale if self.inv_input_scale is not None else x

    def _finish(self, y: torch.Tensor) -> torch.Tensor:
        return y + self.bias if self.bias is not None else y

    def _extra_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.bias, self.inv_input_scale) if t is not None)


class TritonInt4Linear(_TritonQuantLinear):
    """y = x @ dequant(codes, scales, mins)^T (+ bias), int4 codes and float32 (scale, min) per group."""

    def __init__(self, qw: Int4Weight, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(qw.bias, qw.input_scale, device, dtype)
        self.codes = qw.qweight.to(device).contiguous()
        self.scales = qw.scales.float().to(device).contiguous()
        self.mins = qw.mins.float().to(device).contiguous()
        self.group = qw.group_size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from hasten.kernels.triton_quant import int4_matmul

        return self._finish(int4_matmul(self._prepare(x), self.codes, self.scales, self.mins, self.group))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins)) + self._extra_bytes()


class TritonInt8Linear(_TritonQuantLinear):
    """y = x @ (qweight * scales[:, None])^T (+ bias), int8 weights and a float32 scale per row."""

    def __init__(self, qw: Int8Weight, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(qw.bias, qw.input_scale, device, dtype)
        self.qweight = qw.qweight.to(device).contiguous()
        self.scales = qw.scales.float().to(device).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from hasten.kernels.triton_quant import int8_matmul

        return self._finish(int8_matmul(self._prepare(x), self.qweight, self.scales))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales)) + self._extra_bytes()


@dataclass
class DeviceQuantLayers:
    """The layer maker the quantizing factories take on the device path (`layer_maker=`)."""

    device: torch.device
    dtype: torch.dtype

    def __call__(self, qw: Int4Weight | Int8Weight | GroupedInt8Weight) -> LinearLayer:
        if isinstance(qw, Int4Weight):
            return TritonInt4Linear(qw, self.device, self.dtype)
        if isinstance(qw, Int8Weight):
            return TritonInt8Linear(qw, self.device, self.dtype)
        if isinstance(qw, GroupedInt8Weight):
            bias = qw.bias.to(self.device, self.dtype) if qw.bias is not None else None
            return DenseLinear(qw.dequantize().to(self.device, self.dtype), bias)
        raise TypeError(f"no device layer for {type(qw).__name__}")
