"""Backing an engine's large CPU tensors with 2 MB pages (transparent huge pages, MADV_COLLAPSE).

A CPU decode step streams every weight copy its kernels read (hundreds of MB for the default GGUF
with its int8 and bfloat16 copies) and the cache blocks of every running sequence, scattered over a
pool of a GB or more. In 4 KB pages that is ~100k pages per step, far more than the second-level
TLB holds, so most of them cost a page walk, whose page-table entries the streamed data have pushed
out of the caches. In 2 MB pages the same memory is a few hundred TLB entries.

Linux hands out 2 MB pages to a process only where it asks (`enabled` set to `madvise`, the common
default) and only for memory faulted in after asking; the engine's tensors are written while they
load. `collapse` therefore asks (MADV_HUGEPAGE, so that the kernel keeps them huge) and then has the
kernel rebuild the memory already there in 2 MB pages at once (MADV_COLLAPSE, Linux 6.1 and later).
Only whole 2 MB-aligned pages inside a tensor's storage are touched, so nothing outside the tensors
is populated. Where the kernel or the platform refuses (older kernels, THP off, no memory for a huge
page), the memory stays as it was: this changes where the bytes live, never what they hold.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from types import BuiltinFunctionType, FunctionType, MethodType, ModuleType

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


@dataclass
class CollapseReport:
    """What `collapse` did: storages looked at, bytes now in 2 MB pages, bytes the kernel refused."""

    storages: int = 0
    collapsed_bytes: int = 0
    refused_bytes: int = 0
    error: str | None = None  # the first refusal's reason (errno name), or why nothing was tried
    seconds: float = 0.0

    def describe(self) -> str:
        mb = 2**20
        text = f"{self.collapsed_bytes / mb:.0f} MB of {self.storages} tensors in 2 MB pages in {self.seconds:.2f} s"
        if self.refused_bytes:
            text += f", {self.refused_bytes / mb:.0f} MB refused"
        return text + (f" ({self.error})" if self.error else "")


@functools.cache
def _madvise():
    """libc's madvise (loaded once), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def aligned_span(address: int, nbytes: int, page: int = HUGE_PAGE_BYTES) -> tuple[int, int]:
    """The whole `page`-aligned pages inside [address, address + nbytes): (start, length), length 0 if none."""
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    return start, max(0, end - start)


def cpu_storages(tensors: Iterable[torch.Tensor], min_bytes: int = HUGE_PAGE_BYTES) -> dict[int, int]:
    """Address -> size of the distinct CPU storages of at least `min_bytes` behind `tensors` (views share one)."""
    spans: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_sparse:
            continue
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue  # tensors without a plain storage (e.g. some wrapper subclasses)
        if storage.nbytes() >= min_bytes and storage.data_ptr():
            spans[storage.data_ptr()] = storage.nbytes()
    return spans


def advise(tensor: torch.Tensor, madvise=None) -> bool:
    """Ask for 2 MB pages under a CPU tensor not written yet (MADV_HUGEPAGE), so that its first writes
    fault them in whole instead of being rebuilt by `collapse` afterwards. True where the kernel agreed."""
    spans = cpu_storages([tensor])
    madvise = madvise or _madvise()
    if madvise is None or not spans:
        return False
    start, length = aligned_span(*next(iter(spans.items())))
    return bool(length) and madvise(start, length, MADV_HUGEPAGE) == 0


def collapse(tensors: Iterable[torch.Tensor], madvise=None) -> CollapseReport:
    """Put the 2 MB-aligned pages of the tensors' storages in huge pages (see the module's text).
    `madvise` (address, length, advice) -> 0 or -1 stands in for libc's in tests."""
    t0 = time.perf_counter()
    spans = cpu_storages(tensors)
    report = CollapseReport(storages=len(spans))
    if madvise is None:
        madvise = _madvise()
        if madvise is None:
            report.error = "not Linux"
            return report
    for address, nbytes in spans.items():
        start, length = aligned_span(address, nbytes)
        if not length:
            continue
        madvise(start, length, MADV_HUGEPAGE)  # keep them huge from now on (a refusal shows in the collapse)
        if madvise(start, length, MADV_COLLAPSE) == 0:
            report.collapsed_bytes += length
            continue
        report.refused_bytes += length
        code = ctypes.get_errno()
        if report.error is None:  # e.g. EINVAL for a span of a file mapping (a weight read in place)
            report.error = errno.errorcode.get(code, str(code)) if code else "refused"
        if not report.collapsed_bytes and code in (errno.EINVAL, errno.EPERM, errno.ENOSYS):
            break  # refused before anything was granted: no MADV_COLLAPSE here, or THP is off
    report.seconds = time.perf_counter() - t0
    return report


def collapse_engine_memory(model: object, runner: object) -> CollapseReport:
    """`collapse` over every tensor of a model and its runner (weights, kernel copies, KV pool), logged:
    what an engine, or one rank of it, does once loaded (EngineConfig.huge_pages)."""
    report = collapse(tensors_under(model, runner))
    logger.info("huge pages: %s", report.describe())
    return report


def anon_huge_bytes() -> int:
    """Bytes of this process's anonymous memory in huge pages now (/proc/self/smaps_rollup), 0 if unreadable."""
    path = f"/proc/{os.getpid()}/smaps_rollup"
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def tensors_under(*roots: object, max_objects: int = 200_000) -> list[torch.Tensor]:
    """Every tensor reachable from `roots` through attributes, slots, lists, tuples, sets and dict values
    (an engine's model and KV pool), each object visited once; stops after `max_objects` objects."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack: list[object] = list(roots)
    while stack and len(seen) < max_objects:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, _LEAVES):
            continue
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
            for name in getattr(type(obj), "__slots__", ()):
                if isinstance(name, str) and hasattr(obj, name):
                    stack.append(getattr(obj, name))
    return found


# objects whose attributes lead to no engine tensor (modules and functions would lead to the whole program)
_LEAVES = (str, bytes, int, float, complex, bool, type(None), type, ModuleType, FunctionType, MethodType,
           BuiltinFunctionType)
