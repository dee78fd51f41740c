"""Linear layers as small callables, so the decoder does not care how a weight is stored.

The decoder calls `layer(x)` with x: [M, K] and gets [M, N]. `DenseLinear` is the float
path; quantized layouts (hasten.quant) provide their own callables with the same shape
contract. `LinearFactory` builds one from a float weight and its name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

LinearLayer = Callable[[torch.Tensor], torch.Tensor]
# (name, weight [N, K], bias [N] | None) -> layer ; name like "layers.3.qkv_proj" or "lm_head"
LinearFactory = Callable[[str, torch.Tensor, torch.Tensor | None], LinearLayer]


class DenseLinear:
    """y = x W^T + b with the weight kept as a plain tensor."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)


class OneDNNLinear(DenseLinear):
    """Float32 linear with the weight pre-packed for oneDNN (measured ~1.8x faster than F.linear at
    1-5 rows on the 2-core AVX2 CI machine, never slower up to 512 rows). Keeps `weight` for
    introspection; the packed copy is what runs."""

    PACK_HINT = 64  # batch-size hint for the packed layout; 64 measured best from 1 to 512 rows

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight, bias)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.PACK_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class TiledLinear(DenseLinear):
    """Float32 linear through hasten's register-tiled C++ GEMM (hasten/kernels/float_tiles.h) on the
    weight's rows in place. With one layer's weights hot in cache it beats oneDNN's packed path
    1.1-2.4x from 1 to 16 rows; across a whole model (weights streaming from DRAM, the 113 MB
    lm_head) the two are level at every row count (0.83-1.02x, 2 to 512 rows), and end to end
    oneDNN was ahead (offline_vs_hf (b): 105.4 vs 99.3 tok/s), so `auto` keeps oneDNN."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight.contiguous(), bias)
        from hasten.kernels.quant_linear import float_linear

        self._op = float_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            return F.linear(x, self.weight, self.bias)
        y = self._op(x2, self.weight)
        if self.bias is not None:
            y += self.bias
        return y.view(*shape[:-1], y.shape[-1])


def tiled_available(dtype: torch.dtype) -> bool:
    if dtype != torch.float32:
        return False
    from hasten.kernels import quant_linear

    return quant_linear.load() is not None


def onednn_available(dtype: torch.dtype) -> bool:
    """The packed path exists for float32 wherever torch was built with oneDNN; probe it once."""
    if dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.randn(8, 16)
        x = torch.randn(3, 16)
        return torch.allclose(OneDNNLinear(w)(x), F.linear(x, w), atol=1e-4)
    except (RuntimeError, AttributeError):
        return False


def dense_factory(name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearLayer:
    return DenseLinear(weight, bias)


def onednn_factory(name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearLayer:
    return OneDNNLinear(weight, bias)


def tiled_factory(name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearLayer:
    return TiledLinear(weight, bias)


CPU_LINEAR_BACKENDS = ("auto", "hasten", "onednn", "torch")


def float_linear_factory(backend: str, dtype: torch.dtype) -> LinearFactory:
    """backend: "auto" (oneDNN packed when it works for this dtype, else torch) | "hasten" (the
    register tiles, float32) | "onednn" | "torch"."""
    if backend not in CPU_LINEAR_BACKENDS:
        raise ValueError(f"unknown cpu_linear_backend {backend!r}: one of {', '.join(CPU_LINEAR_BACKENDS)}")
    if backend == "torch":
        return dense_factory
    if backend == "hasten":
        if not tiled_available(dtype):
            raise ValueError(f"the hasten tiled linear needs float32 weights and the C++ kernels, not {dtype}")
        return tiled_factory
    if onednn_available(dtype):
        return onednn_factory
    if backend == "onednn":
        raise ValueError(f"the oneDNN linear path is not available for {dtype} on this machine")
    return dense_factory
