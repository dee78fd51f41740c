"""Tiny inline-SVG line and bar charts for the HTML report (no JS, no external assets)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#17becf", "#7f7f7f", "#bcbd22")
DASHES = ("", "6,4", "2,3", "8,3,2,3")


@dataclass
class Series:
    name: str
    xs: Sequence[float]
    ys: Sequence[float]
    color: str = ""
    dash: str = ""
    markers: bool = True


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About `n` round tick values covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0, 1.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step + 1e-9)
    last = math.ceil(hi / step - 1e-9)
    return [round(k * step, 12) for k in range(first, max(last, first + 1) + 1)][:60]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 10000:
        return f"{v:,.0f}"
    return f"{v:.4g}"


def cdf_points(values: Sequence[float], max_points: int = 300) -> tuple[list[float], list[float]]:
    """Empirical CDF as (sorted values, cumulative fraction), thinned to `max_points`."""
    v = sorted(values)
    n = len(v)
    if n == 0:
        return [], []
    idx = range(n) if n <= max_points else sorted({round(i * (n - 1) / (max_points - 1)) for i in range(max_points)})
    return [v[i] for i in idx], [(i + 1) / n for i in idx]


def line_chart(series: Sequence[Series], title: str, xlabel: str, ylabel: str,
               width: int = 520, height: int = 320, y_from_zero: bool = True) -> str:
    """An SVG line chart with axes, ticks, grid and a legend."""
    ml, mr, mt, mb = 64, 16, 30, 46
    legend_h = 16 * ((len(series) + 1) // 2)
    pw, ph = width - ml - mr, height - mt - mb
    total_h = height + legend_h
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{total_h}" '
             f'viewBox="0 0 {width} {total_h}" font-family="sans-serif" font-size="11">',
             f'<rect width="{width}" height="{total_h}" fill="white"/>',
             f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="13" font-weight="bold">'
             f'{escape(title)}</text>']
    xs = [x for s in series for x in s.xs if math.isfinite(x)]
    ys = [y for s in series for y in s.ys if math.isfinite(y)]
    if not xs or not ys:
        parts.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" fill="#888">no data</text>')
        parts.append("</svg>")
        return "".join(parts)
    xt = nice_ticks(min(xs), max(xs))
    yt = nice_ticks(0.0 if y_from_zero else min(ys), max(ys))
    x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]
    x1 = x1 if x1 > x0 else x0 + 1
    y1 = y1 if y1 > y0 else y0 + 1

    def px(x: float) -> float:
        return ml + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return mt + ph - (y - y0) / (y1 - y0) * ph

    for t in yt:
        parts.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="#e5e5e5"/>'
                     f'<text x="{ml - 5}" y="{py(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    for t in xt:
        parts.append(f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{mt}" y2="{mt + ph}" stroke="#f0f0f0"/>'
                     f'<text x="{px(t):.1f}" y="{mt + ph + 15}" text-anchor="middle">{_fmt(t)}</text>')
    parts.append(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>')
    parts.append(f'<text x="{ml + pw / 2}" y="{mt + ph + 34}" text-anchor="middle">{escape(xlabel)}</text>')
    parts.append(f'<text transform="translate(14,{mt + ph / 2}) rotate(-90)" text-anchor="middle">'
                 f'{escape(ylabel)}</text>')
    for i, s in enumerate(series):
        color = s.color or PALETTE[i % len(PALETTE)]
        dash = s.dash or DASHES[(i // len(PALETTE)) % len(DASHES)]
        pts = [(px(x), py(y)) for x, y in zip(s.xs, s.ys, strict=False) if math.isfinite(x) and math.isfinite(y)]
        if not pts:
            continue
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.8"{dash_attr}/>')
        if s.markers and len(pts) <= 40:
            parts.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.8" fill="{color}"/>' for x, y in pts)
        lx = ml + (i % 2) * (pw / 2)
        ly = height + 16 * (i // 2) + 2
        parts.append(f'<line x1="{lx:.1f}" x2="{lx + 18:.1f}" y1="{ly:.1f}" y2="{ly:.1f}" stroke="{color}" '
                     f'stroke-width="2"{dash_attr}/><text x="{lx + 22:.1f}" y="{ly + 4:.1f}">'
                     f'{escape(s.name[:48])}</text>')
    parts.append("</svg>")
    return "".join(parts)


@dataclass
class Bar:
    label: str
    value: float
    mark: float | None = None  # a target drawn as a tick across the bar's row
    good: bool | None = None  # colours the bar: True green, False red, None grey


def bar_chart(bars: Sequence[Bar], title: str, xlabel: str, width: int = 640) -> str:
    """Horizontal bars from zero (one row per bar, label on the left), each with an optional target tick."""
    ml, mr, mt, mb, row_h = 260, 24, 30, 40, 20
    finite = [b for b in bars if math.isfinite(b.value)]
    height = mt + mb + row_h * max(1, len(finite))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="13" font-weight="bold">'
             f'{escape(title)}</text>']
    if not finite:
        parts.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" fill="#888">no data</text></svg>')
        return "".join(parts)
    values = [b.value for b in finite] + [b.mark for b in finite if b.mark is not None]
    ticks = nice_ticks(min(0.0, min(values)), max(values))
    x0, x1 = ticks[0], ticks[-1] if ticks[-1] > ticks[0] else ticks[0] + 1
    pw = width - ml - mr

    def px(x: float) -> float:
        return ml + (x - x0) / (x1 - x0) * pw

    bottom = mt + row_h * len(finite)
    for t in ticks:
        parts.append(f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{mt}" y2="{bottom}" stroke="#e5e5e5"/>'
                     f'<text x="{px(t):.1f}" y="{bottom + 14}" text-anchor="middle">{_fmt(t)}</text>')
    parts.append(f'<text x="{ml + pw / 2}" y="{bottom + 32}" text-anchor="middle">{escape(xlabel)}</text>')
    for i, b in enumerate(finite):
        y = mt + i * row_h
        color = {True: "#2ca02c", False: "#d62728"}.get(b.good, "#7f7f7f")
        left, right = sorted((px(0.0), px(b.value)))
        parts.append(f'<text x="{ml - 6}" y="{y + 14}" text-anchor="end">{escape(b.label[:44])}</text>'
                     f'<rect x="{left:.1f}" y="{y + 4}" width="{max(right - left, 1):.1f}" height="{row_h - 8}" '
                     f'fill="{color}"/><text x="{right + 3:.1f}" y="{y + 14}">{_fmt(b.value)}</text>')
        if b.mark is not None:
            parts.append(f'<line x1="{px(b.mark):.1f}" x2="{px(b.mark):.1f}" y1="{y + 1}" y2="{y + row_h - 1}" '
                         f'stroke="#222" stroke-width="2"/>')
    parts.append("</svg>")
    return "".join(parts)
