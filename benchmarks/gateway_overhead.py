"""Gateway overhead: direct-to-backend vs through `hasten gateway`, same fake SSE backend.

    python benchmarks/gateway_overhead.py                       # 50, 200, 500 streams
    python benchmarks/gateway_overhead.py --concurrency 200 --duration 10
    python benchmarks/gateway_overhead.py --http2               # gateway on hypercorn (h1 clients)
    python benchmarks/gateway_overhead.py --nginx --pipe-baseline  # + nginx and a bare TCP relay
                                                                  #   in the same place (references)
    python benchmarks/gateway_overhead.py --nice -10            # the gateway (and the references)
                                                                  #   at CPU priority -10 (`nice:`)
    python benchmarks/gateway_overhead.py --real-model --skip-fake  # 2 real `hasten serve`
                                                       # replicas: prefix_aware vs round_robin
    python benchmarks/gateway_overhead.py --interleaved 50,100  # direct and gateway halves at once,
                                  # keep-alive and close-delimited backends, false "down" count

Processes: one fake backend (raw asyncio + uvloop), one gateway, and this load client
(raw asyncio protocol, one keep-alive connection per stream), all on the same machine and
sharing its cores; the figures include that contention. "Added" = through-gateway minus
direct, per percentile. Chunk delay = time from the backend writing an SSE chunk to the
client receiving it (both read CLOCK_MONOTONIC, which is system-wide on Linux).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _servers import addr, pct, scrape, spawn  # noqa: E402
from _servers import stop_process as stop  # noqa: E402

from hasten.gateway.testing import LoadResult, run_load  # noqa: E402


def write_config(path: Path, backends: list[str], policy: str, http2: bool = False,
                 nice: int | None = None) -> None:
    cfg: dict = {"listen": "127.0.0.1:0", "http2": http2,
                 "models": [{"name": "bench", "policy": policy, "backends": [{"url": u} for u in backends]}]}
    if nice is not None:
        cfg["nice"] = nice
    path.write_text(json.dumps(cfg))  # JSON is valid YAML


def metric_mean(text: str, name: str) -> float:
    total = re.search(rf"hasten_gateway:{name}_sum\{{[^}}]*\}} (\S+)", text)
    count = re.search(rf"hasten_gateway:{name}_count\{{[^}}]*\}} (\S+)", text)
    if not total or not count or float(count.group(1)) == 0:
        return float("nan")
    return float(total.group(1)) / float(count.group(1)) * 1000


async def measure(host: str, port: int, conc: int, duration: float, payload: dict) -> LoadResult:
    await run_load(host, port, conc, 1.0, payload)  # warm code paths and the gateway's upstream pool
    return await run_load(host, port, conc, duration, payload)


def fake_overhead(args: argparse.Namespace) -> None:
    backend, line = spawn(["-m", "hasten.gateway.testing", "--port", "0", "--name", "bench", "--uvloop",
                           "--tokens", str(args.tokens), "--interval-ms", str(args.interval_ms),
                           "--ttft-ms", str(args.ttft_ms)], "listening")
    bhost, bport = addr(line)
    gateway = pipe = nginx = None
    nginx_dir = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = Path(tmp) / "gateway.yaml"
            write_config(cfg, [f"http://{bhost}:{bport}"], "round_robin", args.http2, args.nice)
            gateway, gline = spawn(["-m", "hasten.cli", "gateway", "--config", str(cfg)], "listening")
        ghost, gport = addr(gline)
        targets = [("direct", (bhost, bport)), ("gateway", (ghost, gport))]
        if args.pipe_baseline:
            pipe, pline = spawn([str(Path(__file__).resolve()), "--_pipe", f"{bhost}:{bport}"], "listening")
            if args.nice is not None:
                os.setpriority(os.PRIO_PROCESS, pipe.pid, args.nice)
            targets.append(("pipe", addr(pline)))
        if args.nginx:
            nginx, nport = start_nginx(args.nginx, bhost, bport, nginx_dir := tempfile.mkdtemp(), args.nice)
            targets.append(("nginx", ("127.0.0.1", nport)))
        payload = {"model": "bench", "stream": True, "messages": [{"role": "user", "content": "hello"}]}
        rows = []
        for conc in args.concurrency:
            results = {name: LoadResult() for name, _ in targets}
            cpu = CpuSample()
            for _ in range(args.rounds):
                for name, target in targets:
                    if name == "gateway":
                        cpu.start(gateway.pid)
                    r = asyncio.run(measure(*target, conc, args.duration, payload))
                    if name == "gateway":
                        cpu.stop(gateway.pid, r)
                    results[name].add(r)
            rows.append((conc, results, cpu))
            via = results["gateway"]
            print(f"  done: {conc} streams ({via.requests} requests via gateway, {via.errors} errors)",
                  file=sys.stderr, flush=True)
        text = scrape(ghost, gport)
        report(args, rows, text)
        if args.json:
            args.json.write_text(json.dumps({"nice": args.nice, "rows": [overhead_row(c, res, cpu) for c, res, cpu in rows]},
                                            indent=2))
    finally:
        for proc in (gateway, pipe, nginx):
            if proc is not None:
                stop(proc)
        stop(backend)
        if nginx_dir is not None:
            import shutil

            shutil.rmtree(nginx_dir, ignore_errors=True)


NGINX_CONF = """worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body;
  proxy_temp_path {dir}/proxy;
  fastcgi_temp_path {dir}/fastcgi;
  uwsgi_temp_path {dir}/uwsgi;
  scgi_temp_path {dir}/scgi;
  upstream backend {{ server {host}:{port}; keepalive 1024; }}
  server {{
    listen 127.0.0.1:{listen} backlog=4096;
    keepalive_requests 1000000;
    location / {{
      proxy_pass http://backend;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      tcp_nodelay on;
    }}
  }}
}}
"""


def start_nginx(binary: str, host: str, port: int, folder: str,
                nice: int | None = None) -> tuple[subprocess.Popen, int]:
    """A reference proxy written in C: nginx, one worker, streaming (proxy_buffering off), keep-alive
    to the backend; the same hop as the gateway with the least per-chunk work we know of."""
    listen = _free_port()
    conf = Path(folder) / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=folder, host=host, port=port, listen=listen))
    prefix = ["nice", "-n", str(nice)] if nice is not None else []
    proc = subprocess.Popen([*prefix, binary, "-p", folder, "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    import socket

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", listen), timeout=0.2):
            return proc, listen
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"nginx did not start (see {folder}/error.log)")


def pipe_main(target: str) -> None:
    """A do-nothing TCP relay (no HTTP parsing): the cost of one extra process hop on this machine."""
    host, port = target.rsplit(":", 1)

    class Side(asyncio.Protocol):
        peer: Side | None = None
        transport: asyncio.Transport | None = None
        pending: bytes = b""

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport  # type: ignore[assignment]

        def data_received(self, data: bytes) -> None:
            if self.peer is not None and self.peer.transport is not None:
                self.peer.transport.write(data)
            else:
                self.pending += data

        def connection_lost(self, exc: Exception | None) -> None:
            if self.peer is not None and self.peer.transport is not None:
                self.peer.transport.close()

    class Front(Side):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            asyncio.get_running_loop().create_task(self._connect())

        async def _connect(self) -> None:
            back = Side()
            back.peer = self
            await asyncio.get_running_loop().create_connection(lambda: back, host, int(port))
            self.peer = back
            if self.pending and back.transport is not None:
                back.transport.write(self.pending)
                self.pending = b""

    async def run() -> None:
        server = await asyncio.get_running_loop().create_server(Front, "127.0.0.1", 0, backlog=4096)
        print(f"pipe listening on 127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = vals[3] + vals[4]
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(vals) - idle) / tick, sum(vals) / tick


class CpuSample:
    """Gateway CPU time and the machine's load from *other* processes during gateway cells."""

    def __init__(self) -> None:
        self.gateway_s = 0.0
        self.wall_s = 0.0
        self.machine_busy_s = 0.0
        self.machine_total_s = 0.0
        self.chunks = 0
        self.requests = 0

    def start(self, pid: int) -> None:
        self._t = time.monotonic()
        self._g = _proc_cpu_s(pid)
        self._m = _machine_busy_s()

    def stop(self, pid: int, r: LoadResult) -> None:
        self.wall_s += time.monotonic() - self._t
        self.gateway_s += _proc_cpu_s(pid) - self._g
        busy, total = _machine_busy_s()
        self.machine_busy_s += busy - self._m[0]
        self.machine_total_s += total - self._m[1]
        self.chunks += len(r.chunk_ms)
        self.requests += r.requests


