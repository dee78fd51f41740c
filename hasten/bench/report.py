"""Terminal tables, summary JSON, per-request JSON/CSV and the self-contained HTML report."""

from __future__ import annotations

import csv
import datetime as _dt
import json
import math
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Any

from hasten.bench.campaign import PointResult
from hasten.bench.metrics import Samples, capacity
from hasten.bench.svgplot import PALETTE, Series, cdf_points, line_chart

RATIO_METRICS: tuple[tuple[str, str], ...] = (
    ("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"),
    ("median_tpot_ms", "TPOT p50"), ("p99_tpot_ms", "TPOT p99"),
    ("output_throughput", "out tok/s"), ("request_goodput", "goodput"),
)


# ----------------------------------------------------------------------------- terminal

def _num(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.{digits}f}"
    return str(v)


LATENCY_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                  "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def detailed_table(s: dict[str, Any], metrics: Sequence[str] = tuple(LATENCY_TITLES)) -> str:
    """The `vllm bench serve` style block for one run; `metrics`: the latency sections shown."""
    w = 50
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="="),
             f"{'Target:':<40}{s.get('target', '')}", f"{'Load:':<40}{s.get('label', '')}",
             f"{'Successful requests:':<40}{s['completed']}",
             f"{'Failed requests:':<40}{s['failed']}"]
    for kind, count in sorted(s.get("error_counts", {}).items()):
        lines.append(f"{'  ' + kind + ':':<40}{count}")
    for example in s.get("error_examples", []):
        lines.append(f"  e.g. {example}")
    lines += [f"{'Benchmark duration (s):':<40}{_num(s['duration'])}",
              f"{'Total input tokens:':<40}{s['total_input_tokens']}",
              f"{'Total generated tokens:':<40}{s['total_output_tokens']}",
              f"{'Request throughput (req/s):':<40}{_num(s['request_throughput'])}",
              f"{'Output token throughput (tok/s):':<40}{_num(s['output_throughput'])}",
              f"{'Total token throughput (tok/s):':<40}{_num(s['total_token_throughput'])}"]
    if s.get("request_goodput") is not None:
        lines.append(f"{'Request goodput (req/s):':<40}{_num(s['request_goodput'])}  [{s.get('slo', '')}]")
    for key, title in LATENCY_TITLES.items():
        if key not in metrics:
            continue
        lines.append("{s:{c}^{n}}".format(s=title, n=w, c="-"))
        for stat, name in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p95", "P95"), ("p99", "P99")):
            label = f"{name} {key.upper()} (ms):"
            lines.append(f"{label:<40}{_num(s[f'{stat}_{key}_ms'])}")
    lines.append("=" * w)
    return "\n".join(lines)


def summary_table(results: Sequence[PointResult]) -> str:
    """One line per (target, load point)."""
    cols = [("target", "target", 12), ("label", "load", 16), ("completed", "ok", 5), ("failed", "err", 4),
            ("request_throughput", "req/s", 7), ("output_throughput", "tok/s", 8),
            ("median_ttft_ms", "TTFT50", 8), ("p99_ttft_ms", "TTFT99", 8),
            ("median_tpot_ms", "TPOT50", 7), ("p99_tpot_ms", "TPOT99", 7),
            ("median_itl_ms", "ITL50", 7), ("median_e2el_ms", "E2E50", 8), ("request_goodput", "goodput", 7)]
    head = " ".join(f"{title:>{w}}" if i > 1 else f"{title:<{w}}" for i, (_, title, w) in enumerate(cols))
    lines = [head, "-" * len(head)]
    for r in results:
        cells = []
        for i, (key, _, w) in enumerate(cols):
            v = r.summary.get(key)
            text = _num(v, 1) if isinstance(v, float) else ("-" if v is None else str(v))
            cells.append(f"{text[:w]:>{w}}" if i > 1 else f"{text[:w]:<{w}}")
        lines.append(" ".join(cells))
    lines.append("(latencies in ms; TTFT50 = median TTFT, TTFT99 = p99; goodput in req/s)")
    return "\n".join(lines)


def error_lines(results: Sequence[PointResult]) -> list[str]:
    """`target / load: kind: message` for the first distinct failures of each run (for the summary table)."""
    return [f"{r.target} / {r.point.label}: {example}" for r in results
            for example in r.summary.get("error_examples", [])]


def targets_of(results: Sequence[PointResult]) -> list[str]:
    return list(dict.fromkeys(r.target for r in results))


def labels_of(results: Sequence[PointResult]) -> list[str]:
    return list(dict.fromkeys(r.point.label for r in results))


