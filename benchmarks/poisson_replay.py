"""Poisson arrivals replayed into the offline engine, configurations taking turns wave by wave.

    python benchmarks/poisson_replay.py '{"512": {"max_num_batched_tokens": 512},
                                         "256": {"max_num_batched_tokens": 256}}' [--rates 1,2,3]
                                         [--requests 24] [--rounds 3]

Every configuration (LLM options as JSON, on top of `quantization="gguf", kv_cache_dtype="int8"`, the
served defaults of benchmarks/serving_peers.py) is built on the default model's GGUF. A wave sends
`--requests` requests of `--prompt` random tokens (greedy, `--output` tokens, ignore_eos) at Poisson
arrival times of `--rate` per second, the same times and prompts for every configuration in a round,
and steps the engine in real time: a request joins the scheduler once its arrival time has passed.
Per wave: the share of requests within TTFT <= 1 s and TPOT <= 100 ms (the SLO of serving_peers.py's
capacity), TTFT p50 / p99, TPOT p50 and output tokens/s. The load of `vllm bench serve --request-rate`
without HTTP, the client or the server process (which add ~5 ms to a first token); the configurations
alternate wave by wave, so that the machine's slow and fast phases fall on all of them alike.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import find_gguf, pct  # noqa: E402

SLO_TTFT_S, SLO_TPOT_S = 1.0, 0.1


def wave(engine, arrivals: list[float], prompts: list[list[int]], output: int, tag: str) -> dict:
    """Replays one wave; per request its TTFT and TPOT in seconds."""
    from hasten import SamplingParams

    params = SamplingParams(max_tokens=output, ignore_eos=True, temperature=0)
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    t0 = time.perf_counter()
    sent = 0
    while len(done) < len(prompts):
        now = time.perf_counter() - t0
        while sent < len(prompts) and arrivals[sent] <= now:
            engine.add_request(f"{tag}-{sent}", prompts[sent], params)
            sent += 1
        if not engine.scheduler.has_work():
            time.sleep(max(0.0, arrivals[sent] - now))
            continue
        for out in engine.step():
            rid = out.request_id
            now = time.perf_counter() - t0
            if rid not in first and out.outputs and out.outputs[0].token_ids:
                first[rid] = now
            if out.finished:
                done[rid] = now
    total = time.perf_counter() - t0
    ttft, tpot = [], []
    for i, arrived in enumerate(arrivals):
        rid = f"{tag}-{i}"
        ttft.append(first[rid] - arrived)
        tpot.append((done[rid] - first[rid]) / max(1, output - 1))
    met = sum(1 for a, b in zip(ttft, tpot, strict=True) if a <= SLO_TTFT_S and b <= SLO_TPOT_S) / len(ttft)
    return {"met": met, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "tpot_p50": pct(tpot, 50), "tok_s": len(prompts) * output / total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", help='JSON object: name -> LLM options, e.g. {"256": {"max_num_batched_tokens": 256}}')
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 2.0, 3.0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from hasten import LLM, SamplingParams

    configs = json.loads(args.configs)
    engines = {name: LLM(model=str(find_gguf()), **{"quantization": "gguf", "kv_cache_dtype": "int8", **opts}).engine
               for name, opts in configs.items()}
    warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    for name, engine in engines.items():  # kernels loaded and first-call costs paid before any wave
        engine.add_request(f"warm-{name}", list(range(100, 100 + args.prompt)), warm)
        while engine.scheduler.has_work():
            engine.step()
    print(f"Poisson arrivals, {args.requests} requests per wave, {args.prompt} -> {args.output} tokens; "
          f"SLO TTFT <= {SLO_TTFT_S:g} s and TPOT <= {SLO_TPOT_S * 1e3:g} ms", flush=True)
    rng = random.Random(7)
    results: dict[tuple[float, str], list[dict]] = {}
    for rnd in range(args.rounds):
        for rate in args.rates:
            arrivals, t = [], 0.0
            for _ in range(args.requests):
                t += rng.expovariate(rate)
                arrivals.append(t)
            prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt)] for _ in range(args.requests)]
            names = list(engines) if rnd % 2 == 0 else list(reversed(engines))
            for name in names:
                w = wave(engines[name], arrivals, prompts, args.output, f"r{rnd}-{rate:g}")
                results.setdefault((rate, name), []).append(w)
                print(f"round {rnd} {rate:g} req/s {name:<16} SLO met {w['met']:4.0%}  TTFT p50 "
                      f"{w['ttft_p50'] * 1e3:5.0f} p99 {w['ttft_p99'] * 1e3:5.0f} ms  TPOT p50 "
                      f"{w['tpot_p50'] * 1e3:5.1f} ms  {w['tok_s']:6.1f} tok/s", flush=True)
    print("\nmedian over rounds:")
    for (rate, name), runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        shares = " / ".join(f"{r['met']:.0%}" for r in runs)
        print(f"  {rate:g} req/s {name:<16} SLO met {med['met']:4.0%} (rounds: {shares})  TTFT p50 {med['ttft_p50'] * 1e3:5.0f} p99 "
              f"{med['ttft_p99'] * 1e3:5.0f} ms  TPOT p50 {med['tpot_p50'] * 1e3:5.1f} ms  {med['tok_s']:6.1f} tok/s")


if __name__ == "__main__":
    main()
