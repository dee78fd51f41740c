"""Triton int4 / int8 weight-only matmuls on a GPU against the fp16 matmul of the same weight.

    python benchmarks/triton_quant_gpu.py            # needs CUDA + Triton; prints one line per shape

For each (M, N, K) it checks the Triton result against dequantize-then-matmul (relative error) and
times, with CUDA events (median of 50 after warm-up): fp16 torch.matmul, int8_matmul and
int4_matmul (group 32 and 128). Shapes: SmolLM2-135M's layers and Llama-3-8B's, at decode (M = 1,
16) and prefill (M = 512) row counts. Ratios > 1 mean the quantized kernel is faster.
"""
from __future__ import annotations

import argparse
import sys

import torch

from hasten.kernels import triton_quant


def bench(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,512")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not triton_quant.available():
        print("SKIPPED: needs a CUDA GPU and Triton")
        return 0
    dev = "cuda"
    shapes = {"smollm2 gate_up": (3072, 576), "smollm2 down": (576, 1536), "llama3-8b qkv": (6144, 4096),
              "llama3-8b gate_up": (28672, 4096), "llama3-8b down": (4096, 14336)}
    print(f"{torch.cuda.get_device_name()}  (times in ms, median of 50; ratio = fp16 time / kernel time)")
    for M in [int(r) for r in args.rows.split(",")]:
        for name, (N, K) in shapes.items():
            x = torch.randn(M, K, device=dev, dtype=torch.float16)
            codes = torch.randint(0, 256, (N, K // 2), device=dev, dtype=torch.uint8)
            q8 = torch.randint(-127, 128, (N, K), device=dev, dtype=torch.int8)
            s8 = torch.rand(N, device=dev) * 0.01
            w8 = (q8.float() * s8[:, None]).half()
            line = [f"M={M:<4} {name:<18} N={N:<6} K={K:<6}"]
            t16 = bench(lambda w=w8, x=x: x @ w.t())
            t8 = bench(lambda x=x, q=q8, s=s8: triton_quant.int8_matmul(x, q, s))
            err8 = ((triton_quant.int8_matmul(x, q8, s8).float() - x.float() @ w8.float().t()).abs().max()
                    / (x.float() @ w8.float().t()).abs().max()).item()
            line.append(f"fp16 {t16:.3f}  int8 {t8:.3f} ({t16 / t8:.2f}x, err {err8:.1e})")
            for group in (32, 128):
                scales = (torch.rand(N, K // group, device=dev) * 0.02).half()
                mins = (-torch.rand(N, K // group, device=dev) * 0.1).half()
                q = torch.stack((codes & 0x0F, codes >> 4), dim=-1).view(N, K // group, group).float()
                w4 = (q * scales.float()[..., None] + mins.float()[..., None]).view(N, K)
                ref = x.float() @ w4.t()
                y = triton_quant.int4_matmul(x, codes, scales, mins, group)
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                t4 = bench(lambda x=x, c=codes, s=scales, m=mins, g=group: triton_quant.int4_matmul(x, c, s, m, g))
                line.append(f"int4-g{group} {t4:.3f} ({t16 / t4:.2f}x, err {err:.1e})")
            print("  ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
