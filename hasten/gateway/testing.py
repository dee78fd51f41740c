"""Test helpers: a fast fake OpenAI-compatible SSE backend and a lean HTTP/1.1 load client.

Both are written on raw asyncio (no web framework) so that, on a small machine, they
leave as much CPU as possible to the gateway under test.

Fake backend::

    python -m hasten.gateway.testing --port 0 --name b1 --tokens 16 --interval-ms 20

prints ``fake backend b1 listening on 127.0.0.1:PORT``. Every SSE chunk carries the
backend's name, the request id it received, and ``"t"``: ``time.monotonic_ns()`` when the
chunk was written (CLOCK_MONOTONIC is system-wide on Linux, so other processes can
compute delivery delay). A request may override timing with a ``"hasten_fake"`` object:
``{"tokens": n, "interval_ms": x, "ttft_ms": y}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests",
            500: "Internal Server Error", 503: "Service Unavailable"}


@dataclass
class FakeBackendOptions:
    name: str = "fake"
    tokens: int = 16
    interval_ms: float = 10.0
    ttft_ms: float = 0.0
    status: int = 200  # status for completion requests (e.g. 503 to simulate an overloaded replica)
    fail_after: int | None = None  # abort the connection after this many chunks
    health_status: int = 200
    health_delay_ms: float = 0.0  # a slow health endpoint (a replica too busy to answer probes quickly)
    # "chunked": keep-alive, chunked SSE; "close": ``Connection: close`` and a close-delimited SSE body
    # (no Content-Length, no Transfer-Encoding), as minimal servers and some proxies answer
    framing: str = "chunked"
    backlog: int = 2048  # listen backlog (100 is asyncio's default, what a minimal server has)


class FakeBackend:
    def __init__(self, opts: FakeBackendOptions) -> None:
        self.opts = opts
        self.requests = 0
        self.connections = 0
        self.models: dict[str, int] = {}
        self.request_ids: list[str] = []
        self.prompts: list[str] = []

    async def serve(self, host: str, port: int) -> asyncio.AbstractServer:
        return await asyncio.start_server(self._conn, host, port, backlog=self.opts.backlog, limit=1 << 22)

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers: dict[str, str] = {}
                for line in lines[1:]:
                    if line:
                        k, _, v = line.partition(":")
                        headers[k.strip().lower()] = v.strip()
                n = int(headers.get("content-length", "0"))
                body = await reader.readexactly(n) if n else b""
                if not await self._handle(method, target, headers, body, writer):
                    break
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    @staticmethod
    def _plain(writer: asyncio.StreamWriter, status: int, payload: Any, extra: str = "") -> None:
        body = json.dumps(payload).encode()
        writer.write(f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\nContent-Type: application/json"
                     f"\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body)

    async def _handle(self, method: str, target: str, headers: dict[str, str], body: bytes,
                      writer: asyncio.StreamWriter) -> bool:
        path = target.split("?", 1)[0]
        if method == "GET" and path == "/health":
            if self.opts.health_delay_ms:
                await asyncio.sleep(self.opts.health_delay_ms / 1000)
            self._plain(writer, self.opts.health_status, {"status": "ok"})
            return True
        if method == "GET" and path == "/stats":
            self._plain(writer, 200, {"name": self.opts.name, "requests": self.requests,
                                      "connections": self.connections, "models": self.models,
                                      "request_ids": self.request_ids[-50:], "prompts": self.prompts[-50:]})
            return True
        if method == "POST" and path == "/admin/health":
            self.opts.health_status = int(json.loads(body)["status"])
            self._plain(writer, 200, {"health_status": self.opts.health_status})
            return True
        if method == "GET" and path == "/v1/models":
            self._plain(writer, 200, {"object": "list", "data": [{"id": self.opts.name, "object": "model"}]})
            return True
        if method != "POST" or not path.startswith("/v1/"):
            self._plain(writer, 404, {"error": {"message": "not found", "type": "invalid_request_error",
                                                "code": None}})
            return True
        try:
            req = json.loads(body)
        except ValueError:
            self._plain(writer, 400, {"error": {"message": "bad json", "type": "invalid_request_error",
                                                "code": None}})
            return True
        self.requests += 1
        model = str(req.get("model", ""))
        self.models[model] = self.models.get(model, 0) + 1
        rid = headers.get("x-request-id", "")
        self.request_ids.append(rid)
        msgs = req.get("messages") or []
        self.prompts.append(str(msgs[-1].get("content", ""))[:64] if msgs else str(req.get("prompt", ""))[:64])
        del self.request_ids[:-1000], self.prompts[:-1000]
        if self.opts.status != 200:
            self._plain(writer, self.opts.status, {"error": {"message": f"{self.opts.name} says {self.opts.status}",
                                                             "type": "server_error", "code": None}})
            return True
        o = req.get("hasten_fake") or {}
        tokens = int(o.get("tokens", req.get("max_tokens") or self.opts.tokens))
        interval = float(o.get("interval_ms", self.opts.interval_ms)) / 1000
        ttft = float(o.get("ttft_ms", self.opts.ttft_ms)) / 1000
        if not req.get("stream"):
            if self.opts.fail_after is not None:
                writer.transport.abort()
                return False
            if ttft:
                await asyncio.sleep(ttft + interval * max(0, tokens - 1))
            text = "".join(f"t{i} " for i in range(tokens))
            self._plain(writer, 200, {
                "id": "cmpl-fake", "object": "chat.completion", "model": model, "backend": self.opts.name,
                "request_id": rid, "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                                "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}})
            return True
        return await self._stream(writer, model, rid, tokens, interval, ttft)

    async def _stream(self, writer: asyncio.StreamWriter, model: str, rid: str, tokens: int, interval: float,
                      ttft: float) -> bool:
        """The SSE answer: chunked on a kept-alive connection, or (``framing="close"``) raw events whose
        end is the end of the connection; returns whether the connection stays open."""
        close = self.opts.framing == "close"
        framing = "Connection: close" if close else "Transfer-Encoding: chunked"
        head = (f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                f"{framing}\r\nX-Request-ID: {rid}\r\n\r\n").encode()

        def frame(event: bytes) -> bytes:
            return event if close else b"%x\r\n%s\r\n" % (len(event), event)

        prefix = ('data: {"id":"chatcmpl-fake","object":"chat.completion.chunk","model":' + json.dumps(model)
                  + ',"backend":' + json.dumps(self.opts.name) + ',"request_id":' + json.dumps(rid) + ",").encode()
        if ttft:
            writer.write(head)
            head = b""
            await asyncio.sleep(ttft)
        fail_after = self.opts.fail_after
        for i in range(tokens):
            if fail_after is not None and i >= fail_after:
                writer.write(head)
                await asyncio.sleep(0.01)
                writer.transport.abort()
                return False
            event = prefix + b'"i":%d,"t":%d,"choices":[{"index":0,"delta":{"content":"t%d "},' \
                                b'"finish_reason":null}]}\n\n' % (i, time.monotonic_ns(), i)
            writer.write(head + frame(event))
            head = b""
            if writer.transport.get_write_buffer_size() > 1 << 16:
                await writer.drain()
            if interval and i + 1 < tokens:
                await asyncio.sleep(interval)
        writer.write(head + frame(b"data: [DONE]\n\n") + (b"" if close else b"0\r\n\r\n"))
        if close:
            await writer.drain()
        return not close


class MemoryTransport(asyncio.Transport):
    """An in-memory transport: collects what is written. Enough of the transport API to drive the
    gateway's protocols (client connection, upstream connection) without sockets."""

    def __init__(self) -> None:
        super().__init__()
        self.out: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.out.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


