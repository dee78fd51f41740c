"""SLO control: attainment and error-budget burn rate from observed TTFT/TPOT, and degradation.

Each objective (per route and/or tenant) counts, in one-second buckets over ``window_s``,
requests that met both latency objectives ("good") and all requests. Attainment is
good/total; the burn rate is (1 - attainment) / (1 - target): 1.0 spends the error budget
exactly as fast as allowed, 2.0 twice as fast.

The degradation level moves one step at a time with hysteresis: it goes up when the burn
rate is above ``burn_degrade`` and down when it is below ``burn_recover`` (lower), and at
most once per ``step_s``. Level n applies the first n entries of ``degrade``, in order:
``route_small`` (send the route's requests to ``small_model``), ``cap_max_tokens`` (clamp
``max_tokens`` to ``max_tokens_cap``), ``shed_sheddable`` (refuse the sheddable class).
Too few requests in the window (``min_requests``) never changes the level.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hasten.gateway.govconfig import SloConfig


@dataclass
class SloState:
    cfg: SloConfig
    buckets: deque[list[float]] = field(default_factory=deque)  # [second, good, total]
    level: int = 0
    changed_at: float = float("-inf")
    transitions: int = 0

    def matches(self, model: str | None, tenant: str | None) -> bool:
        return ((self.cfg.model is None or self.cfg.model == model)
                and (self.cfg.tenant is None or self.cfg.tenant == tenant))

    def _trim(self, now: float) -> None:
        cutoff = now - self.cfg.window_s
        while self.buckets and self.buckets[0][0] <= cutoff:
            self.buckets.popleft()

    def add(self, good: bool, now: float) -> None:
        sec = float(int(now))
        if not self.buckets or self.buckets[-1][0] != sec:
            self.buckets.append([sec, 0.0, 0.0])
        b = self.buckets[-1]
        b[1] += 1.0 if good else 0.0
        b[2] += 1.0

    def counts(self, now: float) -> tuple[float, float]:
        self._trim(now)
        return sum(b[1] for b in self.buckets), sum(b[2] for b in self.buckets)

    def attainment(self, now: float) -> float:
        good, total = self.counts(now)
        return good / total if total else 1.0

    def burn_rate(self, now: float) -> float:
        return (1.0 - self.attainment(now)) / (1.0 - self.cfg.target)

    @property
    def active(self) -> tuple[str, ...]:
        return self.cfg.degrade[: self.level]


class SloController:
    def __init__(self, slos: tuple[SloConfig, ...], clock: Callable[[], float] = time.monotonic) -> None:
        self.states = [SloState(s) for s in slos]
        self._clock = clock

    def observe(self, model: str | None, tenant: str | None, ttft_s: float, tpot_s: float | None) -> None:
        now = self._clock()
        for st in self.states:
            if not st.matches(model, tenant):
                continue
            good = st.cfg.ttft_ms is None or ttft_s * 1000 <= st.cfg.ttft_ms
            if good and st.cfg.tpot_ms is not None and tpot_s is not None:
                good = tpot_s * 1000 <= st.cfg.tpot_ms
            st.add(good, now)
        self.evaluate(now)

    def evaluate(self, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        for st in self.states:
            _, total = st.counts(now)
            if total < st.cfg.min_requests or now - st.changed_at < st.cfg.step_s:
                continue
            burn = st.burn_rate(now)
            if burn > st.cfg.burn_degrade and st.level < len(st.cfg.degrade):
                st.level += 1
            elif burn < st.cfg.burn_recover and st.level > 0:
                st.level -= 1
            else:
                continue
            st.changed_at = now
            st.transitions += 1

    def degradations(self, model: str | None, tenant: str | None) -> list[tuple[str, SloConfig]]:
        """The active degradations for a request, each with the objective that asked for it."""
        out: list[tuple[str, SloConfig]] = []
        for st in self.states:
            if st.level and st.matches(model, tenant):
                out.extend((d, st.cfg) for d in st.active)
        return out
