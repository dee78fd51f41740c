"""Request governance: one middleware that runs, in order,

1. priority class (tenant's class, a request may only lower it) and SLO shedding of the
   sheddable class;
2. rate limits per tenant and per model (rpm, tpm reserved at admission and corrected at
   the end, concurrency), in memory or atomically in Redis; 429 + Retry-After;
3. exact then semantic response cache (tenant-isolated), replaying streams as streams;
4. prompt shaping (duplicate system prompts, context compression);
5. SLO degradations (route to the small model, cap max_tokens), cascade, A/B split;
6. the priority admission queue;
7. the proxy, with fallback to other pools on 502/503;
8. at the end of the response: release, usage correction, SLO and A/B observation, cache fill.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import time
from typing import Any

from hasten.gateway.abtest import CONTROL, choose_arm
from hasten.gateway.cache import (
    CachedResponse,
    MemoryCache,
    StreamCapture,
    exact_key,
    is_deterministic,
    last_user_text,
    observe,
    partition_key,
    prompt_text,
)
from hasten.gateway.cascade import CascadeClassifier
from hasten.gateway.config import GatewayConfig
from hasten.gateway.govconfig import PRIORITIES, GovernanceConfig, RouteGovernance
from hasten.gateway.metrics import FAST_BUCKETS, Counter, GatewayMetrics, Gauge, Histogram
from hasten.gateway.pipeline import GatewayError, GatewayResponse, Handler, RequestContext
from hasten.gateway.priority import RANK, AdmissionQueue, overloaded
from hasten.gateway.ratelimit import LimitSpec, LimitStore, MemoryLimitStore, estimate_tokens, specs_for
from hasten.gateway.routing import Pool
from hasten.gateway.slo import SloController

log = logging.getLogger("hasten.gateway")

PRIORITY_HEADER = "x-hasten-priority"
_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d+)')


class _Metrics:
    def __init__(self, m: GatewayMetrics) -> None:
        self.rate_limited = Counter("rate_limited_total", "Requests refused by a rate limit",
                                    ("scope", "name", "limit"))
        self.shed = Counter("shed_total", "Requests shed (503 overloaded) by priority class", ("class",))
        self.admitted = Counter("admitted_total", "Requests admitted by priority class", ("class",))
        self.queue_wait = Histogram("queue_wait_seconds", "Time spent in the admission queue", ("class",))
        self.queue_depth = Gauge("admission_queue_depth", "Requests waiting in the admission queue")
        self.cache = Counter("cache_requests_total", "Response cache lookups by result", ("model", "result"))
        self.cache_hit_latency = Histogram("cache_hit_seconds", "Request received to cached answer ready",
                                           ("model", "kind"), FAST_BUCKETS)
        self.tokens_saved = Counter("prompt_tokens_saved_total", "Prompt tokens removed by shaping", ("model",))
        self.cascade = Counter("cascade_total", "Cascade decisions", ("model", "target"))
        self.fallback = Counter("fallback_total", "Requests sent to a fallback pool", ("model", "to"))
        self.degraded = Counter("degraded_total", "Degradations applied to requests", ("model", "action"))
        self.ab_requests = Counter("ab_requests_total", "A/B split: requests per arm", ("model", "arm"))
        self.ab_errors = Counter("ab_errors_total", "A/B split: failed requests per arm", ("model", "arm"))
        self.ab_ttft = Histogram("ab_ttft_seconds", "A/B split: time to first byte per arm", ("model", "arm"))
        self.ab_e2e = Histogram("ab_e2e_seconds", "A/B split: end-to-end latency per arm", ("model", "arm"))
        self.slo_attainment = Gauge("slo_attainment", "Share of requests meeting the objective (window)",
                                    ("slo",))
        self.slo_burn = Gauge("slo_burn_rate", "Error-budget burn rate (1 = exactly on budget)", ("slo",))
        self.slo_level = Gauge("slo_degradation_level", "Number of degradation steps applied", ("slo",))
        self.store_errors = Counter("governance_store_errors_total",
                                    "Limit/cache store failures (limits fail open, the cache misses)", ("store",))
        self.slo_transitions = Gauge("slo_transitions", "Degradation level changes so far", ("slo",))
        m.extra.extend([self.rate_limited, self.shed, self.admitted, self.queue_wait, self.queue_depth, self.cache,
                        self.cache_hit_latency, self.tokens_saved, self.cascade, self.fallback, self.degraded,
                        self.ab_requests, self.ab_errors, self.ab_ttft, self.ab_e2e, self.slo_attainment,
                        self.slo_burn, self.slo_level, self.slo_transitions, self.store_errors])


class Governance:
    def __init__(self, cfg: GatewayConfig, pools: dict[str, Pool], metrics: GatewayMetrics) -> None:
        g: GovernanceConfig = cfg.governance
        self.cfg = g
        self.pools = pools
        self.m = _Metrics(metrics)
        metrics.add_collector(self._refresh)
        self._redis: Any = None
        self.limits: LimitStore = MemoryLimitStore()
        blob: Any = None
        if g.redis:
            from hasten.gateway.redis_store import RedisBlobStore, RedisLimitStore, connect

            self._redis = connect(g.redis)
            self.limits = RedisLimitStore(self._redis)
            if g.cache.store == "redis":
                blob = RedisBlobStore(self._redis)
        self.cache_on = g.cache.exact or g.cache.semantic
        self.store: Any = blob or MemoryCache(g.cache.max_entries)
        self.embedder: Any = None
        if g.needs_embeddings:
            from hasten.gateway.embed import shared_embedder

            self.embedder = shared_embedder()
        self.semantic: Any = None
        if g.cache.semantic:
            from hasten.gateway.semantic import SemanticIndex

            self.semantic = SemanticIndex(g.cache.semantic_max_entries, g.cache.ttl_s, blob)
        self.classifiers = {name: CascadeClassifier(r.cascade, self.embedder)
                            for name, r in g.routes.items() if r.cascade is not None}
        self.shaper: Any = None
        if g.shaping.dedupe_system or g.shaping.compress:
            from hasten.gateway.shaping import PromptShaper

            self.shaper = PromptShaper(g.shaping, self.embedder)
        self.admission = AdmissionQueue(g.admission)
        self.slo = SloController(g.slos)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.slo_shed: dict[str, int] = dict.fromkeys(PRIORITIES, 0)

    async def start(self) -> None:
        if self.embedder is not None:  # load the model now, not on the first request
            self._spawn(asyncio.to_thread(self.embedder.embed, ["warm up"]))

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._redis is not None:
            try:
                await self._redis.aclose()
            except Exception:  # noqa: BLE001 - shutting down
                pass

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("governance background task failed: %r", task.exception())

    # -- the middleware ---------------------------------------------------------------------

    def klass(self, ctx: RequestContext) -> str:
        tenant = ctx.tenant.name if ctx.tenant else None
        base = self.cfg.tenant_priority.get(tenant or "", "interactive")
        asked = ctx.header(PRIORITY_HEADER)
        if asked is None and ctx.payload is not None and isinstance(ctx.payload.get("priority"), str):
            asked = ctx.payload["priority"]
        if asked in RANK and RANK[asked] > RANK[base]:  # a request may lower its class, never raise it
            return asked
        return base

    async def middleware(self, ctx: RequestContext, call_next: Handler) -> GatewayResponse:
        assert ctx.payload is not None and ctx.model is not None
        g = self.cfg
        tenant = ctx.tenant.name if ctx.tenant else "-"
        model = ctx.model
        route = g.route(model)
        klass = ctx.attrs["priority"] = self.klass(ctx)
        if isinstance(ctx.payload.get("priority"), str):
            _set_payload(ctx, {k: v for k, v in ctx.payload.items() if k != "priority"})
        degradations = self.slo.degradations(model, tenant)
        if klass == "sheddable" and any(d == "shed_sheddable" for d, _ in degradations):
            self.slo_shed[klass] += 1
            self.m.degraded.inc(model, "shed_sheddable")
            raise overloaded("overloaded: the sheddable class is shed while the SLO error budget burns")

        # rate limits
        specs, member, reserved, prompt_tokens = self._limit_specs(ctx)
        if specs:
            try:
                decision = await self.limits.acquire(specs, member)
            except Exception as exc:  # noqa: BLE001 - the limit store is down: fail open, loudly
                log.warning("rate limit store unavailable, admitting request %s: %r", ctx.request_id, exc)
                self.m.store_errors.inc("limits")
                specs = []
            else:
                if not decision.ok:
                    raise self._limited(decision.failed, decision.retry_after_s, tenant, model, reserved)
        settle = self._settler(ctx, specs, member, reserved)

        try:
            resp = await self._serve(ctx, call_next, route, tenant, klass, degradations, prompt_tokens, settle)
        except BaseException:
            settle(prompt_tokens)
            raise
        return resp

    def _limit_specs(self, ctx: RequestContext) -> tuple[list[LimitSpec], str, int, int]:
        """The limits that apply to this request, its member id, reserved and prompt tokens."""
        g = self.cfg
        payload = ctx.payload or {}
        member = f"{ctx.request_id}:{os.urandom(4).hex()}"
        max_tokens = payload.get("max_tokens") or payload.get("max_completion_tokens")
        prompt_tokens = estimate_tokens(prompt_text(payload))
        reserved = prompt_tokens + (max_tokens if isinstance(max_tokens, int) else g.default_max_tokens)
        specs: list[LimitSpec] = []
        if ctx.tenant and ctx.tenant.name in g.tenant_limits:
            specs += specs_for("t", ctx.tenant.name, g.tenant_limits[ctx.tenant.name], reserved)
        route = g.route(ctx.model or "")
        if route.limits.any:
            specs += specs_for("m", ctx.model or "", route.limits, reserved)
        return specs, member, reserved, prompt_tokens

    def _settler(self, ctx: RequestContext, specs: list[LimitSpec], member: str, reserved: int) -> Any:
        """An idempotent end-of-request callback: release concurrency, correct tpm to the real usage."""
        conc_keys = [s.key for s in specs if s.kind == "concurrency"]
        tpm_keys = [s.key for s in specs if s.key.endswith(":tpm")]
        done = False
        store = self.limits
        sync = isinstance(store, MemoryLimitStore)

        def settle(actual_tokens: int | None) -> None:
            nonlocal done
            if done:
                return
            done = True
            ctx.attrs.pop("_gov_settle", None)
            fix = tpm_keys and actual_tokens is not None and actual_tokens != reserved
            if sync:
                assert isinstance(store, MemoryLimitStore)
                store.release_now(conc_keys, member)
                if fix:
                    store.adjust_now(tpm_keys, member, actual_tokens or 0)
                return
            if conc_keys:
                self._spawn(store.release(conc_keys, member))
            if fix:
                self._spawn(store.adjust(tpm_keys, member, actual_tokens or 0))

        if specs:
            ctx.attrs["_gov_settle"] = settle  # the frontend calls it if the client goes away early
        return settle

    # -- the synchronous variant: in-memory limits only, keeps the callback fast path --------

    @property
    def sync_only(self) -> bool:
        """True when the only feature configured is in-memory rate limiting."""
        g = self.cfg
        return (g.redis is None and not self.admission.enabled and not self.cache_on and not g.slos
                and self.shaper is None and not g.tenant_priority
                and all(r == RouteGovernance(limits=r.limits) for r in g.routes.values()))

    def pre_route(self, ctx: RequestContext) -> None:
        """Sync pre-routing hook (runs inside the client socket callback on the fast path)."""
        specs, member, reserved, prompt_tokens = self._limit_specs(ctx)
        if not specs:
            return
        assert isinstance(self.limits, MemoryLimitStore)
        decision = self.limits.acquire_now(specs, member)
        if not decision.ok:
            tenant = ctx.tenant.name if ctx.tenant else "-"
            raise self._limited(decision.failed, decision.retry_after_s, tenant, ctx.model or "", reserved)
        self._settler(ctx, specs, member, reserved)
        ctx.attrs["_gov_prompt"] = prompt_tokens

    def post_route(self, ctx: RequestContext, resp: GatewayResponse) -> None:
        """Called by :meth:`Gateway.finalize`: settle the limits when the response ends."""
        settle = ctx.attrs.get("_gov_settle")
        if settle is None:
            return
        prompt_tokens = ctx.attrs.get("_gov_prompt", 0)
        state = {"events": 0, "tail": b""}

        def on_chunk(data: bytes) -> None:
            state["events"] += data.count(b"data: ")
            state["tail"] = (state["tail"] + data)[-4096:]

        def on_end(clean: bool) -> None:
            m = _TOTAL_TOKENS.search(state["tail"])
            settle(int(m.group(1)) if m else prompt_tokens + max(0, state["events"] - 1))

        observe(resp, on_chunk, on_end)

    def _limited(self, spec: Any, retry_s: float, tenant: str, model: str, reserved: int) -> GatewayError:
        scope, name, kind = spec.key.split(":")[2:5]
        self.m.rate_limited.inc("tenant" if scope == "t" else "model", name, kind)
        what = {"rpm": "requests per min (RPM)", "tpm": "tokens per min (TPM)",
                "conc": "concurrent requests"}[kind]
        asked = reserved if kind == "tpm" else 1
        wait = max(1, math.ceil(retry_s))
        who = f"tenant {tenant}" if scope == "t" else f"model {model}"
        return GatewayError(429, f"Rate limit reached for {who} on {what}: Limit {spec.limit}, Requested {asked}. "
                                 f"Please try again in {wait}s.", "tokens" if kind == "tpm" else "requests",
                            "rate_limit_exceeded", headers={"retry-after": str(wait)})

    async def _serve(self, ctx: RequestContext, call_next: Handler, route: RouteGovernance, tenant: str,
                     klass: str, degradations: list[tuple[str, Any]], prompt_tokens: int,
                     settle: Any) -> GatewayResponse:
        g = self.cfg
        model = ctx.model or ""
        payload = ctx.payload or {}
        key: str | None = None
        partition: str | None = None
        vec: Any = None
        if self.cache_on and (not g.cache.deterministic_only or is_deterministic(payload)):
            key = exact_key(tenant, model, payload, ctx.stream)
            hit = await self._lookup(ctx, key, route, tenant)
            if isinstance(hit, GatewayResponse):
                settle(0)
                return hit
            partition, vec = hit if hit is not None else (None, None)
        elif self.cache_on:
            self.m.cache.inc(model, "bypass")

        if self.shaper is not None:
            shaped = await self.shaper.shape(ctx.payload or {})
            if shaped is not None:
                _set_payload(ctx, shaped.payload)
                self.m.tokens_saved.inc(model, amount=shaped.saved)
                ctx.attrs["tokens_saved"] = shaped.saved

        rerouted = False
        for action, slo in degradations:
            if action == "route_small" and slo.small_model and slo.small_model != model:
                _reroute(ctx, self.pools[slo.small_model])
                rerouted = True
                self.m.degraded.inc(model, action)
            elif action == "cap_max_tokens":
                cur = (ctx.payload or {}).get("max_tokens")
                if not isinstance(cur, int) or cur > slo.max_tokens_cap:
                    _set_payload(ctx, {**(ctx.payload or {}), "max_tokens": slo.max_tokens_cap})
                    self.m.degraded.inc(model, action)
        classifier = self.classifiers.get(model)
        if classifier is not None and not rerouted and route.cascade is not None:
            decision = await classifier.decide(last_user_text(ctx.payload or {}))
            ctx.attrs["cascade"] = decision
            if decision.easy:
                _reroute(ctx, self.pools[route.cascade.small])
                rerouted = True
            self.m.cascade.inc(model, "small" if decision.easy else "large")
        arm = None
        if route.split and not rerouted:
            arm = choose_arm(route.split, ctx.header(ctx.pool.config.session_header) if ctx.pool else None)
            if arm != CONTROL:
                _reroute(ctx, self.pools[arm])
            self.m.ab_requests.inc(model, arm)
        if route.pass_priority:
            _set_payload(ctx, {**(ctx.payload or {}), "priority": RANK[klass]})

        queued = self.admission.enabled
        if queued:
            t0 = time.perf_counter()
            await self.admission.admit(tenant, klass)
            self.m.queue_wait.observe(time.perf_counter() - t0, klass)
            self.m.admitted.inc(klass)
        try:
            resp = await self._forward(ctx, call_next, route)
        except BaseException as exc:
            if queued:
                self.admission.release(tenant)
            if arm is not None and isinstance(exc, GatewayError):
                self.m.ab_errors.inc(model, arm)
            raise
        self._watch(ctx, resp, tenant, arm, key, partition, vec, prompt_tokens, settle, queued)
        return resp

    async def _lookup(self, ctx: RequestContext, key: str, route: RouteGovernance,
                      tenant: str) -> GatewayResponse | tuple[str, Any] | None:
        g = self.cfg
        model = ctx.model or ""
        if g.cache.exact:
            raw = await self._get(key)
            if raw is not None:
                return self._hit(ctx, raw, "hit")
        if self.semantic is None:
            self.m.cache.inc(model, "miss")
            return None
        payload = ctx.payload or {}
        partition = partition_key(tenant, model, payload, ctx.stream)
        vec = (await self.embedder.aembed([prompt_text(payload)]))[0]
        threshold = route.semantic_threshold if route.semantic_threshold is not None else g.cache.semantic_threshold
        try:
            match = await self.semantic.lookup(partition, vec, threshold)
        except Exception as exc:  # noqa: BLE001 - a cache outage is a miss
            log.warning("semantic cache lookup failed: %r", exc)
            self.m.store_errors.inc("cache")
            match = None
        if match is not None:
            raw = await self._get(match.key)
            if raw is not None:
                resp = self._hit(ctx, raw, "semantic")
                resp.headers["x-hasten-cache-similarity"] = f"{match.similarity:.4f}"
                return resp
        self.m.cache.inc(model, "miss")
        return partition, vec

    async def _get(self, key: str) -> bytes | None:
        try:
            return await self.store.get(key)
        except Exception as exc:  # noqa: BLE001 - a cache outage is a miss
            log.warning("response cache lookup failed: %r", exc)
            self.m.store_errors.inc("cache")
            return None

    def _hit(self, ctx: RequestContext, raw: bytes, kind: str) -> GatewayResponse:
        resp = CachedResponse.from_bytes(raw).response(kind)
        self.m.cache.inc(ctx.model or "", kind)
        self.m.cache_hit_latency.observe(time.perf_counter() - ctx.received_at, ctx.model or "", kind)
        return resp

    async def _forward(self, ctx: RequestContext, call_next: Handler, route: RouteGovernance) -> GatewayResponse:
        try:
            return await call_next(ctx)
        except GatewayError as exc:
            if exc.status not in (502, 503) or not route.fallback:
                raise
            last = exc
        for name in route.fallback:
            if ctx.pool is not None and name == ctx.pool.name:
                continue
            _reroute(ctx, self.pools[name])
            self.m.fallback.inc(ctx.model or "", name)
            try:
                return await call_next(ctx)
            except GatewayError as exc:
                if exc.status not in (502, 503):
                    raise
                last = exc
        raise last

    def _watch(self, ctx: RequestContext, resp: GatewayResponse, tenant: str, arm: str | None, key: str | None,
               partition: str | None, vec: Any, prompt_tokens: int, settle: Any, queued: bool) -> None:
        """Account for the response as it goes out; keeps the relay in push mode."""
        model = ctx.model or ""
        capture = StreamCapture(self.cfg.cache.max_entry_bytes) if key is not None and resp.status == 200 else None
        state = {"first": 0.0, "events": 0, "tail": b""}

        def on_chunk(data: bytes) -> None:
            if not state["first"]:
                state["first"] = time.perf_counter()
            state["events"] += data.count(b"data: ")
            state["tail"] = (state["tail"] + data)[-4096:]
            if capture is not None:
                capture(data)

        def on_end(clean: bool) -> None:
            now = time.perf_counter()
            if queued:
                self.admission.release(tenant)
            m = _TOTAL_TOKENS.search(state["tail"])
            settle(int(m.group(1)) if m else prompt_tokens + max(0, state["events"] - 1))
            first = state["first"] or now
            ttft = first - ctx.received_at
            tpot = (now - first) / (state["events"] - 2) if ctx.stream and state["events"] > 2 else None
            if resp.status < 500:
                self.slo.observe(model, tenant, ttft, tpot)
            if arm is not None:
                self.m.ab_ttft.observe(ttft, model, arm)
                self.m.ab_e2e.observe(now - ctx.received_at, model, arm)
                if not clean or resp.status >= 500:
                    self.m.ab_errors.inc(model, arm)
            if (capture is not None and clean and capture.chunks is not None and not capture.error
                    and key is not None):
                entry = CachedResponse(200, resp.headers.get("content-type", "application/json"),
                                       b"" if resp.stream is not None else resp.body,
                                       capture.chunks if resp.stream is not None else None)
                self._spawn(self._store(key, entry, partition, vec))

        observe(resp, on_chunk, on_end)

    async def _store(self, key: str, entry: CachedResponse, partition: str | None, vec: Any) -> None:
        await self.store.set(key, entry.to_bytes(), self.cfg.cache.ttl_s)
        if self.semantic is not None and partition is not None and vec is not None:
            await self.semantic.add(partition, vec, key)

    def _refresh(self) -> None:
        self.m.queue_depth.set(value=self.admission.queued)
        now = time.monotonic()
        self.slo.evaluate(now)
        for st in self.slo.states:
            name = st.cfg.name
            self.m.slo_attainment.set(name, value=st.attainment(now))
            self.m.slo_burn.set(name, value=st.burn_rate(now))
            self.m.slo_level.set(name, value=st.level)
            self.m.slo_transitions.set(name, value=st.transitions)
        for k in PRIORITIES:
            self.m.shed.set(k, value=self.admission.shed[k] + self.slo_shed[k])


def _set_payload(ctx: RequestContext, payload: dict[str, Any]) -> None:
    ctx.body = json.dumps(payload).encode()
    ctx.keep_payload(payload)
    ctx.attrs.pop("_bodies", None)


def _reroute(ctx: RequestContext, pool: Pool) -> None:
    """Send the request to another pool (cascade, degradation, split, fallback)."""
    ctx.pool = pool
    for k in ("_route", "_tried", "_last_error", "_bodies"):
        ctx.attrs.pop(k, None)
    _set_payload(ctx, {**(ctx.payload or {}), "model": pool.name})
