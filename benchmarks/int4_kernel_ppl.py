"""Perplexity of int4 SmolLM2 through the decode kernels (exact float vs int8 activations).

    python benchmarks/int4_kernel_ppl.py [--tokens 2048]

`quant_kernel_max_rows` is raised above the sequence length so every row runs the kernel
(the plain quantization benchmark evaluates 256-token prefills, which dequantize + GEMM).
"""

from __future__ import annotations

import argparse
import time

import torch

from hasten import LLM
from hasten.quant.data import evaluation_chunks
from hasten.quant.evaluate import evaluate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    common = dict(num_kv_blocks=20, max_model_len=257)
    ref = LLM(None, **common)
    seqs = evaluation_chunks(ref.tokenizer, 256, args.tokens)
    runs = [("int4", m, k) for m in ("awq", "rtn") for k in ("hasten", "hasten-q8")]
    runs += [("gguf", None, k) for k in ("hasten", "hasten-q8")]
    for mode, method, kernel in runs:
        opts = {"quantization": mode, "quant_int4_kernel": kernel, "quant_kernel_max_rows": 1024}
        if method:
            opts["quant_method"] = method
        llm = LLM(None, **common, **opts)
        t = time.time()
        r = evaluate(llm.engine.model, seqs, ref.engine.model)
        print(f"{mode:<5} {method or '-':<4} {kernel:<10} ppl {r.perplexity:.4f} (fp32 {r.reference_perplexity:.4f}) "
              f"{100 * r.increase:+.2f}%  top-1 {100 * r.top1_agreement:.1f}%  ({time.time() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
