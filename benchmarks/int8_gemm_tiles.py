"""The int8-activation GEMM tiles and what they do to the engine, on the default model's shapes.

    python benchmarks/int8_gemm_tiles.py [--threads 2] [--rounds 2] [--skip-engine]

1. SmolLM2's four int4 projections (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) through
   int4_linear_q8_gemm at 16, 64 and 256 rows, weights in cache: the 8-row tiles
   (quant_q8_gemm_wide_rows=0) against the 16-row tiles (8), and oneDNN's bfloat16 F.linear;
2. the same over 30 layers of distinct weights (from memory) at 4, 16 and 64 rows; and the 8-bit GEMM
   of quant_u8_gemm (u8_linear_q8_gemm over u8_pack_rows16's copy) over 30 such layers at 16, 64, 256
   and 512 rows (a prefill step's 512 tokens: what bounds a burst's last TTFT), with x's per-32 scales
   as they are and rounded up to powers of two (quant_u8_gemm_pow2_x_scales), alternating, best of
   --rounds each; and the int4 GEMM at 1-8 rows (a speculative verification step's 1 + k rows); the
   int4 GEMM at 64, 256 and 512 rows with x in 16 KB panels (quant_q8_gemm_x_panel) against all rows at
   once, alternating (medians);
   and the 30 layers' gate_up with SiLU-multiply at 16, 64, 256 and 512 rows: int4_linear_q8_gemm then
   silu_mul (fast) against int4_linear_q8_gemm_silu (quant_int4_gemm_silu), 10 x --rounds passes each,
   alternating (medians);
3. paged decode attention, 16 sequences x 300 tokens over 30 layers' float16 and float32 KV from memory,
   one layer's float16 pool cache-resident, and 48 x 500 tokens of float32 KV: the block ahead requested a
   few lines per step (attention_spread_prefetch) against in one burst, alternating (medians);
4. (unless --skip-engine) the GGUF engine: one 256-token prefill (best of 4) and a 16-sequence decode
   step at 300 tokens (mean of 20), quant_q8_gemm_wide_rows=0 fast_silu=False against the defaults,
   --rounds interleaved rounds.
Best of several repeats for 1-3; the machine is noisy, read the ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import find_gguf  # noqa: E402
from kernels_cpu import best_ms  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def packed_layers(layers: int, gen: torch.Generator) -> list[tuple]:
    from hasten.kernels.quant_linear import int4_pack_rows8

    out = []
    for _ in range(layers):
        for n, k in SHAPES:
            codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
            scales = (torch.rand(n, k // 32, generator=gen) * 0.01).half()
            mins = (-torch.rand(n, k // 32, generator=gen) * 0.1).half()
            out.append((n, k, *int4_pack_rows8(codes, scales, mins, 32)))
    return out


def gemm_rates(layers: list[tuple], rows: int, wide: int, gen: torch.Generator) -> float:
    """GMAC/s of int4_linear_q8_gemm over `layers` (one pass) at `rows` rows of x."""
    from hasten.kernels.quant_linear import int4_linear_q8_gemm, set_q8_gemm_wide_rows

    xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
    set_q8_gemm_wide_rows(wide)
    try:
        sec = best_ms(lambda: [int4_linear_q8_gemm(xs[k], p, s, m, 32, n) for n, k, p, s, m in layers], 5,
                      20 if len(layers) <= 4 else 1) / 1e3
    finally:
        set_q8_gemm_wide_rows(8)
    return sum(rows * n * k for n, k, *_ in layers) / sec / 1e9


def gate_up_silu_ms(layers: list[tuple], rows_list: tuple[int, ...], gen: torch.Generator,
                    passes: int) -> dict[int, tuple[float, float, float]]:
    """Per row count: median ms per pass over the gate_up weights of `layers` of the GEMM then silu_mul
    and of the fused call, and the median of the per-pass ratios, the two alternating `passes` times
    each (the tiles that run in the engine: the 8-row tiles, wide_rows 0 where the build has 16-row ones)."""
    from hasten.kernels import decoder_ops
    from hasten.kernels.quant_linear import (
        int4_linear_q8_gemm,
        int4_linear_q8_gemm_silu,
        set_q8_gemm_wide_rows,
    )

    silu_mul = decoder_ops.load().silu_mul
    gate_up_shape = SHAPES[2]  # [gate | up] x hidden
    gate_up = [(p, s, m, n) for n, k, p, s, m in layers if (n, k) == gate_up_shape]

    def two_calls(x: torch.Tensor) -> None:
        for p, s, m, n in gate_up:
            silu_mul(int4_linear_q8_gemm(x, p, s, m, 32, n), True)

    def fused(x: torch.Tensor) -> None:
        for p, s, m, n in gate_up:
            int4_linear_q8_gemm_silu(x, p, s, m, 32, n)

    out = {}
    set_q8_gemm_wide_rows(0)
    try:
        for rows in rows_list:
            x = torch.randn(rows, gate_up_shape[1], generator=gen)
            times: dict = {two_calls: [], fused: []}
            two_calls(x)
            fused(x)
            for i in range(passes):
                for fn in (two_calls, fused) if i % 2 == 0 else (fused, two_calls):
                    t = time.perf_counter()
                    fn(x)
                    times[fn].append((time.perf_counter() - t) * 1e3)
            ratios = [a / b for a, b in zip(times[two_calls], times[fused], strict=True)]
            out[rows] = (statistics.median(times[two_calls]), statistics.median(times[fused]), statistics.median(ratios))
    finally:
        set_q8_gemm_wide_rows(8)
    return out


def u8_rates(layers: int, rows_list: tuple[int, ...], gen: torch.Generator, rounds: int) -> dict[int, list[float]]:
    """GMAC/s of u8_linear_q8_gemm over `layers` layers of SmolLM2's four projections, per row count:
    [per-32 float scales of x, power-of-two scales], each the best of `rounds` alternating rounds."""
    from hasten.kernels.quant_linear import u8_linear_q8_gemm, u8_pack_rows16

    packs = [(n, k, *u8_pack_rows16(torch.randn(n, k, generator=gen) * 0.05)) for _ in range(layers) for n, k in SHAPES]
    def one_pass(xs: dict[int, torch.Tensor], pow2: bool) -> None:  # each output freed at once, as in the engine
        for n, k, p, s, o in packs:
            u8_linear_q8_gemm(xs[k], p, s, o, n, 1, pow2)

    out = {}
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
        macs = sum(rows * n * k for n, k, *_ in packs)
        best = [0.0, 0.0]
        for _ in range(rounds):
            for i, pow2 in enumerate((False, True)):
                sec = best_ms(lambda xs=xs, pow2=pow2: one_pass(xs, pow2), 3, 1) / 1e3
                best[i] = max(best[i], macs / sec / 1e9)
        out[rows] = best
    return out


def bf16_rate(rows: int, gen: torch.Generator) -> float:
    ws = [(torch.randn(n, k, generator=gen).bfloat16(), torch.randn(rows, k, generator=gen).bfloat16()) for n, k in SHAPES]
    sec = best_ms(lambda: [torch.nn.functional.linear(x, w) for w, x in ws], 5, 20) / 1e3
    return sum(rows * n * k for n, k in SHAPES) / sec / 1e9


def decode_attention_ms(layers: int = 30, dtype: torch.dtype = torch.float16, seqs: int = 16, ctx: int = 300,
                        passes: int = 10) -> tuple[float, float, float]:
    """Paged decode attention of `seqs` sequences x `ctx` tokens over `layers` layers' pools (30: from
    memory, as in a decode step; 1: the pool cache-resident, 30 calls): median ms per pass with the block
    ahead requested a few lines per step (attention_spread_prefetch) and in one burst, the two alternating
    `passes` times each, and the median of the per-pass ratios."""
    from hasten.kernels import cpu_attention

    mod = cpu_attention.load()
    bs, heads, kv_heads, d = 16, 9, 3, 64
    nb = -(-ctx // bs)
    pool = seqs * nb + 64
    caches = [(torch.randn(pool, bs, kv_heads, d).to(dtype), torch.randn(pool, bs, kv_heads, d).to(dtype))
              for _ in range(layers)]
    tables = torch.randperm(pool)[: seqs * nb].view(seqs, nb).to(torch.int32)
    q = torch.randn(seqs, heads, d)
    qs, cl = torch.arange(seqs + 1), torch.full((seqs,), ctx)
    calls = [kv for _ in range(30 // layers) for kv in caches]
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(passes + 1):
        for spread in (True, False) if i % 2 == 0 else (False, True):
            t = time.perf_counter()
            for k, v in calls:
                mod.paged_attention(q, k, v, tables, qs, cl, 0.125, spread_prefetch=spread)
            if i > 0:  # the first pass of each warms up
                times[spread].append((time.perf_counter() - t) * 1e3)
    ratios = [b / a for a, b in zip(times[True], times[False], strict=True)]
    return statistics.median(times[True]), statistics.median(times[False]), statistics.median(ratios)


def x_panel_rates(layers: list[tuple], rows_list: tuple[int, ...], gen: torch.Generator,
                  passes: int) -> dict[int, tuple[float, float, float]]:
    """Per row count: GMAC/s over `layers` (one pass, the 8-row tiles) with x in panels
    (quant_q8_gemm_x_panel, 16 KB) and all rows at once, the two alternating `passes` times each (medians),
    and the median of the per-pass ratios."""
    from hasten.kernels.quant_linear import int4_linear_q8_gemm, set_q8_gemm_wide_rows, set_q8_gemm_x_panel

    macs = sum(n * k for n, k, *_ in layers)
    out = {}
    set_q8_gemm_wide_rows(0)
    try:
        for rows in rows_list:
            xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
            times: dict[int, list[float]] = {16384: [], 0: []}
            for i in range(passes + 1):
                for panel in (16384, 0) if i % 2 == 0 else (0, 16384):
                    set_q8_gemm_x_panel(panel)
                    t = time.perf_counter()
                    for n, k, p, s, m in layers:
                        int4_linear_q8_gemm(xs[k], p, s, m, 32, n)
                    if i > 0:
                        times[panel].append(time.perf_counter() - t)
            ratios = [b / a for a, b in zip(times[16384], times[0], strict=True)]
            out[rows] = (rows * macs / statistics.median(times[16384]) / 1e9,
                         rows * macs / statistics.median(times[0]) / 1e9, statistics.median(ratios))
    finally:
        set_q8_gemm_x_panel(16384)
        set_q8_gemm_wide_rows(8)
    return out


def engine_ab(options: dict) -> tuple[float, float]:
    from hasten import LLM, SamplingParams

    llm = LLM(str(find_gguf()), quantization="gguf", kv_cache_dtype="float16", enable_prefix_caching=False, **options)
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0)
    prefill = best_ms(lambda: llm.generate([[rng.randrange(100, 40000) for _ in range(256)]], one, use_tqdm=False),
                      4, 1)
    engine = llm.engine
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)
    for i in range(16):
        engine.add_request(f"r{i}", [(i * 7 + j) % 5000 + 100 for j in range(300)], params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    for _ in range(2):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(20):
        engine.step()
    return prefill, (time.perf_counter() - t0) / 20 * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from hasten.kernels.quant_linear import q8_gemm_has_wide_tiles

    print(f"16-row tiles in this build: {q8_gemm_has_wide_tiles()}")
    gen = torch.Generator().manual_seed(0)
    hot = packed_layers(1, gen)
    print("1. four projections, weights cached (GMAC/s): rows | 8-row tiles | 16-row tiles | bf16 F.linear")
    for rows in (16, 64, 256):
        narrow, wide = gemm_rates(hot, rows, 0, gen), gemm_rates(hot, rows, 8, gen)
        print(f"   {rows:4d} | {narrow:6.0f} | {wide:6.0f} ({wide / narrow:.2f}x) | {bf16_rate(rows, gen):6.0f}")
    cold = packed_layers(30, gen)
    print("2. 30 layers from memory (GMAC/s): rows | 8-row tiles | 16-row tiles")
    for rows in (4, 16, 64):
        narrow, wide = gemm_rates(cold, rows, 0, gen), gemm_rates(cold, rows, 8, gen)
        print(f"   {rows:4d} | {narrow:6.0f} | {wide:6.0f} ({wide / narrow:.2f}x)")
    # speculative verification and small decode batches: 1 + k rows (below quant_q8_gemm_wide_rows the
    # 8-row-block tiles serve them, up to 8 rows of x per tile where the CPU has 32 vector registers)
    macs = sum(n * k for n, k, *_ in cold)
    print("   verification-sized calls, 30 layers from memory (ms): "
          + "  ".join(f"{rows} rows {rows * macs / gemm_rates(cold, rows, 8, gen) / 1e6:.2f}" for rows in range(1, 9)))
    panels = x_panel_rates(cold, (64, 256, 512), gen, 5 * args.rounds)
    print("   x in 16 KB panels / all rows at once (quant_q8_gemm_x_panel), 30 layers from memory (median GMAC/s, "
          "median ratio): " + "  ".join(f"{rows} rows {a:.0f} / {b:.0f} ({r:.2f}x)" for rows, (a, b, r) in panels.items()))
    silu = gate_up_silu_ms(cold, (16, 64, 256, 512), gen, 10 * args.rounds)
    print("   gate_up + SiLU-multiply, 30 layers from memory (median ms, GEMM then silu_mul / from the tiles, "
          "median ratio): " + "  ".join(f"{rows} rows {a:.2f} / {b:.2f} ({r:.2f}x)" for rows, (a, b, r) in silu.items()))
    del cold
    from hasten.kernels.quant_linear import u8_gemm_has_tiles

    if u8_gemm_has_tiles():
        rates = u8_rates(30, (16, 64, 256, 512), gen, args.rounds)
        print("   8-bit GEMM (quant_u8_gemm), 30 layers from memory (GMAC/s, x scales per 32 / as powers of two): "
              + "  ".join(f"{rows} rows {f:.0f} / {p:.0f} ({p / f:.2f}x)" for rows, (f, p) in rates.items()))
    print("3. decode attention (attention_spread_prefetch): median ms per pass over 30 layers, the block ahead "
          "requested spread / in one burst (median ratio)")
    for dtype, seqs, ctx, layers in ((torch.float16, 16, 300, 30), (torch.float16, 16, 300, 1),
                                     (torch.float32, 16, 300, 30), (torch.float32, 48, 500, 30)):
        spread, burst, ratio = decode_attention_ms(layers, dtype, seqs, ctx, 5 * args.rounds)
        where = "from memory" if layers > 1 else "one layer's pool 30 times, cache-resident"
        print(f"   {str(dtype).removeprefix('torch.')} KV, {seqs} x {ctx} tokens, {where}: {spread:.2f} / {burst:.2f} ms"
              f" ({ratio:.2f}x)")
    if args.skip_engine:
        return
    configs = {"wide_rows=0 fast_silu=False": {"quant_q8_gemm_wide_rows": 0, "fast_silu": False}, "defaults": {}}
    print("4. GGUF engine: 256-token prefill (ms) | decode step, 16 x 300 tokens (ms)")
    for rnd in range(args.rounds):
        for name, options in configs.items():
            prefill, step = engine_ab({"num_threads": args.threads, **options})
            print(f"   round {rnd} {name:28s} {prefill:7.1f} | {step:5.1f}", flush=True)


if __name__ == "__main__":
    main()
