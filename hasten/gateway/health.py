"""Per-backend state: in-flight count, latency estimate, circuit breaker and active probes.

A backend is routable while active probes have not marked it down and its circuit breaker
lets traffic through. The breaker (passive ejection) opens after ``failure_threshold``
consecutive request failures (connect errors, timeouts, 5xx before the first byte, broken
streams); after ``cooldown_s`` it becomes half-open and admits exactly one trial request,
whose outcome closes or re-opens it.

Active probes mark a backend down only after ``unhealthy_threshold`` consecutive failed
probes, and up again after ``healthy_threshold`` good ones. A probe that could not connect
or timed out (within its own ``timeout_s``) is not counted while real requests to that
backend keep succeeding: a replica busy serving is slow to answer probes, not down. An
answer other than 200 always counts (a replica that says it is unhealthy, e.g. draining or
restarting its engine, is believed). Probes are sent on the pool's own idle connections, so
they add no connection to a backend that real traffic keeps connections open to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum

from hasten.gateway.config import BackendConfig, HealthConfig
from hasten.gateway.h1 import ProtocolError

log = logging.getLogger("hasten.gateway")


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class CircuitBreaker:
    failure_threshold: int = 3
    cooldown_s: float = 5.0
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    trial_in_flight: bool = False

    def allows(self, now: float) -> bool:
        """Whether a request may be sent now (does not reserve the half-open trial)."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            return now - self.opened_at >= self.cooldown_s
        return not self.trial_in_flight

    def on_attempt(self, now: float) -> None:
        if self.state is BreakerState.OPEN and now - self.opened_at >= self.cooldown_s:
            self.state = BreakerState.HALF_OPEN
        if self.state is BreakerState.HALF_OPEN:
            self.trial_in_flight = True

    def on_success(self) -> None:
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.trial_in_flight = False

    def on_failure(self, now: float) -> bool:
        """Record a failure; returns True when this transition opened the breaker."""
        self.trial_in_flight = False
        self.failures += 1
        if self.state is BreakerState.HALF_OPEN or self.failures >= self.failure_threshold:
            opened = self.state is not BreakerState.OPEN
            self.state = BreakerState.OPEN
            self.opened_at = now
            return opened
        return False


@dataclass
class BackendState:
    """Mutable runtime state of one backend of one pool."""

    config: BackendConfig
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    in_flight: int = 0
    probe_ok: bool = True
    probe_failures: int = 0  # consecutive failed probes
    probe_successes: int = 0  # consecutive good probes
    last_success: float = -1e18  # time.monotonic() of the last request that got a response
    latency_ms: float | None = None  # EWMA of probe RTT and time to first byte
    rr_current: float = 0.0

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def region(self) -> str | None:
        return self.config.region

    @property
    def weight(self) -> float:
        return self.config.weight

    def available(self, now: float | None = None) -> bool:
        return self.probe_ok and self.breaker.allows(time.monotonic() if now is None else now)

    def observe_latency(self, ms: float, alpha: float = 0.2) -> None:
        self.latency_ms = ms if self.latency_ms is None else (1 - alpha) * self.latency_ms + alpha * ms


ProbeFn = Callable[[str, str, float], Awaitable[int]]  # (backend url, path, timeout_s) -> status


class HealthChecker:
    """Actively probes ``GET <health.path>`` of every distinct backend URL through ``probe``."""

    def __init__(self, backends: list[BackendState], cfg: HealthConfig, probe: ProbeFn,
                 on_change: Callable[[BackendState, bool], None] | None = None) -> None:
        self._by_url: dict[str, list[BackendState]] = {}
        for b in backends:
            self._by_url.setdefault(b.url, []).append(b)
        self._cfg = cfg
        self._probe_fn = probe
        self._task: asyncio.Task[None] | None = None
        self._on_change = on_change
        self.rounds = 0  # probe rounds completed

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(url, states) for url, states in self._by_url.items()))

    async def _run(self) -> None:
        while True:
            try:
                await self.probe_all()
            except Exception:  # pragma: no cover - defensive: probing must never stop
                log.exception("health probe round failed")
            self.rounds += 1
            await asyncio.sleep(self._cfg.interval_s)

    async def _probe(self, url: str, states: list[BackendState]) -> None:
        cfg = self._cfg
        started = time.monotonic()
        t0 = time.perf_counter()
        status: int | None = None
        try:
            status = await self._probe_fn(url, cfg.path, cfg.timeout_s)
        except (OSError, TimeoutError, ValueError, ProtocolError, asyncio.IncompleteReadError):
            pass
        rtt_ms = (time.perf_counter() - t0) * 1000
        # real traffic answered since the previous probe round began: evidence the backend is up
        serving = max(b.last_success for b in states) >= started - cfg.interval_s - cfg.timeout_s
        for s in states:
            if status == 200:
                s.probe_failures = 0
                s.probe_successes += 1
                s.observe_latency(rtt_ms)
                if not s.probe_ok and s.probe_successes >= cfg.healthy_threshold:
                    self._set(s, url, True, "probe answered 200")
            elif status is None and serving:
                continue  # no answer, but its real requests are being answered: busy, not down
            else:
                s.probe_successes = 0
                s.probe_failures += 1
                if s.probe_ok and s.probe_failures >= cfg.unhealthy_threshold:
                    why = f"HTTP {status}" if status is not None else "no answer"
                    self._set(s, url, False, f"{s.probe_failures} failed probes in a row, the last: {why}")

    def _set(self, s: BackendState, url: str, ok: bool, why: str) -> None:
        log.warning("backend %s is now %s (active probe: %s)", url, "up" if ok else "down", why)
        s.probe_ok = ok
        if self._on_change is not None:
            self._on_change(s, ok)
