"""The terminal pipeline stage: send the request to a backend, fail over, stream the answer back.

Retry rule: a request is re-sent to the next candidate only while nothing has been sent
to the client. The client's response headers are held back until the first body chunk
from the backend has arrived, so connect errors, first-byte timeouts, 5xx/429 answers and
streams that die before their first chunk are all retried. After the first byte the
request is never retried; if the backend fails mid-stream the client gets an SSE error
event and a properly terminated response, never a hang.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp

from hasten.gateway.config import GatewayConfig
from hasten.gateway.health import BackendState
from hasten.gateway.metrics import GatewayMetrics
from hasten.gateway.pipeline import GatewayError, GatewayResponse, RequestContext
from hasten.gateway.routing import Pool
from hasten.gateway.tracing import Tracer

log = logging.getLogger("hasten.gateway")

# headers never forwarded upstream (hop-by-hop, recomputed, or gateway credentials)
_DROP_UP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "upgrade",
                      "host", "content-length", "authorization", "x-api-key", "trailer", "expect",
                      "http2-settings", "accept-encoding"})
# headers never copied from the backend response to the client
_DROP_DOWN = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date",
                        "trailer", "upgrade", "proxy-authenticate"})


class _Retryable(Exception):
    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


def sse_error_event(message: str, code: str = "upstream_stream_error") -> bytes:
    payload = {"error": {"message": message, "type": "server_error", "code": code}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


class Proxy:
    def __init__(self, cfg: GatewayConfig, metrics: GatewayMetrics, tracer: Tracer) -> None:
        self._cfg = cfg
        self._metrics = metrics
        self._tracer = tracer
        self.session: aiohttp.ClientSession | None = None
        self._active: set[_Relay] = set()
        self._watchdog: asyncio.Task[None] | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60.0,
                                         ttl_dns_cache=None, force_close=False)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._cfg.timeouts.connect_s)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                             skip_auto_headers=("User-Agent", "Accept-Encoding"))
        self._watchdog = asyncio.get_running_loop().create_task(self._watch_idle())

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            try:
                await self._watchdog
            except (asyncio.CancelledError, Exception):
                pass
        if self.session is not None:
            await self.session.close()

    async def _watch_idle(self) -> None:
        idle = self._cfg.timeouts.idle_s
        while True:
            await asyncio.sleep(min(1.0, idle / 4))
            now = time.monotonic()
            for a in list(self._active):
                if not a.timed_out and now - a.last_activity > idle:
                    a.timed_out = True
                    a.resp.content.set_exception(TimeoutError(f"no data from backend for {idle:g}s"))

    # -- request path -----------------------------------------------------------------

    async def forward(self, ctx: RequestContext) -> GatewayResponse:
        pool = ctx.pool
        assert pool is not None, "the parse stage sets ctx.pool"
        inp = pool.route_input(ctx.payload, ctx.header(pool.config.session_header), ctx.region)
        candidates = pool.candidates(inp)
        if not candidates:
            raise GatewayError(503, f"no healthy backend available for model {pool.name!r}",
                               "server_error", "no_healthy_backend")
        span = self._tracer.start("gateway.request", {"gateway.model": pool.name,
                                                      "gateway.request_id": ctx.request_id})
        last: _Retryable | None = None
        attempts = candidates[: 1 + self._cfg.max_retries]
        for i, backend in enumerate(attempts):
            if i:
                self._metrics.retries.inc(pool.name)
            try:
                resp = await self._attempt(ctx, pool, backend, span, first=(i == 0))
            except _Retryable as exc:
                last = exc
                log.info("request %s: backend %s failed before first byte (%s); %s", ctx.request_id,
                         backend.url, exc, "retrying" if i + 1 < len(attempts) else "giving up")
                continue
            pool.policy.commit(inp, backend)
            span.set_attribute("gateway.attempts", i + 1)
            return resp
        span.set_attribute("gateway.attempts", len(attempts))
        span.end()
        assert last is not None
        status = 503 if last.status in (429, 503) else 502
        raise GatewayError(status, f"no backend could serve the request after {len(attempts)} attempt(s); "
                                   f"last error: {last}", "server_error", "upstream_unavailable")

    def _upstream(self, ctx: RequestContext, pool: Pool, backend: BackendState, span: Any
                  ) -> tuple[dict[str, str], bytes]:
        headers = {k: v for k, v in ctx.headers.items() if k.lower() not in _DROP_UP}
        headers["X-Request-ID"] = ctx.request_id
        if backend.config.api_key:
            headers["Authorization"] = f"Bearer {backend.config.api_key}"
        self._tracer.inject(span, headers)
        body = ctx.body
        target = backend.config.backend_model or pool.config.backend_model
        if target and ctx.payload is not None and ctx.payload.get("model") != target:
            cache = ctx.attrs.setdefault("_bodies", {})
            body = cache.get(target)
            if body is None:
                body = cache[target] = json.dumps({**ctx.payload, "model": target}).encode()
        return headers, body

    async def _attempt(self, ctx: RequestContext, pool: Pool, backend: BackendState, span: Any,
                       first: bool) -> GatewayResponse:
        assert self.session is not None
        m = self._metrics
        headers, body = self._upstream(ctx, pool, backend, span)
        backend.breaker.on_attempt(time.monotonic())
        backend.in_flight += 1
        m.backend_requests.inc(pool.name, backend.url)
        sent_at = time.perf_counter()
        if first:
            m.added_latency.observe(sent_at - ctx.received_at, pool.name)
        resp: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(self._cfg.timeouts.connect_s + self._cfg.timeouts.first_byte_s):
                resp = await self.session.request(ctx.method, backend.url + ctx.path, data=body,
                                                  headers=headers)
                if resp.status >= 500 or resp.status == 429:
                    detail = (await resp.read())[:200].decode("utf-8", "replace")
                    raise _Retryable("status", f"HTTP {resp.status} from {backend.url}: {detail}",
                                     resp.status)
                ctype = resp.headers.get("Content-Type", "")
                if resp.content_length is not None and not ctype.startswith("text/event-stream"):
                    data = await resp.read()
                    first_chunk = None
                else:
                    data = b""
                    first_chunk = await resp.content.readany()
        except _Retryable as exc:
            self._fail(pool, backend, exc.kind, count_breaker=exc.status != 429)
            if resp is not None:
                resp.release()
            raise
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            kind = "timeout" if isinstance(exc, TimeoutError) else (
                "connect" if isinstance(exc, aiohttp.ClientConnectorError) else "stream")
            self._fail(pool, backend, kind)
            if resp is not None:
                resp.close()
            raise _Retryable(kind, f"{kind} error from {backend.url}: {exc!r}") from None
        except BaseException:
            backend.in_flight -= 1
            if resp is not None:
                resp.close()
            raise
        backend.breaker.on_success()
        backend.observe_latency((time.perf_counter() - sent_at) * 1000)
        span.set_attribute("gateway.backend", backend.url)
        span.set_attribute("http.status_code", resp.status)
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP_DOWN}
        out_headers["X-Request-ID"] = ctx.request_id
        if first_chunk is None:
            backend.in_flight -= 1
            resp.release()
            span.end()
            now = time.perf_counter()
            m.ttft.observe(now - ctx.received_at, pool.name)
            m.e2e.observe(now - ctx.received_at, pool.name)
            return GatewayResponse(resp.status, out_headers, body=data)
        is_sse = resp.headers.get("Content-Type", "").startswith("text/event-stream")
        stream = _Relay(self, ctx, pool, backend, resp, first_chunk, is_sse, span)
        return GatewayResponse(resp.status, out_headers, stream=stream)

    def _fail(self, pool: Pool, backend: BackendState, kind: str, count_breaker: bool = True) -> None:
        backend.in_flight -= 1
        self._metrics.backend_errors.inc(pool.name, backend.url, kind)
        if count_breaker and backend.breaker.on_failure(time.monotonic()):
            self._metrics.breaker_opened.inc(pool.name, backend.url)
            log.warning("circuit breaker opened for %s after %s error", backend.url, kind)


class _Relay:
    """Async iterator over the backend's body chunks, as they arrive, for the frontend to write.

    Timing: when the frontend asks for the next chunk, the previous one has been written
    to the client socket, so that moment closes the per-chunk forwarding measurement.
    ``aclose`` releases the backend connection exactly once, even if iteration never began.
    """

    def __init__(self, proxy: Proxy, ctx: RequestContext, pool: Pool, backend: BackendState,
                 resp: aiohttp.ClientResponse, first_chunk: bytes, is_sse: bool, span: Any) -> None:
        self._proxy = proxy
        self._ctx = ctx
        self._pool = pool
        self._backend = backend
        self.resp = resp
        self._content = resp.content
        self._first: bytes | None = first_chunk
        self._is_sse = is_sse
        self._span = span
        self._arrived: float | None = None
        self._sent_first = False
        self._done = False
        self._closed = False
        self._clean = False
        self.timed_out = False
        self.last_activity = time.monotonic()
        proxy._active.add(self)

    def __aiter__(self) -> _Relay:
        return self

    async def __anext__(self) -> bytes:
        if self._arrived is not None:
            now = time.perf_counter()
            metrics = self._proxy._metrics
            metrics.chunk_delay.observe(now - self._arrived, self._pool.name)
            if not self._sent_first:
                self._sent_first = True
                metrics.ttft.observe(now - self._ctx.received_at, self._pool.name)
            self._arrived = None
        if self._first is not None:
            chunk, self._first = self._first, None
            if chunk:
                self._arrived = time.perf_counter()
                return chunk
        if not self._done:
            try:
                chunk = await self._content.readany()
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                self._done = True
                event = self._on_error(exc)
                if event:
                    return event
                chunk = b""
            if chunk:
                self._arrived = time.perf_counter()
                self.last_activity = time.monotonic()
                return chunk
            self._clean = not self._done
            self._done = True
        await self.aclose()
        raise StopAsyncIteration

    def _on_error(self, exc: BaseException) -> bytes:
        kind = "timeout" if self.timed_out else "stream"
        log.warning("request %s: backend %s failed mid-stream: %r", self._ctx.request_id, self._backend.url, exc)
        self._backend.in_flight += 1  # _fail decrements; aclose does the real release
        self._proxy._fail(self._pool, self._backend, kind)
        self._span.set_attribute("gateway.stream_error", kind)
        if self._is_sse:
            return sse_error_event(f"backend failed after the response started: {kind} error")
        return b""

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._proxy._active.discard(self)
        self._backend.in_flight -= 1
        if self._clean:
            self.resp.release()
        else:
            self.resp.close()
        self._proxy._metrics.e2e.observe(time.perf_counter() - self._ctx.received_at, self._pool.name)
        self._span.end()
