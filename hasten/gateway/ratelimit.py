"""Rate limits: requests/min, tokens/min and concurrent requests, per tenant and per model.

Every limit is checked and taken in one atomic step, for all the limits that apply to a
request at once: either all are taken or none is. Two kinds:

* ``window``: a sliding 60 s log of (member, cost). rpm has cost 1 per request; tpm has
  cost prompt tokens + max_tokens at admission, corrected to the real usage at the end
  (:meth:`LimitStore.adjust`). Sliding logs are exact, so a limit holds to the request.
* ``concurrency``: a set of leases (member -> expiry); released at the end of the request.
  The lease expiry (5 min) frees slots held by a gateway instance that died.

:class:`MemoryLimitStore` keeps state in this process (one event loop: trivially atomic);
:class:`hasten.gateway.redis_store.RedisLimitStore` runs the same algorithm as a Lua script
inside Redis, so that any number of gateway instances share one limit.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from hasten.gateway.govconfig import LimitConfig

WINDOW_S = 60.0
LEASE_S = 300.0


@dataclass(frozen=True)
class LimitSpec:
    key: str
    kind: str  # "window" | "concurrency"
    limit: int
    cost: int


@dataclass
class Decision:
    ok: bool
    retry_after_s: float = 0.0
    failed: LimitSpec | None = None


class LimitStore(Protocol):
    async def acquire(self, specs: list[LimitSpec], member: str) -> Decision: ...
    async def adjust(self, keys: list[str], member: str, cost: int) -> None: ...
    async def release(self, keys: list[str], member: str) -> None: ...
    async def close(self) -> None: ...


def specs_for(scope: str, name: str, limits: LimitConfig, tokens: int) -> list[LimitSpec]:
    """The limits of one tenant (``scope`` "t") or one model (``scope`` "m") for a request."""
    base = f"hasten:rl:{scope}:{name}"
    out: list[LimitSpec] = []
    if limits.rpm is not None:
        out.append(LimitSpec(f"{base}:rpm", "window", limits.rpm, 1))
    if limits.tpm is not None:
        out.append(LimitSpec(f"{base}:tpm", "window", limits.tpm, tokens))
    if limits.concurrency is not None:
        out.append(LimitSpec(f"{base}:conc", "concurrency", limits.concurrency, 1))
    return out


@dataclass
class _Window:
    log: deque[tuple[float, str]] = field(default_factory=deque)
    costs: dict[str, int] = field(default_factory=dict)
    total: int = 0

    def expire(self, now: float) -> None:
        cutoff = now - WINDOW_S
        log = self.log
        while log and log[0][0] <= cutoff:
            _, member = log.popleft()
            self.total -= self.costs.pop(member, 0)

    def retry_after(self, now: float, cost: int, limit: int) -> float:
        if cost > limit:
            return WINDOW_S
        need = self.total + cost - limit
        freed = 0
        for ts, member in self.log:
            freed += self.costs.get(member, 0)
            if freed >= need:
                return max(0.001, ts + WINDOW_S - now)
        return WINDOW_S


class MemoryLimitStore:
    """In-process limits (one gateway instance)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._windows: dict[str, _Window] = {}
        self._leases: dict[str, dict[str, float]] = {}

    def acquire_now(self, specs: list[LimitSpec], member: str) -> Decision:
        now = self._clock()
        for spec in specs:
            if spec.kind == "concurrency":
                leases = self._leases.setdefault(spec.key, {})
                for m in [m for m, exp in leases.items() if exp <= now]:
                    del leases[m]
                if len(leases) + spec.cost > spec.limit:
                    return Decision(False, 1.0, spec)
            else:
                w = self._windows.setdefault(spec.key, _Window())
                w.expire(now)
                if w.total + spec.cost > spec.limit:
                    return Decision(False, w.retry_after(now, spec.cost, spec.limit), spec)
        for spec in specs:
            if spec.kind == "concurrency":
                self._leases[spec.key][member] = now + LEASE_S
            else:
                w = self._windows[spec.key]
                w.log.append((now, member))
                w.costs[member] = spec.cost
                w.total += spec.cost
        return Decision(True)

    async def acquire(self, specs: list[LimitSpec], member: str) -> Decision:
        return self.acquire_now(specs, member)

    async def adjust(self, keys: list[str], member: str, cost: int) -> None:
        self.adjust_now(keys, member, cost)

    def adjust_now(self, keys: list[str], member: str, cost: int) -> None:
        for key in keys:
            w = self._windows.get(key)
            if w is not None and member in w.costs:
                w.total += cost - w.costs[member]
                w.costs[member] = cost

    async def release(self, keys: list[str], member: str) -> None:
        self.release_now(keys, member)

    def release_now(self, keys: list[str], member: str) -> None:
        for key in keys:
            self._leases.get(key, {}).pop(member, None)

    async def close(self) -> None:
        return None

    def usage(self, key: str) -> int:
        """Current use of a limit (tests and metrics)."""
        if key in self._leases:
            return len(self._leases[key])
        w = self._windows.get(key)
        if w is None:
            return 0
        w.expire(self._clock())
        return w.total


def estimate_tokens(text: str) -> int:
    """A tokenizer-free estimate (about 4 characters per token for English)."""
    return (len(text) + 3) // 4
