"""Soak: mixed load through `hasten gateway` to two `hasten serve` replicas, with failures injected.

    python benchmarks/soak.py                        # 30 minutes, the embedded GGUF model
    python benchmarks/soak.py --duration 120 --tiny  # a short run on a tiny random model

Each of --concurrency workers loops over a random mix: plain and streaming chat completions,
structured output (a small JSON schema), streams the client drops after a few events, and bad
inputs (out-of-vocabulary token ids, malformed JSON, bad fields, an unknown model, a schema too
large for the budget) that must be 4xx. At 1/3 of the run the engine process of replica 0 is
killed with SIGKILL (hasten serve restarts it); at 2/3 the whole replica 1 is killed and started
again on the same port (as an orchestrator would). Afterwards:

- served: requests answered as expected (2xx for good requests, 4xx for bad inputs);
- unexpected 5xx: a 5xx (or an error event) outside the injected failures' windows (goal 0);
  failures inside a window (requests in flight when a process died) are counted on their own;
- lost: a request that got no answer at all within the client timeout (goal 0);
- RSS growth after warm-up of the gateway and of the replica that was never killed (goal < 5 %);
- KV blocks in use and requests running on each replica once the load stopped (goal 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _servers import find_gguf, stop_process  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
TOPICS = ["the sea", "a small robot", "coffee", "mountains", "a lost key", "trains", "the moon", "bread"]
FAILURE_WINDOW_S = 5.0  # requests that fail this soon after an injected kill are the kill's


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


@dataclass
class Replica:
    model: str
    port: int
    flags: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "hasten.cli", "serve", self.model, "--port", str(self.port),
               "--served-model-name", "soak", *self.flags]
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, cwd=ROOT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise SystemExit(f"replica on {self.port} exited; see {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"replica on {self.port} not ready; see {self.log}")

    def kill_all(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    kills: list[float] = field(default_factory=list)
    examples: dict[str, str] = field(default_factory=dict)

    def record(self, kind: str, started: float, detail: str = "") -> None:
        if kind in ("5xx", "error_event", "transport") and any(k - 60 <= started and time.monotonic() <= k
                                                               + FAILURE_WINDOW_S for k in self.kills):
            kind = f"{kind}_during_kill"
        self.outcomes[kind] += 1
        if detail and kind not in self.examples:
            self.examples[kind] = detail[:300]


def bad_requests(vocab: int) -> list[tuple[str, bytes]]:
    def chat(**extra: object) -> bytes:
        return json.dumps({"model": "soak", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                           **extra}).encode()

    big_enum = {"type": "object", "properties": {"x": {"enum": [f"v{i}" for i in range(100_000)]}}}
    return [
        ("oov_stop_token", chat(min_tokens=2, stop_token_ids=[vocab + 1])),
        ("oov_logit_bias", chat(logit_bias={str(vocab + 7): 3})),
        ("bad_json", b'{"model": "soak", "messages": [oops'),
        ("negative_max_tokens", chat(max_tokens=-3)),
        ("unknown_model", chat(model="nope")),
        ("bad_temperature", chat(temperature="hot")),
        ("schema_bomb", chat(response_format={"type": "json_schema",
                                              "json_schema": {"name": "x", "schema": big_enum}})),
    ]


async def worker(client: httpx.AsyncClient, url: str, stop_at: float, tally: Tally, rng: random.Random,
                 bad: list[tuple[str, bytes]], timeout: float) -> None:
    while time.monotonic() < stop_at:
        r = rng.random()
        topic = rng.choice(TOPICS)
        base = {"model": "soak", "messages": [{"role": "user", "content": f"Write two sentences about {topic}."}],
                "max_tokens": rng.randint(8, 48), "temperature": rng.choice([0, 0.7])}
        started = time.monotonic()
        try:
            if r < 0.15:
                name, body = rng.choice(bad)
                resp = await client.post(url, content=body, headers={"content-type": "application/json"},
                                         timeout=timeout)
                kind = "bad_input_4xx" if 400 <= resp.status_code < 500 else (
                    "5xx" if resp.status_code >= 500 else "bad_input_accepted")
                tally.record(kind, started, f"{name}: {resp.status_code} {resp.text[:200]}")
            elif r < 0.25:
                body = {**base, "response_format": {"type": "json_schema",
                                                    "json_schema": {"name": "person", "schema": SCHEMA}}}
                resp = await client.post(url, json=body, timeout=timeout)
                tally.record("ok" if resp.status_code == 200 else ("5xx" if resp.status_code >= 500 else "4xx"),
                             started, resp.text[:200])
            elif r < 0.55:
                drop = r < 0.35  # a client that goes away after a few events
                async with client.stream("POST", url, json={**base, "stream": True}, timeout=timeout) as resp:
                    if resp.status_code != 200:
                        await resp.aread()
                        tally.record("5xx" if resp.status_code >= 500 else "4xx", started, resp.text[:200])
                        continue
                    n, kind = 0, "stream_incomplete"
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {") and '"error"' in line:
                            kind = "error_event"
                            tally.examples.setdefault("error_event", line[:300])
                        elif line == "data: [DONE]":
                            kind = "ok" if kind != "error_event" else kind
                            break
                        n += 1
                        if drop and n >= 3:
                            kind = "disconnected"
                            break
                    tally.record(kind, started)
            else:
                resp = await client.post(url, json=base, timeout=timeout)
                tally.record("ok" if resp.status_code == 200 else ("5xx" if resp.status_code >= 500 else "4xx"),
                             started, resp.text[:200])
        except httpx.TimeoutException:
            tally.record("lost", started, "client timeout")
        except httpx.HTTPError as exc:
            tally.record("transport", started, repr(exc))


async def run_load(gw_url: str, duration: float, concurrency: int, tally: Tally, vocab: int, seed: int,
                   timeout: float) -> None:
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(limits=limits) as client:
        bad = bad_requests(vocab)
        stop_at = time.monotonic() + duration
        await asyncio.gather(*(worker(client, gw_url + "/v1/chat/completions", stop_at, tally,
                                      random.Random(seed + i), bad, timeout) for i in range(concurrency)))


def replica_state(r: Replica) -> dict[str, float]:
    text = httpx.get(r.url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("hasten:kv_cache_usage_perc", "hasten:num_requests_running", "hasten:num_requests_waiting",
                     "hasten:engine_restarts_total", "hasten:engine_request_failures_total"):
            if line.startswith(name):
                out[name.split(":")[1]] = out.get(name.split(":")[1], 0.0) + float(line.split()[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of load (default 1800)")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--tiny", action="store_true", help="a tiny random llama instead of the GGUF default")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra hasten serve flag (repeatable)")
    ap.add_argument("--timeout", type=float, default=120.0, help="client timeout per request (lost after it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the results here too")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hasten-soak-"))
    if args.tiny:
        from hasten.testing import make_tiny_model

        model = str(make_tiny_model(work / "tiny", arch="llama"))
        flags = ["--max-model-len", "512", "--num-kv-blocks", "256"]
    else:
        model = str(find_gguf())
        flags = ["--quantization", "gguf", "--kv-cache-dtype", "float16", "--max-model-len", "2048"]
    flags += ["-O", "num_threads=1", *args.serve_arg]
    replicas = [Replica(model, free_port(), flags, work / f"replica{i}.log") for i in range(2)]
    gw_port = free_port()
    cfg = {"listen": f"127.0.0.1:{gw_port}", "health": {"interval_s": 1.0},
           "models": [{"name": "soak", "policy": "least_outstanding", "backends": [{"url": r.url} for r in replicas]}]}
    (work / "gateway.yaml").write_text(json.dumps(cfg))
    gw = subprocess.Popen([sys.executable, "-m", "hasten.cli", "gateway", "--config", str(work / "gateway.yaml"),
                           "--log-level", "warning"], stdout=(work / "gateway.log").open("ab"),
                          stderr=subprocess.STDOUT, cwd=ROOT)
    tally = Tally()
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_ready()
        gw_url = f"http://127.0.0.1:{gw_port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(gw_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        vocab = 1 << 20  # token ids from here on are outside every vocabulary served here
        print(f"soak: {args.duration:.0f}s, {args.concurrency} workers, model {model}; logs in {work}", flush=True)

        async def sample_rss() -> None:  # the trend, not just two points
            while True:
                samples.append((round(time.monotonic() - t_start), rss_mb(gw.pid),
                                rss_mb(replicas[0].proc.pid)))  # type: ignore[union-attr]
                await asyncio.sleep(60)

        async def orchestrate() -> dict[str, float]:
            load = asyncio.create_task(run_load(gw_url, args.duration, args.concurrency, tally, vocab, args.seed,
                                                args.timeout))
            sampler = asyncio.create_task(sample_rss())
            warm = min(120.0, args.duration / 6)
            await asyncio.sleep(warm)
            base = {"gateway": rss_mb(gw.pid), "replica0_server": rss_mb(replicas[0].proc.pid)}  # type: ignore[union-attr]
            await asyncio.sleep(max(0.0, args.duration / 3 - warm))
            engines = children(replicas[0].proc.pid)  # type: ignore[union-attr]
            if engines:
                tally.kills.append(time.monotonic())
                os.kill(engines[0], signal.SIGKILL)
                print(f"  killed replica 0's engine process {engines[0]}", flush=True)
            await asyncio.sleep(args.duration / 3)
            tally.kills.append(time.monotonic())
            replicas[1].kill_all()
            print("  killed replica 1 (whole process group); starting it again", flush=True)
            replicas[1].start()
            await asyncio.to_thread(replicas[1].wait_ready)
            tally.kills.append(time.monotonic())  # requests refused while it came back are the kill's too
            await load
            sampler.cancel()
            return base

        samples: list[tuple[int, float, float]] = []
        t_start = time.monotonic()
        base = asyncio.run(orchestrate())
        time.sleep(3)
        end = {"gateway": rss_mb(gw.pid), "replica0_server": rss_mb(replicas[0].proc.pid)}  # type: ignore[union-attr]
        states = [replica_state(r) for r in replicas]
    finally:
        stop_process(gw)
        for r in replicas:
            r.kill_all()

    o = tally.outcomes
    good = o["ok"] + o["bad_input_4xx"] + o["disconnected"]
    results = {
        "duration_s": args.duration, "concurrency": args.concurrency, "model": model,
        "outcomes": dict(o), "served": good,
        "unexpected_5xx": o["5xx"] + o["error_event"] + o["transport"] + o["stream_incomplete"],
        "failed_during_kill": sum(v for k, v in o.items() if k.endswith("_during_kill")),
        "lost": o["lost"], "bad_input_accepted": o["bad_input_accepted"],
        "rss_mb_after_warmup": base, "rss_mb_end": end,
        "rss_growth_pct": {k: 100 * (end[k] - base[k]) / base[k] for k in base},
        "rss_mb_every_minute": [{"s": t, "gateway": g, "replica0_server": r} for t, g, r in samples],
        "replicas_at_end": states, "examples": tally.examples,
    }
    print(json.dumps(results, indent=2))
    print("\n| served | unexpected 5xx | failed in kill windows | lost | RSS growth gateway / replica 0 | "
          "KV in use at end (r0 / r1) |")
    print("|---|---|---|---|---|---|")
    g = results["rss_growth_pct"]
    print(f"| {good} | {results['unexpected_5xx']} | {results['failed_during_kill']} | {o['lost']} | "
          f"{g['gateway']:+.1f} % / {g['replica0_server']:+.1f} % | "
          f"{states[0].get('kv_cache_usage_perc', 0):.3f} / {states[1].get('kv_cache_usage_perc', 0):.3f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
