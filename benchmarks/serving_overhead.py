"""How much throughput does the HTTP server cost? Offline engine vs 64 streaming clients.

Runs the same requests (same prompts, greedy, `ignore_eos`, fixed max_tokens, so both
sides generate exactly the same number of tokens) twice:

1. offline: `LLM(model, **options).generate(prompts, params)` in this process;
2. served: `hasten serve MODEL` in a child process with the same options, driven by
   `--clients` concurrent streaming clients (aiohttp, one request at a time each).

in interleaved rounds (both engines stay loaded; a noisy neighbour hits both sides alike)
and prints output tokens/s for both and the ratio of the best rounds (target >= 0.90).

    python benchmarks/serving_overhead.py                      # default model (SmolLM2-135M)
    python benchmarks/serving_overhead.py --tiny               # a tiny random model: a quick smoke run
    python benchmarks/serving_overhead.py --max-tokens 64 --requests 128 -O dtype=bfloat16
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import gc
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORDS = ("the model serves tokens quickly while the scheduler batches many requests from clients who wait "
         "for answers about science history music code and the weather").split()


def make_prompts(count: int, prompt_words: int) -> list[str]:
    """Deterministic, distinct prompts (distinct so prefix caching does not flatter either side)."""
    prompts = []
    for i in range(count):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(prompt_words)]
        prompts.append(f"Request {i}: " + " ".join(words))
    return prompts


@dataclass
class Side:
    name: str
    seconds: float
    output_tokens: int
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    itl_p50: float | None = None
    cpu: dict[str, float] | None = None  # CPU seconds by process (Linux only)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


class Offline:
    """The engine loaded once in this process; `run()` times one `generate` over all prompts."""

    def __init__(self, model: str | None, options: dict, prompts: list[str], max_tokens: int) -> None:
        from hasten import LLM, SamplingParams

        self.llm = LLM(model=model, **options)
        self.prompts = prompts
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.llm.generate(prompts[: min(4, len(prompts))], self.params)  # warm-up

    def run(self) -> Side:
        gc.collect()
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        outs = self.llm.generate(self.prompts, self.params)
        seconds = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        ttfts = sorted(o.metrics.ttft for o in outs if o.metrics and o.metrics.ttft is not None)
        side = Side("offline", seconds, tokens, cpu={"engine": round(time.process_time() - cpu0, 3)})
        if ttfts:
            side.ttft_p50, side.ttft_p99 = _pct(ttfts, 50), _pct(ttfts, 99)
        return side


def _pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    """Child processes started by any thread of `pid`."""
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, options: dict, serve_args: list[str], port: int,
                 log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hasten.cli", "serve"] + ([model] if model else [])
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *serve_args]
    for key, value in options.items():
        cmd += ["-O", f"{key}={value!r}"]
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


async def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError("server exited during start-up")
            try:
                async with session.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError("server not ready in time")


async def _drive(url: str, prompts: list[str], clients: int, max_tokens: int) -> Side:
    import aiohttp

    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    tokens = 0
    ttfts: list[float] = []
    itls: list[float] = []

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal tokens
        while not queue.empty():
            prompt = queue.get_nowait()
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            start = last = time.perf_counter()
            first = True
            async with session.post(url + "/v1/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    now = time.perf_counter()
                    if b'"usage":{' in line:  # the final usage chunk: exact token count
                        tokens += json.loads(line[6:])["usage"]["completion_tokens"]
                        continue
                    if first:
                        ttfts.append(now - start)
                        first = False
                    else:
                        itls.append(now - last)
                    last = now

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        seconds = time.perf_counter() - t0
    side = Side(f"served ({clients} streaming clients)", seconds, tokens)
    if ttfts:
        side.ttft_p50, side.ttft_p99 = _pct(ttfts, 50), _pct(ttfts, 99)
    if itls:
        side.itl_p50 = statistics.median(itls)
    return side


class Served:
    """`hasten serve` in a child process with the same model and options."""

    def __init__(self, model: str | None, options: dict, serve_args: list[str], startup_timeout: float) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.gettempdir()) / f"hasten-serving-overhead-{self.port}.log"
        self.proc = start_server(model, options, serve_args, self.port, self.log_path)
        try:
            asyncio.run(_wait_ready(self.url, self.proc, startup_timeout))
        except BaseException:
            self.close()
            raise

    def run(self, prompts: list[str], clients: int, max_tokens: int) -> Side:
        pids = {"http": self.proc.pid}
        for i, child in enumerate(_children(self.proc.pid)):
            pids["engine" if i == 0 else f"child{i}"] = child
        before = {k: _cpu_seconds(p) for k, p in pids.items()}
        client_before = time.process_time()
        try:
            side = asyncio.run(_drive(self.url, prompts, clients, max_tokens))
            side.cpu = {k: round(_cpu_seconds(p) - before[k], 3) for k, p in pids.items()}
            side.cpu["client"] = round(time.process_time() - client_before, 3)
            return side
        except BaseException:
            print(self.log_path.read_text()[-4000:], file=sys.stderr)
            raise

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def cpu_ratio(offline: Side, served: Side) -> float | None:
    """CPU the offline engine needed / CPU the server needed (engine + HTTP, without the clients)."""
    if not offline.cpu or not served.cpu:
        return None
    spent = sum(v for k, v in served.cpu.items() if k != "client")
    return offline.cpu["engine"] / spent if spent else None


def parse_options(items: list[str]) -> dict:
    options = {}
    for item in items:
        key, _, raw = item.partition("=")
        try:
            options[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            options[key] = raw
    return options


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or .gguf (default: the embedded SmolLM2-135M)")
    p.add_argument("--tiny", action="store_true", help="use a tiny random llama (hasten.testing) instead")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=None,
                   help="total requests (default: = clients, so both sides run the same batch)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("-O", "--option", action="append", default=[], metavar="KEY=VALUE",
                   help="engine option for both sides (e.g. -O max_num_seqs=64 -O dtype=bfloat16)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved offline/served rounds; best of each")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `hasten serve` (e.g. --serve-arg=--engine-mode=process)")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)

    options = {"max_num_seqs": args.clients, **parse_options(args.option)}
    model = args.model
    tmp = None
    if args.tiny:
        from hasten.testing import make_tiny_model

        tmp = tempfile.TemporaryDirectory()
        model = str(make_tiny_model(Path(tmp.name) / "tiny", arch="llama"))
    prompts = make_prompts(args.requests or args.clients, args.prompt_words)

    offline_engine = Offline(model, options, prompts, args.max_tokens)
    server = Served(model, options, args.serve_arg, args.startup_timeout)
    rounds: list[tuple[Side, Side]] = []
    try:
        server.run(prompts[: min(4, len(prompts))], min(4, args.clients), args.max_tokens)  # warm-up
        for _ in range(args.rounds):  # interleaved, so a noisy neighbour hits both sides alike
            rounds.append((offline_engine.run(), server.run(prompts, args.clients, args.max_tokens)))
    finally:
        server.close()

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}ms"

    print(f"model={model or 'default'} options={options} serve_args={args.serve_arg} requests={len(prompts)} "
          f"max_tokens={args.max_tokens} rounds={args.rounds}")
    print(f"{'round':<6}{'side':<34}{'seconds':>9}{'tokens':>9}{'tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'ITL p50':>10}  CPU seconds")
    for i, pair in enumerate(rounds):
        for side in pair:
            cpu = " ".join(f"{k}={v:.2f}" for k, v in (side.cpu or {}).items())
            print(f"{i:<6}{side.name:<34}{side.seconds:>9.2f}{side.output_tokens:>9}{side.tokens_per_s:>10.1f}"
                  f"{ms(side.ttft_p50):>10}{ms(side.ttft_p99):>10}{ms(side.itl_p50):>10}  {cpu}")
    best_off = max(r[0].tokens_per_s for r in rounds)
    best_srv = max(r[1].tokens_per_s for r in rounds)
    ratio = best_srv / best_off
    per_round = [r[1].tokens_per_s / r[0].tokens_per_s for r in rounds]
    verdict = "PASS" if ratio >= 0.9 else "FAIL"
    print(f"served/offline output tokens/s (best of {args.rounds} each) = {ratio:.3f}  ({verdict}: target >= 0.90); "
          f"per round: {', '.join(f'{r:.3f}' for r in per_round)}")
    cpu_ratios = [cpu_ratio(a, b) for a, b in rounds]
    if all(r is not None for r in cpu_ratios):
        print("CPU efficiency (offline engine CPU / served engine+HTTP CPU, robust to noisy neighbours): "
              + ", ".join(f"{r:.3f}" for r in cpu_ratios if r is not None))
    if any(a.output_tokens != b.output_tokens for a, b in rounds):
        print("warning: token counts differ between the sides")
    if args.json:
        args.json.write_text(json.dumps({"rounds": [[asdict(a), asdict(b)] for a, b in rounds], "ratio": ratio,
                                         "per_round": per_round, "cpu_ratios": cpu_ratios, "options": options,
                                         "serve_args": args.serve_arg, "model": model or "default"}, indent=2))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
