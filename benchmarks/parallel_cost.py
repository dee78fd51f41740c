"""What tensor and pipeline parallelism cost per step on this machine, before they run on GPUs.

Runs the same offline workloads on one rank, on TP ranks and on PP stages (gloo over loopback,
ranks spawned on this machine), in one run, and prints ratios against one rank:

  (a) batch-1 decode: ms per step (tokens/s)
  (b) 16 concurrent decodes: ms per step
  (c) one prefill of 256 tokens: ms
and, from rank 0's own timers, the time spent in the collectives per step and per call (TP: two
all-reduces per layer + the embedding's + one logits gather; PP: the hidden-state transfers and the
logits coming back). On a 2-core box N ranks share the same two cores, so this shows the overhead,
never a speed-up: the point is the per-layer all-reduce figure that a faster interconnect divides.

usage: python benchmarks/parallel_cost.py [--model PATH] [--tp 3] [--pp 2] [--tokens 48]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(n)]


def measure(model: str | None, tokens: int, repeats: int, **options) -> dict[str, float]:
    from hasten import LLM, SamplingParams
    from hasten.distributed.layers import decoder_weight_bytes

    llm = LLM(model, max_model_len=1024, kv_cache_memory_gb=0.5, **options)
    try:
        vocab = llm.engine.model_config.vocab_size
        group = llm.engine.parallel
        out: dict[str, float] = {}

        def run(prompts: list[list[int]], new: int) -> tuple[float, int, float, int]:
            llm.engine.kv.reset_prefix_cache()
            c0, n0 = (group.collective_s, group.collective_calls) if group else (0.0, 0)
            t = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), use_tqdm=False)
            dt = time.perf_counter() - t
            c1, n1 = (group.collective_s, group.collective_calls) if group else (0.0, 0)
            return dt, new, c1 - c0, n1 - n0

        run(_prompts(vocab, 1, 16, 0), 4)  # warm-up
        for name, n, plen in (("decode_b1", 1, 16), ("decode_b16", 16, 16)):
            rows = []
            for r in range(repeats):
                first = run(_prompts(vocab, n, plen, r + 1), 1)
                full = run(_prompts(vocab, n, plen, r + 1), tokens)
                steps = tokens - 1
                rows.append(((full[0] - first[0]) / steps, (full[2] - first[2]) / steps,
                             (full[3] - first[3]) / steps))
            out[f"{name}_ms"] = statistics.median(x[0] for x in rows) * 1e3
            out[f"{name}_coll_ms"] = statistics.median(x[1] for x in rows) * 1e3
            out[f"{name}_calls"] = statistics.median(x[2] for x in rows)
        pre = [run(_prompts(vocab, 1, 256, 50 + r), 1) for r in range(repeats)]
        out["prefill256_ms"] = statistics.median(p[0] for p in pre) * 1e3
        out["prefill256_coll_ms"] = statistics.median(p[2] for p in pre) * 1e3
        out["weights_mb"] = (max(group.rank_weight_bytes) if group else decoder_weight_bytes(llm.engine.model)) / 1e6
        return out
    finally:
        llm.close()


def _allreduce_rank(rank: int, world: int, port: int, hidden: int, rows: list[int], iters: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result = {}
    for n in rows:
        t = torch.randn(n, hidden)
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        result[n] = statistics.median(times) * 1e6
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def allreduce_microbench(world: int, hidden: int, rows: list[int], iters: int = 200) -> dict[int, float]:
    """Median us of one gloo all_reduce of [rows, hidden] float32 between `world` idle ranks (no model
    running: the transport's own cost, not waiting on a slower peer)."""
    import multiprocessing as mp

    from hasten.distributed.group import free_port

    ctx = mp.get_context("spawn")
    port, q = free_port(), ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, world, port, hidden, rows, iters, q)) for r in range(world)]
    for p in procs:
        p.start()
    result = q.get(timeout=300)
    for p in procs:
        p.join(30)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct (float32)")
    ap.add_argument("--tp", type=int, default=3, help="tensor-parallel ranks (SmolLM2: 9 heads, 3 KV heads)")
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    configs = {"1 rank": {}, f"TP={args.tp}": {"tensor_parallel_size": args.tp},
               f"PP={args.pp}": {"pipeline_parallel_size": args.pp}}
    results = {name: measure(args.model, args.tokens, args.repeats, **opts) for name, opts in configs.items()}
    from hasten.model.config import ModelConfig
    from hasten.model.loader import load_hf_config, resolve_model

    cfg = ModelConfig.from_hf(load_hf_config(resolve_model(args.model)))
    micro = {w: allreduce_microbench(w, cfg.hidden_size, [1, 16, 256]) for w in (2, args.tp)}
    base = results["1 rank"]
    cols = ["decode_b1_ms", "decode_b16_ms", "prefill256_ms"]
    print(f"\n{'':10s} " + " ".join(f"{c:>15s}" for c in cols) + f" {'weights/rank MB':>16s}")
    for name, r in results.items():
        cells = " ".join(f"{r[c]:8.1f} ({r[c] / base[c]:4.2f}x)" for c in cols)
        print(f"{name:10s} {cells} {r['weights_mb']:16.1f}")
    print(f"\ngloo all_reduce of [rows, {cfg.hidden_size}] float32 between idle ranks (median us):")
    for w, r in micro.items():
        print(f"  {w} ranks: " + "  ".join(f"{n} rows {us:7.1f}" for n, us in r.items()))
    print(f"  per decode step TP needs 2 x {cfg.num_layers} + 1 all-reduces + 1 logits gather")
    print("\ntime in collectives on rank 0, waiting for the other ranks included (per step):")
    for name, r in results.items():
        if name == "1 rank":
            continue
        for w in ("decode_b1", "decode_b16"):
            calls = r[f"{w}_calls"]
            print(f"  {name:8s} {w:11s} {r[f'{w}_coll_ms']:7.2f} ms  {calls:5.0f} calls  "
                  f"{1e3 * r[f'{w}_coll_ms'] / max(calls, 1):7.1f} us/call")
        print(f"  {name:8s} prefill256  {r['prefill256_coll_ms']:7.2f} ms")


if __name__ == "__main__":
    main()
