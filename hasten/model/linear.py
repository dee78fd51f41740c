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


def dense_factory(name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearLayer:
    return DenseLinear(weight, bias)
