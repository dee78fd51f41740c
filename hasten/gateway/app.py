"""HTTP/1.1 frontend on raw asyncio protocols (the default, lowest-latency transport).

One protocol object per client connection parses requests (keep-alive, pipelining,
``Content-Length`` or chunked bodies), runs the gateway pipeline in a task, and writes
the response. Streams are piped: every upstream chunk is written to this socket from the
upstream socket's ``data_received`` (TCP_NODELAY on both), never buffered. Client
back-pressure pauses reading from the backend.
"""

from __future__ import annotations

import asyncio
import logging
import time

from hasten.gateway.core import Gateway
from hasten.gateway.h1 import (
    LAST_CHUNK,
    MAX_HEAD,
    ChunkedDecoder,
    ProtocolError,
    keep_alive,
    parse_request_head,
    response_head,
)
from hasten.gateway.pipeline import GatewayError, GatewayResponse, RequestContext, error_body, new_request_id
from hasten.gateway.relay import Relay
from hasten.gateway.upstream import set_nodelay

log = logging.getLogger("hasten.gateway")


class ClientConnection(asyncio.Protocol):
    def __init__(self, gateway: Gateway, connections: set[ClientConnection]) -> None:
        self.gateway = gateway
        self.connections = connections
        self.transport: asyncio.Transport | None = None
        self._buf = b""
        self._busy = False
        self._closed = False
        self._received_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._relay: Relay | None = None
        self._fast: Relay | None = None
        self._head_pending = b""
        self._terminated = False  # the current response's last chunk was written
        self._paused = False
        self._drain: asyncio.Future[None] | None = None
        self._peer: str | None = None
        self._ctx: RequestContext | None = None  # the request in progress (to release its governance state)

    # -- asyncio protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        set_nodelay(transport)
        peer = transport.get_extra_info("peername")
        self._peer = peer[0] if peer else None
        self.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.connections.discard(self)
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._fast is not None:  # waiting for the first byte on the fast path
            self.gateway.proxy.cancel_fast(self._fast)
            self._fast = None
        if self._relay is not None and self._task is None:  # a piped fast-path stream
            self._relay.close()
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        if self._ctx is not None:
            self.gateway.abandon(self._ctx)
            self._ctx = None

    def data_received(self, data: bytes) -> None:
        self._received_at = time.perf_counter()
        self._buf = self._buf + data if self._buf else data
        if self._busy:
            if len(self._buf) > self.gateway.config.max_body_bytes + MAX_HEAD and self.transport is not None:
                self.transport.pause_reading()
            return
        self._process()

    def pause_writing(self) -> None:
        self._paused = True
        if self._relay is not None:
            self._relay.pause()

    def resume_writing(self) -> None:
        self._paused = False
        if self._relay is not None:
            self._relay.resume()
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # -- request parsing -----------------------------------------------------------------

    def _process(self) -> None:
        while not self._busy and self._buf and not self._closed:
            buf = self._buf
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    self._fatal(431, "request head too large")
                return
            try:
                method, target, version, headers = parse_request_head(buf[:end])
            except ProtocolError as exc:
                self._fatal(400, str(exc))
                return
            start = end + 4
            limit = self.gateway.config.max_body_bytes
            te = headers.get("transfer-encoding")
            if te is not None:
                if te.lower() != "chunked":
                    self._fatal(501, f"unsupported transfer-encoding {te!r}")
                    return
                dec = ChunkedDecoder()
                try:
                    parts = dec.feed(buf[start:])
                except ProtocolError as exc:
                    self._fatal(400, str(exc))
                    return
                if not dec.done:
                    if len(buf) - start > limit:
                        self._fatal(413, "request body too large")
                    return
                body, rest = b"".join(parts), dec.extra
            else:
                try:
                    n = int(headers.get("content-length", "0"))
                except ValueError:
                    self._fatal(400, "bad content-length")
                    return
                if n > limit:
                    self._fatal(413, "request body too large")
                    return
                if len(buf) - start < n:
                    # the head is re-parsed when the body arrives; answer Expect once, before any body byte
                    expect = headers.get("expect", "").lower() == "100-continue"
                    if expect and len(buf) == start and self.transport is not None:
                        self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    return
                body, rest = buf[start:start + n], buf[start + n:]
            self._buf = rest
            self._busy = True
            self._dispatch(method, target, version, headers, body)

    def _dispatch(self, method: str, target: str, version: str, headers: dict[str, str], body: bytes) -> None:
        keep = keep_alive(version, headers)
        rid = headers.get("x-request-id") or new_request_id()
        path = target.split("?", 1)[0]
        g = self.gateway
        if method == "POST" and path.startswith("/v1/") and path != "/v1/models":
            ctx = RequestContext(method=method, path=target, headers=headers, body=body, request_id=rid,
                                 received_at=self._received_at, client=self._peer)
            self._ctx = ctx
            if g.fast_path:
                self._start_fast(ctx, keep)
            else:
                self._task = asyncio.get_running_loop().create_task(self._run(ctx, keep))
            return
        if method in ("GET", "HEAD") and path == "/health":
            status, payload = g.health_payload()
            resp = GatewayResponse.json(status, payload)
        elif method in ("GET", "HEAD") and path == "/v1/models":
            resp = GatewayResponse.json(200, g.models_payload())
        elif method in ("GET", "HEAD") and path == "/metrics":
            resp = GatewayResponse(200, {"content-type": "text/plain; version=0.0.4; charset=utf-8"},
                                   body=g.metrics.render().encode())
        else:
            code = "method_not_allowed" if path in ("/health", "/metrics", "/v1/models") else "not_found"
            resp = GatewayResponse(405 if code == "method_not_allowed" else 404,
                                   {"content-type": "application/json"},
                                   body=error_body(f"no route for {method} {path}", "invalid_request_error", code))
        resp.headers["x-request-id"] = rid
        if method == "HEAD":
            resp.body = b""
        self._respond(resp, keep)
        # answered synchronously: _process's loop picks up any pipelined request (no recursion)
        self._busy = False
        if not keep and self.transport is not None:
            self.transport.close()
            self._buf = b""

    # -- fast path: no task, no coroutine on the happy path ---------------------------------

    def _start_fast(self, ctx: RequestContext, keep: bool) -> None:
        g = self.gateway
        try:
            g.prepare(ctx)
        except Exception as exc:  # GatewayError, or a bug: answer in JSON either way
            if not isinstance(exc, GatewayError):
                log.exception("request %s: internal error", ctx.request_id)
                exc = GatewayError(500, "internal gateway error", "server_error", "internal_error")
            self._respond(g.finalize(ctx, GatewayResponse.from_error(exc)), keep)
            self._done(keep)
            return
        relay = g.proxy.start_fast(ctx, lambda resp: self._fast_ready(ctx, resp, keep))
        if relay is None:  # no pooled connection or no candidate: the general async path
            self._task = asyncio.get_running_loop().create_task(self._run(ctx, keep, prepared=True))
        else:
            self._fast = relay

    def _fast_ready(self, ctx: RequestContext, resp: GatewayResponse | None, keep: bool) -> None:
        """Called from the upstream socket's callback once the first byte (or a failure) is in."""
        try:
            self._fast_respond(ctx, resp, keep)
        except Exception:  # a bug must not leave the client hanging
            log.exception("request %s: frontend error", ctx.request_id)
            if self.transport is not None:
                self.transport.abort()

    def _fast_respond(self, ctx: RequestContext, resp: GatewayResponse | None, keep: bool) -> None:
        self._fast = None
        if resp is None:  # failed before any byte: retry the other candidates on the async path
            if not self._closed:
                self._task = asyncio.get_running_loop().create_task(self._run(ctx, keep, prepared=True))
            return
        resp = self.gateway.finalize(ctx, resp)
        stream = resp.stream
        if self._closed:
            if isinstance(stream, Relay):
                stream.close()
            return
        if stream is None:
            self._respond(resp, keep)
            self._done(keep)
            return
        assert isinstance(stream, Relay)
        self._head_pending = response_head(resp.status, self._stream_headers(resp, keep))
        self._relay = stream
        stream.pipe_to(self, lambda: self._fast_stream_end(keep))

    def _fast_stream_end(self, keep: bool) -> None:
        self._relay = None
        if self._closed or self.transport is None:
            return
        if not self._terminated:
            self.transport.write(self._head_pending + LAST_CHUNK)
            self._head_pending = b""
        self._done(keep)

    # -- responses -----------------------------------------------------------------------

    async def _run(self, ctx: RequestContext, keep: bool, prepared: bool = False) -> None:
        try:
            resp = await self.gateway.handle(ctx, prepared)
            if self._closed:
                if resp.stream is not None:
                    await resp.stream.aclose()  # type: ignore[attr-defined]
                return
            if resp.stream is None:
                self._respond(resp, keep)
            else:
                await self._stream(resp, keep)
        except asyncio.CancelledError:
            return
        except Exception:
            log.exception("request %s: frontend error", ctx.request_id)
            if self.transport is not None:
                self.transport.abort()
            return
        finally:
            self._task = None
        self._done(keep)

    def _respond(self, resp: GatewayResponse, keep: bool) -> None:
        if self._closed or self.transport is None:
            return
        h = resp.headers
        h["content-length"] = str(len(resp.body))
        if not keep:
            h["connection"] = "close"
        self.transport.write(response_head(resp.status, h) + resp.body)

    @staticmethod
    def _stream_headers(resp: GatewayResponse, keep: bool) -> dict[str, str]:
        h = resp.headers
        h["transfer-encoding"] = "chunked"
        if not keep:
            h["connection"] = "close"
        return h

    async def _stream(self, resp: GatewayResponse, keep: bool) -> None:
        self._head_pending = response_head(resp.status, self._stream_headers(resp, keep))
        stream = resp.stream
        assert stream is not None
        try:
            if isinstance(stream, Relay):
                self._relay = stream
                await stream.pipe(self)
            else:
                async for chunk in stream:
                    self.write(chunk)
                    if self._paused and not self._closed:
                        self._drain = asyncio.get_running_loop().create_future()
                        await self._drain
                    if self._closed:
                        break
        finally:
            self._relay = None
            await stream.aclose()  # type: ignore[attr-defined]
        if not self._closed and self.transport is not None and not self._terminated:
            self.transport.write(self._head_pending + LAST_CHUNK)
            self._head_pending = b""

    def write(self, data: bytes, end: bool = False) -> None:
        """Client sink for piped streams: frame one chunk (and with ``end`` the terminator) and hand
        it to the socket now."""
        if (not data and not end) or self._closed or self.transport is None:
            return
        frame = b"%x\r\n%s\r\n" % (len(data), data) if data else b""
        if end:
            frame += LAST_CHUNK
            self._terminated = True
        if self._head_pending:
            frame = self._head_pending + frame
            self._head_pending = b""
        self.transport.write(frame)

    def _done(self, keep: bool) -> None:
        self._busy = False
        self._terminated = False
        self._ctx = None
        if self.transport is None or self._closed:
            return
        if not keep:
            self.transport.close()
            return
        if self._buf:
            self.transport.resume_reading()
            # pipelined requests: continue from a fresh callback, never re-entrantly from an upstream one
            asyncio.get_running_loop().call_soon(self._process)

    def _fatal(self, status: int, message: str) -> None:
        if self.transport is None:
            return
        body = error_body(message, "invalid_request_error", "bad_request")
        self.transport.write(response_head(status, {"content-type": "application/json",
                                                    "content-length": str(len(body)),
                                                    "connection": "close"}) + body)
        self.transport.close()
        self._buf = b""


async def serve(gateway: Gateway, host: str, port: int, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Run the HTTP/1.1 frontend until ``stop`` is set; prints the bound address once listening."""
    await gateway.start()
    loop = asyncio.get_running_loop()
    connections: set[ClientConnection] = set()
    server = await loop.create_server(lambda: ClientConnection(gateway, connections), host, port,
                                      backlog=4096, reuse_address=True)
    try:
        bound = server.sockets[0].getsockname()
        gateway.address = (bound[0], bound[1])
        print(f"hasten gateway listening on http://{bound[0]}:{bound[1]} (HTTP/1.1, "
              f"{len(gateway.pools)} model pool(s))", flush=True)
        if ready is not None:
            ready.set()
        await (stop or asyncio.Event()).wait()
    finally:
        server.close()
        for conn in list(connections):
            if conn.transport is not None:
                conn.transport.close()
        await gateway.close()

