"""Upstream HTTP/1.1 client on raw asyncio protocols: keep-alive connection pools per backend.

The response is pushed to a *sink* from ``data_received`` as soon as bytes arrive:
``on_head(status, headers)``, then ``on_data(payload)`` for every decoded piece of body,
then exactly one of ``on_end()`` or ``on_error(exc)``. No coroutine runs per chunk.

Backends that close the connection after every response (``Connection: close``, HTTP/1.0,
close-delimited bodies) would otherwise cost a TCP connect, and the backend's accept, inside
every request. For them the pool *preconnects*: each connection taken for an exchange is
replaced by a new one opened in the background, up to ``preconnect`` spares, so the next
request finds an open connection (Envoy's preconnect policy does the same).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Protocol

from httptools import HttpResponseParser

from hasten.gateway.h1 import H1Reader, ProtocolError


class Sink(Protocol):
    def on_head(self, status: int, headers: dict[str, str]) -> None: ...

    def on_data(self, data: bytes, last: bool = False) -> None: ...  # last: the body ends with it

    def on_end(self) -> None: ...

    def on_error(self, exc: BaseException) -> None: ...


def set_nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class UpstreamConnection(H1Reader, asyncio.Protocol):
    """One keep-alive connection to a backend; the response is parsed by llhttp as it arrives.

    A response that llhttp or :class:`H1Reader` rejects, a Transfer-Encoding other than
    ``chunked``, an HTTP version other than 1.0/1.1 or a protocol upgrade fails the exchange
    (``on_error``) and closes the connection; bytes after the end of a response close it too.
    """

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.sink: Sink | None = None
        self.reused = False
        self.got_bytes = False
        self._init_reader()
        self._parser = HttpResponseParser(self)
        self._status = 0
        self._interim = False  # a 1xx response is being parsed (skipped)
        self._head = False  # the final response's head is complete
        self._delivered = False  # ... and was given to the sink
        self._complete = False  # the final response is complete
        self._until_close = False  # its body ends when the backend closes the connection
        self._parts: list[bytes] = []
        self._keep = True
        self._expect_body = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        set_nodelay(transport)

    def start(self, raw: bytes, sink: Sink, expect_body: bool = True) -> None:
        assert self.transport is not None
        self.sink = sink
        self.got_bytes = False
        self._head = self._delivered = self._complete = self._until_close = self._interim = False
        self._parts = []
        self._keep = True
        self._expect_body = expect_body
        self.transport.write(raw)

    # -- llhttp callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._complete:  # more bytes after the response: the connection is out of sync
            raise self._reject("data after the end of the response", 502)
        self._reset_head()

    def on_headers_complete(self) -> None:
        self._end_head()
        headers = self.headers
        parser = self._parser
        status = parser.get_status_code()
        if status < 200:  # 1xx interim response (100 Continue): skipped
            self._interim = True
            return
        version = parser.get_http_version()
        if version != "1.1" and version != "1.0":
            raise self._reject(f"HTTP/{version} response", 502)
        te = headers.get("transfer-encoding")
        if te is not None and te.strip(" \t").lower() != "chunked":
            raise self._reject(f"unsupported Transfer-Encoding {te[:40]!r} in the response", 502)
        self._status = status
        self._head = True
        self._keep = parser.should_keep_alive()
        if self._expect_body:
            self.pool.learn(self._keep)
        self._until_close = te is None and "content-length" not in headers and status not in (204, 304)
        if not self._expect_body:  # HEAD: no body follows, whatever the head says; the parser
            self._complete = True  # would wait for one, so the connection is not reused
            self._keep = False

    def on_body(self, body: bytes) -> None:
        self._chunk_open = False
        if self._expect_body:
            self._parts.append(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
        else:
            self._complete = True

    def _upgraded(self) -> ProtocolError | None:
        return ProtocolError("unexpected protocol upgrade from the backend", 502)

    # -- asyncio protocol --------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if sink is None:  # bytes on an idle connection: the stream is out of sync
            self.abort()
            return
        self.got_bytes = True
        err = self._feed(data)
        if err is not None:
            if not self._complete:
                self._fail(err)
                return
            self._keep = False  # garbage after a complete response: do not reuse the connection
        if not self._head:
            return
        if not self._delivered:
            self._delivered = True
            sink.on_head(self._status, self.headers)
            if self.sink is None:  # the sink gave up on this response
                return
        parts = self._parts
        if parts:
            data = parts[0] if len(parts) == 1 else b"".join(parts)
            parts.clear()
            sink.on_data(data, self._complete)
        if self._complete and self.sink is not None:
            self._finish()

    def _finish(self) -> None:
        sink, self.sink = self.sink, None
        if self._keep and self.transport is not None and not self.transport.is_closing():
            self.pool.release(self)
        elif self.transport is not None:
            self.transport.close()
        if sink is not None:
            sink.on_end()

    def _fail(self, exc: BaseException) -> None:
        sink, self.sink = self.sink, None
        self.abort()
        if sink is not None:
            sink.on_error(exc)

    def abort(self) -> None:
        """Drop the connection without notifying the sink (used when the sink gives up)."""
        self.sink = None
        if self.transport is not None:
            self.transport.abort()

    def pause_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool.discard(self)
        sink, self.sink = self.sink, None
        if sink is None:
            return
        if self._delivered and self._until_close and not self._complete:
            sink.on_end()  # close-delimited body: EOF is the normal end
        else:
            sink.on_error(exc or ConnectionResetError("backend closed the connection"))


class UpstreamPool:
    """Idle connections to one backend, reused most-recent first; spares preconnected for a backend
    that closes its connections (see the module docstring). ``preconnect=0`` turns that off."""

    def __init__(self, host: str, port: int, connect_timeout_s: float, max_idle: int = 1024,
                 preconnect: int = 32) -> None:
        self.host = host
        self.port = port
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self.preconnect = preconnect
        self.closes_connections = False  # the backend's last response head said it closes the connection
        self.preconnected = 0  # spare connections opened so far
        self._idle: list[UpstreamConnection] = []
        self._connecting: set[asyncio.Task[None]] = set()
        self._pause_until = 0.0  # no preconnect before this (monotonic) after one failed

    def take_idle(self) -> UpstreamConnection | None:
        """A pooled keep-alive or preconnected connection, or None (no I/O, never blocks)."""
        while self._idle:
            conn = self._idle.pop()
            if conn.transport is not None and not conn.transport.is_closing():
                conn.reused = True
                if self.closes_connections:
                    self._top_up()
                return conn
        return None

    async def acquire(self, fresh: bool = False) -> UpstreamConnection:
        conn = None if fresh else self.take_idle()
        if conn is not None:
            return conn
        if self.closes_connections:
            self._top_up()
        return await self._connect()

    async def _connect(self) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        _, new = await asyncio.wait_for(
            loop.create_connection(lambda: UpstreamConnection(self), self.host, self.port),
            self.connect_timeout_s)
        return new

    def learn(self, keep_alive: bool) -> None:
        """A response head arrived: whether the backend keeps its connections open."""
        if self.closes_connections == keep_alive:
            self.closes_connections = not keep_alive
            if not keep_alive:
                self._top_up()

    def _top_up(self) -> None:
        """Open one spare connection in the background, within the ``preconnect`` bound."""
        if (len(self._idle) + len(self._connecting) >= self.preconnect
                or time.monotonic() < self._pause_until):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # driven without an event loop (protocol tests): nothing to connect with
            return
        task = loop.create_task(self._open_spare())
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    async def _open_spare(self) -> None:
        try:
            conn = await self._connect()
        except (OSError, TimeoutError):
            self._pause_until = time.monotonic() + 1.0  # the backend refuses: requests will tell
            return
        self.preconnected += 1
        self.release(conn)

    def release(self, conn: UpstreamConnection) -> None:
        if len(self._idle) < self.max_idle:
            self._idle.append(conn)
        elif conn.transport is not None:
            conn.transport.close()

    def discard(self, conn: UpstreamConnection) -> None:
        with contextlib.suppress(ValueError):
            self._idle.remove(conn)

    @property
    def idle(self) -> int:
        return len(self._idle)

    def close(self) -> None:
        for task in self._connecting:
            task.cancel()
        for conn in self._idle:
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()

    async def probe(self, path: str, timeout_s: float) -> int:
        """``GET path`` on a pooled connection (a fresh one when none is idle, or when the pooled one
        turns out to be stale); returns the status code, raises on failure or after ``timeout_s``.
        The connection goes back to the pool afterwards: a probe adds no connection to the backend
        while real traffic keeps some open."""
        raw = f"GET {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\nuser-agent: hasten-gateway-probe\r\n\r\n"
        sink = StatusSink()

        async def run() -> int:
            for fresh in (False, True):
                conn = await self.acquire(fresh=fresh)
                sink.conn = conn
                sink.result = asyncio.get_running_loop().create_future()
                conn.start(raw.encode("latin-1"), sink)
                try:
                    return await sink.result
                except (OSError, ProtocolError):
                    if fresh or not conn.reused or conn.got_bytes:
                        raise
            raise AssertionError("unreachable")

        try:
            return await asyncio.wait_for(run(), timeout_s)
        finally:
            sink.abandon()


class StatusSink:
    """Collects an exchange's status into ``result`` (set before ``start``); the body is dropped (probes)."""

    def __init__(self) -> None:
        self.conn: UpstreamConnection | None = None
        self.result: asyncio.Future[int] | None = None
        self.status = 0

    def on_head(self, status: int, headers: dict[str, str]) -> None:
        self.status = status

    def on_data(self, data: bytes, last: bool = False) -> None:
        pass

    def on_end(self) -> None:
        self.conn = None  # the exchange is over (the connection may already be back in the pool)
        if self.result is not None and not self.result.done():
            self.result.set_result(self.status)

    def on_error(self, exc: BaseException) -> None:
        self.conn = None
        if self.result is not None and not self.result.done():
            self.result.set_exception(exc)

    def abandon(self) -> None:
        """Timed out or cancelled: drop a connection still waiting for its answer."""
        conn, self.conn = self.conn, None
        if conn is not None and conn.sink is self:
            conn.abort()
