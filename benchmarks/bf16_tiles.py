"""The bfloat16 wide calls on AMX: hasten's tile kernel against oneDNN's GEMM, on the default model's shapes.

    python benchmarks/bf16_tiles.py [--threads 2] [--rounds 3] [--layers 30]

SmolLM2's four projections (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) over --layers
layers of distinct weights (from memory, as in a prefill step), x float32 and y float32 as the layer
loop has them, at 32, 128, 256 and 512 rows:
  tiles    bf16_tiles_linear over bf16_tiles_pack's copy (quant_bf16_gemm_tiles, the default), with its
           stream (quant_bf16_gemm_stream, the default: x in tile order, the next weight blocks requested ahead);
  rowmajor the same kernel with stream=False (x row-major, nothing requested ahead; the same outputs);
  onednn   F.linear(x.bfloat16(), row-major bfloat16 weight).float() (quant_bf16_gemm_tiles=False:
           oneDNN reorders the weight for its AMX kernel on every call);
  packed   oneDNN's GEMM over a weight it packed once (torch.ops.mkldnn._linear_pointwise), for reference.
Alternating, best of --rounds each; prints GMAC/s and the ratios tiles / rowmajor and tiles / onednn.
Needs AMX-BF16.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_cpu import best_ms  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def calls(weights: list, tiles: list, packed: list, xs: dict) -> dict:
    """One pass over every layer per way of multiplying."""
    from hasten.kernels import quant_linear

    pairs = list(zip(weights, tiles, packed, strict=True))
    return {
        "tiles": lambda: [quant_linear.bf16_tiles_linear(xs[k], t) for (_, k, _), t, _ in pairs],
        "rowmajor": lambda: [quant_linear.bf16_tiles_linear(xs[k], t, stream=False) for (_, k, _), t, _ in pairs],
        "onednn": lambda: [F.linear(xs[k].to(torch.bfloat16), w).float() for (_, k, w), _, _ in pairs],
        "packed": lambda: [torch.ops.mkldnn._linear_pointwise(xs[k].to(torch.bfloat16), p, None, "none", [], "").float()
                           for (_, k, _), _, p in pairs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    from hasten.kernels import quant_linear

    if quant_linear.load() is None or not quant_linear.bf16_tiles_available():
        raise SystemExit("needs the C++ kernels built with AMX-BF16 tiles on a CPU that has them")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = [(n, k, (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16))
               for _ in range(args.layers) for n, k in SHAPES]
    tiles = [quant_linear.bf16_tiles_pack(w) for _, _, w in weights]
    print(f"{args.layers} layers x {len(SHAPES)} projections, {args.threads} threads, GMAC/s (best of {args.rounds})")
    print(f"{'rows':>5} {'tiles':>8} {'rowmajor':>9} {'onednn':>8} {'packed':>8} {'tiles/rowmajor':>15} "
          f"{'tiles/onednn':>13}")
    for rows in (32, 128, 256, 512):
        xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
        macs = rows * sum(n * k for n, k, _ in weights)
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for _, _, w in weights]  # for this row count
        runs = calls(weights, tiles, packed, xs)
        best = {name: float("inf") for name in runs}
        for _ in range(args.rounds):
            for name, fn in runs.items():
                best[name] = min(best[name], best_ms(fn, 1, 1))
        rate = {name: macs / ms / 1e6 for name, ms in best.items()}
        print(f"{rows:>5} {rate['tiles']:>8.0f} {rate['rowmajor']:>9.0f} {rate['onednn']:>8.0f} {rate['packed']:>8.0f} "
              f"{rate['tiles'] / rate['rowmajor']:>14.2f}x {rate['tiles'] / rate['onednn']:>12.2f}x")


if __name__ == "__main__":
    main()
