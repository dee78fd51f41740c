"""Request governance under a bursty two-tenant workload: with and without governance.

    python benchmarks/governance.py [--duration 10] [--slots 4] [--web-rps 12] [--burst 40] [--json out.json]
    python benchmarks/governance.py --real-model default --duration 20 --web-rps 1 --burst 6 --tokens 8
        # 2 real `hasten serve` replicas (CPU-heavy: keep it short)

Two replicas behind one gateway. Tenant ``web`` (interactive) sends a steady Poisson stream
of streaming chat requests drawn from 40 questions with Zipf popularity (temperature 0,
so repeated questions are cacheable). Tenant ``bulk`` sends bursts of long, uncacheable
requests every ``--burst-every`` seconds. The same arrival schedule runs three times through
the gateway: without governance (``baseline``); with priorities (web interactive, bulk
sheddable), a bounded admission queue sized to the replicas' capacity, shedding and a
bulk concurrency limit (``priority``); and the same plus the exact response cache
(``governed``).

By default the replicas are fake OpenAI-compatible servers with a fixed number of decode
``--slots`` each (requests beyond that queue FIFO inside the replica, like a real engine
with a full batch): this makes overload visible without the CPU cost of a real model.
Reported per run: interactive TTFT p50/p99, goodput (requests that succeeded within the
TTFT objective, per second), requests shed (429/503), cache hit rate and hit TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _servers import stop_process as stop  # noqa: E402

QUESTIONS = [f"Question {i}: what is a short fact about topic number {i}?" for i in range(40)]


# -- a fake replica with a bounded number of decode slots ------------------------------------


def serve_slotted(port: int, slots: int, ttft_ms: float, interval_ms: float, tokens: int) -> None:
    from hasten.gateway.testing import FakeBackend, FakeBackendOptions

    class Slotted(FakeBackend):
        def __init__(self) -> None:
            super().__init__(FakeBackendOptions(name=f"r{port}", tokens=tokens, interval_ms=interval_ms,
                                                ttft_ms=ttft_ms))
            self.sem = asyncio.Semaphore(slots)

        async def _handle(self, method: str, target: str, headers: dict[str, str], body: bytes,
                          writer: asyncio.StreamWriter) -> bool:
            if method != "POST":
                return await super()._handle(method, target, headers, body, writer)
            async with self.sem:
                return await super()._handle(method, target, headers, body, writer)

    async def run() -> None:
        server = await Slotted().serve("127.0.0.1", port)
        print(f"replica listening on 127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
        async with server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


# -- process helpers ---------------------------------------------------------------------------


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args: list[str], ready: str = "listening", timeout_s: float = 60.0) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if ready in line:
            m = re.search(r"127\.0\.0\.1:(\d+)", line)
            assert m, line
            return proc, int(m.group(1))
    stop(proc)
    raise RuntimeError(f"{args} did not start")


def wait_health(url: str, proc: subprocess.Popen[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"replica {url} exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(1)
    raise RuntimeError(f"{url} not healthy after {timeout_s}s")


# -- load --------------------------------------------------------------------------------------


@dataclass
class Result:
    tenant: str
    status: int
    ttft_s: float | None
    e2e_s: float
    cache: str | None


@dataclass
class Plan:
    arrivals: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)


def make_plan(args: argparse.Namespace, model: str, rng: random.Random) -> Plan:
    plan = Plan()
    weights = [1 / (i + 1) ** 1.1 for i in range(len(QUESTIONS))]
    t = 0.0
    while True:
        t += rng.expovariate(args.web_rps)
        if t >= args.duration:
            break
        q = rng.choices(QUESTIONS, weights)[0]
        plan.arrivals.append((t, "web", {"model": model, "stream": True, "temperature": 0,
                                         "max_tokens": args.tokens, "messages": [{"role": "user", "content": q}]}))
    b = args.burst_every / 2
    n = 0
    while b < args.duration:
        for _ in range(args.burst):
            n += 1
            plan.arrivals.append((b + rng.random() * 0.1, "bulk", {
                "model": model, "stream": True, "temperature": 0.7, "max_tokens": args.tokens * 2,
                "messages": [{"role": "user", "content": f"Summarise document {n}: " + "lorem ipsum " * 50}]}))
        b += args.burst_every
    plan.arrivals.sort(key=lambda a: a[0])
    return plan


async def one(port: int, key: str, payload: dict[str, Any], tenant: str, timeout_s: float) -> Result:
    t0 = time.perf_counter()
    body = json.dumps(payload).encode()
    first: float | None = None
    status, cache = 0, None
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                     f"Content-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
        status = int(head[9:12])
        m = re.search(rb"(?i)x-hasten-cache: (\w+)", head)
        cache = m.group(1).decode() if m else None
        while True:
            data = await asyncio.wait_for(reader.read(65536), timeout_s)
            if not data:
                break
            if first is None and b"data: " in data:
                first = time.perf_counter()
            if b'data: {"error"' in data:
                status = 599
        writer.close()
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        status = status or 598
    end = time.perf_counter()
    return Result(tenant, status, (first - t0) if first and status == 200 else None, end - t0, cache)


async def run_plan(port: int, plan: Plan, timeout_s: float) -> list[Result]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks = []
    for at, tenant, payload in plan.arrivals:
        delay = start + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(port, f"sk-{tenant}", payload, tenant, timeout_s)))
    return await asyncio.gather(*tasks)


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]


def summarize(results: list[Result], duration: float, slo_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tenant in ("web", "bulk"):
        rs = [r for r in results if r.tenant == tenant]
        ok = [r for r in rs if r.status == 200]
        ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
        hits = [r for r in ok if r.cache]
        out[tenant] = {
            "requests": len(rs), "ok": len(ok), "shed": sum(r.status in (429, 503) for r in rs),
            "errors": sum(r.status not in (200, 429, 503) for r in rs),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "goodput_rps": sum(1 for r in ok if r.ttft_s is not None and r.ttft_s <= slo_s) / duration,
            "cache_hit_rate": len(hits) / len(ok) if ok else 0.0,
            "cache_hit_ttft_p50_ms": pct([r.ttft_s * 1000 for r in hits if r.ttft_s is not None], 50),
            "miss_ttft_p50_ms": pct([r.ttft_s * 1000 for r in ok if not r.cache and r.ttft_s is not None], 50),
        }
    return out


def gateway_config(urls: list[str], mode: str, args: argparse.Namespace, backend_model: str | None) -> dict:
    """``mode``: baseline (no governance), priority (no cache), governed (priority + cache)."""
    model: dict[str, Any] = {"name": "bench", "policy": "least_outstanding", "backends": [{"url": u} for u in urls]}
    if backend_model:
        model["backend_model"] = backend_model
    cfg: dict[str, Any] = {"listen": "127.0.0.1:0", "models": [model],
                           "tenants": [{"name": "web", "key": "sk-web"}, {"name": "bulk", "key": "sk-bulk"}]}
    if mode != "baseline":
        model["pass_priority"] = True
        cfg["tenants"] = [{"name": "web", "key": "sk-web", "priority": "interactive"},
                          {"name": "bulk", "key": "sk-bulk", "priority": "sheddable",
                           "limits": {"concurrency": args.bulk_concurrency}}]
        cfg["admission"] = {"max_in_flight": args.slots * len(urls), "max_queue": 256,
                            "max_wait_ms": {"interactive": 5000, "batch": 5000, "sheddable": args.shed_wait_ms}}
        if mode == "governed":
            cfg["cache"] = {"exact": True, "ttl_s": 300}
    return cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--web-rps", type=float, default=12.0)
    p.add_argument("--burst", type=int, default=40, help="bulk requests per burst")
    p.add_argument("--burst-every", type=float, default=3.0)
    p.add_argument("--slots", type=int, default=4, help="decode slots per fake replica")
    p.add_argument("--ttft-ms", type=float, default=60.0, help="fake replica prefill time")
    p.add_argument("--interval-ms", type=float, default=15.0, help="fake replica time per token")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--slo-ms", type=float, default=500.0, help="interactive TTFT objective (goodput)")
    p.add_argument("--shed-wait-ms", type=float, default=300.0)
    p.add_argument("--bulk-concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--modes", default="baseline,priority,governed",
                   help="baseline: no governance; priority: classes, queue, shedding, limits; governed: + cache")
    p.add_argument("--real-model", help="run 2 `hasten serve MODEL` replicas instead of fake ones "
                                        "('default' = the serve command's default model)")
    p.add_argument("--real-threads", type=int, default=1, help="--num-threads per real replica")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--serve-replica", nargs=5, metavar=("PORT", "SLOTS", "TTFT", "INTERVAL", "TOKENS"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_replica:
        port, slots, ttft, interval, tokens = args.serve_replica
        serve_slotted(int(port), int(slots), float(ttft), float(interval), int(tokens))
        return 0
    procs: list[subprocess.Popen[Any]] = []
    results: dict[str, Any] = {}
    try:
        urls, backend_model = [], None
        for _ in range(2):
            if args.real_model:
                port = free_port()
                model_arg = [] if args.real_model == "default" else [args.real_model]
                proc = subprocess.Popen([sys.executable, "-m", "hasten.cli", "serve", *model_arg, "--host",
                                         "127.0.0.1", "--port", str(port), "--max-num-seqs", str(args.slots),
                                         "--num-threads", str(args.real_threads),
                                         "--scheduling-policy", "priority"], cwd=ROOT,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                procs.append(proc)
                wait_health(f"http://127.0.0.1:{port}", proc, 600)
            else:
                proc, port = spawn([str(Path(__file__).resolve()), "--serve-replica", "0", str(args.slots),
                                    str(args.ttft_ms), str(args.interval_ms), str(args.tokens)], "replica listening")
                procs.append(proc)
            urls.append(f"http://127.0.0.1:{port}")
        if args.real_model:
            with urllib.request.urlopen(urls[0] + "/v1/models", timeout=5) as r:
                backend_model = json.loads(r.read())["data"][0]["id"]
        plan = make_plan(args, "bench", random.Random(args.seed))
        kind = f"2 x hasten serve {args.real_model}" if args.real_model else (
            f"2 fake replicas x {args.slots} slots, TTFT {args.ttft_ms:g} ms, {args.interval_ms:g} ms/token")
        n_web = sum(1 for a in plan.arrivals if a[1] == "web")
        print(f"{kind}; {args.duration:g} s: web {n_web} requests (~{args.web_rps:g}/s, Zipf over "
              f"{len(QUESTIONS)} questions), bulk {len(plan.arrivals) - n_web} in bursts of {args.burst} "
              f"every {args.burst_every:g} s; TTFT objective {args.slo_ms:g} ms")
        for name in args.modes.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "gateway.yaml"
                path.write_text(json.dumps(gateway_config(urls, name, args, backend_model)))
                gw, gport = spawn(["-m", "hasten.cli", "gateway", "--config", str(path), "--log-level", "error"])
            try:
                rs = asyncio.run(run_plan(gport, plan, 120.0))
            finally:
                stop(gw)
            results[name] = summarize(rs, args.duration, args.slo_ms / 1000)
    finally:
        for proc in procs:
            stop(proc)
    print(f"{'run':>9} {'tenant':>6} | {'ok':>4} {'shed':>4} {'err':>3} | {'TTFT p50':>8} {'TTFT p99':>8} | "
          f"{'goodput/s':>9} | {'cache hit':>9} {'hit TTFT p50':>12} {'miss TTFT p50':>13}")
    for name, per in results.items():
        for tenant, s in per.items():
            print(f"{name:>9} {tenant:>6} | {s['ok']:>4} {s['shed']:>4} {s['errors']:>3} | "
                  f"{s['ttft_p50_ms']:>8.1f} {s['ttft_p99_ms']:>8.1f} | {s['goodput_rps']:>9.2f} | "
                  f"{s['cache_hit_rate']:>9.1%} {s['cache_hit_ttft_p50_ms']:>12.1f} {s['miss_ttft_p50_ms']:>13.1f}")
    print("(ms; goodput = successful requests with TTFT within the objective per second; shed = 429/503)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
