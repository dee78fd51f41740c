"""Time of one engine step of batched decode on the default model's GGUF, per configuration.

    python benchmarks/decode_step.py [--batch 16] [--context 300] [--steps 10] [--configs 2,3,2,3]

Builds the engine for each configuration (float32 weights; GGUF blocks with a float32 / float16
KV cache, or an int8 one), prefills `--batch` prompts of `--context` tokens, then times `--steps` decode steps
(greedy, no HTTP) and prints the mean step time and the time spent in each C++ kernel (inside the
C++ layer loop: per part of the layer, from its own timers), with the ratio to the first
configuration. The machine is noisy: read the ratios (and repeat configurations, interleaved, with
`--configs`: indices into the list below).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import find_gguf  # noqa: E402

CONFIGS = {
    "fp32 weights, fp32 cache": {},
    "gguf weights, fp32 cache": {"quantization": "gguf"},
    "gguf weights, fp16 cache": {"quantization": "gguf", "kv_cache_dtype": "float16"},
    "gguf, fp16 cache, no q8 GEMM": {"quantization": "gguf", "kv_cache_dtype": "float16", "quant_q8_gemm": False},
    "gguf weights, int8 cache": {"quantization": "gguf", "kv_cache_dtype": "int8"},
    "gguf, int8 cache, no u8 GEMM": {"quantization": "gguf", "kv_cache_dtype": "int8", "quant_u8_gemm": "off"},
    "gguf, int8 cache, one row off the GEMM": {"quantization": "gguf", "kv_cache_dtype": "int8",
                                               "quant_q8_gemm_one_row": "off"},
}


def measure(options: dict, batch: int, context: int, steps: int) -> tuple[float, dict[str, float]]:
    from hasten import LLM, SamplingParams

    engine = LLM(model=str(find_gguf()), **options).engine
    # the prompts are prefilled in chunks, and the first ones decode meanwhile: enough tokens that every
    # sequence is still running through the timed steps
    prefill_steps = -(-batch * context // engine.config.max_num_batched_tokens)
    params = SamplingParams(max_tokens=prefill_steps + steps + 8, ignore_eos=True, temperature=0)
    for i in range(batch):
        engine.add_request(f"r{i}", [(i * 7 + j) % 5000 + 100 for j in range(context)], params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    for _ in range(2):
        engine.step()
    if len(engine.scheduler.running) != batch:
        raise SystemExit(f"{len(engine.scheduler.running)} sequences running, not {batch}")
    loop = engine.model.loop  # the C++ layer loop: its calls are timed inside it, not by cProfile
    if loop is not None:
        loop.set_profiling(True)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    kernels: dict[str, float] = {}
    if loop is not None:
        parts = loop.timings()
        calls = parts.pop("calls")
        kernels.update({name: sec / calls * 1e3 for name, sec in parts.items()})
        loop.set_profiling(False)
    for (_, _, name), row in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        if name.startswith("<built-in method hasten_") or "_weight_int" in name:
            short = name.split(".")[-1].rstrip(">")
            kernels[short] = kernels.get(short, 0.0) + row[3] / steps * 1e3
    return step_ms, kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--configs", default=None, help="comma-separated indices into the list of configurations")
    args = ap.parse_args()
    configs = list(CONFIGS.items())
    if args.configs:
        configs = [configs[int(i)] for i in args.configs.split(",")]
    base = None
    print(f"decode step, batch {args.batch}, {args.context}-token contexts, mean of {args.steps} steps")
    for name, options in configs:
        step_ms, kernels = measure(options, args.batch, args.context, args.steps)
        base = base or step_ms
        parts = "  ".join(f"{k} {v:.1f}" for k, v in sorted(kernels.items(), key=lambda kv: -kv[1]))
        print(f"{name:<26} {step_ms:7.1f} ms  ({base / step_ms:4.2f}x the first)   kernels (ms/step): {parts}")


if __name__ == "__main__":
    main()
