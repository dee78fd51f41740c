"""The portable build of the CPU kernels (HASTEN_NATIVE_ARCH=0: no -march=native, so none of the
AVX2 / F16C paths) and the plain-AVX2 build (HASTEN_NATIVE_ARCH=avx2: no AVX-512, no VNNI, as on
CPUs without them) must compile and give the same answers: the kernel tests run again in a
subprocess against each build. Without this, a change to one path can break another unnoticed (it
did once: an AVX2-only constant used outside its #if)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts processes or loads the embedded model

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = [
    "tests/quant/test_quant_linear_kernel.py",
    "tests/quant/test_gguf_kquants.py",
    "tests/quant/test_u8_gemm.py",
    "tests/engine/test_attention_kernel.py",
    "tests/engine/test_int8_kv_cache.py",
    "tests/engine/test_attention_int8_decode.py",
    "tests/engine/test_arch_attention.py",
    "tests/engine/test_decoder_ops.py",
    "tests/engine/test_native_loop.py",
]


@pytest.mark.parametrize("arch", ["0", "avx2"])
@pytest.mark.skipif(os.environ.get("HASTEN_NATIVE_ARCH", "1") != "1", reason="already a reduced build")
@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_kernel_tests_pass_in_the_generic_build(arch):
    cpuinfo = Path("/proc/cpuinfo")
    if arch == "avx2" and not (cpuinfo.exists() and "avx2" in cpuinfo.read_text()):
        pytest.skip("this CPU has no AVX2")
    env = dict(os.environ, HASTEN_NATIVE_ARCH=arch)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail.splitlines()[-1], tail
