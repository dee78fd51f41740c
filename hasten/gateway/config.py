"""Gateway configuration: YAML loading and validation with path-qualified errors.

Every problem found in a file is collected and reported at once, each prefixed with
the location of the offending value (``models[0].backends[1].url: ...``), so that a
user fixes a config in one round instead of one error at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from hasten.gateway.govconfig import ROUTE_KEYS, TOP_KEYS, GovernanceConfig, parse_governance

POLICIES = ("round_robin", "least_outstanding", "prefix_aware", "session")


class ConfigError(ValueError):
    """Raised with every problem found in a configuration, one per line."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        body = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid gateway config {source}:\n{body}")


@dataclass(frozen=True)
class BackendConfig:
    url: str
    host: str
    port: int
    region: str | None = None
    weight: float = 1.0
    backend_model: str | None = None
    api_key: str | None = None


@dataclass(frozen=True)
class RetryConfig:
    """Per pool: which failures before the first byte go to another replica (see retry.py)."""

    on_status: tuple[int, ...] = (429, 503)  # replica answers that mean "not now": retried
    on_failure: bool = False  # also retry other 5xx answers and broken connections (no poison set)
    poison_ttl_s: float = 300.0  # how long a request that failed a replica is refused; 0: never
    poison_max_entries: int = 10000


@dataclass(frozen=True)
class PoolConfig:
    name: str
    backends: tuple[BackendConfig, ...]
    policy: str = "round_robin"
    backend_model: str | None = None
    session_header: str = "x-session-id"
    prefix_block_chars: int = 128
    prefix_max_blocks: int = 64
    load_factor: float = 1.25
    load_slack: int = 1  # requests a replica may hold beyond its load_factor bound (prefix_aware)
    retry: RetryConfig = field(default_factory=RetryConfig)


@dataclass(frozen=True)
class TenantConfig:
    name: str
    key: str
    region: str | None = None


@dataclass(frozen=True)
class CacheSaltConfig:
    """Per-tenant ``cache_salt`` on upstream requests (tenant isolation of the replicas' prefix caches)."""

    enabled: bool = True  # only has an effect when tenants are configured
    secret: str | None = None  # HMAC key; None: a random one per process (instances then disagree)


@dataclass(frozen=True)
class HealthConfig:
    path: str = "/health"
    interval_s: float = 2.0
    timeout_s: float = 1.0  # one probe's budget: connect (if needed), request and answer
    failure_threshold: int = 3  # consecutive failed requests that open a backend's circuit breaker
    cooldown_s: float = 5.0
    unhealthy_threshold: int = 3  # consecutive failed probes that mark a backend down
    healthy_threshold: int = 1  # consecutive good probes that mark it up again


@dataclass(frozen=True)
class TimeoutConfig:
    connect_s: float = 2.0  # upstream: TCP connect to a backend
    first_byte_s: float = 60.0  # upstream: request sent -> first response byte
    idle_s: float = 60.0  # upstream: silence in the middle of a response
    header_read_s: float = 10.0  # client: first byte of a request -> its whole head (else 408)
    body_read_s: float = 30.0  # client: end of the head -> the whole body (else 408)
    keep_alive_s: float = 30.0  # client: an open connection without a request in progress is closed


@dataclass(frozen=True)
class TracingConfig:
    enabled: bool = False
    exporter: str = "none"  # none | console | otlp
    endpoint: str | None = None
    service_name: str = "hasten-gateway"


