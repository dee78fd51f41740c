"""hasten on one GPU against transformers generate(), in one run with nothing from the network.

1. Parity: a tiny random Llama on the device, greedy tokens of hasten (Triton path, CUDA graphs)
   against transformers' on the same device and dtype.
2. Speed on a Llama-3-8B-shaped model with random bfloat16 weights (written once to a local folder):
   device-to-device copy bandwidth (measured here), batch-1 decode tok/s and MBU (weights + KV bytes
   read per step / step time / that bandwidth) for hasten and transformers, decode tok/s at batch
   16, 64 and 256 with 512-token prompts, TTFT and MFU of a 2,048-token prompt.

A table is printed last; a JSON goes to $OUT/gpu_bench.json. Run by benchmarks/gpu/run.sh.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

PEAK_BF16_FLOPS = 989e12  # H100/H200 dense bf16 tensor-core peak (no sparsity)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 4 GiB device-to-device copy (read + write counted)."""
    n = 2**30
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 4 * 10 / (time.perf_counter() - t0)


def make_model(path: Path, **shape) -> Path:
    import transformers

    from hasten.testing import make_tokenizer

    tok = make_tokenizer(path)
    cfg = transformers.LlamaConfig(vocab_size=shape.pop("vocab_size", len(tok)), bos_token_id=tok.bos_token_id,
                                   eos_token_id=tok.eos_token_id, **shape)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(path))
    return path


def decode_rate(outs) -> float:
    """Generated tokens after the first, per second of the decode phase (all requests together)."""
    firsts = [o.metrics.first_token_time for o in outs]
    lasts = [o.metrics.last_token_time for o in outs]
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    return tokens / (max(lasts) - min(firsts))


def hf_decode(model, prompt_len: int, new: int, device) -> float:
    ids = torch.randint(3, 1000, (1, prompt_len), device=device)
    model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return (new - 1) / (time.perf_counter() - t1 - (t1 - t0))


def main() -> int:
    import transformers

    from hasten import LLM, SamplingParams

    device = torch.device("cuda")
    out_dir = Path(os.environ.get("OUT", "."))
    results: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    work = Path(tempfile.mkdtemp(prefix="hasten-gpu-"))

    # 1. parity on a tiny model
    from hasten.testing import make_tiny_model

    tiny = make_tiny_model(work / "tiny")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.bfloat16).to(device)
    llm = LLM(str(tiny), device="cuda", dtype="bfloat16", num_kv_blocks=256, max_model_len=512)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 17, 33, 64, 100)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    ref = [hf.generate(torch.tensor([p], device=device), max_new_tokens=16, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    same = sum(a == b for a, b in zip(got, ref, strict=True))
    results["parity"] = {"prompts": len(prompts), "identical": same}
    print(f"parity (tiny Llama, bf16, 16 greedy tokens): {same}/{len(prompts)} identical", flush=True)
    del llm, hf

    # 2. speed on the Llama-3-8B shape
    bw = copy_bandwidth(device)
    results["copy_bandwidth_GBps"] = bw / 1e9
    big = make_model(work / "llama3-8b-shape", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False)
    weight_bytes = sum(f.stat().st_size for f in big.glob("*.safetensors"))
    params = weight_bytes / 2
    llm = LLM(str(big), device="cuda", dtype="bfloat16", max_model_len=4096, max_num_seqs=256,
              max_num_batched_tokens=8192)
    kv_per_token = 32 * 2 * 8 * 128 * 2
    rows = []
    prompt = list(range(10, 138))
    new = 256
    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    rate = decode_rate(llm.generate([prompt], sp, use_tqdm=False))
    kv_bytes = kv_per_token * (len(prompt) + new / 2)
    mbu = (weight_bytes + kv_bytes) * rate / bw
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(big), dtype=torch.bfloat16).to(device)
    hf_rate = hf_decode(hf, len(prompt), 64, device)
    del hf
    torch.cuda.empty_cache()
    rows.append(("batch-1 decode tok/s", f"{rate:.1f}", f"{hf_rate:.1f}", f"MBU {mbu:.0%}, {rate / hf_rate:.1f}x"))
    results["batch1"] = {"hasten_tok_s": rate, "transformers_tok_s": hf_rate, "mbu": mbu}
    print(rows[-1], flush=True)
    for batch in (16, 64, 256):
        g = torch.Generator().manual_seed(batch)
        ps = [torch.randint(3, 128000, (512,), generator=g).tolist() for _ in range(batch)]
        outs = llm.generate(ps, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True), use_tqdm=False)
        rate = decode_rate(outs)
        step = batch / rate
        bound = (weight_bytes + batch * kv_per_token * (512 + 32)) / bw
        rows.append((f"batch-{batch} decode tok/s (512-token prompts)", f"{rate:.0f}", "",
                     f"{bound / step:.0%} of the bandwidth bound"))
        results[f"batch{batch}"] = {"hasten_tok_s": rate, "of_bound": bound / step}
        print(rows[-1], flush=True)
    long = torch.randint(3, 128000, (2048,), generator=g).tolist()
    llm.generate([long], SamplingParams(max_tokens=1), use_tqdm=False)
    o = llm.generate([long[::-1]], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    ttft = o.metrics.first_token_time - o.metrics.arrival_time
    mfu = 2 * params * 2048 / ttft / PEAK_BF16_FLOPS
    rows.append(("TTFT 2,048-token prompt (ms)", f"{ttft * 1e3:.1f}", "", f"MFU {mfu:.0%}"))
    results["ttft_2048"] = {"ms": ttft * 1e3, "mfu": mfu}
    print(f"\n{'measure':48} {'hasten':>10} {'transformers':>13}  note")
    for r in rows:
        print(f"{r[0]:48} {r[1]:>10} {r[2]:>13}  {r[3]}")
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; weights {weight_bytes / 1e9:.2f} GB")
    (out_dir / "gpu_bench.json").write_text(json.dumps(results, indent=2))
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
