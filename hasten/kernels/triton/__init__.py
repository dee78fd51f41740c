"""The GPU kernels, all Triton: paged attention (decode, prefill), KV write, norms, RoPE, SiLU-mul,
sampling. Each module holds its kernels and the plain-PyTorch reference they are tested against.

On a machine without a GPU the same kernels run in Triton's interpreter on CPU tensors
(`TRITON_INTERPRET=1`, set before the first kernel is defined): that is how the tests prove them,
and how the engine's Triton path runs end to end on the CPU. Kernels are defined lazily (on first
use), so importing these modules never imports Triton.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def available() -> bool:
    """Whether Triton imports here."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def interpreting() -> bool:
    """Whether Triton runs its kernels in the interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def usable_on(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on tensors of `device`: a CUDA device with Triton
    installed, or the CPU under the interpreter."""
    if not available():
        return False
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available() and not interpreting()
    return kind == "cpu" and interpreting()


def unusable_reason(device: torch.device | str) -> str:
    if not available():
        return "Triton is not installed"
    kind = torch.device(device).type
    if kind == "cuda":
        return "no CUDA device here" if not torch.cuda.is_available() else "TRITON_INTERPRET is set"
    return "on the CPU the Triton kernels run only in the interpreter (set TRITON_INTERPRET=1 before starting)"