# -- lean load client ------------------------------------------------------------------


@dataclass
class LoadResult:
    ttft_ms: list[float] = field(default_factory=list)
    chunk_ms: list[float] = field(default_factory=list)  # backend write -> client receive, per chunk
    e2e_ms: list[float] = field(default_factory=list)
    errors: int = 0
    requests: int = 0

    def add(self, other: LoadResult) -> None:
        """Pool another run's samples and counts into this one."""
        self.ttft_ms += other.ttft_ms
        self.chunk_ms += other.chunk_ms
        self.e2e_ms += other.e2e_ms
        self.errors += other.errors
        self.requests += other.requests


class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection doing one request at a time (streaming-aware)."""

    def __init__(self, result: LoadResult) -> None:
        self.result = result
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[bool] | None = None
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            if self.until_close and exc is None:  # a close-delimited body ends here
                self._finish(time.monotonic_ns(), self.status == 200)
            else:
                self.done.set_result(False)
        if not self.lost.done():
            self.lost.set_result(None)

    def request(self, raw: bytes) -> asyncio.Future[bool]:
        self.buf = b""
        self.head_done = False
        self.status = 0
        self.chunked = False
        self.until_close = False  # no Content-Length, no chunking: the body ends with the connection
        self.length = 0
        self.first: int | None = None
        self.done = asyncio.get_running_loop().create_future()
        self.sent = time.monotonic_ns()
        assert self.transport is not None
        self.transport.write(raw)
        return self.done

    def data_received(self, data: bytes) -> None:
        now = time.monotonic_ns()
        buf = self.buf + data
        if not self.head_done:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.buf = buf
                return
            head = buf[:end].lower()
            self.status = int(head[9:12])
            self.chunked = b"transfer-encoding: chunked" in head
            if not self.chunked:
                i = head.find(b"content-length:")
                if i < 0:
                    self.until_close = True
                else:
                    j = head.find(b"\r\n", i)
                    self.length = int(head[i + 15:j if j > 0 else None])
            self.head_done = True
            buf = buf[end + 4:]
        if not self.chunked and not self.until_close:
            self.buf = buf
            if len(buf) >= self.length:
                self._finish(now, self.status == 200)
            return
        chunk_ms = self.result.chunk_ms
        pos = 0
        while True:
            ev = buf.find(b"\n\n", pos)
            if ev < 0:
                break
            d = buf.find(b"data: ", pos, ev)
            if d >= 0:
                if self.first is None:
                    self.first = now
                t = buf.find(b'"t":', d, ev)
                if t >= 0:
                    chunk_ms.append((now - int(buf[t + 4:buf.find(b",", t)])) / 1e6)
                if buf.startswith(b'data: {"error"', d):
                    self.status = 599
            pos = ev + 2
        self.buf = buf[pos:]
        if self.chunked and self.buf.endswith(b"0\r\n\r\n"):
            self._finish(now, self.status == 200)

    def _finish(self, now: int, ok: bool) -> None:
        r = self.result
        r.requests += 1
        if ok and self.first is not None:
            r.ttft_ms.append((self.first - self.sent) / 1e6)
            r.e2e_ms.append((now - self.sent) / 1e6)
        elif ok and not self.chunked:
            r.e2e_ms.append((now - self.sent) / 1e6)
        else:
            r.errors += 1
        if self.done is not None and not self.done.done():
            self.done.set_result(ok)


def build_request(host: str, port: int, path: str, payload: dict[str, Any],
                  headers: dict[str, str] | None = None) -> bytes:
    body = json.dumps(payload).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


async def run_load(host: str, port: int, concurrency: int, duration_s: float, payload: dict[str, Any],
                   path: str = "/v1/chat/completions", request_timeout_s: float = 30.0,
                   headers: dict[str, str] | None = None) -> LoadResult:
    """Keep ``concurrency`` streams in flight for ``duration_s`` seconds; one connection per stream."""
    loop = asyncio.get_running_loop()
    result = LoadResult()
    raw = build_request(host, port, path, payload, headers)
    deadline = loop.time() + duration_s

    async def worker() -> None:
        await asyncio.sleep(random.random() * 0.05)
        conn: _Conn | None = None
        while loop.time() < deadline:
            if conn is None or conn.transport is None or conn.transport.is_closing():
                _, conn = await loop.create_connection(lambda: _Conn(result), host, port)
            try:
                ok = await asyncio.wait_for(conn.request(raw), request_timeout_s)
            except TimeoutError:
                result.errors += 1
                ok = False
            if not ok and conn.transport is not None:
                conn.transport.close()
                conn = None
        if conn is not None and conn.transport is not None:
            conn.transport.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hasten.gateway.testing", description="fast fake SSE backend")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--name", default="fake")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--interval-ms", type=float, default=10.0)
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--status", type=int, default=200)
    p.add_argument("--fail-after", type=int, default=None)
    p.add_argument("--health-status", type=int, default=200)
    p.add_argument("--health-delay-ms", type=float, default=0.0)
    p.add_argument("--framing", choices=("chunked", "close"), default="chunked",
                   help="close: `Connection: close` and a close-delimited SSE body")
    p.add_argument("--backlog", type=int, default=2048, help="listen backlog (asyncio's default is 100)")
    p.add_argument("--uvloop", action="store_true")
    args = p.parse_args(argv)
    opts = FakeBackendOptions(name=args.name, tokens=args.tokens, interval_ms=args.interval_ms,
                              ttft_ms=args.ttft_ms, status=args.status, fail_after=args.fail_after,
                              health_status=args.health_status, health_delay_ms=args.health_delay_ms,
                              framing=args.framing, backlog=args.backlog)
    if args.uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())

    async def run() -> None:
        server = await FakeBackend(opts).serve(args.host, args.port)
        port = server.sockets[0].getsockname()[1]
        print(f"fake backend {opts.name} listening on {args.host}:{port}", flush=True)
        async with server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
