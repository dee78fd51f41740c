"""Latency and throughput metrics, defined as in `vllm bench serve` (see docs/metrics.md).

All times inside a `RequestResult` are absolute `time.perf_counter()` seconds; the summary
reports milliseconds (latencies) and per-second rates (throughputs).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES: tuple[int, ...] = (50, 90, 95, 99)
LATENCY_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """Everything measured for one request. Times are `perf_counter()` seconds."""

    index: int
    start: float
    success: bool = False
    error: str = ""
    error_detail: str = ""
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    output_tokens_source: str = ""  # "usage" | "tokenizer" | "chunks"
    generated_text: str = ""
    end: float = 0.0  # when the response finished (or failed)
    session: int | None = None
    turn: int = 0
    # The unparsed response while a run is in progress: parsing is deferred until the run
    # ends so that it never delays the timestamps of other streams (see client.finalize).
    raw: Any = field(default=None, repr=False, compare=False)

    @property
    def ttft(self) -> float | None:
        """Time to the first chunk carrying content, from just before the request was sent."""
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2el(self) -> float | None:
        """End-to-end latency: last content chunk minus start."""
        return self.chunk_times[-1] - self.start if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); undefined for requests with <= 1 output token."""
        if not self.success or self.output_tokens <= 1 or not self.chunk_times:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive content chunks."""
        t = self.chunk_times
        return [t[i] - t[i - 1] for i in range(1, len(t))]


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds; None means "no objective"."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> SLO | None:
        """Parse `ttft_ms=500,tpot_ms=50,e2e_ms=10000` (any subset)."""
        if not text:
            return None
        values: dict[str, float] = {}
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, value = part.partition("=")
            key = key.strip().lower()
            if key == "e2el_ms":
                key = "e2e_ms"
            if not sep or key not in ("ttft_ms", "tpot_ms", "e2e_ms"):
                raise ValueError(f"bad SLO term {part!r}; expected ttft_ms=, tpot_ms= or e2e_ms=")
            values[key] = float(value)
        return cls(**values)

    def is_met(self, r: RequestResult) -> bool:
        """A successful request meets the SLO if it meets every given objective.

        As in vllm, a request with <= 1 output token counts as TPOT 0 here.
        """
        if not r.success:
            return False
        ttft, e2el, tpot = r.ttft, r.e2el, r.tpot
        if self.ttft_ms is not None and (ttft is None or ttft * 1000.0 > self.ttft_ms):
            return False
        if self.tpot_ms is not None and (tpot or 0.0) * 1000.0 > self.tpot_ms:
            return False
        if self.e2e_ms is not None and (e2el is None or e2el * 1000.0 > self.e2e_ms):
            return False
        return True

    def describe(self) -> str:
        parts = [f"{k}={v:g}" for k, v in (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms),
                                             ("e2e_ms", self.e2e_ms)) if v is not None]
        return ",".join(parts)


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _std(values: Sequence[float]) -> float:
    """Population standard deviation (numpy's default, as vllm reports)."""
    if not values:
        return 0.0
    m = _mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def distribution_ms(values_s: Sequence[float], name: str) -> dict[str, float]:
    """mean/median/std/p90/p95/p99 of `values_s` (seconds) as `<stat>_<name>_ms` keys."""
    ms = [v * 1000.0 for v in values_s]
    out = {f"mean_{name}_ms": _mean(ms), f"median_{name}_ms": percentile(ms, 50),
           f"std_{name}_ms": _std(ms)}
    for p in PERCENTILES:
        if p != 50:
            out[f"p{p}_{name}_ms"] = percentile(ms, p)
    return out


@dataclass
class Samples:
    """Per-metric sample lists (seconds) pooled over the successful requests of a run."""

    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2el: list[float] = field(default_factory=list)

    @classmethod
    def from_results(cls, results: Sequence[RequestResult]) -> Samples:
        s = cls()
        for r in results:
            if not r.success:
                continue
            ttft, e2el, tpot = r.ttft, r.e2el, r.tpot
            if ttft is not None:
                s.ttft.append(ttft)
            if e2el is not None:
                s.e2el.append(e2el)
            if tpot is not None:
                s.tpot.append(tpot)
            s.itl.extend(r.itls)
        return s


def summarize(results: Sequence[RequestResult], duration: float, slo: SLO | None = None,
              **extra: Any) -> dict[str, Any]:
    """The run summary under `vllm bench serve`'s key names (plus p90/p95 and `goodput`).

    `duration` is the wall time of the measured run (first dispatch to last completion).
    """
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    total_input = sum(r.prompt_tokens for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    dur = duration if duration > 0 else float("nan")
    summary: dict[str, Any] = dict(extra)
    summary.update({
        "duration": duration,
        "completed": len(ok),
        "failed": len(failed),
        "num_prompts": len(results),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / dur,
        "output_throughput": total_output / dur,
        "total_token_throughput": (total_input + total_output) / dur,
    })
    if slo is not None:
        good = sum(1 for r in ok if slo.is_met(r))
        summary["request_goodput"] = good / dur
        summary["goodput"] = good / dur
        summary["slo_attainment"] = good / len(results) if results else 0.0
        summary["slo"] = slo.describe()
    else:
        summary["request_goodput"] = None
        summary["goodput"] = None
    samples = Samples.from_results(results)
    for name in LATENCY_METRICS:
        summary.update(distribution_ms(getattr(samples, name), name))
    summary["error_counts"] = dict(Counter(r.error for r in failed))
    summary["error_examples"] = error_examples(failed)
    if ok:
        in_flight = sum((r.end - r.start) for r in ok) / dur
        summary["mean_concurrency"] = in_flight
    else:
        summary["mean_concurrency"] = 0.0
    summary["output_tokens_source"] = dict(Counter(r.output_tokens_source for r in ok))
    return summary


def error_examples(failed: Sequence[RequestResult], limit: int = 3) -> list[str]:
    """The first `limit` distinct failures as `kind: message` (e.g. `http_404: The model ... does not exist.`)."""
    seen: list[str] = []
    for r in failed:
        line = f"{r.error}: {r.error_detail}" if r.error_detail else r.error
        if line not in seen:
            seen.append(line)
            if len(seen) == limit:
                break
    return seen


def capacity(points: Sequence[tuple[float, float]], min_fraction: float = 0.9) -> float | None:
    """Highest request rate whose SLO attainment is >= `min_fraction`.

    `points` are (request rate, fraction of requests meeting the SLO). None if no point passes.
    """
    passing = [rate for rate, frac in points if frac >= min_fraction and math.isfinite(rate)]
    return max(passing) if passing else None
