"""Engine supervision: restart a failed engine, report a stalled one, give up after too many failures.

The server builds its engine once at start-up (`ServerState.load`); from then on an
`EngineSupervisor` task checks it a few times a second:

* **failed** (the engine thread or process died, or its step raised): the engine has already
  ended every in-flight request with an error; the server answers 503 at once, the old engine
  is shut down and a new one is built from the same factory (weights reloaded, prefix cache
  empty). `hasten:engine_restarts_total` counts the restarts.
* **bounded**: after more than `max_restarts` failures within `restart_window_s` seconds the
  supervisor gives up and the server exits non-zero, so systemd or Kubernetes restarts it.
* **stalled** (requests in flight and no step finished for `watchdog_s` seconds): `/health`
  answers 503 and a line is logged; it turns healthy again when steps resume.

An engine is anything with `errored` (None while healthy), `progress_at` (time.monotonic() of its
last step or idle moment), `num_pending` (requests in flight) and `shutdown()`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("hasten.server")


@dataclass(frozen=True)
class SupervisionConfig:
    max_restarts: int = 5  # failures tolerated within the window; one more and the server exits
    restart_window_s: float = 300.0
    watchdog_s: float = 60.0  # requests in flight and no step for this long: unhealthy
    check_interval_s: float = 0.1
    shutdown_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError("max_restarts must be >= 0")
        if self.restart_window_s <= 0 or self.watchdog_s <= 0 or self.check_interval_s <= 0:
            raise ValueError("restart_window_s, watchdog_s and check_interval_s must be positive")


def engine_failure(engine: Any) -> str | None:
    err = getattr(engine, "errored", None)
    return None if err is None else str(err) or type(err).__name__


class EngineSupervisor:
    def __init__(self, config: SupervisionConfig, engine: Any, build: Callable[[], Awaitable[Any]],
                 install: Callable[[Any], None], on_down: Callable[[str], None],
                 give_up: Callable[[str], None], on_restart: Callable[[], None]) -> None:
        self.config = config
        self.engine = engine
        self._build = build  # builds and starts a new engine (blocking parts in a thread)
        self._install = install  # hands a started engine to the server
        self._on_down = on_down  # the server must answer 503 from now until install
        self._give_up = give_up
        self._on_restart = on_restart
        self._failures: deque[float] = deque()
        self.restarting = False
        self.stalled = False
        self.restarts = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def healthy(self) -> bool:
        return not self.restarting and not self.stalled and engine_failure(self.engine) is None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.config.check_interval_s)
            reason = engine_failure(self.engine)
            if reason is not None:
                if not await self._restart(reason):
                    return
                continue
            self._check_stall()

    def _check_stall(self) -> None:
        engine = self.engine
        stalled_for = time.monotonic() - getattr(engine, "progress_at", time.monotonic())
        stalled = getattr(engine, "num_pending", 0) > 0 and stalled_for > self.config.watchdog_s
        if stalled and not self.stalled:
            logger.error("engine watchdog: %d request(s) in flight and no step for %.1fs; /health answers 503",
                         engine.num_pending, stalled_for)
        elif self.stalled and not stalled:
            logger.warning("engine watchdog: steps resumed; /health answers 200 again")
        self.stalled = stalled

    def _note_failure(self) -> bool:
        """Count one failure; False when the window's budget is spent."""
        now = time.monotonic()
        self._failures.append(now)
        while self._failures and now - self._failures[0] > self.config.restart_window_s:
            self._failures.popleft()
        return len(self._failures) <= self.config.max_restarts

    async def _restart(self, reason: str) -> bool:
        self.restarting = True
        self.stalled = False
        self._on_down(reason)
        first_line = reason.strip().splitlines()[-1] if reason.strip() else reason
        old = self.engine
        while True:
            if not self._note_failure():
                msg = (f"the engine failed {len(self._failures)} times within "
                       f"{self.config.restart_window_s:g}s (last: {first_line}); giving up")
                logger.critical("%s", msg)
                self._give_up(msg)
                return False
            logger.error("the engine failed (%s); restarting it", first_line)
            if old is not None:
                try:
                    await asyncio.wait_for(old.shutdown(), self.config.shutdown_timeout_s)
                except Exception:  # a dead engine may not shut down cleanly; it is dropped either way
                    logger.warning("the failed engine did not shut down cleanly", exc_info=True)
                old = None
            t0 = time.perf_counter()
            try:
                engine = await self._build()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                first_line = f"restart failed: {type(exc).__name__}: {exc}"
                logger.exception("engine restart failed")
                await asyncio.sleep(min(5.0, 0.5 * len(self._failures)))
                continue
            break
        self.engine = engine
        self.restarts += 1
        self._on_restart()
        self._install(engine)
        self.restarting = False
        logger.warning("engine restarted in %.2fs (restart %d); serving again", time.perf_counter() - t0,
                       self.restarts)
        return True
