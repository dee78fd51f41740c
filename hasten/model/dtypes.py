"""Element types by name: the model's weights and activations, and its KV cache."""

from __future__ import annotations

import torch


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the model's (auto), or a narrower float16 / bfloat16 one
    (attention still computes in float32; only the stored keys and values are rounded)."""
    table = {"auto": model_dtype, "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
             "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"unsupported kv_cache_dtype {name!r}: use auto, float32, float16 or bfloat16")
    return table[name]


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """The weights' and activations' element type: auto is float32 on the CPU, bfloat16 on a GPU."""
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if name == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    if name not in table:
        raise ValueError(f"unsupported dtype {name!r}: use auto, float32, bfloat16 or float16")
    return table[name]