def overhead_row(conc: int, res: dict[str, LoadResult], cpu: CpuSample) -> dict[str, float]:
    """One concurrency cell for --json: direct and gateway TTFT / chunk-delay percentiles (ms)."""
    d, g = res["direct"], res["gateway"]
    row: dict[str, float] = {"streams": conc, "errors": sum(r.errors for r in res.values()),
                             "gateway_us_per_chunk": cpu.gateway_s / cpu.chunks * 1e6 if cpu.chunks else float("nan")}
    for q in (50, 99):
        row[f"direct_ttft_p{q}_ms"], row[f"gateway_ttft_p{q}_ms"] = pct(d.ttft_ms, q), pct(g.ttft_ms, q)
        row[f"direct_chunk_p{q}_ms"], row[f"gateway_chunk_p{q}_ms"] = pct(d.chunk_ms, q), pct(g.chunk_ms, q)
    return row


def _added(base: list[float], other: list[float]) -> str:
    return f"{pct(other, 50) - pct(base, 50):+6.2f}/{pct(other, 99) - pct(base, 99):+7.2f}"


def report(args: argparse.Namespace, rows: list[tuple[int, dict[str, LoadResult], CpuSample]],
           metrics: str) -> None:
    print(f"\nload average before the run: {args.load_before:.2f} (1 min); fake backend: {args.tokens} tokens/stream, "
          f"{args.interval_ms} ms between tokens, ttft {args.ttft_ms} ms; {args.duration}s x {args.rounds} round(s) "
          f"per cell; gateway transport: {'hypercorn (h1+h2c)' if args.http2 else 'raw asyncio (HTTP/1.1)'}; "
          f"cpus: {os.cpu_count()} shared by client, gateway and backend; gateway (and reference relays) at "
          f"nice {0 if args.nice is None else args.nice}, backend and client at nice 0")
    hdr = (f"{'streams':>7} | {'TTFT p50 direct/gw/added':>26} | {'TTFT p99 direct/gw/added':>26} | "
           f"{'chunk p50 d/gw/added':>22} | {'chunk p99 d/gw/added':>22} | {'req/s gw':>8} | {'errors':>6} | "
           f"{'gw CPU':>6} | {'gw us/chunk':>11} | {'machine busy':>12}")
    print(hdr)
    print("-" * len(hdr))
    for conc, res, cpu in rows:
        d, g = res["direct"], res["gateway"]
        cells = []
        for vals_d, vals_g, q in ((d.ttft_ms, g.ttft_ms, 50), (d.ttft_ms, g.ttft_ms, 99),
                                  (d.chunk_ms, g.chunk_ms, 50), (d.chunk_ms, g.chunk_ms, 99)):
            a, b = pct(vals_d, q), pct(vals_g, q)
            cells.append(f"{a:6.2f}/{b:6.2f}/{b - a:+6.2f}")
        rate = g.requests / (args.duration * args.rounds)
        gw_cpu = cpu.gateway_s / cpu.wall_s if cpu.wall_s else float("nan")
        per_chunk = cpu.gateway_s / cpu.chunks * 1e6 if cpu.chunks else float("nan")
        busy = cpu.machine_busy_s / cpu.machine_total_s if cpu.machine_total_s else float("nan")
        errors = sum(r.errors for r in res.values())
        print(f"{conc:>7} | {cells[0]:>26} | {cells[1]:>26} | {cells[2]:>22} | {cells[3]:>22} | "
              f"{rate:8.1f} | {errors:>6} | {gw_cpu:6.0%} | {per_chunk:11.1f} | {busy:12.0%}")
    for ref, what in (("pipe", "a do-nothing Python TCP relay process (the cost of one extra hop here)"),
                      ("nginx", "nginx, one worker, streaming (a proxy written in C)")):
        if ref not in rows[0][1]:
            continue
        print(f"\nbaseline: {what} in place of the gateway")
        print(f"{'streams':>7} | {'TTFT added p50/p99 ' + ref:>25} | {'TTFT added p50/p99 gw':>22} | "
              f"{'chunk added p50/p99 ' + ref:>26} | {'chunk added p50/p99 gw':>23}")
        for conc, res, _ in rows:
            d, g, p = res["direct"], res["gateway"], res[ref]
            print(f"{conc:>7} | {_added(d.ttft_ms, p.ttft_ms):>25} | {_added(d.ttft_ms, g.ttft_ms):>22} | "
                  f"{_added(d.chunk_ms, p.chunk_ms):>26} | {_added(d.chunk_ms, g.chunk_ms):>23}")
    print("gw CPU = gateway process CPU time / wall time (100% = one core); gw us/chunk = gateway CPU per "
          "forwarded SSE chunk, request costs included; machine busy = all CPUs, all processes (incl. other "
          "users' jobs), during the gateway cells")
    print(f"(all times in ms) gateway self-measured means over the whole run: request->upstream sent "
          f"{metric_mean(metrics, 'added_latency_seconds'):.3f} ms, chunk read->written "
          f"{metric_mean(metrics, 'chunk_forward_seconds'):.3f} ms, upstream request sent->response head read "
          f"(the backend's part) {metric_mean(metrics, 'upstream_first_byte_seconds'):.3f} ms, request "
          f"received->first body byte written {metric_mean(metrics, 'ttft_seconds'):.3f} ms")


