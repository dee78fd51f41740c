"""The server's side of the grammar compiler process (`grammar_worker.py`), for the event loop.

`await service.compile(key, timeout)` sends one compile to the compiler process and waits
for its serialized result. Up to `max_compiles` run at once, each in a worker process of
its own; a request that finds every slot busy waits for one for at most `timeout` seconds
(`CompilerBusy`). When the compile itself runs past `timeout` (`CompileTimeout`), or the
awaiting task is cancelled (every client waiting for it went away), its worker is killed.
Nothing here blocks the event loop: the process is spoken to through an asyncio protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import subprocess
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hasten.server.grammar_worker import HEADER_SIZE, frame, frame_size, load_frame

logger = logging.getLogger("hasten.server.structured")

_START_TIMEOUT_S = 120.0  # importing xgrammar (and torch) on a loaded machine


@dataclass(frozen=True)
class CompileResult:
    serialized: str | None  # CompiledGrammar.serialize_json(), for a grammar slow to compile (else None)
    memory_bytes: int  # CompiledGrammar.memory_size_bytes
    seconds: float  # CPU time of the compile in the worker


class CompileRejected(Exception):
    """xgrammar refused the schema (or its compile process died); the message says why."""


class CompileTooLarge(Exception):
    """The grammar compiled too slowly to be compiled again next to the engine, and its serialized
    form is too large or too slow to write."""


class CompileTimeout(Exception):
    pass


class CompilerBusy(Exception):
    """Every compile slot stayed busy for the whole timeout."""


class CompilerUnavailable(Exception):
    """The compiler process could not start, or died during the compile."""


class _FrameProtocol(asyncio.Protocol):
    def __init__(self, on_message: Callable[[tuple], None], on_lost: Callable[[], None]) -> None:
        self._buf = bytearray()
        self._on_message = on_message
        self._on_lost = on_lost

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        while len(buf) >= HEADER_SIZE:
            size = frame_size(buf)
            if len(buf) < size:
                return
            msg = load_frame(buf[:size])
            del buf[:size]
            self._on_message(msg)

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class CompileService:
    def __init__(self, tokenizer_info_json: Callable[[], str], max_compiles: int, recycle_bytes: int,
                 serialize_above_s: float, max_serialized_bytes: int, max_recompile_s: float) -> None:
        self._info_json = tokenizer_info_json  # blocking (builds xgrammar's TokenizerInfo): run in a thread
        self._recycle_bytes = recycle_bytes
        self.serialize_above_s = serialize_above_s  # see grammar_worker.py
        self.max_serialized_bytes = max_serialized_bytes
        self.max_recompile_s = max_recompile_s
        self._slots = asyncio.Semaphore(max_compiles)
        self._ids = itertools.count(1)
        self._proc: subprocess.Popen | None = None
        self._transport: asyncio.Transport | None = None
        self._starting: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[None] | None = None
        self._generation = 0  # one per process started: a closed connection only resets its own
        self._jobs: dict[int, asyncio.Future[CompileResult]] = {}
        self.workers: dict[int, int] = {}  # job -> pid of the worker compiling it
        self.compiles = 0  # compiles sent to a worker

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def running(self) -> bool:
        """Whether the compiler process is up and has said it is ready."""
        ready = self._ready
        return (ready is not None and ready.done() and not ready.cancelled() and ready.exception() is None
                and self.pid is not None)

    # ---- process lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        """Start the compiler process if it is not running (idempotent, shared by concurrent callers)."""
        task = self._starting
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()

        def spawn() -> tuple[str, subprocess.Popen, socket.socket]:
            info = self._info_json()
            ours, theirs = socket.socketpair()
            with theirs:
                proc = subprocess.Popen([sys.executable, "-m", "hasten.server.grammar_worker",
                                         str(theirs.fileno())], pass_fds=[theirs.fileno()])
            return info, proc, ours

        try:
            info, proc, sock = await asyncio.to_thread(spawn)
        except Exception as exc:  # e.g. xgrammar is not installed
            why = f"{type(exc).__name__}: {exc}"
            raise CompilerUnavailable(f"the grammar compiler did not start: {why}") from exc
        self._proc = proc
        weakref.finalize(self, _stop, proc)
        self._ready = loop.create_future()
        self._generation += 1
        generation = self._generation
        self._transport, _ = await loop.create_connection(
            lambda: _FrameProtocol(self._on_message, lambda: self._on_lost(generation, proc)), sock=sock)
        self._transport.write(frame(("init", info, self._recycle_bytes)))
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), _START_TIMEOUT_S)
        except (TimeoutError, CompilerUnavailable) as exc:
            self._close_transport()
            await asyncio.to_thread(_stop, proc)
            raise CompilerUnavailable(f"the grammar compiler did not start: {exc or 'timed out'}") from exc
        logger.info("grammar compiler process ready (pid %d)", proc.pid)

    def _close_transport(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    async def aclose(self) -> None:
        """Stop the compiler process (it kills its workers when this end closes)."""
        self._close_transport()
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
            await asyncio.gather(self._starting, return_exceptions=True)
        if self._proc is not None:
            proc = self._proc
            try:
                await asyncio.to_thread(proc.wait, 5)
            except subprocess.TimeoutExpired:
                await asyncio.to_thread(_stop, proc)

    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "ready":
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(None)
        elif kind == "failed":
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(CompilerUnavailable(msg[1]))
        elif kind == "started":
            _, job, pid = msg
            if job in self._jobs:
                self.workers[job] = pid
        elif kind == "result":
            _, job, status, payload, memory_bytes, seconds = msg
            self.workers.pop(job, None)
            fut = self._jobs.get(job)
            if fut is None or fut.done():
                return
            if status == "ok":
                fut.set_result(CompileResult(payload, memory_bytes, seconds))
            elif status == "too_large":
                fut.set_exception(CompileTooLarge(payload))
            elif status == "unavailable":
                fut.set_exception(CompilerUnavailable(payload))
            else:  # "rejected", or "died": a schema that crashes the compiler is the schema's fault too
                fut.set_exception(CompileRejected(payload))

    def _on_lost(self, generation: int, proc: subprocess.Popen) -> None:
        asyncio.get_running_loop().run_in_executor(None, _stop_after_exit, proc)  # reaped off the loop
        if generation != self._generation:
            return  # an older process, already replaced
        self._transport = None
        self._starting = None  # the next compile starts a new process
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(CompilerUnavailable("the grammar compiler process exited"))
        for fut in self._jobs.values():
            if not fut.done():
                fut.set_exception(CompilerUnavailable("the grammar compiler process exited"))
        self.workers.clear()

    # ---- compiles ---------------------------------------------------------------------
    async def compile(self, key: str, timeout: float) -> CompileResult:
        await self.start()
        try:
            await asyncio.wait_for(self._slots.acquire(), timeout)
        except TimeoutError:
            raise CompilerBusy() from None
        try:
            return await self._run(key, timeout)
        finally:
            self._slots.release()

    async def _run(self, key: str, timeout: float) -> CompileResult:
        if self._transport is None:
            await self.start()
        assert self._transport is not None
        job = next(self._ids)
        fut: asyncio.Future[CompileResult] = asyncio.get_running_loop().create_future()
        self._jobs[job] = fut
        self.compiles += 1
        self._transport.write(frame(("compile", job, key, self.serialize_above_s, self.max_serialized_bytes,
                                     self.max_recompile_s)))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            self._cancel(job, f"it ran past {timeout:g}s")
            raise CompileTimeout() from None
        except asyncio.CancelledError:
            self._cancel(job, "no client is waiting for it any more")
            raise
        finally:
            self._jobs.pop(job, None)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                if fut.done():
                    fut.exception()  # retrieved: never "exception was never retrieved"

    def _cancel(self, job: int, why: str) -> None:
        pid = self.workers.pop(job, None)
        logger.info("grammar compile stopped (worker pid %s killed): %s", pid, why)
        if self._transport is not None:
            self._transport.write(frame(("cancel", job)))


def _stop_after_exit(proc: subprocess.Popen) -> Any:
    try:
        return proc.wait(10)
    except subprocess.TimeoutExpired:
        _stop(proc)
        return proc.returncode
