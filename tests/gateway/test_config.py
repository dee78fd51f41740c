"""Config loading and validation: the documented shape works; every error names its location."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gw_helpers import ROOT, _env

from hasten.gateway.config import ConfigError, load_config, parse_config

EXAMPLE = """
listen: 127.0.0.1:8080
models:
  - name: smollm2
    policy: prefix_aware        # round_robin | least_outstanding | prefix_aware | session
    backends:
      - {url: "http://127.0.0.1:8001", region: eu, weight: 1}
      - {url: "http://127.0.0.1:8002", region: us}
tenants:                        # optional; without it no key is required
  - {name: a, key: sk-a}
"""


def test_issue_example_parses(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(EXAMPLE)
    cfg = load_config(path)
    assert (cfg.host, cfg.port) == ("127.0.0.1", 8080)
    (pool,) = cfg.models
    assert pool.name == "smollm2" and pool.policy == "prefix_aware"
    assert [(b.url, b.region, b.weight) for b in pool.backends] == [
        ("http://127.0.0.1:8001", "eu", 1.0), ("http://127.0.0.1:8002", "us", 1.0)]
    assert cfg.tenants[0].key == "sk-a"
    assert cfg.http2 is False and cfg.tracing.enabled is False


def test_backend_model_and_defaults() -> None:
    cfg = parse_config({"models": [{"name": "m", "backend_model": "pool-level",
                                    "backends": [{"url": "http://h:1", "backend_model": "own"},
                                                 {"url": "http://h:2/"}]}]})
    assert cfg.models[0].backend_model == "pool-level"
    assert cfg.models[0].backends[0].backend_model == "own"
    assert cfg.models[0].backends[1].url == "http://h:2"
    assert cfg.tenants == () and cfg.models[0].policy == "round_robin"


@pytest.mark.parametrize(("raw", "expected"), [
    ({"models": [{"name": "m", "policy": "fastest", "backends": [{"url": "http://h:1"}]}]},
     "models[0].policy: 'fastest' is not one of round_robin, least_outstanding, prefix_aware, session"),
    ({"models": [{"name": "m", "backends": [{"region": "eu"}]}]}, "models[0].backends[0].url: is required"),
    ({"models": [{"name": "m", "backends": [{"url": "ftp://h"}]}]}, "models[0].backends[0].url: expected http://"),
    ({"models": [{"name": "m", "backends": [{"url": "http://h:1", "weight": 0}]}]},
     "models[0].backends[0].weight: must be > 0"),
    ({"models": [{"name": "m", "backends": []}]}, "models[0].backends: expected a non-empty list"),
    ({"models": []}, "models: expected a non-empty list"),
    ({"listen": "8080", "models": [{"name": "m", "backends": [{"url": "http://h:1"}]}]},
     "listen: expected host:port"),
    ({"modles": []}, "modles: unknown key"),
    ({"models": [{"name": "m", "backends": [{"url": "http://h:1"}]},
                 {"name": "m", "backends": [{"url": "http://h:2"}]}]}, "models[1].name: duplicate model name 'm'"),
    ({"models": [{"name": "m", "backends": [{"url": "http://h:1"}]}], "tenants": [{"name": "a"}]},
     "tenants[0].key: is required"),
    ({"models": [{"name": "m", "backends": [{"url": "http://h:1"}]}], "timeouts": {"connect_s": "fast"}},
     "timeouts.connect_s: expected a number"),
    ({"models": [{"name": "m", "backends": [{"url": "http://h:1"}]}], "nice": 20}, "nice: must be between -20 and 19"),
    ({"models": [{"name": "m", "load_slack": -1, "backends": [{"url": "http://h:1"}]}]},
     "models[0].load_slack: must be >= 0"),
    ({"models": [{"name": "m", "backends": [{"url": "http://h:1"}]}], "nice": -21}, "nice: must be >= -20"),
    ({"models": [{"name": "m", "backends": [{"url": "http://h:1"}]}], "nice": 1.5}, "nice: expected an integer"),
])
def test_errors_name_the_location(raw: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(raw, "g.yaml")
    assert expected in str(exc.value), str(exc.value)


def test_all_problems_reported_at_once() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config({"listen": "x", "models": [{"name": "m", "policy": "p", "backends": [{"url": 3}]}]})
    assert len(exc.value.problems) == 3


def test_bad_yaml_reports_line(tmp_path: Path) -> None:
    path = tmp_path / "g.yaml"
    path.write_text("models:\n  - name: m\n    backends: [\n")
    with pytest.raises(ConfigError, match=r"line \d+, column \d+: not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read file"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ConfigError, match="the file is empty"):
        load_config(tmp_path / "empty.yaml")


def test_cli_reports_config_errors(tmp_path: Path) -> None:
    path = tmp_path / "g.yaml"
    path.write_text("listen: 127.0.0.1:1\nmodels:\n  - name: m\n    policy: nope\n    backends: []\n")
    r = subprocess.run([sys.executable, "-m", "hasten.cli", "gateway", "--config", str(path)], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "models[0].policy: 'nope' is not one of" in r.stderr
    assert "models[0].backends: expected a non-empty list" in r.stderr
    path.write_text(EXAMPLE)
    r = subprocess.run([sys.executable, "-m", "hasten.cli", "gateway", "--config", str(path), "--check"],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "config OK" in r.stdout


def test_nice_sets_the_gateway_process_priority(cluster) -> None:  # noqa: ANN001 - fixture
    b = cluster.backend("b1")
    cfg = {"listen": "127.0.0.1:0", "nice": 5, "models": [{"name": "m", "backends": [{"url": b.url}]}]}
    g = cluster.gateway(cfg)
    stat = Path(f"/proc/{g.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    assert int(stat[16]) == 5  # field 19 of /proc/PID/stat: nice
    g2 = cluster.gateway(cfg, "--nice", "7")  # the command line overrides the file
    assert int(Path(f"/proc/{g2.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[16]) == 7


def test_nice_without_permission_warns_and_keeps_running(monkeypatch, caplog) -> None:  # noqa: ANN001
    from hasten.gateway.cli import set_nice

    def refuse(*_: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    assert set_nice(-10) is False
    assert "cannot set nice -10 (Operation not permitted)" in caplog.text


def test_the_mmap_threshold_is_pinned_on_glibc() -> None:
    import platform

    from hasten.gateway.cli import fix_mmap_threshold, main

    assert fix_mmap_threshold(0) is False  # 0: glibc's own rule is kept
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert fix_mmap_threshold(128) is True
    assert main(["--config", "/nonexistent.yaml", "--malloc-mmap-threshold-kb", "-1"]) == 2
