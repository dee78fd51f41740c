"""benchmarks/scoreboard.py: rows from each suite's JSON (ratio direction, targets), the three
outputs, --from-results, and the --quick smoke run of every suite (slow)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _scoreboard_report import html, markdown  # noqa: E402
from _scoreboard_suites import SUITES, Context, Row  # noqa: E402

BY_NAME = {s.name: s for s in SUITES}


def _ctx(tmp_path: Path, quick: bool = False) -> Context:
    return Context(quick=quick, out_dir=tmp_path, llama_server=None, can_renice=False)


def test_row_targets_and_directions():
    assert Row("s", "m", 2.0, 1.0, "p", "tok/s", 2.0, 1.5).met is True
    assert Row("s", "m", 1.0, 1.0, "p", "tok/s", 1.0, 1.5).met is False
    assert Row("s", "m", 1.0, 1.0, "p", "tok/s", 1.0).met is None
    assert Row("s", "m", 101.2, 100.0, "p", "ms", 1.2, 1.0, kind="at_most").met is False
    assert Row("s", "m", 100.5, 100.0, "p", "ms", 0.5, 1.0, kind="at_most").met is True
    assert Row("s", "m", None, None, "", "", float("nan"), 1.0).met is None


def test_offline_rows_put_latency_ratios_the_right_way_round(tmp_path):
    (tmp_path / "offline.json").write_text(json.dumps({
        "a_batch1_decode_tok_s": {"hasten": 30.0, "transformers": 15.0},
        "b_64_requests_output_tok_s": {"hasten": 100.0, "transformers": 40.0},
        "c_ttft_1024_prefix_s": {"uncached": 2.0, "cached": 0.1}}))
    rows = BY_NAME["offline"].rows(_ctx(tmp_path))
    assert [r.score for r in rows] == pytest.approx([2.0, 2.5, 20.0])
    assert [r.met for r in rows] == [True, False, True]
    assert rows[2].hasten == pytest.approx(100.0) and rows[2].unit == "ms"


def _serving_summary(with_peer: bool) -> dict:
    runs = []
    for target, tok, ttft in (("llama.cpp", 100.0, 400.0), ("hasten", 450.0, 100.0)):
        if target == "llama.cpp" and not with_peer:
            continue
        for label in ("concurrency 1", "concurrency 16", "rate 2.0"):
            runs.append({"target": target, "label": label, "output_throughput": tok, "median_ttft_ms": ttft})
    out = {"runs": runs}
    if with_peer:
        out["capacity"] = {"llama.cpp": 1.5, "hasten": 6.0}
    return out


def test_serving_rows_with_and_without_llama_server(tmp_path):
    (tmp_path / "serving").mkdir()
    (tmp_path / "serving" / "summary.json").write_text(json.dumps(_serving_summary(True)))
    rows = {r.metric: r for r in BY_NAME["serving"].rows(_ctx(tmp_path))}
    assert rows["output at 16 concurrent"].score == pytest.approx(4.5)
    assert rows["output at 16 concurrent"].met is True
    assert rows["TTFT p50 at 1 concurrent"].score == pytest.approx(4.0)  # peer / hasten: > 1 = hasten ahead
    assert rows["capacity (90 % within TTFT 1 s, TPOT 100 ms)"].score == pytest.approx(4.0)
    assert not any("rate" in m for m in rows)
    (tmp_path / "serving" / "summary.json").write_text(json.dumps(_serving_summary(False)))
    rows = BY_NAME["serving"].rows(_ctx(tmp_path))
    assert rows and all(r.peer is None and r.score is None and r.met is None for r in rows)


def test_quantization_and_speculative_rows(tmp_path):
    def variant(label, b1, b16, ppl):
        return {"label": label, "tok_s": {"1": b1, "16": b16}, "ppl": ppl}

    (tmp_path / "quantization.json").write_text(json.dumps({"variants": [
        variant("fp32", 30, 240, 10.0), variant("bf16", 50, 60, 10.0), variant("int8", 120, 330, 10.05),
        variant("int4-awq-g32", 130, 280, 10.8), variant("int4-awq-g32-q8", 150, 270, 10.9),
        variant("gguf-q4_1-q8", 140, 300, 10.1)], "llama_server_tok_s": {"1": 125.0, "16": 150.0}}))
    rows = {r.metric: r for r in BY_NAME["quantization"].rows(_ctx(tmp_path))}
    assert rows["int8 batch-1 decode vs bf16"].score == pytest.approx(2.4)
    assert rows["int4-awq-g32 batch-1 decode vs bf16"].hasten == 130  # the exact kernel, not -q8
    assert rows["gguf-q4_1-q8 batch-16 decode vs llama.cpp Q4_1"].score == pytest.approx(2.0)
    assert rows["int8 perplexity increase"].score == pytest.approx(0.5)
    assert rows["int4-awq-g32 perplexity increase"].met is False  # +8 % against a 6 % bound

    spec = {f"{w}/{v}": {"b1_tok_s": t, "b16_tok_s": 2 * t, "acceptance": None if v == "off" else 0.5,
                         "same_output": not (w == "chat" and v == "draft")}
            for w in ("grounded", "chat") for v, t in (("off", 10.0), ("ngram", 20.0), ("draft", 11.0))}
    (tmp_path / "speculative.json").write_text(json.dumps(spec))
    rows = BY_NAME["speculative"].rows(_ctx(tmp_path))
    assert rows[0].score == pytest.approx(2.0) and rows[0].met is True
    assert rows[-1].kind == "equal" and rows[-1].met is False  # one variant changed the greedy output


def test_gateway_rows_hold_added_latency_to_bounds(tmp_path):
    row = {"streams": 200, "errors": 0, "direct_ttft_p50_ms": 1.0, "gateway_ttft_p50_ms": 1.4,
           "direct_ttft_p99_ms": 3.0, "gateway_ttft_p99_ms": 9.5}
    (tmp_path / "gateway.json").write_text(json.dumps({"nice": -10, "rows": [row]}))
    p50, p99 = BY_NAME["gateway"].rows(_ctx(tmp_path))
    assert (p50.score, p50.met) == (pytest.approx(0.4), True)
    assert (p99.score, p99.met) == (pytest.approx(6.5), False)
    assert "nice -10" in p50.metric


def test_outputs_render_every_row(tmp_path):
    rows = [Row("offline", "batch-1 decode", 30.0, 15.0, "transformers", "tok/s", 2.0, 1.5),
            Row("gateway", "added TTFT p50", 1.4, 1.0, "direct", "ms", 0.4, 1.0, kind="at_most"),
            Row("speculative", "identical", None, None, "", "", 0.0, 1.0, kind="equal")]
    meta = {"date": "2026-01-01 00:00 UTC", "quick": False, "command": "python benchmarks/scoreboard.py",
            "machine": {"cpu": "cpu", "flags": ["avx2"], "cores": 2, "memory_gib": 24},
            "versions": {"torch": "x"}, "suites": [{"name": "offline", "status": "ok"},
                                                     {"name": "serving", "status": "failed (exit status 1)",
                                                      "log": "serving.log"}]}
    md = markdown(rows, SUITES, meta)
    assert "| offline | batch-1 decode (tok/s) | 30.00 | 15.00 (transformers) | 2.00x | ≥ 1.5x | met |" in md
    assert "+0.40 ms | ≤ 1 ms | met" in md and "**no**" in md and "serving: failed" in md
    page = html(rows, SUITES, meta)
    assert page.count("<svg") == 2 and "batch-1 decode" in page


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("suite", [s.name for s in SUITES])
def test_quick_run_of_each_suite(suite, tmp_path):
    """The CI smoke run: each suite's script runs end to end and its rows come out with numbers."""
    done = subprocess.run([sys.executable, "benchmarks/scoreboard.py", "--quick", "--only", suite,
                           "--out-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=880)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "scoreboard.json").read_text())
    assert [s["status"] for s in data["suites"]] == ["ok"]
    assert data["rows"] and all(r["suite"] == suite for r in data["rows"])
    figures = [r[k] for r in data["rows"] for k in ("hasten", "score") if r[k] is not None]
    assert figures and all(math.isfinite(v) for v in figures)
    assert (tmp_path / "scoreboard.md").read_text().count(f"| {suite} |") == len(data["rows"])
    if any(r["score"] is not None for r in data["rows"]):  # no peer here (llama-server missing): no ratio to chart
        assert "<svg" in (tmp_path / "scoreboard.html").read_text()
    rebuilt = subprocess.run([sys.executable, "benchmarks/scoreboard.py", "--from-results", "--only", suite,
                              "--out-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    assert json.loads((tmp_path / "scoreboard.json").read_text())["rows"] == data["rows"]
