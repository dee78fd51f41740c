"""The terminal pipeline stage: send the request to a backend, fail over, stream the answer back.

Retry rule: a request is re-sent to the next candidate only while nothing has been sent
to the client. The client's response head is held back until the first body bytes from
the backend have arrived, so connect errors, first-byte timeouts, 5xx/429 answers and
streams that die before their first bytes are all retried. After the first byte the
request is never retried; if the backend fails mid-stream the client gets an SSE error
event and a properly terminated response, never a hang.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from hasten.gateway.config import GatewayConfig
from hasten.gateway.health import BackendState
from hasten.gateway.metrics import GatewayMetrics
from hasten.gateway.pipeline import GatewayError, GatewayResponse, RequestContext
from hasten.gateway.relay import Relay
from hasten.gateway.routing import Pool
from hasten.gateway.tracing import NOOP_SPAN, Tracer
from hasten.gateway.upstream import UpstreamPool

log = logging.getLogger("hasten.gateway")

# headers never forwarded upstream (hop-by-hop, recomputed, or gateway credentials)
_DROP_UP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "upgrade",
                      "host", "content-length", "authorization", "x-api-key", "trailer", "expect",
                      "http2-settings", "accept-encoding", "x-request-id"})
# headers never copied from the backend response to the client
_DROP_DOWN = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date",
                        "trailer", "upgrade", "proxy-authenticate", "x-request-id"})


class _Retryable(Exception):
    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


class Proxy:
    def __init__(self, cfg: GatewayConfig, metrics: GatewayMetrics, tracer: Tracer) -> None:
        self._cfg = cfg
        self.metrics = metrics
        self._tracer = tracer
        self._pools: dict[str, UpstreamPool] = {}
        for pool_cfg in cfg.models:
            for b in pool_cfg.backends:
                self._pools.setdefault(b.url, UpstreamPool(b.host, b.port, cfg.timeouts.connect_s))
        self.active: set[Relay] = set()  # streams handed to a client
        self.first_byte_s = cfg.timeouts.first_byte_s
        self.awaiting: set[Relay] = set()  # requests sent, first byte not yet in (relays keep it)
        self._watchdog: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._watchdog = asyncio.get_running_loop().create_task(self._watch_idle())

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            try:
                await self._watchdog
            except (asyncio.CancelledError, Exception):
                pass
        for relay in [*self.active, *self.awaiting]:
            relay.abort()
        for p in self._pools.values():
            p.close()

    async def _watch_idle(self) -> None:
        """Enforce first-byte and idle timeouts. One periodic check instead of a timer per request:
        a timeout fires at most 1/8 of the first-byte timeout (1/4 of the idle timeout) late."""
        idle = self._cfg.timeouts.idle_s
        while True:
            await asyncio.sleep(min(1.0, idle / 4, self.first_byte_s / 8))
            now = time.monotonic()
            for relay in [r for r in self.awaiting if now >= r.deadline]:
                relay.first_byte_timeout()
            for relay in list(self.active):
                if now - relay.last_activity > idle:
                    relay.fail_now(TimeoutError(f"no data from backend for {idle:g}s"), "timeout")

    # -- request path -----------------------------------------------------------------

    async def forward(self, ctx: RequestContext) -> GatewayResponse:
        pool = ctx.pool
        assert pool is not None, "the parse stage sets ctx.pool"
        inp, candidates = self._route(ctx, pool)
        # a failed fast-path attempt already used one try on these backends
        tried: set[str] = ctx.attrs.get("_tried", set())
        last: _Retryable | None = ctx.attrs.get("_last_error")
        candidates = [b for b in candidates if b.url not in tried]
        if not candidates and last is None:
            raise GatewayError(503, f"no healthy backend available for model {pool.name!r}",
                               "server_error", "no_healthy_backend")
        span = self._tracer.start("gateway.request", {"gateway.model": pool.name,
                                                      "gateway.request_id": ctx.request_id})
        attempts = candidates[: max(0, 1 + self._cfg.max_retries - len(tried))]
        for i, backend in enumerate(attempts):
            if i or tried:
                self.metrics.retries.inc(pool.name)
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
        n = len(attempts) + len(tried)
        span.set_attribute("gateway.attempts", n)
        span.end()
        if last is None:
            raise GatewayError(503, f"no healthy backend available for model {pool.name!r}",
                               "server_error", "no_healthy_backend")
        status = 503 if last.status in (429, 503) else 502
        raise GatewayError(status, f"no backend could serve the request after {n} attempt(s); "
                                   f"last error: {last}", "server_error", "upstream_unavailable")

    @staticmethod
    def _route(ctx: RequestContext, pool: Pool) -> tuple[Any, list[BackendState]]:
        cached = ctx.attrs.pop("_route", None)
        if cached is not None:
            inp, candidates = cached
            now = time.monotonic()
            return inp, [b for b in candidates if b.available(now)]
        inp = pool.route_input(ctx.payload, ctx.header(pool.config.session_header), ctx.region)
        return inp, pool.candidates(inp)

    def _request_bytes(self, ctx: RequestContext, pool: Pool, backend: BackendState, span: Any) -> bytes:
        cfg = backend.config
        parts = [f"{ctx.method} {ctx.path} HTTP/1.1\r\nhost: {cfg.host}:{cfg.port}\r\n"]
        for k, v in ctx.headers.items():  # names are lower case (RequestContext)
            if k not in _DROP_UP:
                parts.append(f"{k}: {v}\r\n")
        parts.append(f"x-request-id: {ctx.request_id}\r\n")
        if cfg.api_key:
            parts.append(f"authorization: Bearer {cfg.api_key}\r\n")
        if self._tracer.enabled:
            extra: dict[str, str] = {}
            self._tracer.inject(span, extra)
            parts.extend(f"{k}: {v}\r\n" for k, v in extra.items())
        body = ctx.body
        target = cfg.backend_model or pool.config.backend_model
        if target and ctx.payload is not None and ctx.payload.get("model") != target:
            cache = ctx.attrs.setdefault("_bodies", {})
            body = cache.get(target)
            if body is None:
                body = cache[target] = json.dumps({**ctx.payload, "model": target}).encode()
        parts.append(f"content-length: {len(body)}\r\n\r\n")
        return "".join(parts).encode("latin-1") + body

    async def _attempt(self, ctx: RequestContext, pool: Pool, backend: BackendState, span: Any,
                       first: bool) -> GatewayResponse:
        m = self.metrics
        raw = self._request_bytes(ctx, pool, backend, span)
        upstream = self._pools[backend.url]
        backend.breaker.on_attempt(time.monotonic())
        backend.in_flight += 1
        m.backend_requests.inc(pool.name, backend.url)
        sent_at = time.perf_counter()
        if first:
            m.added_latency.observe(sent_at - ctx.received_at, pool.name)
        relay: Relay | None = None
        try:
            for fresh in (False, True):
                try:
                    conn = await upstream.acquire(fresh=fresh)
                except (OSError, TimeoutError) as exc:
                    kind = "timeout" if isinstance(exc, TimeoutError) else "connect"
                    raise _Retryable(kind, f"cannot connect to {backend.url}: {exc!r}") from None
                relay = Relay(self, ctx, pool, backend, conn, span)
                relay.send(raw)
                await relay.ready
                if relay.error is None:
                    break
                if conn.reused and not conn.got_bytes and not relay.timed_out and not fresh:
                    continue  # a pooled keep-alive connection had gone stale: retry on a fresh one
                kind = "timeout" if relay.timed_out else "stream"
                raise _Retryable(kind, f"{kind} error from {backend.url}: {relay.error!r}")
            assert relay is not None
            if relay.status >= 500 or relay.status == 429:
                detail = relay.peek()[:200].decode("utf-8", "replace")
                relay.abort()
                raise _Retryable("status", f"HTTP {relay.status} from {backend.url}: {detail}", relay.status)
        except _Retryable as exc:
            self.fail(pool, backend, exc.kind, count_breaker=exc.status != 429)
            raise
        except BaseException:  # cancelled (client went away) or a bug: release the backend
            backend.in_flight -= 1
            if relay is not None:
                relay.abort()
            raise
        return self._success(ctx, pool, backend, relay, span, sent_at)

    def _success(self, ctx: RequestContext, pool: Pool, backend: BackendState, relay: Relay, span: Any,
                 sent_at: float) -> GatewayResponse:
        m = self.metrics
        backend.breaker.on_success()
        backend.observe_latency((time.perf_counter() - sent_at) * 1000)
        if span is not NOOP_SPAN:
            span.set_attribute("gateway.backend", backend.url)
            span.set_attribute("http.status_code", relay.status)
        headers = {k: v for k, v in relay.headers.items() if k not in _DROP_DOWN}  # finalize adds x-request-id
        if relay.complete:
            body = relay.take_body()
            backend.in_flight -= 1
            span.end()
            now = time.perf_counter()
            m.ttft.observe(now - ctx.received_at, pool.name)
            m.e2e.observe(now - ctx.received_at, pool.name)
            return GatewayResponse(relay.status, headers, body=body)
        relay.activate()
        return GatewayResponse(relay.status, headers, stream=relay)

    # -- fast path: first attempt without any task switch -------------------------------------

    def start_fast(self, ctx: RequestContext, done: Callable[[GatewayResponse | None], None]) -> Relay | None:
        """Send to the primary backend now, on a pooled connection, from the caller's callback.

        Returns None when that is not possible (no idle connection, no candidate): the caller
        then uses the async path. Otherwise ``done`` is called from the upstream socket's
        callback with the response once the first byte arrived, or with None if this attempt
        failed before any byte; the caller then runs the async path, which skips the backend
        tried here and counts this attempt.
        """
        pool = ctx.pool
        assert pool is not None
        inp, candidates = self._route(ctx, pool)
        backend = candidates[0] if candidates else None
        conn = self._pools[backend.url].take_idle() if backend is not None else None
        if backend is None or conn is None:
            ctx.attrs["_route"] = (inp, candidates)  # the async path reuses this decision (policies keep state)
            return None
        span = (self._tracer.start("gateway.request", {"gateway.model": pool.name,
                                                       "gateway.request_id": ctx.request_id})
                if self._tracer.enabled else NOOP_SPAN)
        raw = self._request_bytes(ctx, pool, backend, span)
        backend.breaker.on_attempt(time.monotonic())
        backend.in_flight += 1
        self.metrics.backend_requests.inc(pool.name, backend.url)
        sent_at = time.perf_counter()
        self.metrics.added_latency.observe(sent_at - ctx.received_at, pool.name)
        relay = Relay(self, ctx, pool, backend, conn, span)

        def ready() -> None:
            resp = self._fast_outcome(ctx, pool, backend, relay, inp, span, sent_at)
            if resp is None:
                ctx.attrs["_route"] = (inp, candidates)
            done(resp)

        relay.on_ready = ready
        relay.send(raw)
        return relay

    def _fast_outcome(self, ctx: RequestContext, pool: Pool, backend: BackendState, relay: Relay,
                      inp: Any, span: Any, sent_at: float) -> GatewayResponse | None:
        err: _Retryable | None = None
        if relay.error is not None:
            if relay.conn.reused and not relay.conn.got_bytes and not relay.timed_out:
                backend.in_flight -= 1  # a stale pooled connection: not the backend's fault, not a try
                span.end()
                return None
            kind = "timeout" if relay.timed_out else "stream"
            err = _Retryable(kind, f"{kind} error from {backend.url}: {relay.error!r}")
        elif relay.status >= 500 or relay.status == 429:
            detail = relay.peek()[:200].decode("utf-8", "replace")
            relay.abort()
            err = _Retryable("status", f"HTTP {relay.status} from {backend.url}: {detail}", relay.status)
        if err is not None:
            self.fail(pool, backend, err.kind, count_breaker=err.status != 429)
            log.info("request %s: backend %s failed before first byte (%s); retrying", ctx.request_id,
                     backend.url, err)
            ctx.attrs.setdefault("_tried", set()).add(backend.url)
            ctx.attrs["_last_error"] = err
            span.end()
            return None
        pool.policy.commit(inp, backend)
        span.set_attribute("gateway.attempts", 1)
        return self._success(ctx, pool, backend, relay, span, sent_at)

    def cancel_fast(self, relay: Relay) -> None:
        """The client went away while a fast-path attempt waited for its first byte."""
        if relay.on_ready is not None:
            relay.on_ready = None
            relay.abort()
            relay.backend.in_flight -= 1
            relay.span.end()

    def fail(self, pool: Pool, backend: BackendState, kind: str, count_breaker: bool = True,
             release: bool = True) -> None:
        """Account one failed exchange with ``backend`` (``release``: free its in-flight slot too)."""
        if release:
            backend.in_flight -= 1
        self.metrics.backend_errors.inc(pool.name, backend.url, kind)
        if count_breaker and backend.breaker.on_failure(time.monotonic()):
            self.metrics.breaker_opened.inc(pool.name, backend.url)
            log.warning("circuit breaker opened for %s after %s error", backend.url, kind)
