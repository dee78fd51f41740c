"""Run by tests/quant/test_triton_quant.py in a fresh process: TRITON_INTERPRET=1 must be set before
Triton is imported. Checks the Triton int4 / int8 matmuls against the PyTorch reference on fresh
random inputs (several shapes, ragged edges, three group sizes, float32 and float16 x; the
interpreter mishandles bfloat16, which numpy lacks) and prints
one line per case; exits non-zero on the first mismatch."""
from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from hasten.kernels import triton_quant  # noqa: E402


def reference_int4(x, codes, scales, mins, group):
    n, k = codes.shape[0], codes.shape[1] * 2
    q = torch.stack((codes & 0x0F, codes >> 4), dim=-1).view(n, k // group, group).float()
    w = (q * scales.float()[..., None] + mins.float()[..., None]).view(n, k)
    return x.double() @ w.double().t()


def main() -> int:
    gen = torch.Generator().manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    cases = [(1, 96, 128, 32), (5, 40, 64, 32), (3, 50, 96, 32), (33, 130, 192, 64), (17, 64, 256, 128)]
    for M, N, K, group in cases:
        for dtype in (torch.float32, torch.float16):
            x = torch.randn(M, K, generator=gen).to(dtype)
            codes = torch.randint(0, 256, (N, K // 2), generator=gen, dtype=torch.uint8)
            scales = (torch.rand(N, K // group, generator=gen) * 0.02 + 0.001).half()
            mins = (-torch.rand(N, K // group, generator=gen) * 0.1).half()
            y = triton_quant.int4_matmul(x, codes, scales, mins, group, block_k=64)
            ref = reference_int4(x, codes, scales, mins, group)
            # float32: summation order only; float16: x and the dequantized weight rounded to 11 bits
            tol = 1e-4 if dtype == torch.float32 else 5e-3
            err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
            print(f"int4 M={M} N={N} K={K} group={group} {dtype}: rel err {err:.2e}")
            if y.dtype != dtype or y.shape != (M, N) or not err < tol:
                return 1
            q8 = torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8)
            s8 = torch.rand(N, generator=gen) * 0.01
            y8 = triton_quant.int8_matmul(x, q8, s8, block_k=64)
            ref8 = x.double() @ (q8.double() * s8.double()[:, None]).t()
            err8 = ((y8.double() - ref8).abs().max() / ref8.abs().max()).item()
            print(f"int8 M={M} N={N} K={K} {dtype}: rel err {err8:.2e}")
            if y8.dtype != dtype or y8.shape != (M, N) or not err8 < tol:
                return 1
    for bad in (lambda: triton_quant.int4_matmul(torch.randn(2, 60), torch.zeros(8, 32, dtype=torch.uint8),
                                                  torch.zeros(8, 2).half(), torch.zeros(8, 2).half(), 32),
                lambda: triton_quant.int8_matmul(torch.randn(2, 64), torch.zeros(8, 64, dtype=torch.uint8),
                                                  torch.zeros(8))):
        try:
            bad()
        except ValueError as exc:
            print(f"rejected: {exc}")
        else:
            return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
