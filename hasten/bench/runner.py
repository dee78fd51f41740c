"""Drive one load point against one server.

Load shapes (as in `vllm bench serve`):
- closed loop: `concurrency` clients, each sends its next request when the previous ends;
- open loop: arrivals with gamma-distributed gaps (shape = burstiness, mean = 1/rate;
  burstiness 1 is Poisson), optionally capped at `concurrency` requests in flight.
Every run stops by itself: after `len(specs)` requests or `max_duration` seconds of
dispatching, whichever comes first; requests still running `drain_timeout` seconds after
that are cancelled and reported as `deadline` errors.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from dataclasses import dataclass

from hasten.bench.client import BenchClient
from hasten.bench.datasets import RequestSpec
from hasten.bench.metrics import RequestResult


@dataclass(frozen=True)
class LoadPoint:
    """One load level. `request_rate=inf` with a concurrency is a closed loop."""

    label: str
    concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0

    @property
    def closed_loop(self) -> bool:
        return math.isinf(self.request_rate)

    def describe(self) -> str:
        if self.closed_loop:
            return f"concurrency {self.concurrency}" if self.concurrency else "all at once"
        cap = f", max {self.concurrency} in flight" if self.concurrency else ""
        return f"{self.request_rate:.3g} req/s (burstiness {self.burstiness:g}{cap})"


@dataclass
class RunResult:
    point: LoadPoint
    target: str
    results: list[RequestResult]
    duration: float
    started_at: float = 0.0  # perf_counter() at the first dispatch

    def merged_with(self, other: RunResult) -> RunResult:
        """Pool two runs of the same point (interleaved rounds): durations add up."""
        return RunResult(self.point, self.target, self.results + other.results,
                         self.duration + other.duration, min(self.started_at, other.started_at))


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s from start) for an open loop: gamma gaps, shape k = burstiness,
    scale 1/(rate*k), hence mean 1/rate and CV^2 = 1/k. Infinite rate: all at 0."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


class Progress:
    """Progress on stderr: a one-line bar on a terminal; elsewhere (a log file, CI) a status line every
    `interval` seconds and one at the end. `enabled`: True forces the bar, False shows nothing."""

    def __init__(self, total: int, label: str, enabled: bool | None = None, interval: float = 10.0) -> None:
        self.total, self.label, self.done, self.failed = total, label, 0, 0
        if enabled is None:
            self.mode = "bar" if sys.stderr.isatty() else "lines"
        else:
            self.mode = "bar" if enabled else "off"
        self.interval = interval
        self._t0 = time.perf_counter()
        self._last = self._t0

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = time.perf_counter()
        if self.mode == "bar" and (now - self._last > 0.1 or self.done == self.total):
            self._last = now
            self.draw(now)
        elif self.mode == "lines" and now - self._last >= self.interval:
            self._last = now
            self.status_line(now)

    def _rate(self, now: float) -> float:
        return self.done / max(now - self._t0, 1e-9)

    def draw(self, now: float) -> None:
        width = 30
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        fail = f" {self.failed} failed" if self.failed else ""
        sys.stderr.write(f"\r{self.label[:38]:<38} [{bar}] {self.done}/{self.total} {self._rate(now):6.2f} req/s{fail}")
        sys.stderr.flush()

    def status_line(self, now: float) -> None:
        fail = f", {self.failed} failed" if self.failed else ""
        sys.stderr.write(f"{self.label}: {self.done}/{self.total} requests done after {now - self._t0:.0f}s "
                         f"({self._rate(now):.2f} req/s{fail})\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.mode == "bar":
            self.draw(time.perf_counter())
            sys.stderr.write("\n")
            sys.stderr.flush()
        elif self.mode == "lines":
            self.status_line(time.perf_counter())


@dataclass
class RunOptions:
    max_duration: float = math.inf  # seconds of dispatching
    drain_timeout: float = 60.0  # extra seconds for in-flight requests after max_duration
    ramp_up: float = 0.0  # closed loop: start the N clients evenly spread over this many seconds
    seed: int = 0
    progress: bool | None = None  # None: only on a terminal


async def run_load(client: BenchClient, specs: list[RequestSpec], point: LoadPoint,
                   opts: RunOptions | None = None, label: str = "") -> RunResult:
    """Send `specs` with the load shape of `point`; return every request's measurements."""
    opts = opts or RunOptions()
    n = len(specs)
    results: list[RequestResult | None] = [None] * n
    done_events = [asyncio.Event() for _ in range(n)]
    progress = Progress(n, label or f"{client.target.name} {point.describe()}", opts.progress)
    start = time.perf_counter()
    deadline = start + opts.max_duration
    sem = asyncio.Semaphore(point.concurrency) if point.concurrency else None
    in_flight: set[int] = set()

    async def one(i: int) -> None:
        spec = specs[i]
        try:
            if spec.depends_on is not None:
                await done_events[spec.depends_on].wait()
            if time.perf_counter() > deadline:
                return
            in_flight.add(i)
            res = await client.send(i, spec)
            in_flight.discard(i)
            results[i] = res
            progress.update(res.success)
        finally:
            done_events[i].set()

    async def closed_worker(queue: list[int], delay: float) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        while queue and time.perf_counter() <= deadline:
            await one(queue.pop())

    async def open_loop(tasks: list[asyncio.Task[None]]) -> None:
        offsets = arrival_offsets(n, point.request_rate, point.burstiness, opts.seed)

        async def gated(i: int) -> None:
            if sem is None:
                return await one(i)
            async with sem:
                return await one(i)

        for i, offset in enumerate(offsets):
            delay = start + offset - time.perf_counter()
            if start + offset > deadline:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(gated(i)))

    tasks: list[asyncio.Task[None]] = []
    if point.closed_loop and point.concurrency:
        queue = list(range(n - 1, -1, -1))  # pop() from the end = in order
        workers = min(point.concurrency, n)
        tasks = [asyncio.create_task(closed_worker(queue, opts.ramp_up * k / workers)) for k in range(workers)]
    else:
        await open_loop(tasks)
    if tasks:
        hard_stop = None if math.isinf(opts.max_duration) else max(0.0, deadline + opts.drain_timeout
                                                                   - time.perf_counter())
        _, pending = await asyncio.wait(tasks, timeout=hard_stop)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    end = time.perf_counter()
    progress.close()
    final: list[RequestResult] = [client.finalize(r) for r in results if r is not None]
    for i in sorted(in_flight):  # cancelled at the hard time bound
        final.append(RequestResult(index=i, start=end, end=end, error="deadline",
                                   error_detail="cancelled: still running at the time bound"))
    last = max((r.end for r in final if r.end), default=end)
    return RunResult(point, client.target.name, final, duration=max(last, start) - start, started_at=start)


async def warm_up(client: BenchClient, specs: list[RequestSpec], concurrency: int | None) -> None:
    """Send warm-up requests (results discarded) so connections and caches are warm."""
    if specs:
        point = LoadPoint("warmup", concurrency=max(1, min(concurrency or len(specs), len(specs))))
        await run_load(client, specs, point, RunOptions(progress=False))
