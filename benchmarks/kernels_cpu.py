"""hasten's C++ CPU kernels against the PyTorch paths they replace, side by side, with ratios.

    python benchmarks/kernels_cpu.py [--threads 2] [--repeats 5] [--skip-engine] [--int8-attention-only]
                                     [--int8-decode-only]

1. paged attention, 64 decode sequences (contexts 32-700, SmolLM2 heads: 9 q / 3 kv, D=64,
   blocks scattered in a 4,000-block pool): C++ kernel vs index_select gather + SDPA, and the
   kernel over a float16 copy of the cache (kv_cache_dtype=float16);
2. one 512-token causal prefill: kernel vs SDPA; a 256-token prefill over 30 layers of an int8
   cache (kv_cache_dtype=int8), and a second 256-token chunk after it: the float path vs
   attention_int8_scores (q rounded to int8, VNNI) vs that with attention_bf16_pv (AVX512-BF16) vs
   that on AMX tiles (attention_amx: AMX-INT8 scores, AMX-BF16 P V); 32 decode sequences (contexts
   256-384, blocks scattered) over an int8 cache: the float path vs attention_int8_decode (q rounded
   to int8, the key codes read in place; VNNI or AVX2), over one layer's pool (cache-resident) and over 30
   layers' pools (~125 MB read per step: from memory, as in a 32-request decode step);
3. SiLU-multiply of a 512-token step over 30 layers (512 x 2 x 1536): the C++ op with its vectorized
   exp (fast=True, what int8-activation layers get) vs the exact op vs F.silu(gate) * up;
4. int4 matmuls of one SmolLM2 layer (qkv, o, gate_up, down) at 1 and 16 rows: hasten (float
   activations), hasten-q8 (int8 activations), aten int4pack (bf16 activations), fp32 oneDNN;
   int8 lm_head (49152 x 576) at 1 and 16 rows: hasten vs aten int8pack;
5. (unless --skip-engine) batch-1 decode of SmolLM2 fp32 with the fused decoder glue on/off.
Each timing is the best of --repeats rounds; the machine is noisy, read the ratios.
"""

from __future__ import annotations

import argparse
import random
import time
from types import SimpleNamespace

import torch


def best_ms(fn, repeats: int, inner: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t) / inner)
    return best * 1e3