@dataclass(frozen=True)
class GatewayConfig:
    host: str
    port: int
    models: tuple[PoolConfig, ...]
    tenants: tuple[TenantConfig, ...] = ()
    cache_salt: CacheSaltConfig = field(default_factory=CacheSaltConfig)
    region: str | None = None
    region_header: str = "x-hasten-region"
    http2: bool = False
    max_retries: int = 2
    preconnect: int = 32  # spare connections per backend that closes its connections (0: off)
    max_body_bytes: int = 32 * 1024 * 1024
    health: HealthConfig = field(default_factory=HealthConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    governance: GovernanceConfig = field(default_factory=GovernanceConfig)
    nice: int | None = None  # CPU priority for the gateway process (-20..19); None: leave it alone


class _Checker:
    """Collects problems while reading an untrusted mapping."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def fail(self, where: str, message: str) -> None:
        self.problems.append(f"{where}: {message}")

    def mapping(self, value: Any, where: str, allowed: set[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(where, f"expected a mapping, got {type(value).__name__}")
            return {}
        for key in value:
            if key not in allowed:
                hint = ", ".join(sorted(allowed))
                self.fail(f"{where}.{key}" if where else str(key), f"unknown key (allowed: {hint})")
        return value

    def string(self, raw: dict[str, Any], key: str, where: str, default: Any = None,
               required: bool = False) -> Any:
        if key not in raw or raw[key] is None:
            if required:
                self.fail(_join(where, key), "is required")
            return default
        value = raw[key]
        if not isinstance(value, str) or not value.strip():
            self.fail(_join(where, key), f"expected a non-empty string, got {value!r}")
            return default
        return value.strip()

    def number(self, raw: dict[str, Any], key: str, where: str, default: float,
               minimum: float = 0.0, integer: bool = False, positive: bool = False) -> Any:
        if key not in raw or raw[key] is None:
            return default
        value = raw[key]
        ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
        if isinstance(value, bool) or not ok_type:
            kind = "an integer" if integer else "a number"
            self.fail(_join(where, key), f"expected {kind}, got {value!r}")
            return default
        if value < minimum or (positive and value <= 0):
            bound = f"> {minimum}" if positive else f">= {minimum}"
            self.fail(_join(where, key), f"must be {bound}, got {value!r}")
            return default
        return value

    def boolean(self, raw: dict[str, Any], key: str, where: str, default: bool) -> bool:
        if key not in raw or raw[key] is None:
            return default
        if not isinstance(raw[key], bool):
            self.fail(_join(where, key), f"expected true or false, got {raw[key]!r}")
            return default
        return raw[key]


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def parse_hostport(text: str) -> tuple[str, int]:
    """Parse ``host:port`` (``[v6]:port`` allowed); raises ValueError."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {text!r}")
    host = host.strip("[]")
    value = int(port)
    if not 0 <= value <= 65535:
        raise ValueError(f"port out of range in {text!r}")
    return host, value


def _backend(c: _Checker, raw: Any, where: str) -> BackendConfig | None:
    raw = c.mapping(raw, where, {"url", "region", "weight", "backend_model", "api_key"})
    url = c.string(raw, "url", where, required=True)
    region = c.string(raw, "region", where)
    weight = c.number(raw, "weight", where, 1.0, positive=True)
    backend_model = c.string(raw, "backend_model", where)
    api_key = c.string(raw, "api_key", where)
    if url is None:
        return None
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        c.fail(f"{where}.url", f"expected http://host:port, got {url!r} (https backends are not supported)")
        return None
    try:
        port = parts.port or 80
    except ValueError:
        c.fail(f"{where}.url", f"invalid port in {url!r}")
        return None
    if parts.path not in ("", "/"):
        c.fail(f"{where}.url", f"must not contain a path, got {url!r}")
        return None
    return BackendConfig(url=f"http://{parts.hostname}:{port}", host=parts.hostname, port=port,
                         region=region, weight=float(weight), backend_model=backend_model, api_key=api_key)


def _pool(c: _Checker, raw: Any, where: str) -> PoolConfig | None:
    allowed = {"name", "policy", "backends", "backend_model", "session_header", "prefix_block_chars",
               "prefix_max_blocks", "load_factor", "load_slack", "retry", *ROUTE_KEYS}
    raw = c.mapping(raw, where, allowed)
    name = c.string(raw, "name", where, required=True)
    policy = c.string(raw, "policy", where, default="round_robin")
    if policy not in POLICIES:
        c.fail(f"{where}.policy", f"{policy!r} is not one of {', '.join(POLICIES)}")
    backend_model = c.string(raw, "backend_model", where)
    session_header = c.string(raw, "session_header", where, default="x-session-id")
    block = c.number(raw, "prefix_block_chars", where, 128, minimum=1, integer=True)
    max_blocks = c.number(raw, "prefix_max_blocks", where, 64, minimum=1, integer=True)
    load_factor = c.number(raw, "load_factor", where, 1.25, minimum=1.0)
    load_slack = c.number(raw, "load_slack", where, 1, minimum=0, integer=True)
    retry = _retry(c, raw.get("retry"), f"{where}.retry")
    backends_raw = raw.get("backends")
    backends: list[BackendConfig] = []
    if not isinstance(backends_raw, list) or not backends_raw:
        c.fail(f"{where}.backends", "expected a non-empty list of {url: ...} entries")
    else:
        seen: set[str] = set()
        for i, item in enumerate(backends_raw):
            b = _backend(c, item, f"{where}.backends[{i}]")
            if b is None:
                continue
            if b.url in seen:
                c.fail(f"{where}.backends[{i}].url", f"duplicate backend {b.url}")
            seen.add(b.url)
            backends.append(b)
    if name is None:
        return None
    return PoolConfig(name=name, backends=tuple(backends), policy=policy, backend_model=backend_model,
                      session_header=session_header.lower(), prefix_block_chars=block,
                      prefix_max_blocks=max_blocks, load_factor=float(load_factor), load_slack=load_slack,
                      retry=retry)


