"""`hasten bench` end to end: tables, JSON/CSV/HTML files, and the HTML in headless Chromium."""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hasten.bench.cli import main
from hasten.bench.fake_server import FakeServerConfig, ServerThread


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(args)
    return rc, capsys.readouterr().out


def test_single_run_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with ServerThread(FakeServerConfig(ttft_ms=15, itl_ms=3, fail_every=7)) as srv:
        rc, out = run_cli(["--base-url", srv.base_url, "--model", "m", "--endpoint", "chat",
                           "--num-requests", "12", "--concurrency", "3", "--output-len", "6",
                           "--input-len", "8", "--slo", "ttft_ms=5000,tpot_ms=1000", "--warmup", "0",
                           "--output-dir", str(tmp_path), "--quiet"], capsys)
    assert rc == 0
    assert "Serving Benchmark Result" in out and "Mean TTFT (ms):" in out and "P95 TPOT (ms):" in out
    assert "http_503" in out  # error count by type in the table
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["completed"] + summary["failed"] == 12 and summary["error_counts"] == {"http_503": 1}
    for key in ("request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                "p95_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
                "p99_itl_ms", "mean_e2el_ms", "p95_e2el_ms", "goodput", "request_goodput"):
        assert isinstance(summary[key], float), key
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])  # loose SLO: all good
    rows = json.loads((tmp_path / "requests.json").read_text())
    assert len(rows) == 12
    ok = [r for r in rows if r["success"]]
    assert all(len(r["itl_ms"]) == 5 and r["output_tokens"] == 6 for r in ok)
    assert all(r["tpot_ms"] == pytest.approx((r["e2el_ms"] - r["ttft_ms"]) / 5) for r in ok)
    with open(tmp_path / "requests.csv") as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == 12 and {"ttft_ms", "tpot_ms", "e2el_ms", "itl_ms", "error"} <= set(table[0])
    html = (tmp_path / "report.html").read_text()
    assert html.count("<svg") >= 8  # CDFs x4, TTFT/TPOT vs load, throughput vs concurrency, goodput
    assert "<script" not in html and not re.search(r"(src|href)=[\"']?https?:", html)


def test_compare_mode_prints_ratio_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with ServerThread(FakeServerConfig(ttft_ms=10, itl_ms=2)) as a, ServerThread(FakeServerConfig(ttft_ms=10, itl_ms=4)) as b:
        rc, out = run_cli(["--target", f"fast={a.base_url}", "--target", f"slow={b.base_url},model=other",
                           "--num-requests", "6", "--concurrency", "1,3", "--output-len", "5", "--input-len", "4",
                           "--save-json", str(tmp_path / "s.json"), "--save-html", str(tmp_path / "r.html"),
                           "--quiet"], capsys)
    assert rc == 0
    assert "slow / fast" in out and "TPOT p50" in out
    data = json.loads((tmp_path / "s.json").read_text())
    assert len(data["runs"]) == 4 and {r["target"] for r in data["runs"]} == {"fast", "slow"}
    assert [r["load"] for r in data["ratios"]] == ["concurrency 1", "concurrency 3"]
    assert {r["model_id"] for r in data["runs"]} == {"fake-model", "other"}  # asked from /v1/models


def test_bad_arguments() -> None:
    assert main(["--num-requests", "1"]) == 2  # no server given
    assert main(["--base-url", "http://127.0.0.1:1", "--concurrency", "1,2", "--request-rate", "1,2"]) == 2
    assert main(["--target", "a=http://127.0.0.1:1", "--target", "a=http://127.0.0.1:2"]) == 2
    assert main(["--base-url", "http://127.0.0.1:1", "--extra-body", "[1]"]) == 2


CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium)")
def test_html_report_renders_in_headless_chromium(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with ServerThread(FakeServerConfig(ttft_ms=10, itl_ms=2, max_concurrency=2)) as srv:
        rc, _ = run_cli(["--base-url", srv.base_url, "--num-requests", "8", "--output-len", "4", "--input-len", "4",
                         "--sweep", "--sweep-points", "1", "--slo", "ttft_ms=200", "--save-html",
                         str(tmp_path / "report.html"), "--quiet"], capsys)
    assert rc == 0
    shot = tmp_path / "shot.png"
    profile = tmp_path / "profile"
    proc = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--window-size=1200,1600",
         f"--screenshot={shot}", (tmp_path / "report.html").as_uri()],
        capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    log = proc.stderr
    assert "Uncaught" not in log and "Failed to load resource" not in log and "ERR_FILE_NOT_FOUND" not in log


def test_bench_never_imports_torch() -> None:
    code = ("import sys, hasten.bench.cli, hasten.bench.fake_server, hasten.bench.rawclient; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([__import__("sys").executable, "-c", code], timeout=60).returncode == 0
