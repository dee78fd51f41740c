"""Priority classes, a bounded admission queue, fair sharing, and load shedding.

At most ``max_in_flight`` requests run at once. The others wait in a queue ordered by
class (interactive, then batch, then sheddable) and, within a class, shared fairly
between tenants: the next slot goes to the tenant of that class with the fewest requests
running, and within one tenant to the earliest deadline.

Shedding, always lowest class first:

* on arrival, the expected queueing delay (requests ahead of this one divided by the
  measured completion rate) is compared with the class's ``max_wait_ms``; a request that
  would wait longer is refused at once with 503, instead of timing out later;
* when the queue is full, an arriving request evicts the worst queued one (lowest class,
  latest deadline) if that one is of a lower class; otherwise the arrival is refused;
* a queued request whose deadline passes is removed with 503.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hasten.gateway.govconfig import PRIORITIES, AdmissionConfig
from hasten.gateway.pipeline import GatewayError

RANK = {name: i for i, name in enumerate(PRIORITIES)}


def overloaded(message: str, retry_after_s: float = 1.0) -> GatewayError:
    return GatewayError(503, message, "server_error", "overloaded",
                        headers={"retry-after": str(max(1, round(retry_after_s)))})


@dataclass(order=True)
class _Waiter:
    deadline: float
    seq: int
    tenant: str = field(compare=False)
    rank: int = field(compare=False)
    future: asyncio.Future[None] = field(compare=False)


class AdmissionQueue:
    def __init__(self, cfg: AdmissionConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self._clock = clock
        self.in_flight = 0
        self._running: dict[str, int] = {}
        # rank -> tenant -> waiters in deadline order (lists kept sorted; queues are small)
        self._queues: list[dict[str, list[_Waiter]]] = [{} for _ in PRIORITIES]
        self._queued = 0
        self._seq = 0
        self._rate = 0.0  # completions per second (EWMA)
        self._last_done = 0.0
        self.shed: dict[str, int] = dict.fromkeys(PRIORITIES, 0)
        self.admitted: dict[str, int] = dict.fromkeys(PRIORITIES, 0)
        self.wait_s: dict[str, float] = dict.fromkeys(PRIORITIES, 0.0)
        self._timer: asyncio.TimerHandle | None = None
        self._served_at: dict[str, int] = {}
        self._tick = 0

    @property
    def enabled(self) -> bool:
        return self.cfg.max_in_flight > 0

    @property
    def queued(self) -> int:
        return self._queued

    def expected_wait_s(self, rank: int) -> float:
        ahead = sum(len(w) for q in self._queues[: rank + 1] for w in q.values())
        if ahead == 0 and self.in_flight < self.cfg.max_in_flight:
            return 0.0
        rate = self._rate or 1.0
        return (ahead + 1) / rate

    async def admit(self, tenant: str, klass: str) -> None:
        """Wait for a slot (or raise 503); the caller must call :meth:`release` afterwards."""
        rank = RANK[klass]
        now = self._clock()
        if self.in_flight < self.cfg.max_in_flight and self._queued == 0:
            self._start(tenant, klass)
            return
        budget = self.cfg.max_wait_ms[klass] / 1000.0
        expect = self.expected_wait_s(rank)
        if expect > budget:
            self.shed[klass] += 1
            raise overloaded(f"overloaded: expected queueing delay {expect * 1000:.0f} ms exceeds the "
                             f"{klass} budget of {budget * 1000:.0f} ms", expect)
        if self._queued >= self.cfg.max_queue and not self._evict_below(rank):
            self.shed[klass] += 1
            raise overloaded("overloaded: admission queue full", expect)
        self._seq += 1
        waiter = _Waiter(now + budget, self._seq, tenant, rank, asyncio.get_running_loop().create_future())
        lst = self._queues[rank].setdefault(tenant, [])
        lst.append(waiter)
        lst.sort()
        self._queued += 1
        self._arm_timer()
        try:
            await waiter.future
        except asyncio.CancelledError:
            if not waiter.future.done() or waiter.future.cancelled():
                self._remove(waiter)
            elif waiter.future.exception() is None:  # got a slot just as it was cancelled
                self.release(tenant)
            raise
        self.wait_s[klass] += self._clock() - now

    def _start(self, tenant: str, klass: str) -> None:
        self._tick += 1
        self._served_at[tenant] = self._tick
        self.in_flight += 1
        self._running[tenant] = self._running.get(tenant, 0) + 1
        self.admitted[klass] += 1

    def release(self, tenant: str) -> None:
        self.in_flight -= 1
        n = self._running.get(tenant, 1) - 1
        if n:
            self._running[tenant] = n
        else:
            self._running.pop(tenant, None)
        now = self._clock()
        if self._last_done:
            dt = max(now - self._last_done, 1e-4)
            self._rate = 0.9 * self._rate + 0.1 * (1.0 / dt) if self._rate else 1.0 / dt
        self._last_done = now
        self._dispatch()

    def _dispatch(self) -> None:
        while self.in_flight < self.cfg.max_in_flight and self._queued:
            waiter = self._pop_next()
            if waiter is None:
                return
            self._start(waiter.tenant, PRIORITIES[waiter.rank])
            waiter.future.set_result(None)

    def _pop_next(self) -> _Waiter | None:
        for q in self._queues:
            if not q:
                continue
            # fair share: the tenant with the fewest running requests, then round robin (the one
            # served longest ago), then the earliest deadline
            tenant = min(q, key=lambda t: (self._running.get(t, 0), self._served_at.get(t, 0), q[t][0]))
            self._tick += 1
            self._served_at[tenant] = self._tick
            lst = q[tenant]
            waiter = lst.pop(0)
            if not lst:
                del q[tenant]
            self._queued -= 1
            return waiter
        return None

    def _remove(self, waiter: _Waiter) -> None:
        q = self._queues[waiter.rank]
        lst = q.get(waiter.tenant)
        if lst and waiter in lst:
            lst.remove(waiter)
            self._queued -= 1
            if not lst:
                del q[waiter.tenant]

    def _evict_below(self, rank: int) -> bool:
        for r in range(len(self._queues) - 1, rank, -1):
            q = self._queues[r]
            if not q:
                continue
            tenant = max(q, key=lambda t: q[t][-1])
            victim = q[tenant][-1]
            self._remove(victim)
            self.shed[PRIORITIES[r]] += 1
            victim.future.set_exception(overloaded("overloaded: shed for a higher-priority request"))
            return True
        return False

    def _arm_timer(self) -> None:
        if self._timer is not None:
            return
        self._timer = asyncio.get_running_loop().call_later(0.05, self._expire)

    def _expire(self) -> None:
        self._timer = None
        now = self._clock()
        for r, q in enumerate(self._queues):
            for lst in list(q.values()):
                for waiter in [w for w in lst if w.deadline <= now]:
                    self._remove(waiter)
                    self.shed[PRIORITIES[r]] += 1
                    waiter.future.set_exception(overloaded("overloaded: queueing deadline passed"))
        if self._queued:
            self._arm_timer()
