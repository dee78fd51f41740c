"""Batch-1 decode of engine configurations side by side: interleaved rounds in one process.

    python benchmarks/engine_ab.py '{"python loop": {"quantization": "gguf", "native_decoder_loop": false},
                                     "C++ loop": {"quantization": "gguf"}}' [--rounds 10]

Every configuration (LLM options as JSON) is built once on the default model's GGUF; each round
generates `--tokens` greedy tokens after a 32-token prompt with each configuration in turn, so the
machine's slow and fast phases hit them alike. Prints the best round's tokens/s (prefill included)
and the ratio to the first configuration, after checking that all give the same tokens when they
should (`--same-tokens`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import find_gguf  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", help='JSON object: name -> LLM options, e.g. {"a": {}, "b": {"quantization": "gguf"}}')
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--same-tokens", action="store_true", help="fail unless every configuration gives the same tokens")
    args = ap.parse_args()
    from hasten import LLM, SamplingParams

    configs = json.loads(args.configs)
    llms = {name: LLM(model=str(find_gguf()), **opts) for name, opts in configs.items()}
    prompt = [(j * 7) % 5000 + 100 for j in range(32)]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0)
    best = dict.fromkeys(llms, float("inf"))
    tokens = {}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            t0 = time.perf_counter()
            out = llm.generate([prompt], params)
            best[name] = min(best[name], time.perf_counter() - t0)
            tokens[name] = out[0].outputs[0].token_ids
    if args.same_tokens and len({tuple(t) for t in tokens.values()}) != 1:
        raise SystemExit(f"configurations disagree: {tokens}")
    first = next(iter(best.values()))
    print(f"batch 1, {args.tokens} tokens after a 32-token prompt, best of {args.rounds} interleaved rounds")
    for name, sec in best.items():
        print(f"{name:<24} {args.tokens / sec:7.1f} tok/s  {first / sec:5.2f}x")


if __name__ == "__main__":
    main()
