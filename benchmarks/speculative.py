"""Speculation off vs n-gram vs draft model, in one run, on SmolLM2 (or --model).

Workloads: (i) input-grounded prompts (rewrite / edit / extract: the answer copies the input),
(ii) open chat. Reports per workload, at batch 1: tokens/s end to end (prefill included),
decode tokens/s (tokens after the first over the time after the first, as in
offline_vs_hf.py's (a)) and TPOT; tokens/s at 16 concurrent requests; acceptance rates; ratios
against speculation off. The variants take turns prompt by prompt, for --rounds rounds, and each
keeps its best round, so machine noise hits them alike. Greedy decoding, so every variant must
emit identical tokens (checked).

usage: python benchmarks/speculative.py [--draft PATH] [--draft-quantization int4] [--draft-layers 8]
       [--max-tokens 128] [--rounds 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

GROUNDED = [
    "Rewrite this Python function with the variable `total` renamed to `acc`, and change nothing else:\n\n"
    "def sum_list(values):\n    total = 0\n    for v in values:\n        total = total + v\n    return total\n\n"
    "def mean(values):\n    total = sum_list(values)\n    return total / len(values)\n",
    "Fix the spelling mistakes in this text and repeat it in full:\n\nThe quick brwn fox jumpd over the lazy dog. "
    "It was a sunny day and the fox was very hapy. The dog did not care at all and kept sleeping under the old tree.",
    "Convert this list to a JSON array of objects with keys name and age:\nAlice 31\nBob 27\nCarol 45\nDave 38\nEve 29",
    "Copy the following paragraph exactly, but in upper case:\n\nSpeculative decoding lets a model check several "
    "guessed tokens in one forward pass. When the guesses are right, more tokens come out per step.",
    "Add type hints to this code and return the whole code:\n\ndef greet(name, times):\n    out = []\n"
    "    for i in range(times):\n        out.append('Hello, ' + name)\n    return out\n",
    "Extract every sentence that mentions the river from this text and repeat them:\n\nThe town sits on a hill. "
    "The river runs along the east side of the town. Many people fish in the river. The market opens on Sundays. "
    "In winter the river sometimes freezes.",
    "Reformat this as a markdown table with columns City and Population:\nParis 2100000\nBerlin 3600000\n"
    "Madrid 3300000\nRome 2800000",
    "Translate the comments to English and keep the code identical:\n\n# calcule la somme\ndef somme(a, b):\n"
    "    # retourne le resultat\n    return a + b\n",
]
CHAT = [
    "Tell me a short story about a cat who learns to fly.",
    "What are three benefits of regular exercise?",
    "Explain how a rainbow forms.",
    "Give me some tips for learning a new language.",
    "Why do leaves change color in autumn?",
    "Describe your ideal weekend.",
    "What makes a good friend?",
    "How do airplanes stay in the air?",
]


def truncated_copy(folder: Path, layers: int) -> Path:
    """A smaller model with the same tokenizer: the first `layers` layers of the target."""
    from safetensors.torch import load_file, save_file

    out = Path(tempfile.mkdtemp(prefix=f"draft-{layers}l-"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(cfg))
    state = {}
    for f in folder.glob("*.safetensors"):
        for k, v in load_file(str(f)).items():
            if k.startswith("model.layers."):
                if int(k.split(".")[2]) >= layers:
                    continue
            state[k] = v
    save_file(state, str(out / "model.safetensors"))
    for f in folder.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    return out


def run_batch(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    from hasten import SamplingParams

    llm.engine.kv.reset_prefix_cache()
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t
    tpots, toks = [], 0
    for o in outs:
        n = len(o.outputs[0].token_ids)
        toks += n
        m = o.metrics
        if n > 1:
            tpots.append((m.last_token_time - m.first_token_time) / (n - 1))
    return {"tokens": [o.outputs[0].token_ids for o in outs], "tok_s": toks / wall, "tpot_ms": 1e3 * statistics.median(tpots),
            "decode_tok_s": 1 / statistics.mean(tpots) if tpots else 0.0}


def best_round(rounds: list[list[dict]]) -> list[dict]:
    """The round (one run per prompt) with the highest mean end-to-end tokens/s."""
    return max(rounds, key=lambda runs: statistics.mean(r["tok_s"] for r in runs))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None, help="draft model folder (default: a truncated copy of the target)")
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--draft-quantization", default=None, help="quantize the draft (needs hasten.quant)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds; each variant keeps its best")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from hasten import LLM

    common = dict(max_model_len=2048, kv_cache_memory_gb=1.0, num_threads=args.threads)
    base = LLM(args.model, **common)
    folder = base.engine.model_path
    draft = args.draft or str(truncated_copy(folder, args.draft_layers))
    variants = {
        "off": base,
        "ngram": LLM(args.model, speculative="ngram", num_speculative_tokens=args.k, **common),
        "draft": LLM(args.model, speculative=f"draft:{draft}", num_speculative_tokens=args.k,
                     speculative_draft_quantization=args.draft_quantization, **common),
    }
    n_prompts = 2 if args.quick else 8
    max_tokens = 32 if args.quick else args.max_tokens
    workloads = {
        "grounded": [base.engine.apply_chat_template([{"role": "user", "content": p}]) for p in GROUNDED[:n_prompts]],
        "chat": [base.engine.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT[:n_prompts]],
    }
    for llm in variants.values():  # warm-up
        run_batch(llm, workloads["chat"][:1], 4)
    results: dict = {}
    for wname, prompts in workloads.items():
        st0 = {name: llm.engine.get_stats() for name, llm in variants.items()}
        b1_rounds: dict[str, list[list[dict]]] = {name: [] for name in variants}
        b16_runs: dict[str, list[dict]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            runs: dict[str, list[dict]] = {name: [] for name in variants}
            for p in prompts:  # batch 1, one prompt at a time, the variants in turn
                for name, llm in variants.items():
                    runs[name].append(run_batch(llm, [p], max_tokens))
            for name, llm in variants.items():
                b1_rounds[name].append(runs[name])
                b16_runs[name].append(run_batch(llm, (prompts * 2)[:16], max_tokens))  # 16 concurrent requests
        for name, llm in variants.items():
            st1 = llm.engine.get_stats()
            proposed = st1.spec_proposed_tokens - st0[name].spec_proposed_tokens
            accepted = st1.spec_accepted_tokens - st0[name].spec_accepted_tokens
            b1 = best_round(b1_rounds[name])
            results[(wname, name)] = {
                "b1_tok_s": statistics.mean(r["tok_s"] for r in b1),
                "b1_decode_tok_s": statistics.mean(r["decode_tok_s"] for r in b1),
                "b1_tpot_ms": statistics.median(r["tpot_ms"] for r in b1),
                "b16_tok_s": max(r["tok_s"] for r in b16_runs[name]),
                "acceptance": accepted / proposed if proposed else None,
                "tokens": [r["tokens"][0] for r in b1],
            }
    print(f"\nmodel={base.engine.model_name} draft={Path(draft).name} k={args.k} max_tokens={max_tokens} (greedy)")
    print(f"{'workload':<9} {'variant':<6} {'b1 tok/s':>9} {'b1 decode':>10} {'b1 TPOT ms':>11} {'b16 tok/s':>10} "
          f"{'accept':>7} {'b1 ratio':>9} {'decode ratio':>13} {'b16 ratio':>10} {'same output':>12}")
    for (wname, name), r in results.items():
        off = results[(wname, "off")]
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        same = r["tokens"] == off["tokens"]
        print(f"{wname:<9} {name:<6} {r['b1_tok_s']:>9.1f} {r['b1_decode_tok_s']:>10.1f} {r['b1_tpot_ms']:>11.1f} "
              f"{r['b16_tok_s']:>10.1f} {acc:>7} {r['b1_tok_s'] / off['b1_tok_s']:>8.2f}x "
              f"{r['b1_decode_tok_s'] / off['b1_decode_tok_s']:>12.2f}x {r['b16_tok_s'] / off['b16_tok_s']:>9.2f}x "
              f"{str(same):>12}")
    print("b1 tok/s: end to end, prefill included; b1 decode: tokens after the first / time after the first; "
          f"each variant's best of {args.rounds} interleaved rounds")
    if args.json:
        Path(args.json).write_text(json.dumps({
            f"{w}/{n}": {**{k: v for k, v in r.items() if k != "tokens"},
                         "same_output": r["tokens"] == results[(w, "off")]["tokens"]}
            for (w, n), r in results.items()}, indent=2))


if __name__ == "__main__":
    main()
