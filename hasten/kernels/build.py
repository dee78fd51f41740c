"""Compile-on-first-use for the C++ kernels in this folder (torch.utils.cpp_extension, cached).

The first build takes about a minute; torch keeps the result in its extension folder, so later
processes load it in well under a second. If no compiler is available, `load` returns None and
the caller falls back to a PyTorch path; `error` says why.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)


class Extension:
    def __init__(self, name: str, sources: tuple[str, ...], extra_cflags: tuple[str, ...] = (), headers: tuple[str, ...] = ()):
        self.name = name
        self.extra_cflags = list(extra_cflags)
        self.sources = [Path(__file__).with_name(s) for s in sources]
        self.headers = [Path(__file__).with_name(h) for h in headers]  # included by the sources
        self.module: ModuleType | None = None
        self.error: str | None = None
        self._lock = threading.Lock()

    def load(self) -> ModuleType | None:
        if self.module is not None or self.error is not None:
            return self.module
        with self._lock:
            if self.module is None and self.error is None:
                try:
                    self.module = self._build()
                except Exception as exc:  # no compiler, no headers, ...: the caller falls back
                    self.error = f"{type(exc).__name__}: {exc}"
                    log.warning("C++ kernel %s unavailable: %s", self.name, self.error.splitlines()[0])
        return self.module

    def _build(self) -> ModuleType:
        """Build in a folder named by a hash of the source, its headers, flags and torch version,
        from a copy of them kept there: every checkout with the same kernel reuses one build (building
        from each checkout's own path would make ninja rebuild whenever the path changes)."""
        import torch
        from torch.utils import cpp_extension

        flags = ["-O3", "-fopenmp", *self.extra_cflags]
        # HASTEN_NATIVE_ARCH: 1 (default) this CPU's instruction set; 0 none (the portable loops);
        # avx2: AVX2 + FMA + F16C only (the paths of a CPU without AVX-512 / VNNI, testable anywhere)
        arch = os.environ.get("HASTEN_NATIVE_ARCH", "1")
        if arch == "avx2":
            flags += ["-mavx2", "-mfma", "-mf16c"]
        elif arch != "0":
            flags.append("-march=native")
        files = {p.name: p.read_bytes() for p in (*self.headers, *self.sources)}
        digest = hashlib.blake2b(repr((flags, torch.__version__)).encode(), digest_size=6)
        for fname, code in files.items():
            digest.update(fname.encode() + code)
        name = f"{self.name}_{digest.hexdigest()}"
        folder = Path(cpp_extension._get_build_directory(name, verbose=False))
        _clear_stale_lock(folder / "lock")
        for fname, code in files.items():  # headers first: the sources are what ninja watches
            target = folder / fname
            if not target.exists() or target.read_bytes() != code:
                tmp = folder / (fname + f".{os.getpid()}.tmp")
                tmp.write_bytes(code)
                tmp.replace(target)  # atomic: a concurrent build never sees half a file
        return cpp_extension.load(
            name=name,
            sources=[str(folder / p.name) for p in self.sources],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )


STALE_LOCK_S = 300  # a build takes about a minute; a lock this old was left by a killed process


def _clear_stale_lock(lock: Path) -> None:
    """torch waits forever on the build folder's lock file; a process killed while compiling
    leaves it behind, which would hang every later start. Remove it once it is clearly stale."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing a stale kernel build lock (%.0f s old): %s", age, lock)
        lock.unlink(missing_ok=True)


# Every CPU kernel in one module (one build, compiled in parallel, and the C++ decoder loop calls
# the other kernels directly). No fused multiply-add contraction: the glue ops keep PyTorch's
# rounding of each product; the hot kernels spell their FMAs out with intrinsics.
CPU_KERNELS = Extension(
    "hasten_cpu_kernels",
    ("quant_linear_cpu.cpp", "quant_linear_q8_cpu.cpp", "quant_gemm_q8_cpu.cpp", "paged_attention_cpu.cpp",
     "gemm_u8_cpu.cpp", "gemm_bf16_amx_cpu.cpp", "decoder_ops_cpu.cpp", "decoder_loop_cpu.cpp"),
    ("-ffp-contract=off",),
    headers=("float_tiles.h", "int4_common.h", "attention_math.h", "attention_prefetch.h", "attention_int8_scores.h", "attention_int8_decode.h",
             "quant_gemm_q8_grouped.h", "quant_gemm_q8_silu.h", "quant_gemm_q8_loops.h", "attention_lane_tiles.h", "attention_groups.h", "attention_amx.h", "amx_tiles.h", "cpu_kernels.h"),
)
