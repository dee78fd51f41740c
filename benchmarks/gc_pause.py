"""What Python's cyclic garbage collector costs an engine process, with and without gc_freeze.

    python benchmarks/gc_pause.py [--rounds 2] [--waves 2] [--concurrency 16]

Builds the engine as `hasten serve`'s engine process does (the default model's GGUF, int8 KV cache,
the warm-up request), then, per round, unfrozen and frozen (gc.freeze after a collection, as
EngineConfig.gc_freeze does; gc.unfreeze between rounds):
- the objects a full collection walks and how long one takes (median of 3 gc.collect() calls): the
  pause a load-triggered full collection puts between two steps of every running request;
- a load of `--waves` waves of `--concurrency` requests (256 random prompt tokens, 64 output tokens,
  greedy) stepped to the end, with every collection the interpreter made meanwhile timed through
  gc.callbacks: how many per generation, their total and longest pause.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import find_gguf  # noqa: E402


class PauseLog:
    """Every collection's generation and duration while installed."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._start))

    def summary(self) -> str:
        parts = []
        for gen in range(3):
            d = [s for g, s in self.pauses if g == gen]
            if d:
                parts.append(f"gen{gen} {len(d)} x, {sum(d) * 1e3:.1f} ms total, longest {max(d) * 1e3:.2f} ms")
            else:
                parts.append(f"gen{gen} none")
        return "; ".join(parts)


def full_collection_ms() -> float:
    times = []
    for _ in range(3):
        t = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def load(engine, waves: int, concurrency: int, rng: random.Random, tag: str) -> float:
    from hasten import SamplingParams

    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
    t0 = time.perf_counter()
    for w in range(waves):
        for i in range(concurrency):
            engine.add_request(f"{tag}-{w}-{i}", [rng.randrange(100, 40000) for _ in range(256)], params)
        while engine.has_unfinished_requests():
            engine.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    from hasten.config import EngineConfig
    from hasten.engine.engine import LLMEngine
    from hasten.runtime.heap import freeze_heap

    engine = LLMEngine(EngineConfig(model=str(find_gguf()), quantization="gguf", kv_cache_dtype="int8"))
    engine.warm_up()
    rng = random.Random(0)
    for rnd in range(args.rounds):
        for frozen in (False, True):
            if frozen:  # what the engine process does after its warm-up
                freeze_heap()
            else:
                gc.unfreeze()
            objects = len(gc.get_objects())
            pause = full_collection_ms()
            log = PauseLog()
            gc.callbacks.append(log)
            try:
                seconds = load(engine, args.waves, args.concurrency, rng, f"r{rnd}{int(frozen)}")
            finally:
                gc.callbacks.remove(log)
            print(f"round {rnd} {'frozen  ' if frozen else 'unfrozen'}: a full collection walks {objects:,} objects "
                  f"in {pause:.1f} ms; load {seconds:.2f} s: {log.summary()}", flush=True)


if __name__ == "__main__":
    main()