def _retry(c: _Checker, raw: Any, where: str) -> RetryConfig:
    """A pool's ``retry`` mapping (absent or null: the defaults)."""
    if raw is None:
        return RetryConfig()
    raw = c.mapping(raw, where, {"on_status", "on_failure", "poison_ttl_s", "poison_max_entries"})
    default = RetryConfig()
    on_status = default.on_status
    statuses = raw.get("on_status")
    if statuses is not None:
        if not isinstance(statuses, list):
            c.fail(f"{where}.on_status", f"expected a list of HTTP statuses, got {statuses!r}")
        else:
            good: list[int] = []
            for i, st in enumerate(statuses):
                if isinstance(st, bool) or not isinstance(st, int) or not (st == 429 or 500 <= st <= 599):
                    c.fail(f"{where}.on_status[{i}]", f"expected 429 or a 5xx status, got {st!r} (other "
                                                      "4xx answers are the request's own fault: never retried)")
                else:
                    good.append(st)
            on_status = tuple(sorted(set(good)))
    return RetryConfig(
        on_status=on_status,
        on_failure=c.boolean(raw, "on_failure", where, default.on_failure),
        poison_ttl_s=float(c.number(raw, "poison_ttl_s", where, default.poison_ttl_s)),
        poison_max_entries=c.number(raw, "poison_max_entries", where, default.poison_max_entries, minimum=1,
                                    integer=True),
    )


def _section(c: _Checker, raw: dict[str, Any], key: str, cls: type, spec: dict[str, tuple]) -> Any:
    """Read a flat section whose fields are all numbers/strings/booleans."""
    if key not in raw or raw[key] is None:
        return cls()
    section = c.mapping(raw[key], key, set(spec))
    values: dict[str, Any] = {}
    defaults = cls()
    for name, (kind, kwargs) in spec.items():
        default = getattr(defaults, name)
        if kind == "number":
            values[name] = c.number(section, name, key, default, **kwargs)
        elif kind == "bool":
            values[name] = c.boolean(section, name, key, default)
        else:
            values[name] = c.string(section, name, key, default)
    return cls(**values)


