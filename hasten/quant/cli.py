"""`hasten eval-ppl MODEL --quantization ...`: perplexity and top-1 agreement on held-out ShareGPT.

The text is a fixed slice of ShareGPT conversations that calibration never reads
(hasten.quant.data.EVAL_OFFSET on). The reference is the same model unquantized, in the same
dtype. `--max-increase` turns the run into a gate: exit 1 when perplexity rises by more.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hasten eval-ppl", description=__doc__)
    ap.add_argument("model", nargs="?", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--quantization", default="int8", help="int8 | int4 | gguf | none")
    ap.add_argument("--method", default="rtn", choices=["rtn", "awq"], help="int4 recipe")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--symmetric", action="store_true")
    ap.add_argument("--no-quantize-lm-head", action="store_true")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="the evaluated model's KV cache: auto | float32 | float16 | bfloat16 | int8 "
                         "(against the reference's model-dtype cache)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=4096, help="evaluation tokens in all")
    ap.add_argument("--no-reference", action="store_true", help="skip the unquantized model (no top-1 agreement)")
    ap.add_argument("--max-increase", type=float, default=None, help="fail (exit 1) above this relative increase, e.g. 0.06")
    ap.add_argument("--min-top1", type=float, default=None, help="fail (exit 1) below this top-1 agreement")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--engine-option", "-O", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine option of the evaluated model (repeatable), e.g. quant_u8_gemm=off")
    return ap


def quant_options(args: argparse.Namespace) -> dict:
    q = None if args.quantization.lower() in ("none", "") else args.quantization.lower()
    opts: dict = {"quantization": q}
    if q:
        opts.update(
            quant_method=args.method,
            quant_group_size=args.group_size,
            quant_symmetric=args.symmetric,
            quantize_lm_head=not args.no_quantize_lm_head,
        )
    return opts


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from hasten import LLM
    from hasten.config import EngineConfig, parse_option_pairs
    from hasten.model.dtypes import resolve_kv_cache_dtype
    from hasten.quant.data import evaluation_chunks
    from hasten.quant.evaluate import evaluate

    try:
        extra = parse_option_pairs(args.engine_option)
        EngineConfig.from_options(model="", **extra)  # names and types checked before any model loads
    except (TypeError, ValueError) as e:
        print(f"hasten eval-ppl: {e}", file=sys.stderr)
        return 2
    max_len = max(args.seq_len + 1, 128)
    common = dict(dtype=args.dtype, num_kv_blocks=-(-max_len // 16) + 1, max_model_len=max_len)
    t0 = time.time()
    llm = LLM(args.model, **(common | quant_options(args) | {"kv_cache_dtype": args.kv_cache_dtype} | extra))
    load_s = time.time() - t0
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, llm.engine.dtype)
    compared = llm.engine.config.quantization or kv_dtype != llm.engine.dtype
    reference = None if args.no_reference or not compared else LLM(args.model, **common)
    seqs = evaluation_chunks(llm.tokenizer, args.seq_len, args.max_tokens)
    t0 = time.time()
    result = evaluate(llm.engine.model, seqs, reference.engine.model if reference else None, kv_dtype=kv_dtype)
    report = result.as_dict() | {"quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
                                 "engine_options": extra,
                                 "load_s": round(load_s, 2), "eval_s": round(time.time() - t0, 2)}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"model: {llm.engine.model_name}  quantization: {args.quantization}  dtype: {args.dtype}  "
              f"kv cache: {args.kv_cache_dtype}")
        print(f"tokens: {result.num_tokens} in {result.num_sequences} sequences of {args.seq_len}")
        print(f"perplexity: {result.perplexity:.4f}")
        if result.reference_perplexity is not None:
            print(f"reference perplexity: {result.reference_perplexity:.4f}  increase: {100 * result.increase:+.2f}%")
            print(f"top-1 agreement: {100 * result.top1_agreement:.2f}%")
    failed = False
    if args.max_increase is not None and result.increase is not None and result.increase > args.max_increase:
        print(f"FAIL: perplexity increase {100 * result.increase:.2f}% > {100 * args.max_increase:.2f}%")
        failed = True
    if args.min_top1 is not None and result.top1_agreement is not None and result.top1_agreement < args.min_top1:
        print(f"FAIL: top-1 agreement {100 * result.top1_agreement:.2f}% < {100 * args.min_top1:.2f}%")
        failed = True
    return 1 if failed else 0
