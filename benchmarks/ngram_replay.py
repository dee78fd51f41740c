"""Replay the n-gram proposer on greedy outputs: how far each step would get, with no timing noise.

    python benchmarks/ngram_replay.py [--k 4] [--max-tokens 128]

Generates the greedy answer to each of benchmarks/speculative.py's prompts once (speculation
off), then walks every answer as speculative decoding would: at each step the proposer sees the
prompt and the answer so far, its drafts are checked against the true next tokens, and the step
advances by the accepted drafts plus one. Prints, per proposer setting, the tokens per step and
the verified rows per step (1 + drafts): the first is the speed-up at zero verification cost, the
second what each step pays for it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import CHAT, GROUNDED  # noqa: E402

SETTINGS = {  # name: (max_n, short_match_depths)
    "matches 1-4, k drafts always": (4, ()),
    "matches 1-8, k drafts always": (8, ()),
    "matches 1-8, scaled depth (default)": (8, (1, 4)),
}


def replay(answers: list[tuple[list[int], list[int]]], k: int, max_n: int, depths: tuple[int, ...]) -> tuple[int, int, int]:
    from hasten.engine.spec.ngram import ngram_propose

    steps = tokens = rows = 0
    for prompt, answer in answers:
        seq = prompt + answer
        pos = len(prompt)
        while pos < len(seq):
            drafts = ngram_propose(np.asarray(seq[:pos], dtype=np.int64), k, 1, max_n, depths)
            accepted = 0
            while accepted < len(drafts) and pos + accepted < len(seq) and drafts[accepted] == seq[pos + accepted]:
                accepted += 1
            steps += 1
            tokens += accepted + 1
            rows += 1 + len(drafts)
            pos += accepted + 1
    return steps, tokens, rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    from hasten import LLM, SamplingParams

    llm = LLM(args.model, max_model_len=2048)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    print(f"k={args.k} max_tokens={args.max_tokens}")
    print(f"{'workload':<9} {'proposer':<38} {'tokens/step':>11} {'rows/step':>10} {'tokens/row':>11}")
    for name, prompts in (("grounded", GROUNDED), ("chat", CHAT)):
        answers = []
        for p in prompts:
            ids = llm.engine.apply_chat_template([{"role": "user", "content": p}])
            out = llm.generate([ids], greedy)[0].outputs[0].token_ids
            answers.append((list(ids), list(out)))
        for label, (max_n, depths) in SETTINGS.items():
            steps, tokens, rows = replay(answers, args.k, max_n, depths)
            print(f"{name:<9} {label:<38} {tokens / steps:>11.2f} {rows / steps:>10.2f} {tokens / rows:>11.2f}")


if __name__ == "__main__":
    main()