def ratio_rows(results: Sequence[PointResult]) -> list[dict[str, Any]]:
    """For each point and each non-baseline target: metric(target) / metric(baseline)."""
    targets = targets_of(results)
    cell = {(r.target, r.point.label): r.summary for r in results}
    rows = []
    for label in labels_of(results):
        base = cell.get((targets[0], label))
        for t in targets[1:]:
            other = cell.get((t, label))
            if base is None or other is None:
                continue
            row: dict[str, Any] = {"load": label, "target": t, "baseline": targets[0]}
            for key, _ in RATIO_METRICS:
                a, b = other.get(key), base.get(key)
                row[key] = (a / b) if isinstance(a, int | float) and isinstance(b, int | float) and b else None
            rows.append(row)
    return rows


def ratio_table(results: Sequence[PointResult]) -> str:
    rows = ratio_rows(results)
    if not rows:
        return ""
    head = f"{'load':<16} {'target / baseline':<26}" + "".join(f"{name:>11}" for _, name in RATIO_METRICS)
    lines = [head, "-" * len(head)]
    for row in rows:
        vals = "".join(f"{('-' if row[k] is None else f'{row[k]:.2f}x'):>11}" for k, _ in RATIO_METRICS)
        lines.append(f"{row['load'][:16]:<16} {(row['target'] + ' / ' + row['baseline'])[:26]:<26}" + vals)
    lines.append("(< 1 is better for latencies, > 1 is better for throughput and goodput)")
    return "\n".join(lines)


def offered_rate(r: PointResult) -> float:
    """Offered rate for open-loop points; achieved request throughput for closed loops."""
    rate = r.point.request_rate
    return rate if math.isfinite(rate) else float(r.summary["request_throughput"])


def capacities(results: Sequence[PointResult], min_fraction: float = 0.9) -> dict[str, float | None]:
    """Per target: highest request rate with >= `min_fraction` of requests meeting the SLO."""
    out: dict[str, float | None] = {}
    for t in targets_of(results):
        pts = [(offered_rate(r), r.summary["slo_attainment"]) for r in results
               if r.target == t and "slo_attainment" in r.summary]
        out[t] = capacity(pts, min_fraction) if pts else None
    return out


# ----------------------------------------------------------------------------- files

