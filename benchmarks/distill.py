"""Layer pruning healed by distillation (`hasten distill prune`) on the default model, in one run:

  - which layers block influence removes, and the training budget spent healing (time, tokens, peak RSS);
  - held-out ShareGPT perplexity of the original, of the pruned model before and after healing, and the
    student's greedy next-token agreement with the original (hasten's own decoder, hasten.quant.evaluate);
    the same on text of another kind that healing never reads (Python's own reference text, pydoc_data):
    what `--ce-weight` (cross-entropy on the ShareGPT text) gains there is not ShareGPT's style alone;
  - batch-1 decode tokens/s of the student vs the original, both served by hasten with the same settings
    (float32 weights; and int8, the quantized setting that stays exact per layer), interleaved.

usage: python benchmarks/distill.py [--layers 8] [--steps 400] [--lr 1e-4] [--ce-weight 0] [--max-minutes 20]
                                   [--precision auto] [--out DIR] [--reuse]
       python benchmarks/distill.py --step-cost [--rounds 6]   (seconds per healing step, float32 vs the defaults)
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


def decode_rate(model: str, tokens: int, **options) -> float:
    from hasten import LLM, SamplingParams

    llm = LLM(model, max_model_len=1024, kv_cache_memory_gb=0.25, **options)
    prompt = llm.engine.apply_chat_template([{"role": "user", "content": "Tell me about the history of Rome."}])
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    first = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    return (tokens - 1) / (time.perf_counter() - t - first)


def step_costs(layers: int, rounds: int, seq_len: int = 256, batch_size: int = 2) -> None:
    """Seconds per healing step (2 x 256 ShareGPT tokens) of the default model with `layers` removed:
    float32 forward passes with the embedding trained against the default settings (bfloat16 autocast
    where the CPU has it, the embedding fixed), the same batches in turn, median of `rounds`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hasten.distill.prune import remove_layers
    from hasten.distill.train import DistillConfig, Distiller
    from hasten.model.loader import resolve_model
    from hasten.quant.data import calibration_chunks

    folder = str(resolve_model(None))
    tok = AutoTokenizer.from_pretrained(folder)
    teacher = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    data = calibration_chunks(tok, seq_len, seq_len * batch_size * (rounds + 1))
    drop = list(range(12, 12 + layers))
    variants = {"float32, embedding trained": dict(precision="float32", train_embeddings=True),
                "defaults (--precision auto)": dict(precision="auto", train_embeddings=False)}
    loops = {name: Distiller(remove_layers(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), drop),
                             teacher, data, data[:1], DistillConfig(steps=rounds + 1, batch_size=batch_size, **kw))
             for name, kw in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in loops}
    for r in range(rounds + 1):  # round 0 warms up
        batch = data[r * batch_size : (r + 1) * batch_size]
        for name, loop in loops.items():
            t = time.perf_counter()
            loop._step(batch)
            if r:
                times[name].append(time.perf_counter() - t)
    base = statistics.median(times[next(iter(times))])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:<30} {med:.2f} s per step (rounds {', '.join(f'{t:.2f}' for t in ts)})  {base / med:.2f}x")


def reference_text_chunks(tokenizer, seq_len: int, max_tokens: int) -> list[list[int]]:
    """`max_tokens` of Python's reference text (pydoc_data.topics, in key order) in `seq_len` pieces."""
    from pydoc_data.topics import topics

    ids = tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)))[:max_tokens]
    return [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]


