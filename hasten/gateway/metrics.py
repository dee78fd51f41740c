"""A tiny, allocation-light Prometheus text exporter (``hasten_gateway:`` prefix).

Written in-house rather than with prometheus_client to keep the per-request hot path to
a dict lookup and a few float additions.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

PREFIX = "hasten_gateway:"

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
FAST_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                0.025, 0.05, 0.1)

Labels = tuple[str, ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt_labels(names: tuple[str, ...], values: Labels, extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _fmt_num(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


@dataclass
class Counter:
    name: str
    help: str
    labels: tuple[str, ...] = ()
    kind: str = "counter"
    values: dict[Labels, float] = field(default_factory=dict)

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def set(self, *labels: str, value: float) -> None:
        self.values[labels] = value

    def get(self, *labels: str) -> float:
        return self.values.get(labels, 0.0)

    def render(self) -> Iterable[str]:
        full = PREFIX + self.name
        yield f"# HELP {full} {self.help}"
        yield f"# TYPE {full} {self.kind}"
        for labels, value in sorted(self.values.items()):
            yield f"{full}{_fmt_labels(self.labels, labels)} {_fmt_num(value)}"


def Gauge(name: str, help: str, labels: tuple[str, ...] = ()) -> Counter:  # noqa: N802 - factory
    return Counter(name, help, labels, kind="gauge")


class _HistSeries:
    """One label combination of a histogram; ``observe`` is the per-event hot path."""

    __slots__ = ("buckets", "counts", "total", "n")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1


@dataclass
class Histogram:
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    series: dict[Labels, _HistSeries] = field(default_factory=dict)

    def observe(self, value: float, *labels: str) -> None:
        s = self.series.get(labels)
        if s is None:
            s = self.series[labels] = _HistSeries(self.buckets)
        s.observe(value)

    def child(self, *labels: str) -> _HistSeries:
        """The series for ``labels`` (created on first use), to observe without a lookup."""
        s = self.series.get(labels)
        if s is None:
            s = self.series[labels] = _HistSeries(self.buckets)
        return s

    def count(self, *labels: str) -> int:
        s = self.series.get(labels)
        return s.n if s else 0

    def render(self) -> Iterable[str]:
        full = PREFIX + self.name
        yield f"# HELP {full} {self.help}"
        yield f"# TYPE {full} histogram"
        for labels, s in sorted(self.series.items()):
            cum = 0
            for bound, c in zip((*self.buckets, float("inf")), s.counts, strict=True):
                cum += c
                le = f'le="{_fmt_num(bound)}"'
                yield f"{full}_bucket{_fmt_labels(self.labels, labels, le)} {cum}"
            yield f"{full}_sum{_fmt_labels(self.labels, labels)} {_fmt_num(s.total)}"
            yield f"{full}_count{_fmt_labels(self.labels, labels)} {s.n}"


@dataclass
class PoolSeries:
    """A model pool's per-request and per-chunk histogram series, bound once."""

    chunk: _HistSeries
    ttft: _HistSeries
    e2e: _HistSeries


class GatewayMetrics:
    """All gateway metrics. Label values are model and backend URL strings."""

    def __init__(self) -> None:
        self.requests = Counter("requests_total", "Client requests by model and final HTTP status",
                                ("model", "status"))
        self.backend_requests = Counter("backend_requests_total", "Requests sent to each backend",
                                        ("model", "backend"))
        self.backend_errors = Counter("backend_errors_total",
                                      "Backend failures by kind (connect, timeout, status, stream)",
                                      ("model", "backend", "kind"))
        self.retries = Counter("retries_total", "Requests re-sent to another backend before any byte",
                               ("model",))
        self.in_flight = Gauge("backend_in_flight", "Requests in flight per backend", ("model", "backend"))
        self.backend_up = Gauge("backend_up", "1 if the backend is routable (probe ok, breaker not open)",
                                ("model", "backend"))
        self.breaker_opened = Counter("breaker_opened_total", "Circuit breaker openings", ("model", "backend"))
        self.probe_down = Counter("probe_down_total", "Backends marked down by active probes",
                                  ("model", "backend"))
        self.spare_connections = Gauge("backend_idle_connections",
                                       "Open idle connections to each backend (keep-alive or preconnected)",
                                       ("model", "backend"))
        self.poison_rejected = Counter("poison_rejected_total",
                                       "Requests refused because an identical request failed a replica",
                                       ("model",))
        self.added_latency = Histogram("added_latency_seconds",
                                       "Gateway time from request received to upstream request sent",
                                       ("model",), FAST_BUCKETS)
        self.chunk_delay = Histogram("chunk_forward_seconds",
                                     "Gateway time from a chunk read from upstream to written to the client",
                                     ("model",), FAST_BUCKETS)
        self.upstream_first_byte = Histogram("upstream_first_byte_seconds",
                                             "Backend time from the upstream request sent to its response head read",
                                             ("model", "backend"))
        self.ttft = Histogram("ttft_seconds", "Time to first byte of the response body as sent to the client",
                              ("model",))
        self.e2e = Histogram("e2e_seconds", "Time from request received to last byte sent", ("model",))
        self._collectors: list[Callable[[], None]] = []
        self._pool_series: dict[str, PoolSeries] = {}
        self.extra: list[Counter | Histogram] = []  # registered by optional features (governance)

    def pool_series(self, model: str) -> PoolSeries:
        ps = self._pool_series.get(model)
        if ps is None:
            ps = self._pool_series[model] = PoolSeries(self.chunk_delay.child(model), self.ttft.child(model),
                                                       self.e2e.child(model))
        return ps

    def add_collector(self, fn: Callable[[], None]) -> None:
        """Register a callback run before rendering (used to refresh gauges)."""
        self._collectors.append(fn)

    def render(self) -> str:
        for fn in self._collectors:
            fn()
        lines: list[str] = []
        for metric in (self.requests, self.backend_requests, self.backend_errors, self.retries,
                       self.in_flight, self.backend_up, self.breaker_opened, self.probe_down,
                       self.spare_connections, self.poison_rejected,
                       self.added_latency,
                       self.chunk_delay, self.upstream_first_byte, self.ttft, self.e2e, *self.extra):
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"