def save_summary_json(results: Sequence[PointResult], path: str | Path) -> None:
    """One run: a flat object with vllm's key names. Several: {"runs": [...], ...}."""
    data: dict[str, Any]
    if len(results) == 1:
        data = dict(results[0].summary)
    else:
        data = {"runs": [r.summary for r in results], "ratios": ratio_rows(results)}
        if any("slo_attainment" in r.summary for r in results):
            data["capacity"] = capacities(results)
    data.setdefault("date", _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    Path(path).write_text(json.dumps(data, indent=2, default=str))


def request_rows(results: Sequence[PointResult]) -> list[dict[str, Any]]:
    rows = []
    for pr in results:
        t0 = pr.run.started_at
        for r in sorted(pr.run.results, key=lambda x: (x.start, x.index)):
            ttft, tpot, e2el = r.ttft, r.tpot, r.e2el
            rows.append({
                "target": pr.target, "load": pr.point.label, "index": r.index, "session": r.session,
                "turn": r.turn, "success": r.success, "error": r.error, "error_detail": r.error_detail,
                "start_s": r.start - t0,
                "ttft_ms": None if ttft is None else ttft * 1000.0,
                "tpot_ms": None if tpot is None else tpot * 1000.0,
                "e2el_ms": None if e2el is None else e2el * 1000.0,
                "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                "output_tokens_source": r.output_tokens_source, "chunks": len(r.chunk_times),
                "itl_ms": [x * 1000.0 for x in r.itls],
                "chunk_times_s": [c - r.start for c in r.chunk_times],
            })
    return rows


def save_requests_json(results: Sequence[PointResult], path: str | Path) -> None:
    Path(path).write_text(json.dumps(request_rows(results)))


def save_requests_csv(results: Sequence[PointResult], path: str | Path) -> None:
    rows = request_rows(results)
    fields = [k for k in (rows[0] if rows else {}) if k != "chunk_times_s"]
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            row = dict(row)
            row["itl_ms"] = " ".join(f"{x:.3f}" for x in row["itl_ms"])
            writer.writerow(row)


# ----------------------------------------------------------------------------- HTML

def _cdf_chart(results: Sequence[PointResult], metric: str, title: str) -> str:
    series = []
    for r in results:
        values = [v * 1000.0 for v in getattr(Samples.from_results(r.run.results), metric)]
        xs, ys = cdf_points(values)
        series.append(Series(f"{r.target} @ {r.point.label}", xs, ys, markers=False))
    return line_chart(series, f"{title} CDF", f"{title} (ms)", "fraction of samples")


def _per_target(results: Sequence[PointResult], x_of: Any, y_key: str, suffix: str = "",
                dash: str = "") -> list[Series]:
    series = []
    for i, t in enumerate(targets_of(results)):
        pts = sorted((x_of(r), r.summary.get(y_key)) for r in results if r.target == t
                     and isinstance(r.summary.get(y_key), int | float))
        series.append(Series(t + suffix, [p[0] for p in pts], [p[1] for p in pts],
                             color=PALETTE[i % len(PALETTE)], dash=dash))
    return series


def _html_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    th = "".join(f"<th>{escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def render_html(results: Sequence[PointResult], title: str = "hasten bench report",
                meta: dict[str, Any] | None = None) -> str:
    """A self-contained page: tables plus inline SVG plots. No scripts, no external assets."""
    def rate(r: PointResult) -> float:
        return float(r.summary["request_throughput"])

    def conc(r: PointResult) -> float:
        return float(r.summary["mean_concurrency"])

    keys = [("target", "target"), ("label", "load"), ("completed", "ok"), ("failed", "failed"),
            ("request_throughput", "req/s"), ("output_throughput", "out tok/s"),
            ("mean_ttft_ms", "TTFT mean"), ("median_ttft_ms", "TTFT p50"), ("p95_ttft_ms", "TTFT p95"),
            ("p99_ttft_ms", "TTFT p99"), ("median_tpot_ms", "TPOT p50"), ("p99_tpot_ms", "TPOT p99"),
            ("median_itl_ms", "ITL p50"), ("p99_itl_ms", "ITL p99"), ("median_e2el_ms", "E2E p50"),
            ("p99_e2el_ms", "E2E p99"), ("request_goodput", "goodput req/s")]
    rows = [[_num(r.summary.get(k), 2) if isinstance(r.summary.get(k), float) else
             ("-" if r.summary.get(k) is None else r.summary.get(k)) for k, _ in keys] for r in results]
    sections = [f"<h2>Summary</h2>{_html_table([n for _, n in keys], rows)}"]
    errors = [(r.target, r.point.label, k, v) for r in results for k, v in r.summary["error_counts"].items()]
    if errors:
        sections.append("<h2>Errors</h2>" + _html_table(["target", "load", "error", "count"], errors))
    ratios = ratio_rows(results)
    if ratios:
        rr = [[x["load"], f"{x['target']} / {x['baseline']}"] +
              ["-" if x[k] is None else f"{x[k]:.2f}x" for k, _ in RATIO_METRICS] for x in ratios]
        sections.append("<h2>Ratios to the baseline</h2>" +
                        _html_table(["load", "target / baseline"] + [n for _, n in RATIO_METRICS], rr))
    has_slo = any("slo_attainment" in r.summary for r in results)
    if has_slo:
        caps = capacities(results)
        sections.append("<h2>Capacity</h2><p>Highest request rate with at least 90% of requests meeting "
                        "every SLO.</p>" + _html_table(["target", "capacity (req/s)"],
                                                       [[t, _num(c)] for t, c in caps.items()]))
    charts = [_cdf_chart(results, "ttft", "TTFT"), _cdf_chart(results, "tpot", "TPOT"),
              _cdf_chart(results, "itl", "ITL"), _cdf_chart(results, "e2el", "E2E latency")]
    charts.append(line_chart(_per_target(results, rate, "median_ttft_ms", " p50") +
                             _per_target(results, rate, "p99_ttft_ms", " p99", "6,4"),
                             "TTFT vs load", "achieved request rate (req/s)", "TTFT (ms)"))
    charts.append(line_chart(_per_target(results, rate, "median_tpot_ms", " p50") +
                             _per_target(results, rate, "p99_tpot_ms", " p99", "6,4"),
                             "TPOT vs load", "achieved request rate (req/s)", "TPOT (ms)"))
    charts.append(line_chart(_per_target(results, conc, "output_throughput"),
                             "Throughput vs concurrency", "mean requests in flight", "output tokens/s"))
    if has_slo:
        charts.append(line_chart(_per_target(results, offered_rate, "request_goodput"),
                                 "Goodput vs rate", "offered request rate (req/s)", "goodput (req/s)"))
    sections.append("<h2>Plots</h2><div class='charts'>" +
                    "".join(f"<div class='chart'>{c}</div>" for c in charts) + "</div>")
    meta_rows = [[k, v] for k, v in (meta or {}).items()]
    meta_html = _html_table(["setting", "value"], meta_rows) if meta_rows else ""
    style = ("body{font-family:sans-serif;margin:24px;color:#222}table{border-collapse:collapse;"
             "margin:8px 0 20px;font-size:12px}th,td{border:1px solid #ccc;padding:3px 7px;text-align:right}"
             "th{background:#f3f3f3}td:first-child,td:nth-child(2){text-align:left}"
             ".charts{display:flex;flex-wrap:wrap;gap:12px}.chart{border:1px solid #ddd}")
    generated = _dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{escape(title)}</title>"
            f"<style>{style}</style></head><body><h1>{escape(title)}</h1><p>Generated {generated}. "
            "Metric definitions follow <code>vllm bench serve</code> (see docs/metrics.md).</p>"
            f"{meta_html}{''.join(sections)}</body></html>")


def save_html(results: Sequence[PointResult], path: str | Path, meta: dict[str, Any] | None = None) -> None:
    Path(path).write_text(render_html(results, meta=meta), encoding="utf-8")
