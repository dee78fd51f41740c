"""Element types by name: the model's weights and activations, and its KV cache."""

from __future__ import annotations

import torch

# An int8 KV cache row (one head of one token) is head_dim codes and then its float32 scale.
INT8_KV_SCALE_BYTES = 4
INT8_KV_MAX_BLOCK_SIZE = 256  # the attention kernel keeps a block's key scales on its stack (kMaxKeys)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the model's (auto), a narrower float16 / bfloat16 one, or int8
    (each head's row of each token rounded to int8 with its own absmax scale; the C++ attention
    kernel on the CPU only). Attention still computes in float32; only the stored keys and values
    are rounded."""
    table = {"auto": model_dtype, "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
             "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "int8": torch.int8}
    if name not in table:
        raise ValueError(f"unsupported kv_cache_dtype {name!r}: use auto, float32, float16, bfloat16 or int8")
    return table[name]


def kv_row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Elements of one head's cache row for one token: head_dim, plus the scale's bytes for int8."""
    return head_dim + (INT8_KV_SCALE_BYTES if kv_dtype == torch.int8 else 0)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> int:
    """Bytes of keys and values one token holds in the cache, over all layers."""
    elem = torch.tensor([], dtype=kv_dtype).element_size()
    return 2 * num_layers * num_kv_heads * kv_row_width(head_dim, kv_dtype) * elem


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """The weights' and activations' element type: auto is float32 on the CPU, bfloat16 on a GPU."""
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if name == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    if name not in table:
        raise ValueError(f"unsupported dtype {name!r}: use auto, float32, bfloat16 or float16")
    return table[name]


def check_int8_kv_cache(config, device: torch.device, attention_backend: str) -> None:
    """An int8 KV cache is written by the C++ RoPE + cache op and read by the C++ attention kernel
    only: refuse it, saying why, where either would not run."""
    from hasten.kernels import cpu_attention, decoder_ops

    if device.type != "cpu" or attention_backend != "cpp":
        raise ValueError(f"kv_cache_dtype='int8' needs the C++ attention kernel on the CPU (device {device}, "
                         f"attention_backend {attention_backend!r}); use float16 or bfloat16 there")
    if config.block_size > INT8_KV_MAX_BLOCK_SIZE:
        raise ValueError(f"kv_cache_dtype='int8' takes block_size up to {INT8_KV_MAX_BLOCK_SIZE} "
                         f"(got {config.block_size})")
    if not config.fused_decoder_ops:
        raise ValueError("kv_cache_dtype='int8' needs fused_decoder_ops (its C++ op writes the int8 rows)")
    if decoder_ops.load() is None or cpu_attention.load() is None:
        raise ValueError(f"kv_cache_dtype='int8' needs the C++ kernels, which did not build here: "
                         f"{decoder_ops.load_error() or cpu_attention.load_error()}")
