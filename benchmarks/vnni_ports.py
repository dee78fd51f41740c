"""Which vector operations compete with the int8 multiply-adds (vpdpbusd) for issue slots on this CPU.

    python benchmarks/vnni_ports.py [--iters 50000000]

The 8-bit GEMM (gemm_u8_cpu.cpp) spends 8 `vpdpbusd` per 16 outputs and 32 k, then converts the run's
integer sums to float and applies x's scale to them. Whether that epilogue slows the multiply-adds
depends on which execution pipes its operations share with them. This compiles a loop of 12
independent `vpdpbusd` on 512-bit registers (one core, `c++ -O3 -march=native`) and adds 3 or 6
independent operations of one kind per iteration: FMA, multiply, int -> float conversion, float add,
`vscalefps`, 32-bit integer add. It prints the multiply-add rate of each against the loop alone;
a ratio near 1.00 means the operation issues beside them. Needs a C++ compiler and AVX-512 VNNI.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

KINDS = {  # name -> one operation on accumulator number i (f: float, n: int32 registers)
    "fma": "f{i} = _mm512_fmadd_ps(f{i}, m, m);",
    "mul": "f{i} = _mm512_mul_ps(f{i}, m);",
    "cvt": "f{i} = _mm512_cvtepi32_ps(n{i}); n{i} = _mm512_castps_si512(f{i});",
    "add": "f{i} = _mm512_add_ps(f{i}, m);",
    "scalef": "f{i} = _mm512_scalef_ps(f{i}, m);",
    "add_epi32": "n{i} = _mm512_add_epi32(n{i}, w);",
}

PROGRAM = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>

template <int KIND, int EXTRA>
double rate(long iters) {  // G vpdpbusd per second
  const __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
  const __m512 m = _mm512_set1_ps(0.999f);
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
          a9 = a0, a10 = a0, a11 = a0;
  __m512 f0 = _mm512_set1_ps(1.0f), f1 = f0, f2 = f0, f3 = f0, f4 = f0, f5 = f0;
  __m512i n0 = a0, n1 = a0, n2 = a0, n3 = a0, n4 = a0, n5 = a0;
  const auto t0 = std::chrono::steady_clock::now();
  for (long it = 0; it < iters; ++it) {
#define D(a) a = _mm512_dpbusd_epi32(a, w, x);
    D(a0) D(a1) D(a2) D(a3) D(a4) D(a5) D(a6) D(a7) D(a8) D(a9) D(a10) D(a11)
    BODY
    asm volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8),
                 "+v"(a9), "+v"(a10), "+v"(a11));
    asm volatile("" : "+v"(f0), "+v"(f1), "+v"(f2), "+v"(f3), "+v"(f4), "+v"(f5), "+v"(n0), "+v"(n1), "+v"(n2),
                 "+v"(n3), "+v"(n4), "+v"(n5));
  }
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return iters * 12.0 / sec / 1e9;
}

int main(int argc, char** argv) {
  const long iters = argc > 1 ? std::atol(argv[1]) : 50000000L;
  CALLS
}
"""


def source() -> str:
    """The program: template argument KIND picks a row of KINDS (0: none), EXTRA how many per iteration."""
    body = []
    for k, op in enumerate(KINDS.values(), start=1):
        ops = " ".join(f"if (EXTRA > {i}) {{ {op.format(i=i)} }}" for i in range(6))
        body.append(f"if constexpr (KIND == {k}) {{ {ops} }}")
    calls = ['printf("none 0 %.3f\\n", rate<0, 0>(iters));']
    for k, name in enumerate(KINDS, start=1):
        for extra in (3, 6):
            calls.append(f'printf("{name} {extra} %.3f\\n", rate<{k}, {extra}>(iters));')
    return PROGRAM.replace("BODY", "\n    ".join(body)).replace("CALLS", "\n  ".join(calls))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=50_000_000)
    args = ap.parse_args()
    compiler = shutil.which("c++") or shutil.which("g++")
    cpuinfo = Path("/proc/cpuinfo")
    if compiler is None or not (cpuinfo.exists() and "avx512_vnni" in cpuinfo.read_text()):
        print("needs a C++ compiler and a CPU with AVX-512 VNNI; skipped")
        return
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "ports.cpp", Path(tmp) / "ports"
        src.write_text(source())
        subprocess.run([compiler, "-O3", "-march=native", "-std=c++17", str(src), "-o", str(exe)], check=True)
        out = subprocess.run([str(exe), str(args.iters)], check=True, capture_output=True, text=True).stdout
    rates = {}
    for line in out.splitlines():
        name, extra, value = line.split()
        rates[(name, int(extra))] = float(value)
    alone = rates.pop(("none", 0))
    print(f"12 vpdpbusd per iteration alone: {alone:.2f} G/s (one core)")
    print("+ per iteration | 3 of them | 6 of them   (vpdpbusd rate against the loop alone)")
    for name in KINDS:
        print(f"  {name:10s}    | {rates[(name, 3)] / alone:9.2f} | {rates[(name, 6)] / alone:9.2f}")


if __name__ == "__main__":
    main()
