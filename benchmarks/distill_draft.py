"""A trained EAGLE draft (`hasten distill draft`) on the default model, in one run:

  - the training budget: time, tokens, peak RSS, held-out agreement, vocabulary coverage (draft.json);
  - on held-out ShareGPT chat prompts that training never read (the evaluation split, past the
    prompts the trainer holds out): acceptance rate and tokens per verification step;
  - batch-1 decode tokens/s with the trained draft vs no speculation vs n-gram lookup vs both
    (`ngram+eagle`: lookup after a match of 2+ tokens, the head elsewhere), interleaved
    over rounds, for each engine setting (float32, the exact default; the GGUF blocks with a float16
    cache, the fastest); and at batch 16 (adaptive depth), draft vs none.

  - the time of one draft token through the head, float32 and int8 weights.

usage: python benchmarks/distill_draft.py [--out DIR] [--reuse] [--max-minutes 30] [--head-cost-only]
                                          [-- draft args...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {
    "float32": {},
    "gguf": {"quantization": "gguf", "kv_cache_dtype": "float16"},
}


def heldout_prompts(tokenizer, count: int, skip: int) -> list[list[int]]:
    """Opening user turns of evaluation-split conversations, past the `skip` the trainer holds out."""
    from hasten.distill.draft import chat_prompts, first_user_turns, prompt_conversations

    turns = first_user_turns(prompt_conversations(heldout=True), skip + count)[skip:]
    return chat_prompts(tokenizer, turns, 512)


def head_cost_ms(folder: str, repeats: int = 300) -> dict[str, float]:
    """Milliseconds of one draft token through the head (its layer and lm_head on one row, attention
    left out), float32 and int8 weights, as the proposer runs it."""
    import torch

    from hasten.model.eagle import EagleHead

    head = EagleHead.load(folder)
    hidden = head.cfg.hidden_size
    emb, feat, attn, pos = (torch.randn(1, hidden), torch.randn(1, hidden),
                            torch.randn(1, head.cfg.num_heads * head.cfg.head_dim), torch.tensor([100]))
    costs = {}
    with torch.inference_mode():
        for name in ("float32", "int8"):
            if name == "int8":
                head.quantize_int8()
            for i in range(repeats + 20):
                if i == 20:
                    t = time.perf_counter()
                x, _, _, _ = head.qkv(emb, feat, pos)
                head.logits(head.finish(x, attn))
            costs[name] = (time.perf_counter() - t) / repeats * 1e3
    return costs


def decode_tok_s(outs) -> float:
    """Output tokens after the first over the time after the first token, summed over requests
    (batch 1: one request at a time)."""
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    seconds = sum(o.metrics.finished_time - o.metrics.first_token_time for o in outs)
    return tokens / seconds


def run_setting(name: str, options: dict, draft: str, prompts: list[list[int]], batch_prompts: list[list[int]],
                max_tokens: int, rounds: int) -> dict:
    from hasten import LLM, SamplingParams
    from hasten.engine.spec import SpecStats

    modes = {"none": {}, "ngram": {"speculative": "ngram"}, "eagle": {"speculative": f"eagle:{draft}"},
             "ngram+eagle": {"speculative": f"ngram+eagle:{draft}"}}
    llms = {m: LLM(None, max_model_len=2048, kv_cache_memory_gb=0.5, **options, **o) for m, o in modes.items()}
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for llm in llms.values():  # warm-up (kernels, adaptive depth's cost fit)
        llm.generate(prompts[:2], params, use_tqdm=False)
    b1: dict[str, list[float]] = {m: [] for m in modes}
    b16: dict[str, list[float]] = {"none": [], "eagle": []}
    stats = {}
    greedy: dict[str, list[list[int]]] = {}  # round 0's tokens per mode
    for rnd in range(rounds):
        for m, llm in llms.items():
            llm.engine.spec_stats = SpecStats()
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
            b1[m].append(decode_tok_s(outs))
            if rnd == 0:
                greedy[m] = [list(o.outputs[0].token_ids) for o in outs]
            st = llm.engine.spec_stats
            stats[m] = {"acceptance": st.acceptance_rate, "tokens_per_step": st.emitted / st.steps if st.steps else 1.0,
                        "proposed": st.proposed}
            if hasattr(llm.engine.proposer, "lookup_drafts"):  # the hybrid: which side drafted, over all rounds
                stats[m] |= {"lookup_drafts": llm.engine.proposer.lookup_drafts,
                             "head_drafts": llm.engine.proposer.head_drafts}
        for m in b16:
            t = time.perf_counter()
            outs = llms[m].generate(batch_prompts, params, use_tqdm=False)
            b16[m].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
    # prompts whose greedy tokens equal no speculation's (float32: all, as the tests assert; on the
    # GGUF blocks a verification step's rows take the multi-row int8 kernels, whose rounding differs
    # from the one-row kernel's, so outputs may part at near-ties)
    identical = {m: sum(a == b for a, b in zip(greedy["none"], greedy[m], strict=True)) for m in modes if m != "none"}
    med = {m: statistics.median(v) for m, v in b1.items()}
    med16 = {m: statistics.median(v) for m, v in b16.items()}
    return {"setting": name, "batch1_decode_tok_s": med, "batch1_runs": b1, "batch16_out_tok_s": med16,
            "batch16_runs": b16, "spec": stats, "identical_greedy": identical, "prompts": len(prompts),
            "eagle_vs_none": med["eagle"] / med["none"], "ngram_vs_none": med["ngram"] / med["none"],
            "hybrid_vs_none": med["ngram+eagle"] / med["none"],
            "eagle_vs_none_batch16": med16["eagle"] / med16["none"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/hasten-eagle-draft")
    ap.add_argument("--reuse", action="store_true", help="measure an existing --out (no training)")
    ap.add_argument("--max-minutes", type=float, default=30.0, help="training budget of the draft")
    ap.add_argument("--prompts", type=int, default=12, help="held-out prompts timed at batch 1")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--settings", default="float32,gguf")
    ap.add_argument("--json", default=None)
    ap.add_argument("--head-cost-only", action="store_true", help="only time one draft token through the head")
    ap.add_argument("draft_args", nargs="*", help="more `hasten distill draft` arguments (after --)")
    args = ap.parse_args()
    out = Path(args.out)
    if not args.reuse:
        cmd = [sys.executable, "-m", "hasten.cli", "distill", "draft", "--out", str(out), "--restart",
               "--max-minutes", str(args.max_minutes), *args.draft_args]
        print("$", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd).returncode
        if rc not in (0, 3):
            sys.exit(f"hasten distill draft failed with exit code {rc}")
    cost = head_cost_ms(str(out))
    print(f"one draft token through the head: {cost['float32']:.2f} ms in float32, {cost['int8']:.2f} ms in int8")
    if args.head_cost_only:
        return
    report = json.loads((out / "draft.json").read_text())
    print(json.dumps({k: report[k] for k in ("steps", "finished", "train_seconds", "train_tokens", "answer_tokens",
                                             "draft_vocab", "vocab_coverage", "heldout_top1", "seconds",
                                             "peak_rss_mb")}))

    from transformers import AutoTokenizer

    from hasten.model.loader import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    skip = 64  # past the trainer's held-out prompts (it holds out --heldout-prompts, 24 by default)
    prompts = heldout_prompts(tok, args.prompts + 16, skip)
    timed, batch = prompts[: args.prompts], prompts[args.prompts : args.prompts + 16]
    results = [run_setting(s, SETTINGS[s], str(out), timed, batch, args.max_tokens, args.rounds)
               for s in args.settings.split(",")]
    print("\n| setting | none tok/s | n-gram tok/s | EAGLE tok/s | n-gram+EAGLE tok/s | EAGLE / none | n-gram / none "
          "| n-gram+EAGLE / none | acceptance (EAGLE, n-gram+EAGLE) | tokens / step (same) | batch 16: EAGLE / none |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        d, sp, hy = r["batch1_decode_tok_s"], r["spec"]["eagle"], r["spec"]["ngram+eagle"]
        print(f"| {r['setting']} | {d['none']:.1f} | {d['ngram']:.1f} | {d['eagle']:.1f} | {d['ngram+eagle']:.1f} "
              f"| {r['eagle_vs_none']:.2f}x | {r['ngram_vs_none']:.2f}x | {r['hybrid_vs_none']:.2f}x "
              f"| {sp['acceptance']:.3f}, {hy['acceptance']:.3f} | {sp['tokens_per_step']:.2f}, {hy['tokens_per_step']:.2f} "
              f"| {r['eagle_vs_none_batch16']:.2f}x |")
        print(f"  n-gram+EAGLE drafts by side ({r['setting']}, all rounds): lookup {hy.get('lookup_drafts')}, "
              f"head {hy.get('head_drafts')}; greedy tokens equal to no speculation's: "
              + ", ".join(f"{m} {n}/{r['prompts']}" for m, n in r["identical_greedy"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"report": report, "results": results}, indent=2))


if __name__ == "__main__":
    main()
