"""Per-backend state: in-flight count, latency estimate, circuit breaker and active probes.

A backend is routable when its last active probe succeeded (or none has run yet) and its
circuit breaker lets traffic through. The breaker opens after ``failure_threshold``
consecutive request failures (connect errors, timeouts, 5xx before the first byte,
broken streams); after ``cooldown_s`` it becomes half-open and admits exactly one trial
request, whose outcome closes or re-opens it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from hasten.gateway.config import BackendConfig, HealthConfig
from hasten.gateway.upstream import probe

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


class HealthChecker:
    """Actively probes ``GET <health.path>`` of every distinct backend URL."""

    def __init__(self, backends: list[BackendState], cfg: HealthConfig,
                 on_change: Callable[[BackendState, bool], None] | None = None) -> None:
        self._by_url: dict[str, list[BackendState]] = {}
        for b in backends:
            self._by_url.setdefault(b.url, []).append(b)
        self._cfg = cfg
        self._task: asyncio.Task[None] | None = None
        self._on_change = on_change

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
            await asyncio.sleep(self._cfg.interval_s)

    async def _probe(self, url: str, states: list[BackendState]) -> None:
        cfg = states[0].config
        start = time.perf_counter()
        try:
            ok = await probe(cfg.host, cfg.port, self._cfg.path, self._cfg.timeout_s) == 200
        except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            ok = False
        rtt_ms = (time.perf_counter() - start) * 1000
        for s in states:
            if s.probe_ok != ok:
                log.warning("backend %s is now %s (active probe)", url, "up" if ok else "down")
                if self._on_change is not None:
                    self._on_change(s, ok)
            s.probe_ok = ok
            if ok:
                s.observe_latency(rtt_ms)
