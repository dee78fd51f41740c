"""The Triton int4 / int8 matmuls (hasten/kernels/triton_quant.py) in Triton's interpreter on the
CPU, against the PyTorch reference; on a GPU the same kernels are timed by
benchmarks/triton_quant_gpu.py."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hasten.kernels import triton_quant

pytestmark = pytest.mark.skipif(not triton_quant.available(), reason="triton is not installed")


@pytest.mark.parametrize("seed", [0, 1])
def test_triton_matmuls_match_the_reference_in_the_interpreter(seed):
    script = Path(__file__).with_name("triton_interpret_check.py")
    proc = subprocess.run([sys.executable, str(script), str(seed)], capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.rstrip().endswith("OK") and out.count("rel err") == 20, out[-4000:]
