"""The scoreboard's outputs: the machine and versions it ran on, and one table as markdown, JSON and a
self-contained HTML page with bar charts (the style of `hasten bench`'s report)."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Any

from _scoreboard_suites import Row, Suite

from hasten.bench.svgplot import Bar, bar_chart

ROOT = Path(__file__).resolve().parent.parent
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8")


def _run(argv: Sequence[str]) -> str:
    """What a short command printed (stdout, then stderr), or "" if it could not run."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return ""
    return (done.stdout + "\n" + done.stderr).strip()


def machine_info() -> dict[str, Any]:
    """CPU model, the SIMD flags that matter to the kernels, cores and memory."""
    model, flags = platform.processor() or "unknown", set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    mem_gib = None
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        first = meminfo.read_text().splitlines()[0].split()
        mem_gib = round(int(first[1]) / 2**20, 1)
    return {"cpu": model, "flags": [f for f in CPU_FLAGS if f in flags], "cores": cores, "memory_gib": mem_gib,
            "os": platform.platform()}


def versions(llama_server: str | None) -> dict[str, str]:
    out = {"python": platform.python_version(), "hasten": _run(["git", "rev-parse", "--short", "HEAD"]) or "?"}
    for mod in ("torch", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = "not installed"
    if llama_server:
        text = _run([llama_server, "--version"])
        line = next((x for x in text.splitlines() if "version" in x), "")
        out["llama-server"] = line.strip() or llama_server
    else:
        out["llama-server"] = "not found (llama.cpp columns skipped)"
    return out


def fmt(v: float | None) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if abs(v) >= 100:
        return f"{v:,.0f}" if abs(v) >= 10000 else f"{v:.1f}"
    return f"{v:.2f}" if abs(v) >= 1 else f"{v:.3f}"


def score_text(r: Row) -> str:
    if r.score is None or not math.isfinite(r.score):
        return "-"
    if r.kind == "equal":
        return "yes" if r.score >= 1 else "**no**"
    if r.kind == "at_most":
        return f"{r.score:+.2f} {r.unit}"
    return f"{r.score:.2f}x"


def target_text(r: Row) -> str:
    if r.target is None:
        return "-"
    if r.kind == "equal":
        return "yes"
    if r.kind == "at_most":
        return f"≤ {r.target:g} {r.unit}"
    return f"≥ {r.target:g}x"


def met_text(r: Row) -> str:
    return {True: "met", False: "**missed**", None: "-"}[r.met]


def markdown(rows: Sequence[Row], suites: Sequence[Suite], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    when = meta["date"] + (f" to {meta['finished']}" if meta.get("finished", meta["date"]) != meta["date"] else "")
    lines = [f"Scoreboard of {when} ({'quick smoke run' if meta['quick'] else 'full run'}): "
             f"`{meta['command']}`",
             f"on {m['cpu']} ({', '.join(m['flags']) or 'no AVX2'}), {m['cores']} cores, {m['memory_gib']} GiB; "
             + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".", "",
             "ratio > 1 means hasten is ahead (peer / hasten for latencies); for added latencies and "
             "perplexity the figure itself is held to the target.", "",
             "| benchmark | metric | hasten | peer | ratio / figure | target | |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        unit = f" ({r.unit})" if r.unit and r.kind != "at_most" else ""
        peer = f"{fmt(r.peer)} ({r.peer_name})" if r.peer_name else "-"
        note = f" — {r.note}" if r.note else ""
        lines.append(f"| {r.suite} | {r.metric}{unit}{note} | {fmt(r.hasten)} | {peer} | {score_text(r)} | "
                     f"{target_text(r)} | {met_text(r)} |")
    failed = [s for s in meta["suites"] if s["status"] != "ok"]
    for s in failed:
        lines.append(f"\n{s['name']}: {s['status']} (log: {s['log']})")
    return "\n".join(lines) + "\n"


def save_json(rows: Sequence[Row], meta: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps({**meta, "rows": [r.as_dict() for r in rows]}, indent=2, default=str))


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    th = "".join(f"<th>{escape(h)}</th>" for h in header)
    trs = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in body)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


def html(rows: Sequence[Row], suites: Sequence[Suite], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    info = [["date", meta["date"]], ["command", meta["command"]], ["cpu", m["cpu"]],
            ["flags", ", ".join(m["flags"])], ["cores", str(m["cores"])], ["memory", f"{m['memory_gib']} GiB"],
            *[[k, v] for k, v in meta["versions"].items()]]
    sections = ["<h2>Machine and versions</h2>" + _table(["", ""], info)]
    body = [[r.suite, r.metric + (f" ({r.unit})" if r.unit and r.kind != "at_most" else ""), fmt(r.hasten),
             f"{fmt(r.peer)} ({r.peer_name})" if r.peer_name else "-", score_text(r).replace("**", ""),
             target_text(r), met_text(r).replace("**", ""), r.note] for r in rows]
    sections.append("<h2>Scoreboard</h2>" + _table(
        ["benchmark", "metric", "hasten", "peer", "ratio / figure", "target", "", "note"], body))
    charts = []
    ratio_bars = [Bar(f"{r.suite}: {r.metric}", r.score, r.target, r.met) for r in rows
                  if r.kind == "ratio" and r.score is not None]
    if ratio_bars:
        charts.append(bar_chart(ratio_bars, "hasten / peer (the tick: target)", "ratio (> 1: hasten ahead)"))
    for unit in dict.fromkeys(r.unit for r in rows if r.kind == "at_most"):
        bars = [Bar(f"{r.suite}: {r.metric}", r.score, r.target, r.met) for r in rows
                if r.kind == "at_most" and r.unit == unit and r.score is not None]
        charts.append(bar_chart(bars, f"figures held to a bound, in {unit} (the tick: bound)", unit))
    sections.append("<h2>Plots</h2>" + "".join(f"<div class='chart'>{c}</div>" for c in charts))
    sections.append("<h2>What each benchmark measures</h2><ul>" + "".join(
        f"<li><b>{escape(s.name)}</b> ({escape(s.title)}): {escape(s.measures)}; peer: {escape(s.peers)}</li>"
        for s in suites) + "</ul>")
    style = ("body{font-family:sans-serif;margin:24px;color:#222}table{border-collapse:collapse;"
             "margin:8px 0 20px;font-size:12px}th,td{border:1px solid #ccc;padding:3px 7px;text-align:left}"
             "th{background:#f3f3f3}.chart{border:1px solid #ddd;display:inline-block;margin:6px}")
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>hasten scoreboard</title>"
            f"<style>{style}</style></head><body><h1>hasten scoreboard</h1>{''.join(sections)}</body></html>")


def now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
