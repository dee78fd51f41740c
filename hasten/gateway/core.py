"""The transport-independent gateway: pools, built-in pipeline stages, health, metrics.

Frontends (``app.py``: raw asyncio HTTP/1.1, ``asgi.py`` for HTTP/2 via hypercorn) turn
HTTP requests into :class:`RequestContext` objects and call :meth:`Gateway.handle`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from hasten.gateway.config import GatewayConfig
from hasten.gateway.health import BackendState, HealthChecker
from hasten.gateway.metrics import GatewayMetrics
from hasten.gateway.pipeline import (
    GatewayError,
    GatewayResponse,
    Handler,
    Middleware,
    RequestContext,
    build_chain,
)
from hasten.gateway.proxy import Proxy
from hasten.gateway.routing import Pool
from hasten.gateway.tracing import Tracer

if TYPE_CHECKING:
    from hasten.gateway.governance import Governance

log = logging.getLogger("hasten.gateway")


class Gateway:
    """Holds all runtime state. ``middlewares`` run between the built-in stages and the proxy."""

    def __init__(self, cfg: GatewayConfig, middlewares: list[Middleware] | None = None) -> None:
        self.config = cfg
        self.metrics = GatewayMetrics()
        self.tracer = Tracer(cfg.tracing)
        self.pools: dict[str, Pool] = {
            p.name: Pool(p, cfg.health.failure_threshold, cfg.health.cooldown_s) for p in cfg.models
        }
        self._tenants = {t.key: t for t in cfg.tenants}
        self.proxy = Proxy(cfg, self.metrics, self.tracer)
        all_backends = [b for pool in self.pools.values() for b in pool.backends]
        self.health = HealthChecker(all_backends, cfg.health, self.proxy.probe, self._probe_changed)
        self.governance: Governance | None = None
        # synchronous pre-routing hook (after auth and parsing, before any middleware; also on the fast
        # path) and its counterpart, run by finalize on every response
        self.pre_route: Callable[[RequestContext], None] | None = None
        self.post_route: Callable[[RequestContext, GatewayResponse], None] | None = None
        gov: list[Middleware] = []
        if cfg.governance.enabled:
            from hasten.gateway.governance import Governance

            self.governance = Governance(cfg, self.pools, self.metrics)
            if self.governance.sync_only:  # in-memory limits only: sync hooks, the fast path stays on
                self.pre_route = self.governance.pre_route
                self.post_route = self.governance.post_route
            else:
                gov.append(self.governance.middleware)
        stages: list[Middleware] = [self.authenticate, self.parse_request, *gov, *(middlewares or [])]
        # without middlewares (user or governance) the frontend may run the request without any task switch
        self.fast_path = not middlewares and not gov
        self.handler: Handler = build_chain(stages, self.proxy.forward)
        self.metrics.add_collector(self._refresh_gauges)
        self.started_at = time.time()
        self.address: tuple[str, int] | None = None  # set by the frontend once it listens

    async def start(self) -> None:
        await self.proxy.start()
        self.health.start()
        if self.governance is not None:
            await self.governance.start()

    async def close(self) -> None:
        await self.health.stop()
        await self.proxy.close()
        if self.governance is not None:
            await self.governance.close()

    # -- built-in pipeline stages ---------------------------------------------------

    async def authenticate(self, ctx: RequestContext, call_next: Handler) -> GatewayResponse:
        self.check_auth(ctx)
        return await call_next(ctx)

    async def parse_request(self, ctx: RequestContext, call_next: Handler) -> GatewayResponse:
        self.parse(ctx)
        if self.pre_route is not None:
            self.pre_route(ctx)
        return await call_next(ctx)

    def check_auth(self, ctx: RequestContext) -> None:
        if self._tenants:
            auth = ctx.header("authorization") or ""
            key = auth[7:].strip() if auth[:7].lower() == "bearer " else (ctx.header("x-api-key") or "")
            tenant = self._tenants.get(key)
            if tenant is None:
                msg = "missing API key" if not key else "incorrect API key provided"
                raise GatewayError(401, msg, "invalid_request_error", "invalid_api_key",
                                   headers={"WWW-Authenticate": "Bearer"})
            ctx.tenant = tenant

    def parse(self, ctx: RequestContext) -> None:
        try:
            payload = orjson.loads(ctx.body) if ctx.body else None  # strict RFC 8259 JSON
        except (ValueError, UnicodeDecodeError) as exc:
            raise GatewayError(400, f"request body is not valid JSON: {exc}", "invalid_request_error",
                               "invalid_json") from None
        if not isinstance(payload, dict):
            raise GatewayError(400, "request body must be a JSON object", "invalid_request_error",
                               "invalid_json")
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise GatewayError(400, "you must provide a model parameter", "invalid_request_error",
                               "missing_model")
        pool = self.pools.get(model)
        if pool is None:
            raise GatewayError(404, f"the model {model!r} does not exist; available: "
                                    f"{', '.join(sorted(self.pools))}", "invalid_request_error",
                               "model_not_found")
        ctx.keep_payload(payload)
        ctx.model = model
        ctx.pool = pool
        ctx.stream = bool(payload.get("stream"))
        region = ctx.header(self.config.region_header)
        ctx.region = region or (ctx.tenant.region if ctx.tenant else None) or self.config.region

    def prepare(self, ctx: RequestContext) -> None:
        """The built-in stages, synchronously (fast path only); raises :class:`GatewayError`."""
        self.check_auth(ctx)
        self.parse(ctx)
        if self.pre_route is not None:
            self.pre_route(ctx)

    # -- entry points used by the frontends -----------------------------------------------

    async def handle(self, ctx: RequestContext, prepared: bool = False) -> GatewayResponse:
        """Run the pipeline; ``prepared``: the built-in stages already ran (fast-path fallback)."""
        try:
            resp = await (self.proxy.forward(ctx) if prepared else self.handler(ctx))
        except GatewayError as err:
            resp = GatewayResponse.from_error(err)
        except Exception:
            log.exception("request %s: internal error", ctx.request_id)
            resp = GatewayResponse.from_error(GatewayError(500, "internal gateway error", "server_error",
                                                           "internal_error"))
        return self.finalize(ctx, resp)

    def finalize(self, ctx: RequestContext, resp: GatewayResponse) -> GatewayResponse:
        resp.headers["x-request-id"] = ctx.request_id
        if self.post_route is not None:
            self.post_route(ctx, resp)
        self.metrics.requests.inc(ctx.model if ctx.pool else "", str(resp.status))
        return resp

    def abandon(self, ctx: RequestContext) -> None:
        """The client went away: release the backend slot reserved for this request and what
        governance holds for it (idempotent)."""
        self.proxy.release_reservation(ctx)
        settle = ctx.attrs.pop("_gov_settle", None)
        if settle is not None:
            settle(None)

    def models_payload(self) -> dict[str, Any]:
        created = int(self.started_at)
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "hasten-gateway",
             "policy": pool.config.policy, "backends": len(pool.backends),
             "healthy_backends": sum(1 for b in pool.backends if b.available())}
            for name, pool in self.pools.items()
        ]}

    def health_payload(self) -> tuple[int, dict[str, Any]]:
        pools = {name: sum(1 for b in pool.backends if b.available()) for name, pool in self.pools.items()}
        ok = all(pools.values())
        return (200 if ok else 503), {"status": "ok" if ok else "degraded", "healthy_backends": pools}

    def _probe_changed(self, backend: BackendState, up: bool) -> None:
        if not up:
            for name, pool in self.pools.items():
                if backend in pool.backends:
                    self.metrics.probe_down.inc(name, backend.url)

    def _refresh_gauges(self) -> None:
        now = time.monotonic()
        for name, pool in self.pools.items():
            for b in pool.backends:
                self.metrics.in_flight.set(name, b.url, value=b.in_flight)
                self.metrics.backend_up.set(name, b.url, value=1.0 if b.available(now) else 0.0)
                self.metrics.spare_connections.set(name, b.url, value=self.proxy.upstream(b.url).idle)
