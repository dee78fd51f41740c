"""Configuration of request governance: limits, priorities, caches, cascades, SLOs, splits, shaping.

Parsed by :func:`hasten.gateway.config.parse_config` with the same located-error checker.
Every section is optional; with none of them the gateway installs no governance at all
and keeps its callback fast path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

PRIORITIES = ("interactive", "batch", "sheddable")
DEGRADATIONS = ("route_small", "cap_max_tokens", "shed_sheddable")


class Checker(Protocol):
    problems: list[str]

    def fail(self, where: str, message: str) -> None: ...
    def mapping(self, value: Any, where: str, allowed: set[str]) -> dict[str, Any]: ...
    def string(self, raw: dict[str, Any], key: str, where: str, default: Any = None,
               required: bool = False) -> Any: ...
    def number(self, raw: dict[str, Any], key: str, where: str, default: float, minimum: float = 0.0,
               integer: bool = False, positive: bool = False) -> Any: ...
    def boolean(self, raw: dict[str, Any], key: str, where: str, default: bool) -> bool: ...


@dataclass(frozen=True)
class LimitConfig:
    """Per tenant or per model; ``None`` means unlimited."""

    rpm: int | None = None
    tpm: int | None = None
    concurrency: int | None = None

    @property
    def any(self) -> bool:
        return self.rpm is not None or self.tpm is not None or self.concurrency is not None


@dataclass(frozen=True)
class CascadeConfig:
    small: str  # pool for easy requests
    easy: tuple[str, ...] = ()
    hard: tuple[str, ...] = ()
    max_easy_tokens: int = 400  # longer prompts always go to the large model
    margin: float = 0.0  # easy when sim(easy) - sim(hard) > margin
    k: int = 3


@dataclass(frozen=True)
class SplitArm:
    pool: str
    weight: float


@dataclass(frozen=True)
class RouteGovernance:
    """Per-model (route) governance options."""

    limits: LimitConfig = field(default_factory=LimitConfig)
    fallback: tuple[str, ...] = ()
    cascade: CascadeConfig | None = None
    split: tuple[SplitArm, ...] = ()
    semantic_threshold: float | None = None  # overrides cache.semantic_threshold
    pass_priority: bool = False  # send "priority" (0 interactive, 1 batch, 2 sheddable) to the backend


@dataclass(frozen=True)
class AdmissionConfig:
    max_in_flight: int = 0  # 0 = no admission queue
    max_queue: int = 256
    max_wait_ms: dict[str, float] = field(default_factory=lambda: {
        "interactive": 5000.0, "batch": 30000.0, "sheddable": 1000.0})


@dataclass(frozen=True)
class CacheConfig:
    exact: bool = False
    ttl_s: float = 300.0
    max_entries: int = 10000
    max_entry_bytes: int = 1 << 20
    deterministic_only: bool = True
    semantic: bool = False
    semantic_threshold: float = 0.95
    semantic_max_entries: int = 2000
    store: str = "memory"  # memory | redis


@dataclass(frozen=True)
class SloConfig:
    name: str
    model: str | None = None
    tenant: str | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    target: float = 0.95
    window_s: float = 60.0
    min_requests: int = 20
    burn_degrade: float = 2.0  # burn rate above which one more degradation step is applied
    burn_recover: float = 1.0  # below which one step is undone (hysteresis: recover < degrade)
    step_s: float = 10.0  # minimum time between two level changes
    degrade: tuple[str, ...] = DEGRADATIONS
    small_model: str | None = None
    max_tokens_cap: int = 128


@dataclass(frozen=True)
class ShapingConfig:
    dedupe_system: bool = False
    compress: bool = False
    min_context_tokens: int = 300  # only compress context longer than this
    token_budget: int = 200  # context tokens kept


@dataclass(frozen=True)
class GovernanceConfig:
    redis: str | None = None
    tenant_limits: dict[str, LimitConfig] = field(default_factory=dict)
    tenant_priority: dict[str, str] = field(default_factory=dict)
    routes: dict[str, RouteGovernance] = field(default_factory=dict)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    slos: tuple[SloConfig, ...] = ()
    shaping: ShapingConfig = field(default_factory=ShapingConfig)
    default_max_tokens: int = 256

    @property
    def enabled(self) -> bool:
        return bool(any(x.any for x in self.tenant_limits.values()) or self.tenant_priority
                    or any(r != RouteGovernance() for r in self.routes.values())
                    or self.admission.max_in_flight or self.cache.exact or self.cache.semantic
                    or self.slos or self.shaping.dedupe_system or self.shaping.compress)

    @property
    def needs_embeddings(self) -> bool:
        return bool(self.cache.semantic or self.shaping.compress
                    or any(r.cascade is not None and (r.cascade.easy or r.cascade.hard)
                           for r in self.routes.values()))

    def route(self, model: str) -> RouteGovernance:
        return self.routes.get(model) or _DEFAULT_ROUTE


_DEFAULT_ROUTE = RouteGovernance()


# -- parsing ----------------------------------------------------------------------------------


def parse_limits(c: Checker, raw: Any, where: str) -> LimitConfig:
    if raw is None:
        return LimitConfig()
    m = c.mapping(raw, where, {"rpm", "tpm", "concurrency"})
    return LimitConfig(**{k: c.number(m, k, where, None, minimum=1, integer=True)
                          for k in ("rpm", "tpm", "concurrency")})


def parse_priority(c: Checker, raw: dict[str, Any], where: str) -> str | None:
    value = c.string(raw, "priority", where)
    if value is not None and value not in PRIORITIES:
        c.fail(f"{where}.priority", f"{value!r} is not one of {', '.join(PRIORITIES)}")
        return None
    return value


def _strings(c: Checker, raw: Any, where: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not all(isinstance(x, str) and x.strip() for x in raw):
        c.fail(where, "expected a list of non-empty strings")
        return ()
    return tuple(x.strip() for x in raw)


ROUTE_KEYS = {"limits", "fallback", "cascade", "split", "semantic_threshold", "pass_priority"}


def parse_route(c: Checker, raw: dict[str, Any], where: str) -> RouteGovernance:
    """Governance keys of one ``models[i]`` entry (the caller allowed ROUTE_KEYS)."""
    limits = parse_limits(c, raw.get("limits"), f"{where}.limits")
    fallback = _strings(c, raw.get("fallback"), f"{where}.fallback")
    cascade = None
    if raw.get("cascade") is not None:
        w = f"{where}.cascade"
        m = c.mapping(raw["cascade"], w, {"small", "easy", "hard", "max_easy_tokens", "margin", "k"})
        small = c.string(m, "small", w, required=True)
        if small is not None:
            cascade = CascadeConfig(
                small=small, easy=_strings(c, m.get("easy"), f"{w}.easy"),
                hard=_strings(c, m.get("hard"), f"{w}.hard"),
                max_easy_tokens=c.number(m, "max_easy_tokens", w, 400, minimum=1, integer=True),
                margin=float(c.number(m, "margin", w, 0.0, minimum=-1.0)),
                k=c.number(m, "k", w, 3, minimum=1, integer=True))
    arms: list[SplitArm] = []
    split_raw = raw.get("split")
    if split_raw is not None:
        if not isinstance(split_raw, list):
            c.fail(f"{where}.split", "expected a list of {pool, weight} entries")
        else:
            for i, item in enumerate(split_raw):
                w = f"{where}.split[{i}]"
                m = c.mapping(item, w, {"pool", "weight"})
                pool = c.string(m, "pool", w, required=True)
                weight = c.number(m, "weight", w, 0.0, minimum=0.0)
                if weight > 1:
                    c.fail(f"{w}.weight", f"must be a fraction in [0, 1], got {weight!r}")
                if pool is not None:
                    arms.append(SplitArm(pool, float(weight)))
            if sum(a.weight for a in arms) > 1.0 + 1e-9:
                c.fail(f"{where}.split", "weights add up to more than 1")
    thr = raw.get("semantic_threshold")
    if thr is not None:
        thr = c.number(raw, "semantic_threshold", where, None, minimum=-1.0)
        if thr is not None and thr > 1:
            c.fail(f"{where}.semantic_threshold", f"must be <= 1, got {thr!r}")
    return RouteGovernance(limits=limits, fallback=fallback, cascade=cascade, split=tuple(arms),
                           semantic_threshold=None if thr is None else float(thr),
                           pass_priority=c.boolean(raw, "pass_priority", where, False))


def _admission(c: Checker, raw: Any) -> AdmissionConfig:
    if raw is None:
        return AdmissionConfig()
    m = c.mapping(raw, "admission", {"max_in_flight", "max_queue", "max_wait_ms"})
    waits = dict(AdmissionConfig().max_wait_ms)
    if m.get("max_wait_ms") is not None:
        w = c.mapping(m["max_wait_ms"], "admission.max_wait_ms", set(PRIORITIES))
        for k in PRIORITIES:
            waits[k] = float(c.number(w, k, "admission.max_wait_ms", waits[k], positive=True))
    return AdmissionConfig(max_in_flight=c.number(m, "max_in_flight", "admission", 0, integer=True),
                           max_queue=c.number(m, "max_queue", "admission", 256, integer=True),
                           max_wait_ms=waits)


def _cache(c: Checker, raw: Any, has_redis: bool) -> CacheConfig:
    if raw is None:
        return CacheConfig()
    d = CacheConfig()
    m = c.mapping(raw, "cache", {"exact", "ttl_s", "max_entries", "max_entry_bytes", "deterministic_only",
                                 "semantic", "semantic_threshold", "semantic_max_entries", "store"})
    store = c.string(m, "store", "cache", d.store)
    if store not in ("memory", "redis"):
        c.fail("cache.store", f"{store!r} is not one of memory, redis")
    elif store == "redis" and not has_redis:
        c.fail("cache.store", "'redis' needs the top-level 'redis' URL")
    thr = float(c.number(m, "semantic_threshold", "cache", d.semantic_threshold, minimum=-1.0))
    if thr > 1:
        c.fail("cache.semantic_threshold", f"must be <= 1, got {thr!r}")
    return CacheConfig(
        exact=c.boolean(m, "exact", "cache", False), ttl_s=float(c.number(m, "ttl_s", "cache", d.ttl_s,
                                                                            positive=True)),
        max_entries=c.number(m, "max_entries", "cache", d.max_entries, minimum=1, integer=True),
        max_entry_bytes=c.number(m, "max_entry_bytes", "cache", d.max_entry_bytes, minimum=1, integer=True),
        deterministic_only=c.boolean(m, "deterministic_only", "cache", True),
        semantic=c.boolean(m, "semantic", "cache", False), semantic_threshold=thr,
        semantic_max_entries=c.number(m, "semantic_max_entries", "cache", d.semantic_max_entries, minimum=1,
                                      integer=True),
        store=store)


def _slos(c: Checker, raw: Any) -> tuple[SloConfig, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        c.fail("slo", "expected a list of objectives")
        return ()
    out: list[SloConfig] = []
    keys = {"name", "model", "tenant", "ttft_ms", "tpot_ms", "target", "window_s", "min_requests",
            "burn_degrade", "burn_recover", "step_s", "degrade", "small_model", "max_tokens_cap"}
    for i, item in enumerate(raw):
        w = f"slo[{i}]"
        m = c.mapping(item, w, keys)
        d = SloConfig(name="")
        target = float(c.number(m, "target", w, d.target, positive=True))
        if target >= 1:
            c.fail(f"{w}.target", f"must be below 1 (an error budget is needed), got {target!r}")
        degrade = _strings(c, m.get("degrade"), f"{w}.degrade") if "degrade" in m else d.degrade
        for j, step in enumerate(degrade):
            if step not in DEGRADATIONS:
                c.fail(f"{w}.degrade[{j}]", f"{step!r} is not one of {', '.join(DEGRADATIONS)}")
        ttft = c.number(m, "ttft_ms", w, None, positive=True)
        tpot = c.number(m, "tpot_ms", w, None, positive=True)
        if ttft is None and tpot is None:
            c.fail(w, "needs ttft_ms or tpot_ms")
        burn_degrade = float(c.number(m, "burn_degrade", w, d.burn_degrade, positive=True))
        burn_recover = float(c.number(m, "burn_recover", w, d.burn_recover, minimum=0.0))
        if burn_recover >= burn_degrade:
            c.fail(f"{w}.burn_recover", "must be below burn_degrade (hysteresis)")
        small = c.string(m, "small_model", w)
        if "route_small" in degrade and small is None:
            c.fail(f"{w}.small_model", "is required by the route_small degradation")
        out.append(SloConfig(
            name=c.string(m, "name", w, default=f"slo{i}"), model=c.string(m, "model", w),
            tenant=c.string(m, "tenant", w), ttft_ms=ttft, tpot_ms=tpot, target=target,
            window_s=float(c.number(m, "window_s", w, d.window_s, positive=True)),
            min_requests=c.number(m, "min_requests", w, d.min_requests, minimum=1, integer=True),
            burn_degrade=burn_degrade, burn_recover=burn_recover,
            step_s=float(c.number(m, "step_s", w, d.step_s, minimum=0.0)), degrade=degrade,
            small_model=small, max_tokens_cap=c.number(m, "max_tokens_cap", w, d.max_tokens_cap, minimum=1,
                                                       integer=True)))
    return tuple(out)


def _shaping(c: Checker, raw: Any) -> ShapingConfig:
    if raw is None:
        return ShapingConfig()
    d = ShapingConfig()
    m = c.mapping(raw, "shaping", {"dedupe_system", "compress", "min_context_tokens", "token_budget"})
    return ShapingConfig(
        dedupe_system=c.boolean(m, "dedupe_system", "shaping", False),
        compress=c.boolean(m, "compress", "shaping", False),
        min_context_tokens=c.number(m, "min_context_tokens", "shaping", d.min_context_tokens, minimum=1,
                                    integer=True),
        token_budget=c.number(m, "token_budget", "shaping", d.token_budget, minimum=1, integer=True))


TOP_KEYS = {"redis", "admission", "cache", "slo", "shaping", "default_max_tokens"}


def parse_governance(c: Checker, raw: dict[str, Any], tenants: list[tuple[str, dict[str, Any]]],
                     models: list[tuple[str, dict[str, Any], str]], pool_names: set[str]) -> GovernanceConfig:
    """``tenants``: (name, raw entry); ``models``: (name, raw entry, location)."""
    redis_url = c.string(raw, "redis", "")
    if redis_url is not None and not redis_url.startswith(("redis://", "unix://")):
        c.fail("redis", f"expected redis://host:port/db, got {redis_url!r}")
    tenant_limits: dict[str, LimitConfig] = {}
    tenant_priority: dict[str, str] = {}
    for i, (name, t) in enumerate(tenants):
        where = f"tenants[{i}]"
        lim = parse_limits(c, t.get("limits"), f"{where}.limits")
        if lim.any:
            tenant_limits[name] = lim
        prio = parse_priority(c, t, where)
        if prio is not None:
            tenant_priority[name] = prio
    routes: dict[str, RouteGovernance] = {}
    for name, m, where in models:
        r = parse_route(c, m, where)
        for target, label in ([(f, "fallback") for f in r.fallback]
                              + ([(r.cascade.small, "cascade.small")] if r.cascade else [])
                              + [(a.pool, "split") for a in r.split]):
            if target not in pool_names:
                c.fail(f"{where}.{label}", f"unknown model pool {target!r}")
        if r != RouteGovernance():
            routes[name] = r
    slos = _slos(c, raw.get("slo"))
    for i, s in enumerate(slos):
        for value, label in ((s.model, "model"), (s.small_model, "small_model")):
            if value is not None and value not in pool_names:
                c.fail(f"slo[{i}].{label}", f"unknown model pool {value!r}")
    return GovernanceConfig(
        redis=redis_url, tenant_limits=tenant_limits, tenant_priority=tenant_priority, routes=routes,
        admission=_admission(c, raw.get("admission")), cache=_cache(c, raw.get("cache"), redis_url is not None),
        slos=slos, shaping=_shaping(c, raw.get("shaping")),
        default_max_tokens=c.number(raw, "default_max_tokens", "", 256, minimum=1, integer=True))
