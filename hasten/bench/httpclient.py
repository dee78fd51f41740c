"""A small asyncio HTTP/1.1 client built for measuring streamed responses.

Why not aiohttp/httpx: every layer between the socket and our timestamp adds latency that
would be reported as server latency. Here `data_received` (a plain callback, no coroutine
switch) stamps each read with `perf_counter()`, strips HTTP framing and appends the body
bytes; nothing else happens until the response has finished. SSE/JSON parsing is done
afterwards (see `sse.py`).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit


class HttpError(Exception):
    """Transport-level failure; `kind` is the error type reported in the summary."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind
        self.detail = detail


class ResponseParser:
    """Incremental HTTP/1.1 response framing: headers, then Content-Length, chunked or
    until-close bodies. `feed()` returns the body bytes contained in a read."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.finished = False
        self.keep_alive = True
        self._head = b""
        self._in_body = False
        self._length: int | None = None  # remaining Content-Length bytes
        self._chunked = False
        self._chunk_left = 0
        self._need_crlf = False
        self._in_trailers = False
        self._pending = b""

    @property
    def delimited_by_close(self) -> bool:
        """True once headers say the body ends when the server closes the connection."""
        return self._in_body and not self._chunked and self._length is None

    def feed(self, data: bytes) -> bytes:
        if self.finished:
            return b""
        if not self._in_body:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                if len(self._head) > 65536:
                    raise HttpError("bad_response", "response head too large")
                return b""
            head, data = self._head[:end], self._head[end + 4:]
            self._head = b""
            self._parse_head(head)
        if self._chunked:
            return self._feed_chunked(data)
        if self._length is not None:
            body = data[: self._length]
            self._length -= len(body)
            if self._length <= 0:
                self.finished = True
            return body
        return data  # delimited by connection close

    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/"):
            raise HttpError("bad_response", f"bad status line {lines[0][:80]!r}")
        self.status = int(parts[1])
        for line in lines[1:]:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        self._in_body = True
        connection = self.headers.get("connection", "").lower()
        self.keep_alive = connection != "close" and parts[0] != "HTTP/1.0"
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            self._chunked = True
        elif "content-length" in self.headers:
            self._length = int(self.headers["content-length"])
            if self._length == 0:
                self.finished = True
        else:
            self.keep_alive = False

    def _feed_chunked(self, data: bytes) -> bytes:
        buf = self._pending + data if self._pending else data
        self._pending = b""
        out: list[bytes] = []
        pos, n = 0, len(buf)
        while pos < n and not self.finished:
            if self._chunk_left:
                take = min(self._chunk_left, n - pos)
                out.append(buf[pos:pos + take])
                pos += take
                self._chunk_left -= take
                self._need_crlf = self._chunk_left == 0
            elif self._need_crlf:
                if n - pos < 2:
                    self._pending = buf[pos:]
                    break
                pos += 2
                self._need_crlf = False
            else:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    self._pending = buf[pos:]
                    break
                line = buf[pos:end]
                pos = end + 2
                if self._in_trailers:
                    if not line:
                        self.finished = True
                    continue
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError as exc:
                    raise HttpError("bad_response", f"bad chunk size {line[:40]!r}") from exc
                if size == 0:
                    self._in_trailers = True
                else:
                    self._chunk_left = size
        return b"".join(out) if len(out) != 1 else out[0]


@dataclass
class StreamedResponse:
    """A finished response: status, headers and body pieces stamped with their arrival."""

    status: int
    headers: dict[str, str]
    pieces: list[tuple[float, bytes]] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0

    @property
    def body(self) -> bytes:
        return b"".join(p for _, p in self.pieces)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; serves one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._parser: ResponseParser | None = None
        self._pieces: list[tuple[float, bytes]] = []
        self._waiter: asyncio.Future[None] | None = None
        self._got_bytes = False  # any byte of the current response seen

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        parser = self._parser
        if parser is None:
            return
        self._got_bytes = True
        try:
            body = parser.feed(data)
        except HttpError as exc:
            self._finish(exc)
            return
        if body:
            self._pieces.append((now, body))
        if parser.finished:
            self._finish(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        parser = self._parser
        if parser is not None:
            if parser.delimited_by_close:
                self._finish(None)  # body delimited by close
            elif not self._got_bytes:  # an idle keep-alive connection the server had closed
                self._finish(HttpError("closed_before_response", "server closed the connection before answering"))
            else:
                self._finish(HttpError("connection_closed", "server closed the connection mid-response"))

    def _finish(self, exc: Exception | None) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)

    def begin(self, raw: bytes) -> asyncio.Future[None]:
        """Write a request now (synchronously) and return a future set when the response ends."""
        assert self.transport is not None
        self._parser = ResponseParser()
        self._pieces = []
        self._got_bytes = False
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return self._waiter

    def take_response(self, start: float) -> StreamedResponse:
        parser, pieces = self._parser, self._pieces
        assert parser is not None
        self._parser = None
        self._waiter = None
        if not parser.keep_alive:
            self.close()
        end = pieces[-1][0] if pieces else time.perf_counter()
        return StreamedResponse(parser.status, parser.headers, pieces, start, end)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class HttpClient:
    """POSTs JSON and collects the (streamed) response with per-read timestamps.

    Keeps a pool of idle keep-alive connections so a closed loop of N clients reuses N
    connections, like `vllm bench serve`'s aiohttp session.
    """

    def __init__(self, base_url: str, headers: dict[str, str] | None = None,
                 keepalive: bool = True, connect_timeout: float = 30.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"unsupported URL scheme in {base_url!r}")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        default_port = (parts.scheme == "https" and self.port == 443) or (parts.scheme == "http" and self.port == 80)
        self.host_header = self.host if default_port else f"{self.host}:{self.port}"
        self.extra_headers = dict(headers or {})
        self.keepalive = keepalive
        self.connect_timeout = connect_timeout
        self._idle: list[_Connection] = []

    def build_request(self, path: str, body: bytes) -> bytes:
        lines = [f"POST {self.prefix}{path} HTTP/1.1", f"Host: {self.host_header}",
                 "Content-Type: application/json", "Accept: text/event-stream",
                 f"Content-Length: {len(body)}",
                 "Connection: keep-alive" if self.keepalive else "Connection: close"]
        lines += [f"{k}: {v}" for k, v in self.extra_headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    def _idle_connection(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, proto = await asyncio.wait_for(
                loop.create_connection(_Connection, self.host, self.port, ssl=self.ssl),
                self.connect_timeout)
        except (TimeoutError, OSError) as exc:
            raise HttpError("connect_error", f"{type(exc).__name__}: {exc}") from exc
        return proto

    async def post(self, path: str, body: bytes, timeout: float | None) -> StreamedResponse:
        """Send one request and wait for the whole response.

        `start` is taken just before the request goes out, including connecting when no idle
        keep-alive connection is available (as `vllm bench serve` does). With a warm
        connection the request is written synchronously right after the timestamp: no task
        hop between the two."""
        raw = self.build_request(path, body)
        start = time.perf_counter()
        conn = self._idle_connection()
        reused = conn is not None
        if conn is None:
            conn = await self._connect()
        while True:
            waiter = conn.begin(raw)
            timer = None
            if timeout is not None:
                timer = asyncio.get_running_loop().call_later(timeout, self._expire, waiter, timeout)
            try:
                await waiter
                break
            except HttpError as exc:
                conn.close()
                # a server may close idle keep-alive connections at any time (llama-server does
                # after a few requests): resend once on a fresh connection, as HTTP clients do;
                # the retry counts in this request's latency (start is unchanged)
                if exc.kind != "closed_before_response" or not reused:
                    raise
                reused = False
                conn = await self._connect()
            except BaseException:
                conn.close()
                raise
            finally:
                if timer is not None:
                    timer.cancel()
        resp = conn.take_response(start)
        if self.keepalive and not conn.closed:
            self._idle.append(conn)
        else:
            conn.close()
        return resp

    @staticmethod
    def _expire(waiter: asyncio.Future[None], timeout: float) -> None:
        if not waiter.done():
            waiter.set_exception(HttpError("timeout", f"no complete response within {timeout} s"))

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
