"""Upstream HTTP/1.1 client on raw asyncio protocols: keep-alive connection pools per backend.

The response is pushed to a *sink* from ``data_received`` as soon as bytes arrive:
``on_head(status, headers)``, then ``on_data(payload)`` for every decoded piece of body,
then exactly one of ``on_end()`` or ``on_error(exc)``. No coroutine runs per chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Protocol

from hasten.gateway.h1 import MAX_HEAD, ChunkedDecoder, ProtocolError, parse_response_head


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


class UpstreamConnection(asyncio.Protocol):
    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.sink: Sink | None = None
        self.reused = False
        self.got_bytes = False
        self._buf = b""
        self._head = False
        self._decoder: ChunkedDecoder | None = None
        self._length: int | None = None
        self._keep = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        set_nodelay(transport)

    def start(self, raw: bytes, sink: Sink, expect_body: bool = True) -> None:
        assert self.transport is not None
        self.sink = sink
        self.got_bytes = False
        self._buf = b""
        self._head = False
        self._decoder = None
        self._length = None
        self._keep = True
        self._expect_body = expect_body
        self.transport.write(raw)

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if sink is None:  # bytes on an idle connection: the stream is out of sync
            self.abort()
            return
        self.got_bytes = True
        if not self._head:
            buf = self._buf + data
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    self._fail(ProtocolError("response head too large"))
                else:
                    self._buf = buf
                return
            try:
                status, headers = parse_response_head(buf[:end])
            except ProtocolError as exc:
                self._fail(exc)
                return
            data = buf[end + 4:]
            self._buf = b""
            if 100 <= status < 200:  # interim response (100 Continue): skip it
                if data:
                    self.data_received(data)
                return
            self._head = True
            if "chunked" in headers.get("transfer-encoding", "").lower():
                self._decoder = ChunkedDecoder()
            elif "content-length" in headers:
                try:
                    self._length = int(headers["content-length"])
                except ValueError:
                    self._fail(ProtocolError("bad content-length"))
                    return
            else:
                self._keep = False  # body ends when the backend closes the connection
            if "close" in headers.get("connection", "").lower():
                self._keep = False
            sink.on_head(status, headers)
            if self.sink is None:  # the sink gave up on this response
                return
            if not self._expect_body or status in (204, 304) or self._length == 0:
                self._finish()
                return
            if not data:
                return
        decoder = self._decoder
        if decoder is not None:
            try:
                parts = decoder.feed(data)
            except ProtocolError as exc:
                self._fail(exc)
                return
            if parts:
                sink.on_data(parts[0] if len(parts) == 1 else b"".join(parts), decoder.done)
            if decoder.done and self.sink is not None:
                if decoder.extra:
                    self._keep = False
                self._finish()
        elif self._length is not None:
            take = data[:self._length] if len(data) > self._length else data
            self._length -= len(take)
            if take:
                sink.on_data(take, not self._length)
            if not self._length and self.sink is not None:
                if len(take) < len(data):
                    self._keep = False
                self._finish()
        else:
            sink.on_data(data)

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
        if self._head and self._decoder is None and self._length is None:
            sink.on_end()  # close-delimited body: EOF is the normal end
        else:
            sink.on_error(exc or ConnectionResetError("backend closed the connection"))


class UpstreamPool:
    """Idle keep-alive connections to one backend, reused most-recent first."""

    def __init__(self, host: str, port: int, connect_timeout_s: float, max_idle: int = 1024) -> None:
        self.host = host
        self.port = port
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self._idle: list[UpstreamConnection] = []

    def take_idle(self) -> UpstreamConnection | None:
        """A pooled keep-alive connection, or None (no I/O, never blocks)."""
        while self._idle:
            conn = self._idle.pop()
            if conn.transport is not None and not conn.transport.is_closing():
                conn.reused = True
                return conn
        return None

    async def acquire(self, fresh: bool = False) -> UpstreamConnection:
        conn = None if fresh else self.take_idle()
        if conn is not None:
            return conn
        loop = asyncio.get_running_loop()
        _, new = await asyncio.wait_for(
            loop.create_connection(lambda: UpstreamConnection(self), self.host, self.port),
            self.connect_timeout_s)
        return new

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
        for conn in self._idle:
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()


async def probe(host: str, port: int, path: str, timeout_s: float) -> int:
    """``GET path`` on a fresh connection; returns the status code (raises on failure)."""

    async def run() -> int:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
            head = await reader.readuntil(b"\r\n\r\n")
            status, _ = parse_response_head(head[:-4])
            return status
        finally:
            writer.close()

    return await asyncio.wait_for(run(), timeout_s)
