"""Interleaved direct-vs-gateway load against two backends of one framing kind (gateway_overhead.py
``--interleaved``).

Two fake SSE backends on the standard library's asyncio (no uvloop; a close-delimited backend
also keeps asyncio's default listen backlog of 100, as a minimal server does) answer every
stream with its head at once, the first token after ``--ttft-ms`` and one token every
``--interval-ms``. The gateway (``least_outstanding``, default health settings) fronts both.
One client process runs N streams straight to the first backend and N through the gateway at
the same time, so both halves see the same client and machine load; "added" is gateway minus
direct per percentile. The gateway's ``probe_down_total`` counts backends marked down by its
active probes (every one a false "down": the backends never fail).

``--client httpx`` drives the same load with httpx (one AsyncClient per half, default pool
settings but no connection cap) instead of the lean raw-asyncio client; ``--client httpx-close``
does the same with ``Connection: close`` on every request, so neither half keeps connections in
httpx's pool (a close-delimited backend keeps none in the direct half anyway).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from _servers import addr, pct, scrape, spawn  # type: ignore[import-not-found]
from _servers import stop_process as stop  # type: ignore[import-not-found]

from hasten.gateway.testing import LoadResult, run_load

PAYLOAD = {"model": "bench", "stream": True, "messages": [{"role": "user", "content": "hello"}]}


def _backend_args(kind: str, name: str, args: argparse.Namespace) -> list[str]:
    a = ["-m", "hasten.gateway.testing", "--port", "0", "--name", name, "--framing", kind,
         "--tokens", str(args.tokens), "--interval-ms", str(args.interval_ms), "--ttft-ms", str(args.ttft_ms)]
    if kind == "close":
        a += ["--backlog", "100"]
    return a


async def _httpx_load(url: str, conc: int, duration: float, close: bool = False) -> LoadResult:
    import httpx

    res = LoadResult()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + duration
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        async def worker() -> None:
            while loop.time() < deadline:
                t0 = time.perf_counter()
                first = None
                try:
                    async with client.stream("POST", url + "/v1/chat/completions", json=PAYLOAD,
                                             headers={"connection": "close"} if close else None) as r:
                        async for line in r.aiter_lines():
                            if first is None and line.startswith("data: "):
                                first = time.perf_counter()
                    res.requests += 1
                    if r.status_code == 200 and first is not None:
                        res.ttft_ms.append((first - t0) * 1000)
                    else:
                        res.errors += 1
                except httpx.HTTPError:
                    res.errors += 1

        await asyncio.gather(*(worker() for _ in range(conc)))
    return res


async def _pair(args: argparse.Namespace, direct: tuple[str, int], gw: tuple[str, int], conc: int,
                duration: float) -> tuple[LoadResult, LoadResult]:
    if args.client.startswith("httpx"):
        close = args.client == "httpx-close"
        return await asyncio.gather(_httpx_load(_url(direct), conc, duration, close),
                                    _httpx_load(_url(gw), conc, duration, close))
    return await asyncio.gather(run_load(*direct, conc, duration, PAYLOAD), run_load(*gw, conc, duration, PAYLOAD))


def _url(hostport: tuple[str, int]) -> str:
    return f"http://{hostport[0]}:{hostport[1]}"


def run_interleaved(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for kind in args.backend_kinds:
        procs = [spawn(_backend_args(kind, f"b{i}", args), "listening") for i in (1, 2)]
        gateway = None
        try:
            urls = [_url(addr(line)) for _, line in procs]
            with tempfile.TemporaryDirectory() as tmp:
                cfg = Path(tmp) / "gateway.yaml"
                body: dict[str, Any] = {"listen": "127.0.0.1:0", "models": [
                    {"name": "bench", "policy": "least_outstanding", "backends": [{"url": u} for u in urls]}]}
                if args.nice is not None:
                    body["nice"] = args.nice
                cfg.write_text(json.dumps(body))
                gateway, gline = spawn(["-m", "hasten.cli", "gateway", "--config", str(cfg)], "listening")
            gw = addr(gline)
            direct = addr(procs[0][1])
            for conc in args.interleaved:
                asyncio.run(_pair(args, direct, gw, conc, 1.0))  # warm-up
                d, g = LoadResult(), LoadResult()
                for _ in range(args.rounds):
                    rd, rg = asyncio.run(_pair(args, direct, gw, conc, args.duration))
                    d.add(rd)
                    g.add(rg)
                rows.append({"kind": kind, "streams": conc, "direct": d, "gateway": g})
            text = scrape(*gw)
            downs = sum(float(v) for line in text.splitlines() if line.startswith("hasten_gateway:probe_down_total{")
                        for v in [line.rsplit(" ", 1)[1]])
            for r in rows:
                if r["kind"] == kind:
                    r["downs"] = downs  # over the whole run of this backend kind
        finally:
            if gateway is not None:
                stop(gateway)
            for p, _ in procs:
                stop(p)
    return rows


def interleaved_row(r: dict[str, Any]) -> dict[str, Any]:
    """One (backend kind, streams) cell for --json: TTFT percentiles direct and through the gateway (ms)."""
    d, g = r["direct"], r["gateway"]
    row = {"kind": r["kind"], "streams": r["streams"], "errors": d.errors + g.errors, "false_downs": r["downs"]}
    for q in (50, 99):
        row[f"direct_ttft_p{q}_ms"], row[f"gateway_ttft_p{q}_ms"] = pct(d.ttft_ms, q), pct(g.ttft_ms, q)
    return row


def report_interleaved(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    print(f"\ninterleaved: N streams straight to backend 1 and N through the gateway (least_outstanding over "
          f"backends 1 and 2) at the same time; client: {args.client}; backends: stdlib asyncio, head at once, "
          f"first token after {args.ttft_ms:g} ms, {args.tokens} tokens {args.interval_ms:g} ms apart; "
          f"{args.duration:g}s x {args.rounds} round(s); gateway at nice {0 if args.nice is None else args.nice}")
    hdr = (f"{'backend':>8} | {'streams':>9} | {'TTFT p50 direct/gw/added':>26} | {'TTFT p99 direct/gw/added':>26} | "
           f"{'chunk p50 added':>15} | {'requests d/gw':>13} | {'errors':>6} | {'false downs':>11}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        d, g = r["direct"], r["gateway"]
        cells = []
        for q in (50, 99):
            a, b = pct(d.ttft_ms, q), pct(g.ttft_ms, q)
            cells.append(f"{a:6.1f}/{b:6.1f}/{b - a:+6.2f}")
        chunk = pct(g.chunk_ms, 50) - pct(d.chunk_ms, 50) if d.chunk_ms and g.chunk_ms else float("nan")
        print(f"{r['kind']:>8} | {r['streams']:>4} + {r['streams']:<3}| {cells[0]:>26} | {cells[1]:>26} | "
              f"{chunk:+15.2f} | {d.requests:>6}/{g.requests:<6} | {d.errors + g.errors:>6} | {r['downs']:>11.0f}")
    print("false downs = hasten_gateway:probe_down_total over the whole run of that backend kind (the backends "
          "never fail, so every one is false); times in ms")
