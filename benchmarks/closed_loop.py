"""A closed loop of concurrent requests in the offline engine: how steps split into prefill and decode.

    python benchmarks/closed_loop.py '{"fp16 cache": {"kv_cache_dtype": "float16"},
                                      "int8 cache": {"kv_cache_dtype": "int8"}}' [--concurrency 32] [--rounds 2]
                                      [--parts]

Every configuration (LLM options as JSON, on top of `quantization="gguf"`) is built on the default
model's GGUF. Each round sends `--concurrency` requests of `--prompt` random tokens at once
(greedy, `--output` tokens, ignore_eos) to each configuration in turn and steps the engine until all
finish - the load of `vllm bench serve --max-concurrency C` without HTTP, the client or the server
process. Prints per wave the output tokens/s, when the last request got its first token (the TTFT
of the last of the requests that arrived together: what a TTFT p99 under that load measures), and
the time in steps that carried prefill tokens ("mixed") and in pure decode steps; with --parts also
where the time of a mixed and of a decode step goes inside the C++ layer loop (its per-part timers, ms
per step of each kind).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import find_gguf  # noqa: E402


def wave(engine, prompts: list[list[int]], output: int, tag: str, parts: bool = False) -> dict:
    from hasten import SamplingParams

    params = SamplingParams(max_tokens=output, ignore_eos=True, temperature=0)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, params)
    schedule = engine.scheduler.schedule
    seen: dict[str, int] = {}

    def traced():
        batch = schedule()
        seen["tokens"], seen["seqs"] = batch.total_tokens, len(batch.requests)
        return batch

    engine.scheduler.schedule = traced
    split = {"mixed": [0, 0.0], "decode": [0, 0.0]}
    started: set[str] = set()  # requests with a first token
    last_first = 0.0
    loop = engine.model.loop if parts else None  # the C++ layer loop's per-part timers
    parts_of: dict[str, dict[str, float]] = {"mixed": {}, "decode": {}}
    if loop is not None:
        loop.set_profiling(True)
    t0 = time.perf_counter()
    try:
        while engine.scheduler.has_work():
            b = time.perf_counter()
            before = loop.timings() if loop is not None else {}
            engine.step()
            kind = "decode" if seen["tokens"] == seen["seqs"] else "mixed"
            split[kind][0] += 1
            split[kind][1] += time.perf_counter() - b
            if loop is not None:
                for name, sec in loop.timings().items():
                    if name != "calls":
                        parts_of[kind][name] = parts_of[kind].get(name, 0.0) + sec - before[name]
            if len(started) < len(prompts):
                started.update(r.request_id for r in engine.scheduler.running if r.output_token_ids)
                if len(started) == len(prompts):
                    last_first = time.perf_counter() - t0
    finally:
        engine.scheduler.schedule = schedule
        if loop is not None:
            loop.set_profiling(False)
    total = time.perf_counter() - t0
    per_step = {kind: {k: v / max(1, split[kind][0]) * 1e3 for k, v in parts.items()}
                for kind, parts in parts_of.items()}
    return {"tok_s": len(prompts) * output / total, "seconds": total, "last_first": last_first, "parts": per_step,
            **split}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", help='JSON object: name -> LLM options, e.g. {"int8": {"kv_cache_dtype": "int8"}}')
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--parts", action="store_true", help="per-part times of the mixed and decode steps (C++ layer loop)")
    args = ap.parse_args()
    from hasten import LLM

    configs = json.loads(args.configs)
    engines = {name: LLM(model=str(find_gguf()), **{"quantization": "gguf", **opts}).engine
               for name, opts in configs.items()}
    rng = random.Random(5)
    print(f"{args.concurrency} requests at once, {args.prompt} -> {args.output} tokens")
    for rnd in range(args.rounds):
        prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt)] for _ in range(args.concurrency)]
        for name, engine in engines.items():
            w = wave(engine, prompts, args.output, f"r{rnd}", args.parts)
            print(f"round {rnd} {name:<20} {w['tok_s']:6.1f} tok/s  wave {w['seconds']:.2f} s  "
                  f"last first token {w['last_first']:.2f} s  "
                  f"mixed {w['mixed'][0]} steps {w['mixed'][1]:.2f} s  decode {w['decode'][0]} steps "
                  f"{w['decode'][1]:.2f} s ({w['decode'][1] / max(1, w['decode'][0]) * 1e3:.1f} ms/step)", flush=True)
            for kind, parts in w["parts"].items():
                if parts:
                    print(f"    per {kind} step: " + "  ".join(f"{k} {v:.1f} ms" for k, v in parts.items()), flush=True)


if __name__ == "__main__":
    main()
