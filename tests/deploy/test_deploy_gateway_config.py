"""The gateway's ConfigMap is a config `hasten gateway` accepts (its own loader), and the init container's
render_config.py merges the Secret into it the way the gateway pod relies on."""

from __future__ import annotations

import importlib.util
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_helpers import BASE, DEPLOY, ROOT, build, by_key, containers

from hasten.gateway.config import ConfigError, load_config, parse_config

RENDER = DEPLOY / "gateway" / "render_config.py"


def _render_module() -> Any:
    spec = importlib.util.spec_from_file_location("render_config", RENDER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render_config = _render_module()


def _objects() -> dict:
    return by_key(build(BASE))


def _write_mounts(tmp_path: Path) -> tuple[Path, Path]:
    objects = _objects()
    config = tmp_path / "config" / "gateway.yaml"
    secrets = tmp_path / "secrets" / "secrets.yaml"
    config.parent.mkdir()
    secrets.parent.mkdir()
    config.write_text(objects[("ConfigMap", "hasten-gateway")]["data"]["gateway.yaml"])
    secrets.write_text(objects[("Secret", "hasten-gateway")]["stringData"]["secrets.yaml"])
    return config, secrets


def test_configmap_loads_with_hastens_loader(tmp_path: Path) -> None:
    config, _ = _write_mounts(tmp_path)
    cfg = load_config(config)  # raises ConfigError with every problem
    assert (cfg.host, cfg.port) == ("0.0.0.0", 8080)
    assert cfg.tenants == (), "API keys belong in the Secret, not the ConfigMap"


def test_backends_are_the_statefulset_replicas(tmp_path: Path) -> None:
    objects = _objects()
    cfg = load_config(_write_mounts(tmp_path)[0])
    sts = objects[("StatefulSet", "hasten-engine")]
    hpa = objects[("HorizontalPodAutoscaler", "hasten-engine")]
    (engine,) = containers(sts, init=False)
    args = engine["args"]
    service, port = sts["spec"]["serviceName"], engine["ports"][0]["containerPort"]
    (pool,) = cfg.models
    assert pool.name == args[args.index("--served-model-name") + 1]  # clients' model name = the engines'
    expected = [f"http://{sts['metadata']['name']}-{i}.{service}:{port}" for i in range(hpa["spec"]["maxReplicas"])]
    assert [b.url for b in pool.backends] == expected, "one backend per ordinal up to the HPA's maxReplicas"
    assert cfg.health.path == engine["readinessProbe"]["httpGet"]["path"]


def test_redis_url_names_the_redis_service(tmp_path: Path) -> None:
    objects = _objects()
    cfg = load_config(_write_mounts(tmp_path)[0])
    host_port = cfg.governance.redis.removeprefix("redis://").split("/")[0]
    host, port = host_port.split(":")
    svc = objects[("Service", host)]
    assert int(port) in {p["port"] for p in svc["spec"]["ports"]}


def test_gateway_container_reads_what_the_init_container_writes() -> None:
    gw = _objects()[("Deployment", "hasten-gateway")]
    spec = gw["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    (main,) = spec["containers"]
    cmd = init["command"]
    out = cmd[cmd.index("--out") + 1]
    assert main["args"][:3] == ["gateway", "--config", out]
    assert "--require-tenants" in cmd
    assert cmd[1] == "/opt/hasten/" + str(RENDER.relative_to(ROOT)), "the script's path inside the image"
    mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
    for flag, volume in (("--config", "config"), ("--secrets", "secrets"), ("--out", "run")):
        assert mounts[str(Path(cmd[cmd.index(flag) + 1]).parent)] == volume
    run = next(v for v in spec["volumes"] if v["name"] == "run")
    assert run["emptyDir"]["medium"] == "Memory"
    port = int(yaml.safe_load(_objects()[("ConfigMap", "hasten-gateway")]["data"]["gateway.yaml"])["listen"]
               .rsplit(":", 1)[1])
    assert main["ports"][0]["containerPort"] == port


def test_render_merges_the_secret(tmp_path: Path) -> None:
    config, secrets = _write_mounts(tmp_path)
    out = tmp_path / "run" / "gateway.yaml"
    assert render_config.main(["--config", str(config), "--secrets", str(secrets), "--out", str(out),
                               "--require-tenants"]) == 0
    cfg = load_config(out)
    assert [t.name for t in cfg.tenants] == ["web", "batch"]
    assert cfg.cache_salt.enabled and cfg.cache_salt.secret and len(cfg.cache_salt.secret) >= 16
    assert cfg.governance.tenant_limits["web"].rpm == 600
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    assert cfg.models == load_config(config).models


def test_render_refuses_an_open_gateway_and_bad_configs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config, secrets = _write_mounts(tmp_path)
    out = tmp_path / "out.yaml"
    assert render_config.main(["--config", str(config), "--out", str(out), "--require-tenants"]) == 2
    assert "no tenants" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: 1.2.3.4:99\n")  # the Secret may not reroute the gateway
    assert render_config.main(["--config", str(config), "--secrets", str(bad), "--out", str(out)]) == 2
    assert "may only set" in capsys.readouterr().err
    bad.write_text("tenants: [{name: x}]\ncache_salt: {secret: short}\n")  # hasten's loader: every problem
    assert render_config.main(["--config", str(config), "--secrets", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "tenants[0].key: is required" in err and "cache_salt.secret: must be at least 16" in err
    assert not out.exists()


def test_merge_rules() -> None:
    base = {"listen": "0.0.0.0:8080", "cache_salt": {"enabled": True}}
    merged = render_config.merge(base, {"cache_salt": {"secret": "s" * 16}, "tenants": [{"name": "a", "key": "k"}]})
    assert merged["cache_salt"] == {"enabled": True, "secret": "s" * 16}
    assert base == {"listen": "0.0.0.0:8080", "cache_salt": {"enabled": True}}
    with pytest.raises(render_config.RenderError):
        render_config.merge(base, {"models": []})


def test_render_runs_as_the_init_container_runs_it(tmp_path: Path) -> None:
    config, secrets = _write_mounts(tmp_path)
    out = tmp_path / "gateway.yaml"
    proc = subprocess.run([sys.executable, str(RENDER), "--config", str(config), "--secrets", str(secrets),
                           "--out", str(out), "--require-tenants"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "2 tenant(s)" in proc.stdout
    parse_config(yaml.safe_load(out.read_text()))


def test_a_wrong_configmap_would_fail(tmp_path: Path) -> None:
    config, _ = _write_mounts(tmp_path)
    raw = yaml.safe_load(config.read_text())
    raw["models"][0]["policy"] = "fastest"
    with pytest.raises(ConfigError, match="models\\[0\\].policy"):
        parse_config(raw)
