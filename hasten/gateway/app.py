"""HTTP/1.1 frontend on raw asyncio protocols (the default, lowest-latency transport).

One protocol object per client connection parses requests with llhttp (keep-alive,
pipelining, ``Content-Length`` or chunked bodies; see :mod:`hasten.gateway.h1`), runs the
gateway pipeline in a task, and writes the response. Streams are piped: every upstream chunk
is written to this socket from the upstream socket's ``data_received`` (TCP_NODELAY on both),
never buffered. Client back-pressure pauses reading from the backend.

Slow clients are bounded by three read timeouts (``timeouts:`` in the config), enforced by one
periodic sweep over the open connections rather than a timer per request: the request head
must be complete ``header_read_s`` after its first byte, the body ``body_read_s`` after the
head (both answered 408 and closed), and a connection waiting for its next request is closed
after ``keep_alive_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from hasten.gateway.config import TimeoutConfig
from hasten.gateway.core import Gateway
from hasten.gateway.h1 import (
    BODY,
    CLOSING,
    HEAD,
    IDLE,
    LAST_CHUNK,
    MAX_HEAD,
    ProtocolError,
    Request,
    RequestReader,
    response_head,
)
from hasten.gateway.pipeline import GatewayError, GatewayResponse, RequestContext, error_body, new_request_id
from hasten.gateway.relay import Relay
from hasten.gateway.upstream import set_nodelay

log = logging.getLogger("hasten.gateway")

_CODES = {400: "bad_request", 408: "request_timeout", 413: "request_too_large",
          431: "request_header_fields_too_large", 500: "internal_error", 501: "not_implemented",
          505: "http_version_not_supported"}
_LINGER_S = 2.0  # after an error answer: how long the client may take to read it before an abort


class ClientConnection(RequestReader, asyncio.Protocol):
    def __init__(self, gateway: Gateway, connections: set[ClientConnection]) -> None:
        self.gateway = gateway
        self.connections = connections
        self.transport: asyncio.Transport | None = None
        self._init_requests(gateway.config.max_body_bytes)
        self._buf = b""  # bytes not parsed yet (they arrived while a request was being answered)
        self._busy = False
        self._stopped = False  # no further request is read on this connection
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
        self.phase_at = time.perf_counter()  # idle until the first byte of a request

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._stop()
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
        self._received_at = self._now = time.perf_counter()
        if self._stopped:
            return
        if self._busy or self._buf or self.requests:  # parsed in order, once the current request is answered
            self._buf = self._buf + data if self._buf else data
            if len(self._buf) > self._max_body + MAX_HEAD and self.transport is not None:
                self.transport.pause_reading()
            return
        err = self._feed(data)
        if err is not None:
            self.requests.append(err)
            self._stopped = True
        if self.requests:
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

    # -- requests, in order ----------------------------------------------------------------

    def _process(self) -> None:
        """Answer the parsed requests one at a time; parse held bytes once the queue is empty."""
        requests = self.requests
        while not self._busy and not self._closed:
            if requests:
                item = requests.popleft()
                if isinstance(item, ProtocolError):
                    self._fatal(item.status, str(item))
                    return
                self._busy = True
                self._dispatch(item)
                continue
            buf = self._buf
            if not buf or self._stopped:
                break
            self._buf = b""
            self._now = time.perf_counter()
            err = self._feed(buf)
            if err is not None:
                requests.append(err)
                self._stopped = True
        if self.continue_owed and not self._busy and not requests and not self._body_size:
            self.continue_owed = False
            self._send_continue()

    def _send_continue(self) -> None:
        if self.transport is not None and not self._stopped:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _stop(self) -> None:
        self._stopped = True
        self._buf = b""
        self.requests.clear()
        self._hold = None

    def expire(self, now: float, timeouts: TimeoutConfig) -> None:
        """Called by the periodic sweep: close the connection if its client is too slow."""
        if self._busy or self._closed or self.transport is None:
            return
        age = now - self.phase_at
        phase = self.phase
        if phase == IDLE:
            if age > timeouts.keep_alive_s and not self.requests:
                self._stop()
                self.transport.close()
                self.phase, self.phase_at = CLOSING, now
        elif phase == HEAD:
            if age > timeouts.header_read_s:
                self._fatal(408, f"request head not received within {timeouts.header_read_s:g}s")
        elif phase == BODY:
            if age > timeouts.body_read_s:
                self._fatal(408, f"request body not received within {timeouts.body_read_s:g}s")
        elif age > _LINGER_S:  # CLOSING: the client does not read what is left to send
            self.transport.abort()

    def _dispatch(self, req: Request) -> None:
        method, target, headers, keep = req.method, req.target, req.headers, req.keep_alive
        rid = headers.get("x-request-id") or new_request_id()
        path = target.split("?", 1)[0]
        g = self.gateway
        if method == "POST" and path.startswith("/v1/") and path != "/v1/models":
            ctx = RequestContext(method=method, path=target, headers=headers, body=req.body, request_id=rid,
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
            self._stop()
            self.transport.close()

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
            self._stop()
            self.transport.close()
            return
        self.phase_at = time.perf_counter()  # idle (or the next request's bytes are parsed now)
        if self._buf or self.requests or self.continue_owed:
            self.transport.resume_reading()
            # pipelined requests: continue from a fresh callback, never re-entrantly from an upstream one
            asyncio.get_running_loop().call_soon(self._process)

    def _fatal(self, status: int, message: str) -> None:
        """Answer an unreadable request with an error and close: the rest of the input is ignored."""
        self._stop()
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        log.debug("client %s: %d %s", self._peer, status, message)
        body = error_body(message, "invalid_request_error", _CODES.get(status, "bad_request"))
        transport.write(response_head(status, {"content-type": "application/json",
                                               "content-length": str(len(body)),
                                               "connection": "close"}) + body)
        # half-close: the client reads the answer before it sees the end (an immediate close with
        # unread input would reset the connection); the sweep aborts it if it lingers
        try:
            transport.write_eof()
        except (NotImplementedError, OSError, RuntimeError):
            transport.close()
        self.phase, self.phase_at = CLOSING, time.perf_counter()


async def sweep(connections: set[ClientConnection], timeouts: TimeoutConfig) -> None:
    """Enforce the client read timeouts: one pass over the connections every quarter of the
    shortest timeout (at most every second), so a timeout fires at most that late."""
    interval = min(1.0, timeouts.header_read_s / 4, timeouts.body_read_s / 4, timeouts.keep_alive_s / 4)
    while True:
        await asyncio.sleep(interval)
        now = time.perf_counter()
        for conn in list(connections):
            conn.expire(now, timeouts)


async def serve(gateway: Gateway, host: str, port: int, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Run the HTTP/1.1 frontend until ``stop`` is set; prints the bound address once listening."""
    await gateway.start()
    loop = asyncio.get_running_loop()
    connections: set[ClientConnection] = set()
    server = await loop.create_server(lambda: ClientConnection(gateway, connections), host, port,
                                      backlog=4096, reuse_address=True)
    sweeper = loop.create_task(sweep(connections, gateway.config.timeouts))
    try:
        bound = server.sockets[0].getsockname()
        gateway.address = (bound[0], bound[1])
        print(f"hasten gateway listening on http://{bound[0]}:{bound[1]} (HTTP/1.1, "
              f"{len(gateway.pools)} model pool(s))", flush=True)
        if ready is not None:
            ready.set()
        await (stop or asyncio.Event()).wait()
    finally:
        sweeper.cancel()
        server.close()
        for conn in list(connections):
            if conn.transport is not None:
                conn.transport.close()
        await gateway.close()

