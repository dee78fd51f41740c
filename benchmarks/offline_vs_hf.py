"""hasten vs transformers generate() on the same model and prompts, in one run; prints ratios.

(a) batch-1 decode tokens/s (same dtype)
(b) 64 requests, prompts 32-512 and outputs 32-256 tokens: total output tokens/s
    (transformers in left-padded batches of 16, each generating up to its longest request)
(c) TTFT of a request whose 1,024-token prefix is cached vs not cached (hasten)

usage: python benchmarks/offline_vs_hf.py [--model PATH] [--dtype float32] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def build_prompts(vocab: int, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(100, vocab, (k,), generator=g).tolist() for k in lens]


def hf_decode_rate(hf, prompt: list[int], new: int) -> tuple[float, float]:
    ids = torch.tensor([prompt])
    t = time.perf_counter()
    hf.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    total = time.perf_counter() - t
    n = out.shape[1] - len(prompt)
    return (n - 1) / (total - ttft), ttft


def hasten_decode_rate(llm, prompt: list[int], new: int) -> tuple[float, float]:
    from hasten import SamplingParams

    llm.engine.kv.reset_prefix_cache()
    o = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))[0]
    m = o.metrics
    return (len(o.outputs[0].token_ids) - 1) / (m.last_token_time - m.first_token_time), m.ttft


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF folder or GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="smaller workload for a smoke run")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    from hasten import LLM, SamplingParams

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    llm = LLM(args.model, dtype=args.dtype, max_model_len=2048, kv_cache_memory_gb=2.0, max_num_seqs=64,
              num_threads=args.threads)
    hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.model_path), dtype=dtype).eval()
    vocab = llm.engine.model_config.vocab_size
    results: dict[str, dict] = {}

    # (a) batch-1 decode, interleaved repeats, best of each
    prompt = build_prompts(vocab, 1, 71, 71, seed=1)[0]
    new = 32 if args.quick else 128
    h_rates, t_rates = [], []
    with torch.inference_mode():
        hasten_decode_rate(llm, prompt, 8)
        hf_decode_rate(hf, prompt, 8)
        for _ in range(2 if args.quick else 3):
            h_rates.append(hasten_decode_rate(llm, prompt, new)[0])
            t_rates.append(hf_decode_rate(hf, prompt, new)[0])
    results["a_batch1_decode_tok_s"] = {"hasten": max(h_rates), "transformers": max(t_rates)}

    # (b) 64 mixed requests
    n_req = 8 if args.quick else 64
    prompts = build_prompts(vocab, n_req, 32, 128 if args.quick else 512, seed=2)
    g = torch.Generator().manual_seed(3)
    outs = torch.randint(16 if args.quick else 32, 65 if args.quick else 257, (n_req,), generator=g).tolist()
    total_out = sum(outs)
    llm.engine.kv.reset_prefix_cache()
    t = time.perf_counter()
    res = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in outs])
    h_time = time.perf_counter() - t
    assert sum(len(r.outputs[0].token_ids) for r in res) == total_out
    t = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, n_req, 16):
            chunk = prompts[i : i + 16]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            k = max(outs[i : i + 16])
            hf.generate(ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0)
    t_time = time.perf_counter() - t
    results["b_64_requests_output_tok_s"] = {"hasten": total_out / h_time, "transformers": total_out / t_time}

    # (c) TTFT with a cached 1,024-token prefix vs uncached
    prefix = build_prompts(vocab, 1, 1024, 1024, seed=4)[0]
    sp1 = SamplingParams(temperature=0, max_tokens=1)
    cold, warm = [], []
    for rep in range(3):
        suffix_a = build_prompts(vocab, 1, 32, 32, seed=10 + rep)[0]
        suffix_b = build_prompts(vocab, 1, 32, 32, seed=20 + rep)[0]
        llm.engine.kv.reset_prefix_cache()
        cold.append(llm.generate([prefix + suffix_a], sp1)[0].metrics.ttft)
        warm.append(llm.generate([prefix + suffix_b], sp1)[0].metrics.ttft)
    results["c_ttft_1024_prefix_s"] = {"uncached": statistics.median(cold), "cached": statistics.median(warm)}

    a, b, c = (results[k] for k in ("a_batch1_decode_tok_s", "b_64_requests_output_tok_s", "c_ttft_1024_prefix_s"))
    rows = [
        ("(a) batch-1 decode tok/s", a["hasten"], a["transformers"], a["hasten"] / a["transformers"], 1.5),
        (f"(b) {n_req} requests output tok/s", b["hasten"], b["transformers"], b["hasten"] / b["transformers"], 4.0),
        ("(c) TTFT 1024-token prefix (s)", c["cached"], c["uncached"], c["uncached"] / c["cached"], 5.0),
    ]
    print(f"\nmodel={llm.engine.model_name} dtype={args.dtype} threads={torch.get_num_threads()}")
    print(f"{'metric':<34} {'hasten':>10} {'baseline':>10} {'ratio':>7} {'target':>7}")
    for name, h, base, ratio, target in rows:
        print(f"{name:<34} {h:>10.3f} {base:>10.3f} {ratio:>6.2f}x {target:>6.1f}x")
    print("baseline = transformers generate() for (a)/(b); hasten without a cached prefix for (c)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