def attention_decode(repeats: int) -> tuple[float, float, float]:
    from hasten.engine.model_runner import ModelRunner
    from hasten.kernels import cpu_attention
    from hasten.model.layers import AttentionMetadata, paged_attention

    rng = random.Random(0)
    seqs, bs, kvh, heads, d, pool = 64, 16, 3, 9, 64, 4000
    ctx = [rng.randint(32, 700) for _ in range(seqs)]
    k_cache, v_cache = torch.randn(pool, bs, kvh, d), torch.randn(pool, bs, kvh, d)
    width = max(-(-c // bs) for c in ctx)
    tables = torch.randperm(pool)[: seqs * width].view(seqs, width)
    q = torch.randn(seqs, heads, d)
    flat = AttentionMetadata(slot_mapping=torch.zeros(seqs, dtype=torch.long), block_tables=tables.to(torch.int32),
                             query_start=torch.arange(seqs + 1), context_lens=torch.tensor(ctx))
    runner = SimpleNamespace(block_size=bs)  # ModelRunner._group only reads block_size
    reqs = [SimpleNamespace(block_ids=tables[i].tolist()) for i in range(seqs)]
    group = ModelRunner._group(runner, reqs, [c - 1 for c in ctx], [1] * seqs, list(range(seqs)))
    padded = AttentionMetadata(slot_mapping=flat.slot_mapping, groups=[group])
    assert torch.allclose(paged_attention(q, k_cache, v_cache, flat, kvh, 0.125),
                          paged_attention(q, k_cache, v_cache, padded, kvh, 0.125), atol=1e-4)
    assert cpu_attention.load() is not None
    kernel = best_ms(lambda: paged_attention(q, k_cache, v_cache, flat, kvh, 0.125), repeats, 10)
    sdpa = best_ms(lambda: paged_attention(q, k_cache, v_cache, padded, kvh, 0.125), repeats, 10)
    k16, v16 = k_cache.half(), v_cache.half()
    half = best_ms(lambda: paged_attention(q, k16, v16, flat, kvh, 0.125), repeats, 10)
    return kernel, sdpa, half


def attention_prefill(repeats: int) -> tuple[float, float]:
    from hasten.model.layers import paged_attention, single_sequence_metadata

    n, bs, kvh, heads, d = 512, 16, 3, 9, 64
    k_cache, v_cache = torch.randn(n // bs, bs, kvh, d), torch.randn(n // bs, bs, kvh, d)
    q = torch.randn(n, heads, d)
    cpp = single_sequence_metadata(n, bs, "cpp")
    sdpa = single_sequence_metadata(n, bs, "sdpa")
    return (best_ms(lambda: paged_attention(q, k_cache, v_cache, cpp, kvh, 0.125), repeats, 5),
            best_ms(lambda: paged_attention(q, k_cache, v_cache, sdpa, kvh, 0.125), repeats, 5))


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as an int8 cache stores it: D codes (absmax / 127) and their float32 scale."""
    amax = x.abs().amax(-1, keepdim=True)
    codes = torch.round(x * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))).to(torch.int8)
    return torch.cat([codes, (amax / 127.0).contiguous().view(torch.int8)], -1).contiguous()


def attention_prefill_int8(repeats: int, n: int = 256, layers: int = 30) -> dict[tuple[int, str], float] | None:
    """ms for one n-token prefill's attention over `layers` layers of an int8 cache, then of a second
    n-token chunk after it (2n keys): the per-token float path, the lane tiles (where the build has them:
    AVX2), int8 scores (AVX-512 VNNI), int8 scores with bfloat16 P V (where the build has it), on AMX tiles
    (where the CPU has them), keyed by (keys, path); None where this build has none of them."""
    from hasten.kernels import cpu_attention

    bs, kvh, heads, d = 16, 3, 9, 64
    modes: dict[str, dict] = {"float": {}}
    if cpu_attention.lane_tiles_available():
        modes["lane tiles"] = {"lane_tokens": 4}
    if cpu_attention.int8_scores_available():
        modes["int8 scores"] = {"int8_rows": 16}
    if len(modes) == 1:
        return None
    if cpu_attention.int8_scores_available() and cpu_attention.bf16_pv_available():
        modes["int8 scores + bf16 P V"] = {"int8_rows": 16, "int8_bf16_pv": True}
    if cpu_attention.amx_attention_available():
        modes["AMX tiles"] = {"int8_rows": 16, "int8_bf16_pv": True, "int8_tiles": True}
    out: dict[tuple[int, str], float] = {}
    for ctx in (n, 2 * n):
        tables = torch.arange(ctx // bs, dtype=torch.int32).view(1, -1)
        meta = (tables, torch.tensor([0, n]), torch.tensor([ctx]))
        calls = [(torch.randn(n, heads, d), int8_rows(torch.randn(ctx // bs, bs, kvh, d)),
                  int8_rows(torch.randn(ctx // bs, bs, kvh, d))) for _ in range(layers)]

        def run(kw: dict, calls: list = calls, meta: tuple = meta) -> None:
            for q, k, v in calls:
                cpu_attention.paged_attention(q, k, v, *meta, 0.125, **kw)

        for name, kw in modes.items():
            out[ctx, name] = best_ms(lambda kw=kw: run(kw), repeats, 2)
    return out


def attention_decode_int8(repeats: int, seqs: int = 32, layers: int = 30) -> dict[tuple[int, str], float] | None:
    """ms for `seqs` decodes' attention over an int8 cache, one layer's pool called `layers` times and
    `layers` pools called once each: the float path and attention_int8_decode, keyed by (pools, path);
    None where this build has no such path (neither AVX-512 VNNI nor AVX2 + FMA)."""
    from hasten.kernels import cpu_attention

    if not cpu_attention.int8_decode_available():
        return None
    rng = random.Random(1)
    bs, kvh, heads, d = 16, 3, 9, 64
    ctx = [rng.randint(256, 384) for _ in range(seqs)]
    width = max(-(-c // bs) for c in ctx)
    pool = seqs * width + 5

    def one_layer() -> tuple:
        tables = torch.randperm(pool)[: seqs * width].view(seqs, width).to(torch.int32)
        return (torch.randn(seqs, heads, d), int8_rows(torch.randn(pool, bs, kvh, d)),
                int8_rows(torch.randn(pool, bs, kvh, d)), tables, torch.arange(seqs + 1), torch.tensor(ctx))

    out: dict[tuple[int, str], float] = {}
    first = one_layer()
    for pools, calls in ((1, [first] * layers), (layers, [first] + [one_layer() for _ in range(layers - 1)])):
        for name, flag in (("float", False), ("int8 decode", True)):
            def run(calls: list = calls, flag: bool = flag) -> None:
                for q, k, v, tables, qs, cl in calls:
                    cpu_attention.paged_attention(q, k, v, tables, qs, cl, 0.125, int8_decode=flag)

            out[pools, name] = best_ms(run, repeats, 2)
    return out


def silu_mul_step(repeats: int, rows: int = 512, inter: int = 1536, layers: int = 30) -> dict[str, float]:
    """ms for `layers` SiLU-multiplies of [rows, 2 * inter]: the C++ op fast / exact, and PyTorch."""
    from hasten.kernels import decoder_ops

    ops = decoder_ops.load()
    xs = [torch.randn(rows, 2 * inter) * 3 for _ in range(layers)]
    return {
        "fast": best_ms(lambda: [ops.silu_mul(x, True) for x in xs], repeats, 1),
        "exact": best_ms(lambda: [ops.silu_mul(x) for x in xs], repeats, 1),
        "torch": best_ms(lambda: [torch.nn.functional.silu(x[:, :inter]) * x[:, inter:] for x in xs], repeats, 1),
    }


def int4_layers(repeats: int, rows: int) -> dict[str, float]:
    from hasten.model.linear import OneDNNLinear
    from hasten.quant.formats import Int4Weight, pack_nibbles
    from hasten.quant.kernels import Int4HastenLinear, Int4Linear

    gen = torch.Generator().manual_seed(0)
    shapes = [(1728, 576), (576, 576), (3072, 576), (576, 1536)]
    totals = {"hasten": 0.0, "hasten-q8": 0.0, "aten-int4": 0.0, "fp32": 0.0}
    for n, k in shapes:
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        qw = Int4Weight(pack_nibbles(codes), torch.rand(n, k // 32, generator=gen) * 0.01,
                        -torch.rand(n, k // 32, generator=gen) * 0.1, 32)
        x = torch.randn(rows, k, generator=gen)
        layers = {"hasten": Int4HastenLinear(qw, 64), "hasten-q8": Int4HastenLinear(qw, 64, int8_activations=True),
                  "aten-int4": Int4Linear(qw, 64), "fp32": OneDNNLinear(qw.dequantize())}
        for name, layer in layers.items():
            totals[name] += best_ms(lambda layer=layer, x=x: layer(x), repeats, 50)
    return totals


def int8_lm_head(repeats: int, rows: int) -> dict[str, float]:
    from hasten.quant.formats import quantize_int8
    from hasten.quant.kernels import Int8Linear

    gen = torch.Generator().manual_seed(1)
    qw = quantize_int8(torch.randn(49152, 576, generator=gen))
    x = torch.randn(rows, 576, generator=gen)
    return {k: best_ms(lambda layer=Int8Linear(qw, 64, k): layer(x), repeats, 5) for k in ("hasten", "torch")}


def engine_batch1(repeats: int) -> dict[str, float]:
    from hasten import LLM, SamplingParams

    llms = {"fused": LLM(None, num_kv_blocks=64, max_model_len=512),
            "pytorch ops": LLM(None, num_kv_blocks=64, max_model_len=512, fused_decoder_ops=False)}
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    rates = {k: 0.0 for k in llms}
    for _ in range(repeats):
        for name, llm in llms.items():
            m = llm.generate([list(range(100, 132))], sp)[0].metrics
            rates[name] = max(rates[name], (len(m.token_times) - 1) / (m.last_token_time - m.first_token_time))
    return rates


def print_int8_attention(repeats: int) -> None:
    int8 = attention_prefill_int8(repeats)
    if int8 is None:
        print("attention, int8 cache, 256-token prefill: no lane tiles (AVX2) or int8-score path (AVX-512 VNNI) here")
    else:
        print("attention, int8 cache, 256 new tokens over 256 / 512 keys, 30 layers: " + "  ".join(
            f"{name}, {keys} keys {ms:6.2f} ms ({int8[keys, 'float'] / ms:4.2f}x)" for (keys, name), ms in int8.items()))


def print_int8_decode(repeats: int) -> None:
    t = attention_decode_int8(repeats)
    if t is None:
        print("attention, int8 cache, 32 decodes: no int8-decode path in this build (AVX-512 VNNI or AVX2 + FMA)")
        return
    for pools, where in ((1, "one pool (in cache)"), (30, "30 pools (from memory)")):
        print(f"attention, int8 cache, 32 decodes x 30 layers, {where}: float {t[pools, 'float']:6.2f} ms  "
              f"int8 decode {t[pools, 'int8 decode']:6.2f} ms ({t[pools, 'float'] / t[pools, 'int8 decode']:4.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--int8-attention-only", action="store_true", help="part 2's int8-cache prefill only (its paths)")
    ap.add_argument("--int8-decode-only", action="store_true", help="part 2's int8-cache decodes only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads={torch.get_num_threads()}  (best of {args.repeats}; ratio = PyTorch path / hasten kernel)")
    if args.int8_attention_only:
        print_int8_attention(args.repeats)
        return
    if args.int8_decode_only:
        print_int8_decode(args.repeats)
        return
    kernel, sdpa, half = attention_decode(args.repeats)
    print(f"attention, 64 decode seqs, one layer : kernel {kernel:7.2f} ms  gather+SDPA {sdpa:7.2f} ms  "
          f"ratio {sdpa / kernel:5.2f}x;  float16 cache {half:7.2f} ms ({kernel / half:4.2f}x the float32 cache)")
    kernel, sdpa = attention_prefill(args.repeats)
    print(f"attention, 512-token prefill, 1 layer: kernel {kernel:7.2f} ms  SDPA        {sdpa:7.2f} ms  "
          f"ratio {sdpa / kernel:5.2f}x")
    print_int8_attention(args.repeats)
    print_int8_decode(args.repeats)
    t = silu_mul_step(args.repeats)
    print(f"SiLU-multiply, 512 x 1536, 30 layers   : fast {t['fast']:6.2f} ms  exact {t['exact']:6.2f} ms  "
          f"PyTorch {t['torch']:6.2f} ms  ratio PyTorch/fast {t['torch'] / t['fast']:4.2f}x")
    for rows in (1, 16):
        t = int4_layers(args.repeats, rows)
        cells = "  ".join(f"{k} {v:6.3f} ms" for k, v in t.items())
        print(f"int4 matmuls of one layer, {rows:>2} rows : {cells}  "
              f"aten/hasten {t['aten-int4'] / t['hasten']:4.2f}x  aten/hasten-q8 {t['aten-int4'] / t['hasten-q8']:4.2f}x  "
              f"fp32/hasten-q8 {t['fp32'] / t['hasten-q8']:4.2f}x")
    for rows in (1, 16):
        t = int8_lm_head(args.repeats, rows)
        print(f"int8 lm_head 49152x576, {rows:>2} rows    : hasten {t['hasten']:6.2f} ms  aten int8pack "
              f"{t['torch']:6.2f} ms  ratio {t['torch'] / t['hasten']:4.2f}x")
    if not args.skip_engine:
        r = engine_batch1(args.repeats)
        print(f"SmolLM2 fp32 batch-1 decode: fused glue {r['fused']:6.1f} tok/s  PyTorch ops {r['pytorch ops']:6.1f} "
              f"tok/s  ratio {r['fused'] / r['pytorch ops']:4.2f}x")


if __name__ == "__main__":
    main()
