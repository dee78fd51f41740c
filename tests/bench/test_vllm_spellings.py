"""`hasten bench` takes the `vllm bench serve` spellings people paste, with the same meaning as its own flags,
and reports progress when stderr is not a terminal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hasten.bench.cli import build_config, build_parser, main
from hasten.bench.fake_server import FakeServerConfig, ServerThread
from hasten.bench.runner import Progress

URL = "http://127.0.0.1:1"


def settings(argv: list[str]) -> tuple[object, ...]:
    args = build_parser().parse_args(argv)
    cfg = build_config(args)
    return (cfg.workload, cfg.client.endpoint, cfg.slo, cfg.run.progress, args.percentile_metrics, cfg.targets)


def test_vllm_spellings_parse_to_the_same_settings() -> None:
    vllm = ["--base-url", URL, "--model", "m", "--dataset-name", "random", "--random-input-len", "32",
            "--random-output-len", "8", "--random-range-ratio", "0.5", "--goodput", "ttft:500", "tpot:50", "e2el:9000",
            "--endpoint", "/v1/chat/completions", "--disable-tqdm", "--num-prompts", "7",
            "--percentile-metrics", "ttft,tpot,itl,e2el"]
    ours = ["--base-url", URL, "--model", "m", "--dataset", "random", "--input-len", "32", "--output-len", "8",
            "--range-ratio", "0.5", "--slo", "ttft_ms=500,tpot_ms=50,e2e_ms=9000", "--endpoint", "chat",
            "--no-progress", "--num-requests", "7"]
    assert settings(vllm) == settings(ours)
    assert settings(["--base-url", URL, "--endpoint", "/v1/completions"])[1] == "completions"


@pytest.mark.parametrize("bad", [["--goodput", "ttfb:5"], ["--goodput", "ttft=5"], ["--goodput", "ttft:5", "--slo",
                                                                                     "ttft_ms=5"]])
def test_bad_goodput(bad: list[str]) -> None:
    assert main(["--base-url", URL, *bad]) == 2


@pytest.mark.parametrize("bad", [["--endpoint", "/v1/embeddings"], ["--percentile-metrics", "ttft,foo"]])
def test_bad_spellings_are_usage_errors(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--base-url", URL, *bad])
    assert info.value.code == 2


def test_save_result_and_percentile_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with ServerThread(FakeServerConfig(ttft_ms=1, itl_ms=1)) as srv:
        rc = main(["--base-url", srv.base_url, "--num-prompts", "3", "--random-output-len", "3",
                   "--random-input-len", "4", "--save-result", "--result-dir", str(tmp_path / "res"),
                   "--result-filename", "out.json", "--percentile-metrics", "ttft,e2el", "--goodput", "ttft:60000"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Time to First Token" in out and "End-to-end Latency" in out
    assert "Inter-token Latency" not in out and "Time per Output Token" not in out
    assert "Request goodput" in out
    data = json.loads((tmp_path / "res" / "out.json").read_text())
    assert data["completed"] == 3 and data["model_id"] == "fake-model"  # one run: a flat object


def test_progress_lines_when_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    p = Progress(4, "server all at once", enabled=None, interval=0.0)  # capsys: stderr is not a terminal
    for ok in (True, False, True, True):
        p.update(ok)
    p.close()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 5 and "\r" not in "".join(lines)
    assert lines[-1].startswith("server all at once: 4/4 requests done") and "1 failed" in lines[-1]
    off = Progress(4, "x", enabled=False, interval=0.0)
    off.update(True)
    off.close()
    assert capsys.readouterr().err == ""
