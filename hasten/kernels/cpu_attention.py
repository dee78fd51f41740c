"""Loader for the C++ paged-attention kernel (paged_attention_cpu.cpp).

The extension is compiled on first use (about a minute; cached in torch's extension folder, so
later processes load it in well under a second). If no compiler is available the caller falls back
to the SDPA path; `load()` returns None and `load_error()` says why.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention_cpu.cpp")
_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    flags = ["-O3", "-fopenmp", "-std=c++17"]
    if os.environ.get("HASTEN_NATIVE_ARCH", "1") != "0":
        flags.append("-march=native")
    return cpp_extension.load(
        name="hasten_paged_attention_cpu",
        sources=[str(_SOURCE)],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def load() -> ModuleType | None:
    """The compiled module, or None when it cannot be built here (reason in load_error())."""
    global _module, _error
    if _module is not None or _error is not None:
        return _module
    with _lock:
        if _module is None and _error is None:
            try:
                _module = _build()
            except Exception as exc:  # no compiler, no headers, ...: fall back to SDPA
                _error = f"{type(exc).__name__}: {exc}"
                log.warning("C++ paged attention unavailable, using SDPA: %s", _error.splitlines()[0])
    return _module


def load_error() -> str | None:
    return _error


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    q_tile: int = 8,
) -> torch.Tensor:
    """See paged_attention_cpu.cpp for the layout. Raises RuntimeError if the kernel is unavailable."""
    mod = load()
    if mod is None:
        raise RuntimeError(f"C++ paged attention unavailable: {_error}")
    return mod.paged_attention(q, k_cache, v_cache, block_tables, query_start, context_lens, scale, q_tile)
