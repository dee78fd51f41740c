"""`hasten generate`: offline generation from the command line (a demo of the engine)."""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hasten generate", description=__doc__)
    ap.add_argument("model", nargs="?", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--prompt", action="append", help="a user message (repeatable); default: a demo question")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    from hasten import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(args.model, dtype=args.dtype)
    print(f"loaded {llm.engine.model_name} in {time.time() - t0:.1f}s")
    prompts = args.prompt or ["What is the capital of France?", "Write a haiku about speed."]
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    t0 = time.time()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sp)
    dt = time.time() - t0
    n = 0
    for p, o in zip(prompts, outs, strict=True):
        n += len(o.outputs[0].token_ids)
        print(f"\n>>> {p}\n{o.outputs[0].text}")
    print(f"\n{n} tokens in {dt:.2f}s ({n / dt:.1f} tok/s)")
    return 0