def quality(student: str, original: str, seq_len: int, max_tokens: int) -> dict[str, dict]:
    """The student against the original on held-out ShareGPT text and on Python's reference text."""
    from hasten import LLM
    from hasten.quant.data import evaluation_chunks
    from hasten.quant.evaluate import evaluate

    common = dict(num_kv_blocks=-(-(seq_len + 1) // 16) + 1, max_model_len=max(seq_len + 1, 128))
    s, o = LLM(student, **common), LLM(original, **common)
    texts = {"sharegpt": evaluation_chunks(s.tokenizer, seq_len, max_tokens),
             "python reference": reference_text_chunks(s.tokenizer, seq_len, max_tokens)}
    return {name: evaluate(s.engine.model, seqs, o.engine.model).as_dict() for name, seqs in texts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--ce-weight", type=float, default=0.0, help="hasten distill prune --ce-weight")
    ap.add_argument("--max-minutes", type=float, default=20.0)
    ap.add_argument("--calib-tokens", type=int, default=524288)
    ap.add_argument("--precision", default="auto", help="hasten distill prune --precision (auto | float32 | bfloat16)")
    ap.add_argument("--out", default="/tmp/hasten-distill-prune")
    ap.add_argument("--reuse", action="store_true", help="measure an existing --out (no training)")
    ap.add_argument("--resume", action="store_true", help="continue --out's checkpoint instead of restarting")
    ap.add_argument("--tokens", type=int, default=96, help="decode tokens per timing")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--step-cost", action="store_true",
                    help="only time healing steps: float32 with the embedding trained vs the defaults")
    args = ap.parse_args()
    if args.step_cost:
        print(f"healing step of 2 x 256 tokens, {args.layers} layers removed:")
        step_costs(args.layers, max(args.rounds, 3))
        return
    from hasten.model.loader import resolve_model

    original = str(resolve_model(None))
    out = Path(args.out)
    if not args.reuse:
        cmd = [sys.executable, "-m", "hasten.cli", "distill", "prune", original, "--layers", str(args.layers),
               "--out", str(out), "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--lr",
               str(args.lr), "--max-minutes", str(args.max_minutes), "--calib-tokens", str(args.calib_tokens),
               "--eval-every", "50", "--precision", args.precision, "--ce-weight", str(args.ce_weight)] + ([] if args.resume else ["--restart"])
        t = time.time()
        rc = subprocess.run(cmd).returncode
        print(f"distill exit status {rc} after {time.time() - t:.0f} s")
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        if rc not in (0, 1, 3):  # 3: the time budget ended training first
            raise SystemExit(f"hasten distill prune failed ({rc})")
    else:
        peak_mb = float("nan")
    report = json.loads((out / "distill.json").read_text())
    q = quality(str(out), original, 256, 4096)
    rates: dict[str, list[float]] = {k: [] for k in ("original fp32", "student fp32", "original int8", "student int8")}
    for _ in range(args.rounds):
        for name in rates:
            model = original if name.startswith("original") else str(out)
            opts = {"quantization": "int8"} if name.endswith("int8") else {}
            rates[name].append(decode_rate(model, args.tokens, **opts))
    med = {k: statistics.median(v) for k, v in rates.items()}
    ppl = report["heldout_perplexity"]
    print(f"\nlayers removed: {report['layers_removed']} of {report['layers_before']}")
    print(f"healing: {report['steps']} steps, {report['train_tokens']} tokens, {report['train_seconds']:.0f} s "
          f"({report.get('precision', 'float32')} forward passes), peak RSS {peak_mb:.0f} MB")
    print(f"held-out perplexity (transformers, distill.json): original {ppl['original']:.3f}, "
          f"pruned {ppl['pruned']:.3f} ({100 * (ppl['pruned'] / ppl['original'] - 1):+.1f} %), "
          f"healed {ppl['healed']:.3f} ({100 * (ppl['healed'] / ppl['original'] - 1):+.1f} %)")
    print(f"(--lr {report.get('lr', '?')}, --ce-weight {report.get('ce_weight', 0.0)})")
    for name, r in q.items():
        print(f"{name} (hasten decoder): student {r['perplexity']:.3f} vs original {r['reference_perplexity']:.3f} "
              f"({100 * r['increase']:+.1f} %), greedy next-token agreement {100 * r['top1_agreement']:.1f} %")
    print("batch-1 decode tok/s (median of rounds):")
    for kind in ("fp32", "int8"):
        o, s = med[f"original {kind}"], med[f"student {kind}"]
        print(f"  {kind}: original {o:.1f}, student {s:.1f}  ({s / o:.2f}x)")


if __name__ == "__main__":
    main()
