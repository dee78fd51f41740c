"""The terminal pipeline stage: send the request to a backend, fail over, stream the answer back.

Retry rule: a request is re-sent to the next candidate only while nothing has been sent
to the client, and only when the replica could not take it (connect error, first-byte
timeout, a status in the pool's ``retry.on_status``: 429 and 503 by default). A request
the replica took and failed (another 5xx, or the connection breaking before any response
byte) is not retried and is remembered in the pool's poison set (``retry.py``); the client
gets the replica's own answer. The client's response head is held back until the first
body bytes from the backend have arrived. After the first byte the request is never
retried; if the backend fails mid-stream the client gets an SSE error event and a properly
terminated response, never a hang.

Load accounting: ``BackendState.in_flight`` counts a request from the moment it is routed
to a backend, also while it waits for a connection on the async path (a *reservation*,
``ctx.attrs["_reserved"]``), so requests routed in the same event-loop turn see each other.
Every count is released exactly once: by the relay at the end of the exchange, by the
failure paths, by ``forward`` when the reserved backend is not the one it tries, or by
:meth:`Proxy.release_reservation` when the client goes away first.

Tenant isolation: with tenants configured, chat and completion bodies get the tenant's
``cache_salt`` (an HMAC of the tenant name), replacing any value the client sent.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import secrets
import time
from collections.abc import Callable
from typing import Any

import orjson

from hasten.gateway.config import GatewayConfig
from hasten.gateway.health import BackendState, BreakerState
from hasten.gateway.metrics import GatewayMetrics
from hasten.gateway.pipeline import GatewayError, GatewayResponse, RequestContext
from hasten.gateway.relay import Relay
from hasten.gateway.retry import request_key
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
    """The replica could not take the request: try the next candidate."""

    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


class _Failed(Exception):
    """The replica took the request and failed it: charged to the request, not retried."""

    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


def tenant_salt(secret: str, tenant: str) -> str:
    """The ``cache_salt`` of a tenant: 128 bits of HMAC-SHA256(secret, tenant name), in hex."""
    msg = b"hasten-gateway cache salt\x00" + tenant.encode("utf-8", "surrogatepass")
    return hmac.new(secret.encode("utf-8", "surrogatepass"), msg, hashlib.sha256).hexdigest()[:32]


def _salted_path(path: str) -> bool:
    """Bodies that carry a cache salt: /v1/completions and /v1/chat/completions."""
    return path.split("?", 1)[0].endswith("/completions")


class Proxy:
    def __init__(self, cfg: GatewayConfig, metrics: GatewayMetrics, tracer: Tracer) -> None:
        self._cfg = cfg
        self.metrics = metrics
        self._tracer = tracer
        self._pools: dict[str, UpstreamPool] = {}
        for pool_cfg in cfg.models:
            for b in pool_cfg.backends:
                self._pools.setdefault(b.url, UpstreamPool(b.host, b.port, cfg.timeouts.connect_s,
                                                           preconnect=cfg.preconnect))
        self.active: set[Relay] = set()  # streams handed to a client
        self.first_byte_s = cfg.timeouts.first_byte_s
        self.awaiting: set[Relay] = set()  # requests sent, first byte not yet in (relays keep it)
        self._watchdog: asyncio.Task[None] | None = None
        self._salts: dict[str, str] = {}  # tenant name -> cache_salt
        if cfg.tenants and cfg.cache_salt.enabled:
            secret = cfg.cache_salt.secret
            if secret is None:
                secret = secrets.token_hex(32)
                log.warning("cache_salt.secret is not set: tenant cache salts are random for this process, so "
                            "another gateway instance (or this one after a restart) gives a tenant other salts "
                            "and the replicas' cached prefixes are not shared between them; set the same "
                            "cache_salt.secret on every instance")
            self._salts = {t.name: tenant_salt(secret, t.name) for t in cfg.tenants}

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

    async def probe(self, url: str, path: str, timeout_s: float) -> int:
        """An active health probe of ``url`` on that backend's connection pool (health.py)."""
        return await self._pools[url].probe(path, timeout_s)

    def upstream(self, url: str) -> UpstreamPool:
        return self._pools[url]

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
        held: BackendState | None = ctx.attrs.pop("_reserved", None)  # routed by the fast path, counted
        try:
            self._refuse_poisoned(ctx, pool)
            inp, candidates = self._route(ctx, pool)
            # a failed fast-path attempt already used one try on these backends
            tried: set[str] = ctx.attrs.get("_tried", set())
            last: _Retryable | None = ctx.attrs.get("_last_error")
            stale: str | None = ctx.attrs.pop("_stale", None)
            candidates = [b for b in candidates if b.url not in tried]
            attempts = candidates[: max(0, 1 + self._cfg.max_retries - len(tried))]
            if held is not None and (not attempts or attempts[0] is not held):
                self._release(held)  # the reserved backend is not the one tried first (any more)
                held = None
            if not attempts and last is None:
                raise GatewayError(503, f"no healthy backend available for model {pool.name!r}",
                                   "server_error", "no_healthy_backend")
            span = self._tracer.start("gateway.request", {"gateway.model": pool.name,
                                                          "gateway.request_id": ctx.request_id})
        except BaseException:
            self._release(held)
            raise
        for i, backend in enumerate(attempts):
            if i or tried:
                self.metrics.retries.inc(pool.name)
            try:
                resp = await self._attempt(ctx, pool, backend, span, first=(i == 0),
                                           held=(i == 0 and held is not None), stale=(stale == backend.url))
            except _Retryable as exc:
                last = exc
                log.info("request %s: backend %s failed before first byte (%s); %s", ctx.request_id,
                         backend.url, exc, "retrying" if i + 1 < len(attempts) else "giving up")
                continue
            span.set_attribute("gateway.attempts", i + 1)
            if resp.status < 500:
                pool.policy.commit(inp, backend)
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

    def _route(self, ctx: RequestContext, pool: Pool) -> tuple[Any, list[BackendState]]:
        cached = ctx.attrs.pop("_route", None)
        if cached is not None:
            inp, candidates = cached
            now = time.monotonic()
            return inp, [b for b in candidates if b.available(now)]
        payload = ctx.payload if pool.reads_prompt else None
        inp = pool.route_input(payload, ctx.header(pool.config.session_header), ctx.region, self._salt(ctx))
        return inp, pool.candidates(inp)

    def _salt(self, ctx: RequestContext) -> str | None:
        if ctx.tenant is None or not self._salts or not _salted_path(ctx.path):
            return None
        return self._salts.get(ctx.tenant.name)

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
        salt = self._salt(ctx)
        if target or salt is not None:
            payload = ctx.payload
            if payload is not None:
                model = target if target and payload.get("model") != target else None
                if salt is not None and payload.get("cache_salt") == salt:
                    salt = None
                if model is not None or salt is not None:
                    cache = ctx.attrs.setdefault("_bodies", {})  # per upstream model name
                    body = cache.get(target)
                    if body is None:
                        new = dict(payload)
                        if model is not None:
                            new["model"] = model
                        if salt is not None:
                            new["cache_salt"] = salt  # the tenant's salt wins over the client's
                        body = cache[target] = orjson.dumps(new)
        parts.append(f"content-length: {len(body)}\r\n\r\n")
        return "".join(parts).encode("latin-1") + body

    async def _attempt(self, ctx: RequestContext, pool: Pool, backend: BackendState, span: Any,
                       first: bool, held: bool = False, stale: bool = False) -> GatewayResponse:
        """One try on ``backend``. ``held``: its in-flight slot is this request's reservation;
        ``stale``: a pooled connection to it broke under this request just before (fast path)."""
        m = self.metrics
        if not held:
            backend.in_flight += 1
        relay: Relay | None = None
        sent_at = time.perf_counter()
        try:
            raw = self._request_bytes(ctx, pool, backend, span)
            upstream = self._pools[backend.url]
            backend.breaker.on_attempt(time.monotonic())
            m.backend_requests.inc(pool.name, backend.url)
            sent_at = time.perf_counter()
            if first:
                m.added_latency.observe(sent_at - ctx.received_at, pool.name)
            for fresh in (False, True):
                try:
                    conn = await upstream.acquire(fresh=fresh)
                except (OSError, TimeoutError) as exc:
                    if stale and not isinstance(exc, TimeoutError) and not pool.config.retry.on_failure:
                        # it broke the connection that held this request and now refuses new ones:
                        # the replica went down while it had the request
                        raise _Failed("stream", f"{backend.url} closed the connection before answering and "
                                                f"then refused a new one: {exc!r}") from None
                    kind = "timeout" if isinstance(exc, TimeoutError) else "connect"
                    raise _Retryable(kind, f"cannot connect to {backend.url}: {exc!r}") from None
                relay = Relay(self, ctx, pool, backend, conn, span)
                relay.send(raw)
                await relay.ready
                if relay.error is None or fresh or not self._stale(relay):
                    break
                stale = True  # a pooled keep-alive connection had gone stale: retry on a fresh one
            assert relay is not None
            verdict = self._verdict(pool, backend, relay)
            if verdict is not None:
                raise verdict
        except _Retryable as exc:
            if relay is not None:
                relay.abort()
            self.fail(pool, backend, exc.kind, count_breaker=exc.status != 429)
            raise
        except _Failed as exc:
            return self._request_failed(ctx, pool, backend, relay, span, sent_at, exc)
        except BaseException:  # cancelled (client went away) or a bug: release the backend
            backend.in_flight -= 1
            if relay is not None:
                relay.abort()
            raise
        return self._deliver(ctx, pool, backend, relay, span, sent_at, ok=True)

    @staticmethod
    def _stale(relay: Relay) -> bool:
        """A pooled connection that broke before any byte: it had most likely been closed by the
        backend while idle (not the backend's fault and not a try; checked by a fresh connection)."""
        return relay.conn.reused and not relay.conn.got_bytes and not relay.timed_out

    @staticmethod
    def _verdict(pool: Pool, backend: BackendState, relay: Relay) -> _Retryable | _Failed | None:
        """Classify an exchange at its first byte (or failure): None = deliver it to the client."""
        retry = pool.config.retry
        if relay.error is not None:
            kind = "timeout" if relay.timed_out else "stream"
            message = f"{kind} error from {backend.url}: {relay.error!r}"
            if relay.timed_out or retry.on_failure:
                return _Retryable(kind, message)
            return _Failed(kind, message)
        status = relay.status
        if status in retry.on_status or (status >= 500 and retry.on_failure):
            detail = relay.peek()[:200].decode("utf-8", "replace")
            return _Retryable("status", f"HTTP {status} from {backend.url}: {detail}", status)
        if status >= 500:
            return _Failed("status", f"HTTP {status} from {backend.url}", status)
        return None

    def _request_failed(self, ctx: RequestContext, pool: Pool, backend: BackendState, relay: Relay | None,
                        span: Any, sent_at: float, exc: _Failed) -> GatewayResponse:
        """The replica failed this request: charge it, never retry it, give the client the replica's
        own answer (or a 500 when the connection broke)."""
        breaker = backend.breaker
        healthy = breaker.state is BreakerState.CLOSED and breaker.failures == 0
        self._count_failure(pool, backend, exc.kind, count_breaker=True)
        blocked = False
        if pool.poison.enabled:
            entry = pool.poison.charge(self._poison_key(ctx), backend.url, exc.status, time.monotonic(), healthy)
            blocked = entry.blocked
        log.warning("request %s failed on %s (%s); not retried on another replica%s", ctx.request_id,
                    backend.url, exc, "; identical requests are refused for a while" if blocked else "")
        if exc.status is not None and relay is not None:
            return self._deliver(ctx, pool, backend, relay, span, sent_at, ok=False)
        if relay is not None:
            relay.abort()
        backend.in_flight -= 1
        span.end()
        return GatewayResponse.from_error(GatewayError(
            500, "the replica closed the connection while handling this request, before the response started; "
                 "the request is not retried on another replica because it may be what made the replica fail",
            "server_error", "request_failed_upstream"))

    def _deliver(self, ctx: RequestContext, pool: Pool, backend: BackendState, relay: Relay, span: Any,
                 sent_at: float, ok: bool) -> GatewayResponse:
        """Hand the exchange to the client (``ok``: a success for the breaker and the poison set)."""
        m = self.metrics
        if ok:
            backend.breaker.on_success()
            backend.last_success = time.monotonic()
            backend.observe_latency((time.perf_counter() - sent_at) * 1000)
            if pool.poison and relay.status < 400:  # it was served: not what made a replica fail
                pool.poison.forgive(self._poison_key(ctx))
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

    # -- poison set and reservations ------------------------------------------------------

    @staticmethod
    def _poison_key(ctx: RequestContext) -> bytes:
        return request_key(ctx.tenant.name if ctx.tenant is not None else None, ctx.path, ctx.body)

    def _refuse_poisoned(self, ctx: RequestContext, pool: Pool) -> None:
        if not pool.poison:
            return
        now = time.monotonic()
        entry = pool.poison.blocked(self._poison_key(ctx), now)
        if entry is None:
            return
        self.metrics.poison_rejected.inc(pool.name)
        what = f"HTTP {entry.status}" if entry.status is not None else "its connection closed before the response"
        left = max(1, math.ceil(pool.poison.ttl_s - (now - entry.at)))
        raise GatewayError(500, f"an identical request failed on a replica of model {pool.name!r} ({what}) "
                                f"{now - entry.at:.0f}s ago; the gateway refuses it for {left}s more so that "
                                "it cannot make another replica fail", "server_error", "poison_request")

    @staticmethod
    def _reserve(ctx: RequestContext, backend: BackendState) -> None:
        """Count the request on ``backend`` now, before the async path gets to send it."""
        backend.in_flight += 1
        ctx.attrs["_reserved"] = backend

    @staticmethod
    def _release(backend: BackendState | None) -> None:
        if backend is not None:
            backend.in_flight -= 1

    def release_reservation(self, ctx: RequestContext) -> None:
        """The request will not be forwarded (its client went away): free its reserved slot (idempotent)."""
        self._release(ctx.attrs.pop("_reserved", None))

    def _hand_over(self, ctx: RequestContext, inp: Any, candidates: list[BackendState]) -> None:
        """Leave the request to the async path: keep the routing decision and reserve the backend
        that path will try first."""
        ctx.attrs["_route"] = (inp, candidates)
        tried = ctx.attrs.get("_tried", ())
        now = time.monotonic()
        nxt = next((b for b in candidates if b.url not in tried and b.available(now)), None)
        if nxt is not None:
            self._reserve(ctx, nxt)

    # -- fast path: first attempt without any task switch -------------------------------------

    def start_fast(self, ctx: RequestContext, done: Callable[[GatewayResponse | None], None]) -> Relay | None:
        """Send to the primary backend now, on a pooled connection, from the caller's callback.

        Returns None when that is not possible (no idle connection, no candidate, a refused
        request): the caller then uses the async path, for which the primary backend is
        reserved. Otherwise ``done`` is called from the upstream socket's callback with the
        response once the first byte arrived, or with None if this attempt failed before any
        byte in a way that may be retried; the caller then runs the async path, which skips
        the backend tried here and counts this attempt.
        """
        pool = ctx.pool
        assert pool is not None
        if pool.poison and pool.poison.blocked(self._poison_key(ctx), time.monotonic()) is not None:
            return None  # forward() refuses it
        inp, candidates = self._route(ctx, pool)
        backend = candidates[0] if candidates else None
        conn = self._pools[backend.url].take_idle() if backend is not None else None
        if backend is None or conn is None:
            self._hand_over(ctx, inp, candidates)
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
            done(self._fast_outcome(ctx, pool, backend, relay, inp, candidates, span, sent_at))

        relay.on_ready = ready
        relay.send(raw)
        return relay

    def _fast_outcome(self, ctx: RequestContext, pool: Pool, backend: BackendState, relay: Relay,
                      inp: Any, candidates: list[BackendState], span: Any,
                      sent_at: float) -> GatewayResponse | None:
        if relay.error is not None and self._stale(relay):
            backend.in_flight -= 1  # a stale pooled connection: not the backend's fault, not a try
            span.end()
            ctx.attrs["_stale"] = backend.url
            self._hand_over(ctx, inp, candidates)
            return None
        verdict = self._verdict(pool, backend, relay)
        if isinstance(verdict, _Failed):
            return self._request_failed(ctx, pool, backend, relay, span, sent_at, verdict)
        if verdict is not None:
            relay.abort()
            self.fail(pool, backend, verdict.kind, count_breaker=verdict.status != 429)
            log.info("request %s: backend %s failed before first byte (%s); retrying", ctx.request_id,
                     backend.url, verdict)
            ctx.attrs.setdefault("_tried", set()).add(backend.url)
            ctx.attrs["_last_error"] = verdict
            span.end()
            self._hand_over(ctx, inp, candidates)
            return None
        pool.policy.commit(inp, backend)
        span.set_attribute("gateway.attempts", 1)
        return self._deliver(ctx, pool, backend, relay, span, sent_at, ok=True)

    def cancel_fast(self, relay: Relay) -> None:
        """The client went away while a fast-path attempt waited for its first byte."""
        if relay.on_ready is not None:
            relay.on_ready = None
            relay.abort()
            relay.backend.in_flight -= 1
            relay.span.end()

    def fail(self, pool: Pool, backend: BackendState, kind: str, count_breaker: bool = True,
             release: bool = True) -> None:
        """Account one failed exchange with ``backend``. ``release``: free its in-flight slot too;
        ``release=False`` is the relay reporting a stream that broke after it reached the client."""
        if release:
            backend.in_flight -= 1
        else:
            pool.poison.note_failure(backend.url, time.monotonic())
        self._count_failure(pool, backend, kind, count_breaker)

    def _count_failure(self, pool: Pool, backend: BackendState, kind: str, count_breaker: bool) -> None:
        self.metrics.backend_errors.inc(pool.name, backend.url, kind)
        if count_breaker and backend.breaker.on_failure(time.monotonic()):
            self.metrics.breaker_opened.inc(pool.name, backend.url)
            log.warning("circuit breaker opened for %s after %s error", backend.url, kind)
