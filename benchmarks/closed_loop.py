"""A closed loop of concurrent requests in the offline engine: how steps split into prefill and decode.

    python benchmarks/closed_loop.py '{"fp16 cache": {"kv_cache_dtype": "float16"},
                                      "int8 cache": {"kv_cache_dtype": "int8"}}' [--concurrency 32] [--rounds 2]

Every configuration (LLM options as JSON, on top of `quantization="gguf"`) is built on the default
model's GGUF. Each round sends `--concurrency` requests of `--prompt` random tokens at once
(greedy, `--output` tokens, ignore_eos) to each configuration in turn and steps the engine until all
finish - the load of `vllm bench serve --max-concurrency C` without HTTP, the client or the server
process. Prints per wave the output tokens/s and the time in steps that carried prefill tokens
("mixed") and in pure decode steps.
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


def wave(engine, prompts: list[list[int]], output: int, tag: str) -> dict:
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
    t0 = time.perf_counter()
    try:
        while engine.scheduler.has_work():
            b = time.perf_counter()
            engine.step()
            kind = "decode" if seen["tokens"] == seen["seqs"] else "mixed"
            split[kind][0] += 1
            split[kind][1] += time.perf_counter() - b
    finally:
        engine.scheduler.schedule = schedule
    total = time.perf_counter() - t0
    return {"tok_s": len(prompts) * output / total, "seconds": total, **split}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", help='JSON object: name -> LLM options, e.g. {"int8": {"kv_cache_dtype": "int8"}}')
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
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
            w = wave(engine, prompts, args.output, f"r{rnd}")
            print(f"round {rnd} {name:<20} {w['tok_s']:6.1f} tok/s  wave {w['seconds']:.2f} s  "
                  f"mixed {w['mixed'][0]} steps {w['mixed'][1]:.2f} s  decode {w['decode'][0]} steps "
                  f"{w['decode'][1]:.2f} s ({w['decode'][1] / max(1, w['decode'][0]) * 1e3:.1f} ms/step)", flush=True)


if __name__ == "__main__":
    main()