def parse_config(raw: Any, source: str = "<config>") -> GatewayConfig:
    """Validate a decoded YAML document and build a :class:`GatewayConfig`."""
    c = _Checker()
    allowed = {"listen", "models", "tenants", "region", "region_header", "http2", "max_retries", "preconnect",
               "max_body_bytes", "health", "timeouts", "tracing", "nice", "cache_salt", *TOP_KEYS}
    if raw is None:
        raise ConfigError(source, ["the file is empty; expected a mapping with 'listen' and 'models'"])
    raw = c.mapping(raw, "", allowed)
    host, port = "127.0.0.1", 8080
    listen = c.string(raw, "listen", "", default="127.0.0.1:8080")
    try:
        host, port = parse_hostport(listen)
    except ValueError as exc:
        c.fail("listen", str(exc))
    pools: list[PoolConfig] = []
    gov_models: list[tuple[str, dict[str, Any], str]] = []
    gov_tenants: list[tuple[str, dict[str, Any]]] = []
    models_raw = raw.get("models")
    if not isinstance(models_raw, list) or not models_raw:
        c.fail("models", "expected a non-empty list of model pools")
    else:
        names: set[str] = set()
        for i, item in enumerate(models_raw):
            pool = _pool(c, item, f"models[{i}]")
            if pool is None:
                continue
            if pool.name in names:
                c.fail(f"models[{i}].name", f"duplicate model name {pool.name!r}")
            names.add(pool.name)
            pools.append(pool)
            gov_models.append((pool.name, item, f"models[{i}]"))
    tenants: list[TenantConfig] = []
    tenants_raw = raw.get("tenants")
    if tenants_raw is not None:
        if not isinstance(tenants_raw, list):
            c.fail("tenants", "expected a list of {name, key} entries")
        else:
            keys: set[str] = set()
            for i, item in enumerate(tenants_raw):
                where = f"tenants[{i}]"
                t = c.mapping(item, where, {"name", "key", "region", "limits", "priority"})
                name = c.string(t, "name", where, required=True)
                key = c.string(t, "key", where, required=True)
                region = c.string(t, "region", where)
                if key is not None and key in keys:
                    c.fail(f"{where}.key", "duplicate tenant key")
                if name is not None and key is not None:
                    keys.add(key)
                    tenants.append(TenantConfig(name=name, key=key, region=region))
                    gov_tenants.append((name, t))
    health = _section(c, raw, "health", HealthConfig, {
        "path": ("string", {}),
        "interval_s": ("number", {"positive": True}),
        "timeout_s": ("number", {"positive": True}),
        "failure_threshold": ("number", {"minimum": 1, "integer": True}),
        "cooldown_s": ("number", {"positive": True}),
        "unhealthy_threshold": ("number", {"minimum": 1, "integer": True}),
        "healthy_threshold": ("number", {"minimum": 1, "integer": True}),
    })
    timeouts = _section(c, raw, "timeouts", TimeoutConfig, {
        "connect_s": ("number", {"positive": True}),
        "first_byte_s": ("number", {"positive": True}),
        "idle_s": ("number", {"positive": True}),
        "header_read_s": ("number", {"positive": True}),
        "body_read_s": ("number", {"positive": True}),
        "keep_alive_s": ("number", {"positive": True}),
    })
    tracing = _section(c, raw, "tracing", TracingConfig, {
        "enabled": ("bool", {}),
        "exporter": ("string", {}),
        "endpoint": ("string", {}),
        "service_name": ("string", {}),
    })
    if tracing.exporter not in ("none", "console", "otlp"):
        c.fail("tracing.exporter", f"{tracing.exporter!r} is not one of none, console, otlp")
    cache_salt = _section(c, raw, "cache_salt", CacheSaltConfig, {"enabled": ("bool", {}), "secret": ("string", {})})
    if cache_salt.secret is not None and len(cache_salt.secret) < 16:
        c.fail("cache_salt.secret", "must be at least 16 characters (it keys the HMAC that makes tenant salts "
                                    "unguessable)")
    if not health.path.startswith("/"):
        c.fail("health.path", f"must start with '/', got {health.path!r}")
    governance = parse_governance(c, raw, gov_tenants, gov_models, {p.name for p in pools})
    nice = c.number(raw, "nice", "", None, minimum=-20, integer=True)
    if nice is not None and nice > 19:
        c.fail("nice", f"must be between -20 and 19, got {nice!r}")
        nice = None
    config = GatewayConfig(
        host=host, port=port, models=tuple(pools), tenants=tuple(tenants), cache_salt=cache_salt,
        region=c.string(raw, "region", ""),
        region_header=c.string(raw, "region_header", "", default="x-hasten-region").lower(),
        http2=c.boolean(raw, "http2", "", False),
        max_retries=c.number(raw, "max_retries", "", 2, integer=True),
        preconnect=c.number(raw, "preconnect", "", 32, integer=True, minimum=0),
        max_body_bytes=c.number(raw, "max_body_bytes", "", 32 * 1024 * 1024, integer=True, positive=True),
        health=health, timeouts=timeouts, tracing=tracing, governance=governance, nice=nice,
    )
    if c.problems:
        raise ConfigError(source, c.problems)
    return config


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate a YAML config file; raises :class:`ConfigError`."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(source, [f"cannot read file: {exc.strerror or exc}"]) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "YAML"
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(source, [f"{where}: not valid YAML ({problem})"]) from None
    return parse_config(raw, source)
