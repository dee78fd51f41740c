"""Relay: one upstream exchange, from the first byte wait to the last forwarded chunk.

Before the proxy commits to a backend, the relay collects the response head and the
first body bytes (``ready`` resolves then, or on error / first-byte timeout). Once
activated it forwards the body in one of two ways:

* push (``pipe(sink)``), used by the HTTP/1.1 frontend: each upstream ``data_received``
  calls ``sink.write`` directly, so a chunk goes from the backend socket to the client
  socket without any coroutine switch or buffering;
* pull (``async for chunk in relay``), used by the ASGI/HTTP/2 frontend and by middlewares
  that want to wrap a stream.

Mid-stream failures end an SSE stream with an error event; the relay then finishes
normally so that the client never hangs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from hasten.gateway.health import BackendState
    from hasten.gateway.metrics import GatewayMetrics
    from hasten.gateway.pipeline import RequestContext
    from hasten.gateway.routing import Pool
    from hasten.gateway.upstream import UpstreamConnection

log = logging.getLogger("hasten.gateway")

_PAUSE_AT = 64  # queued pieces in pull mode before upstream reading is paused


class RelayOwner(Protocol):
    """What a relay needs from the proxy that started it (hasten.gateway.proxy.Proxy)."""

    metrics: GatewayMetrics
    first_byte_s: float
    awaiting: set[Relay]  # sent, first byte not in yet (the owner's watchdog enforces first_byte_s)
    active: set[Relay]  # handed to a client

    def fail(self, pool: Pool, backend: BackendState, kind: str, count_breaker: bool = True,
             release: bool = True) -> None: ...


class ClientSink(Protocol):
    def write(self, data: bytes, end: bool = False) -> None: ...  # end: also terminate the response


def sse_error_event(message: str, code: str = "upstream_stream_error") -> bytes:
    payload = {"error": {"message": message, "type": "server_error", "code": code}}
    return b"\n\ndata: " + json.dumps(payload).encode() + b"\n\n"


class Relay:
    __slots__ = ("_loop", "_ready", "resolved", "_proxy", "_ctx", "_pool", "_backend", "_conn", "_span",
                 "_series", "on_ready", "status", "headers", "streaming", "error", "timed_out", "complete",
                 "last_activity", "deadline", "_parts", "_ended", "_active", "_closed", "_sink", "_done",
                 "_on_done", "_waiter", "_arrived", "_sent_at", "_out_t", "_sent_first", "_paused", "_is_sse",
                 "_upstream_done", "taps", "finishers")

    def __init__(self, proxy: RelayOwner, ctx: RequestContext, pool: Pool, backend: BackendState,
                 conn: UpstreamConnection, span: Any) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[None] | None = None  # created only when awaited (async path)
        self.resolved = False  # the first bytes (or a failure) are in
        self._proxy = proxy
        self._ctx = ctx
        self._pool = pool
        self._backend = backend
        self._conn = conn
        self._span = span
        self._series = proxy.metrics.pool_series(pool.name)
        self.on_ready: Callable[[], None] | None = None  # fast path: called instead of awaiting ready
        self.status = 0
        self.headers: dict[str, str] = {}
        self.streaming = False
        self.error: BaseException | None = None
        self.timed_out = False
        self.complete = False
        self.last_activity = 0.0
        self.deadline = 0.0  # first-byte deadline (time.monotonic); the proxy's watchdog enforces it
        self._parts: list[bytes] = []
        self._ended = False
        self._active = False
        self._closed = False
        self._sink: ClientSink | None = None
        self._done: asyncio.Future[None] | None = None
        self._on_done: Callable[[], None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._arrived: float | None = None
        self._sent_at = 0.0  # when the upstream request was written (send)
        self._out_t: float | None = None
        self._sent_first = False
        self._paused = False
        self._is_sse = False
        self._upstream_done = False  # the connection has delivered on_end/on_error and may be back in the pool
        # observers that keep push mode (governance: caches, SLO and usage accounting)
        self.taps: list[Callable[[bytes], None]] = []  # every body piece forwarded to the client
        self.finishers: list[Callable[[bool], None]] = []  # once, at the end; True when it ended cleanly

    # -- before the first byte -------------------------------------------------------

    def send(self, raw: bytes) -> None:
        self._sent_at = time.perf_counter()
        self.last_activity = now = time.monotonic()
        self.deadline = now + self._proxy.first_byte_s
        self._proxy.awaiting.add(self)
        self._conn.start(raw, self, expect_body=self._ctx.method != "HEAD")

    @property
    def ready(self) -> asyncio.Future[None]:
        """Resolves once the response head and first body bytes (or a failure) are in."""
        if self._ready is None:
            self._ready = self._loop.create_future()
            if self.resolved:
                self._ready.set_result(None)
        return self._ready

    def first_byte_timeout(self) -> None:
        """Called by the proxy's watchdog when the deadline passed before the first byte."""
        if not self.resolved and not self._closed:
            self.timed_out = True
            self._drop_connection()
            self.error = TimeoutError(f"no response within {self._proxy.first_byte_s:g}s")
            self._resolve()

    def _resolve(self) -> None:
        if self.resolved:
            return
        self.resolved = True
        self._proxy.awaiting.discard(self)
        if self._ready is not None:
            self._ready.set_result(None)
        callback, self.on_ready = self.on_ready, None
        if callback is not None:
            callback()

    @property
    def conn(self) -> UpstreamConnection:
        return self._conn

    @property
    def backend(self) -> BackendState:
        return self._backend

    @property
    def span(self) -> Any:
        return self._span

    def peek(self) -> bytes:
        return b"".join(self._parts)

    def take_body(self) -> bytes:
        body, self._parts = b"".join(self._parts), []
        return body

    def abort(self) -> None:
        """Give up on this exchange before it was handed to the client (no accounting)."""
        self._closed = True
        self._proxy.awaiting.discard(self)
        self._drop_connection()
        self._proxy.active.discard(self)

    def _drop_connection(self) -> None:
        # once the exchange is over the connection may already serve another request: leave it alone
        if not self._upstream_done:
            self._upstream_done = True
            self._conn.abort()

    # -- upstream sink callbacks -------------------------------------------------------

    def on_head(self, status: int, headers: dict[str, str]) -> None:
        self._proxy.metrics.upstream_first_byte.observe(time.perf_counter() - self._sent_at, self._pool.name,
                                                        self._backend.url)
        self.status = status
        self.headers = headers
        self._is_sse = headers.get("content-type", "").startswith("text/event-stream")
        self.streaming = self._is_sse or "content-length" not in headers

    def on_data(self, data: bytes, last: bool = False) -> None:
        self.last_activity = time.monotonic()
        sink = self._sink
        if sink is not None:
            t0 = time.perf_counter()
            # the body's last piece and the response terminator leave in one write (one syscall, one
            # wakeup of the client) when the sink is ended by a done callback (fast path)
            sink.write(data, last and self._on_done is not None)
            if self.taps:
                self._tap(data)
            if not self._sent_first:
                self._sent_first = True
                self._series.ttft.observe(t0 - self._ctx.received_at)
            self._series.chunk.observe(time.perf_counter() - t0)
            return
        self._parts.append(data)
        if not self._active:
            if self.streaming:
                self._resolve()
            return
        if self._arrived is None:
            self._arrived = time.perf_counter()
        self._wake()
        if len(self._parts) >= _PAUSE_AT and not self._paused:
            self._paused = True
            self._conn.pause_reading()

    def on_end(self) -> None:
        self._upstream_done = True
        self._ended = True
        if not self._active:
            self.complete = not self.streaming
            self._resolve()
        elif self._sink is not None or self._waiter is not None or not self._parts:
            self._finish(clean=True)
        else:
            self._wake()

    def on_error(self, exc: BaseException) -> None:
        self._upstream_done = True
        if not self._active:
            self.error = exc
            self._resolve()
            return
        self._stream_error(exc, "timeout" if self.timed_out else "stream")

    # -- after activation --------------------------------------------------------------

    def activate(self) -> None:
        self._active = True
        self._proxy.active.add(self)

    def pipe(self, sink: ClientSink) -> asyncio.Future[None]:
        """Push mode: write everything to ``sink`` as it arrives; the future resolves at the end."""
        self._done = self._loop.create_future()
        self.pipe_to(sink, None)
        if self._closed and not self._done.done():
            self._done.set_result(None)
        return self._done

    def pipe_to(self, sink: ClientSink, on_done: Callable[[], None] | None) -> None:
        """Push mode with a plain callback, called once at the end (possibly before this returns)."""
        self._on_done = on_done
        parts, self._parts = self._parts, []
        for p in parts:
            sink.write(p)
            if self.taps:
                self._tap(p)
        if parts and not self._sent_first:
            self._sent_first = True
            self._series.ttft.observe(time.perf_counter() - self._ctx.received_at)
        self._sink = sink
        self._settle_pending()
        if self._closed and self._on_done is not None:
            self._call_done()

    def _call_done(self) -> None:
        callback, self._on_done = self._on_done, None
        if callback is not None:
            callback()

    def _settle_pending(self) -> None:
        if self.error is not None and not self._closed:
            self._stream_error(self.error, "timeout" if self.timed_out else "stream")
        elif self._ended and not self._parts:
            self._finish(clean=True)

    def pause(self) -> None:
        if not self._upstream_done:
            self._conn.pause_reading()

    def resume(self) -> None:
        if not self._upstream_done:
            self._conn.resume_reading()

    def __aiter__(self) -> Relay:
        return self

    async def __anext__(self) -> bytes:
        if self._out_t is not None:
            now = time.perf_counter()
            self._series.chunk.observe(now - self._out_t)
            if not self._sent_first:
                self._sent_first = True
                self._series.ttft.observe(now - self._ctx.received_at)
            self._out_t = None
        while True:
            if self._parts:
                parts, self._parts = self._parts, []
                self._out_t = self._arrived or time.perf_counter()
                self._arrived = None
                if self._paused:
                    self._paused = False
                    self.resume()
                data = parts[0] if len(parts) == 1 else b"".join(parts)
                if self.taps:
                    self._tap(data)
                return data
            if self._closed:
                raise StopAsyncIteration
            if self._ended or self.error is not None:
                self._settle_pending()
                continue
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def fail_now(self, exc: BaseException, kind: str) -> None:
        """Called by the idle watchdog: the backend went silent mid-stream."""
        if self._closed:
            return
        self.timed_out = True
        self._drop_connection()
        self._stream_error(exc, kind)

    def _stream_error(self, exc: BaseException, kind: str) -> None:
        if self._closed:
            return
        self.error = exc
        log.warning("request %s: backend %s failed mid-stream: %r", self._ctx.request_id, self._backend.url, exc)
        self._proxy.fail(self._pool, self._backend, kind, release=False)
        self._span.set_attribute("gateway.stream_error", kind)
        if self._is_sse:
            event = sse_error_event(f"backend failed after the response started: {kind} error")
            if self._sink is not None:
                self._sink.write(event)
            else:
                self._parts.append(event)
        self._finish(clean=False)

    def _finish(self, clean: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if not clean:
            self._drop_connection()
        self._proxy.active.discard(self)
        self._backend.in_flight -= 1
        self._series.e2e.observe(time.perf_counter() - self._ctx.received_at)
        self._span.end()
        if self._done is not None and not self._done.done():
            self._done.set_result(None)
        self._wake()
        finishers, self.finishers = self.finishers, []
        for fn in finishers:
            try:
                fn(clean)
            except Exception:  # an observer must not break the stream
                log.exception("request %s: stream observer failed", self._ctx.request_id)
        if self._on_done is not None:
            self._call_done()

    def _tap(self, data: bytes) -> None:
        for fn in self.taps:
            try:
                fn(data)
            except Exception:
                log.exception("request %s: stream observer failed", self._ctx.request_id)

    def close(self) -> None:
        """The client side is done (or gone): release the backend connection."""
        if not self._closed:
            self._finish(clean=False)

    async def aclose(self) -> None:
        self.close()
