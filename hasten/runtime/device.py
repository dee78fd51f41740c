"""Which device the engine runs on, and the decoder glue of the Triton path.

`resolve_device` checks the `device` option; `TritonDecoderOps` gives the decoder's fused-op
interface (the one hasten/kernels/decoder_ops_cpu.cpp exports: rms_norm, add_rms_norm,
rope_and_cache, silu_mul) over the Triton kernels of hasten/kernels/triton/ops.py, so
`Decoder._forward_fused` is the GPU path's layer loop too.
"""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """cpu, cuda or cuda:N; a CUDA device must exist here."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {name!r}: use cpu, cuda or cuda:N") from exc
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}: use cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device={name!r} but no CUDA device is available (torch {torch.__version__})")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"device={name!r}: only {torch.cuda.device_count()} CUDA device(s) here")
        device = torch.device("cuda", index)
    return device


def uses_device_path(device: torch.device, attention_backend: str) -> bool:
    """Whether the engine takes the device runner (step tensors packed and copied once, batched
    sampling): on a GPU, and on the CPU with the Triton kernels (in the interpreter)."""
    return device.type != "cpu" or attention_backend == "triton"


def check_device_options(config, device: torch.device, dtype: torch.dtype, device_path: bool, world: int) -> None:
    """Options the device path does not take: each a clear error at start-up, not a failure later."""
    if dtype == torch.float16 and not device_path:
        raise ValueError("dtype=float16 runs on the device path only (device=cuda, or attention_backend=triton)")
    if not device_path:
        return
    if world > 1:
        raise ValueError("tensor and pipeline parallelism run on the CPU path only (device=cpu with cpp or sdpa "
                         "attention)")
    if not 0.0 < config.gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {config.gpu_memory_utilization}")


class TritonDecoderOps:
    """The C++ decoder ops' call signatures over the Triton kernels."""

    def __init__(self) -> None:
        from hasten.kernels.triton import ops

        self._ops = ops

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._ops.add_rms_norm(h, delta, weight, eps)

    def rope_and_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                       slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                       kv_heads: int) -> torch.Tensor:
        return self._ops.rope_and_cache(qkv, cos, sin, positions, slots, k_cache, v_cache, heads, kv_heads)

    def silu_mul(self, gate_up: torch.Tensor, fast: bool = False) -> torch.Tensor:
        return self._ops.silu_mul(gate_up)