def real_replicas(args: argparse.Namespace) -> None:
    """2 real `hasten serve` replicas, `hasten bench`'s shared-prefix workload: prefix_aware vs round_robin.

    Each policy gets its own system prompts (another workload seed), so neither finds the
    replicas' prefix caches warmed by the other; the hit rate comes from the replicas' own
    `hasten:prefix_cache_*` counters over that policy's run.
    """
    from hasten.model.loader import default_model_path

    model = str(default_model_path()) if args.real_model == "default" else args.real_model
    replicas = []
    try:
        urls = []
        for _ in range(2):
            port = _free_port()
            proc = subprocess.Popen([sys.executable, "-m", "hasten.cli", "serve", model, "--host",
                                     "127.0.0.1", "--port", str(port), *args.real_serve_arg], cwd=ROOT,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            replicas.append(proc)
            urls.append(f"http://127.0.0.1:{port}")
        for u, proc in zip(urls, replicas, strict=True):
            _wait_health(u, proc, 600)
        with urllib.request.urlopen(urls[0] + "/v1/models", timeout=5) as r:
            served = json.loads(r.read())["data"][0]["id"]
        bench = ["--endpoint", "chat", "--dataset", "shared-prefix", "--num-prefixes", str(args.real_prefixes),
                 "--prefix-len", "384", "--input-len", "32", "--output-len", "16",
                 "--concurrency", str(args.real_concurrency), "--num-requests", str(args.real_requests)]
        print(f"\n2 x hasten serve {model} {' '.join(args.real_serve_arg)}, one gateway per policy in front of both; "
              f"hasten bench {' '.join(bench)} (system prompts drawn from a different seed per policy)")
        print(f"{'policy':>18} | {'requests':>8} | {'TTFT p50 ms':>11} | {'TTFT p99 ms':>11} | "
              f"{'req/s':>6} | {'prefix hit rate':>15} | {'per replica':>15}")
        for seed, policy in enumerate(args.real_policies, start=1):  # ABBA: order effects cancel
            before = [_hit_counts(u) for u in urls]
            with tempfile.TemporaryDirectory() as tmp:
                cfg = Path(tmp) / "gateway.yaml"
                cfg.write_text(json.dumps({"listen": "127.0.0.1:0", "models": [
                    {"name": "bench", "policy": policy, "backend_model": served,
                     "backends": [{"url": u} for u in urls]}]}))
                gw, line = spawn(["-m", "hasten.cli", "gateway", "--config", str(cfg)], "listening")
                try:
                    host, port = addr(line)
                    out = Path(tmp) / "summary.json"
                    subprocess.run([sys.executable, "-m", "hasten.cli", "bench", "--base-url",
                                    f"http://{host}:{port}", "--model", "bench", *bench, "--seed", str(seed),
                                    "--save-json", str(out), "--quiet"], cwd=ROOT, check=True,
                                   stdout=subprocess.DEVNULL)
                    summary = json.loads(out.read_text())
                finally:
                    stop(gw)
            after = [_hit_counts(u) for u in urls]
            hits = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
            queried = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
            rate = f"{sum(hits) / sum(queried):.1%}" if sum(queried) else "n/a"
            split = "/".join(f"{q:.0f}" for q in queried)
            print(f"{policy:>18} | {summary['completed']:>8} | {summary['median_ttft_ms']:11.1f} | "
                  f"{summary['p99_ttft_ms']:11.1f} | {summary['request_throughput']:6.2f} | {rate:>15} | "
                  f"{split:>15}")
        print("per replica = prompt tokens each replica looked up in its prefix cache")
    finally:
        for p in replicas:
            stop(p)  # type: ignore[arg-type]


def _free_port() -> int:
    import socket

    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`hasten serve` for {url} exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(1)
    raise RuntimeError(f"{url} not healthy after {timeout_s}s")


def _hit_counts(url: str) -> tuple[float, float]:
    """(prefix-cache hit tokens, queried tokens) from a replica's /metrics (hasten:prefix_cache_*)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return (0.0, 0.0)

    def total(pattern: str) -> float:
        return sum(float(v) for v in re.findall(rf"^\S*{pattern}\S*(?:\{{[^}}]*\}})? (\S+)$", text, re.M))

    return total("prefix_cache_hits"), total("prefix_cache_queries")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[50, 200, 500])
    p.add_argument("--duration", type=float, default=6.0, help="seconds per measurement cell")
    p.add_argument("--rounds", type=int, default=1, help="alternating direct/gateway rounds per cell")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--interval-ms", type=float, default=25.0)
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--http2", action="store_true", help="run the gateway on hypercorn (HTTP/2 capable)")
    p.add_argument("--real-model", nargs="?", const="default", default=None, metavar="MODEL",
                   help="also run the 2-real-replica prefix benchmark: a model folder or .gguf path "
                        "`hasten serve` can load (no value: the embedded default model)")
    p.add_argument("--real-concurrency", type=int, default=8)
    p.add_argument("--real-requests", type=int, default=64, help="measured requests per policy")
    p.add_argument("--real-prefixes", type=int, default=8, help="distinct system prompts per policy")
    p.add_argument("--real-serve-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for each replica's `hasten serve` (repeatable), e.g. "
                        "--real-serve-arg=--num-kv-blocks=400 to make the KV cache the constraint")
    p.add_argument("--real-policies", type=lambda v: v.split(","),
                   default=["round_robin", "prefix_aware", "prefix_aware", "round_robin"],
                   help="policies to run, in this order, each with fresh system prompts")
    p.add_argument("--skip-fake", action="store_true", help="only run the real-replica part")
    p.add_argument("--pipe-baseline", action="store_true",
                   help="also measure a do-nothing TCP relay process in place of the gateway")
    p.add_argument("--nginx", nargs="?", const="nginx", default=None, metavar="BINARY",
                   help="also measure nginx (one worker, streaming) as a reference proxy in the same place")
    p.add_argument("--nice", type=int, default=None, metavar="N",
                   help="run the gateway with `nice: N` (and the pipe/nginx references at the same priority); "
                        "negative values need root or CAP_SYS_NICE")
    p.add_argument("--interleaved", type=lambda s: [int(x) for x in s.split(",")], default=None, metavar="N,..",
                   help="interleaved mode (benchmarks/_gateway_interleaved.py): N streams direct to one of two "
                        "backends and N through the gateway at the same time, e.g. 50,100")
    p.add_argument("--backend-kinds", type=lambda v: v.split(","), default=["chunked", "close"],
                   help="interleaved mode: backend framings to run, chunked (keep-alive) and/or close "
                        "(Connection: close, close-delimited body)")
    p.add_argument("--client", choices=("lean", "httpx", "httpx-close"), default="lean",
                   help="interleaved mode: the load client (httpx-close: httpx with Connection: close)")
    p.add_argument("--json", type=Path, default=None, help="also write the fake-backend or interleaved rows here")
    p.add_argument("--_pipe", help=argparse.SUPPRESS)
    args = p.parse_args()
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    if args._pipe:
        pipe_main(args._pipe)
        return
    args.load_before = os.getloadavg()[0]
    if args.interleaved:
        from _gateway_interleaved import interleaved_row, report_interleaved, run_interleaved

        if "--ttft-ms" not in sys.argv:
            args.ttft_ms = 100.0
        if "--tokens" not in sys.argv:
            args.tokens = 50
        if "--interval-ms" not in sys.argv:
            args.interval_ms = 20.0
        rows = run_interleaved(args)
        report_interleaved(args, rows)
        if args.json:
            args.json.write_text(json.dumps({"nice": args.nice, "rows": [interleaved_row(r) for r in rows]}, indent=2))
        return
    if not args.skip_fake:
        fake_overhead(args)
    if args.real_model:
        real_replicas(args)


if __name__ == "__main__":
    main()
