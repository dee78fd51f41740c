"""Every metric the dashboard, the Prometheus adapter and the HPA read is one hasten really exports: the
names, types and labels come from the /metrics text of hasten's own ServerMetrics and of a Gateway built
from the deployed gateway config, so renaming a metric in hasten fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_helpers import (
    BASE,
    DEPLOY,
    TARGET_LABELS,
    build,
    by_key,
    check_expr,
    gateway_exposition,
    promql_names,
    series,
    server_exposition,
)

DASHBOARD = DEPLOY / "grafana" / "hasten-dashboard.json"
ADAPTER = DEPLOY / "prometheus" / "adapter-values.yaml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, set[str]]]:
    import importlib.util

    from hasten.gateway.config import load_config

    spec = importlib.util.spec_from_file_location("render_config", DEPLOY / "gateway" / "render_config.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    objects = by_key(build(BASE))
    folder = tmp_path_factory.mktemp("gw")
    (folder / "gateway.yaml").write_text(objects[("ConfigMap", "hasten-gateway")]["data"]["gateway.yaml"])
    (folder / "secrets.yaml").write_text(objects[("Secret", "hasten-gateway")]["stringData"]["secrets.yaml"])
    text, _ = render.render(folder / "gateway.yaml", folder / "secrets.yaml")
    (folder / "merged.yaml").write_text(text)
    server = series(server_exposition())
    gateway = series(gateway_exposition(load_config(folder / "merged.yaml")))
    assert all(n.startswith("hasten:") for n in server) and all(n.startswith("hasten_gateway:") for n in gateway)
    return {**server, **gateway}


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def _exprs(dash: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in _panels(dash) for t in p.get("targets", [])]


def test_dashboard_structure() -> None:
    dash = _dashboard()
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    panels = _panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs))
    used = {v for _, e in _exprs(dash) for v in re.findall(r"\$(\w+)", e)}
    assert used <= set(variables) | {"__rate_interval", "__interval", "__range"}


def test_dashboard_queries_read_exported_metrics(exported: dict[str, tuple[str, set[str]]]) -> None:
    problems = [f"{title}: {expr}\n    {p}" for title, expr in _exprs(_dashboard()) for p in check_expr(expr, exported)]
    assert not problems, "\n".join(problems)


def test_dashboard_legends_name_real_labels(exported: dict[str, tuple[str, set[str]]]) -> None:
    for p in _panels(_dashboard()):
        for t in p.get("targets", []):
            labels = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")))
            have = set().union(*(exported[n][1] for n in promql_names(t["expr"]) if n in exported)) | TARGET_LABELS
            assert labels <= have, f"{p['title']}: {labels - have}"


def test_dashboard_variables_read_exported_metrics(exported: dict[str, tuple[str, set[str]]]) -> None:
    for v in _dashboard()["templating"]["list"]:
        if v["type"] != "query":
            continue
        query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        metric, label = re.fullmatch(r"label_values\(([\w:]+),\s*(\w+)\)", query).groups()
        assert label in exported[metric][1]


def test_dashboard_covers_what_an_operator_needs() -> None:
    names = {n for _, e in _exprs(_dashboard()) for n in promql_names(e)}
    wanted = {
        "hasten:time_to_first_token_seconds_bucket", "hasten:request_time_per_output_token_seconds_bucket",
        "hasten:e2e_request_latency_seconds_bucket", "hasten:num_requests_running", "hasten:num_requests_waiting",
        "hasten:kv_cache_usage_perc", "hasten:prefix_cache_hits_total", "hasten:prefix_cache_queries_total",
        "hasten:generation_tokens_total", "hasten:engine_request_failures_total",
        "hasten_gateway:requests_total", "hasten_gateway:backend_errors_total", "hasten_gateway:backend_up",
        "hasten_gateway:ttft_seconds_bucket",
    }
    assert wanted <= names, sorted(wanted - names)
    quantiles = [e for _, e in _exprs(_dashboard()) if "histogram_quantile" in e]
    for metric in ("time_to_first_token_seconds", "request_time_per_output_token_seconds",
                   "e2e_request_latency_seconds"):
        assert {q for q in (0.5, 0.9, 0.99) if any(f"({q}," in e and metric in e for e in quantiles)} == {0.5, 0.9, 0.99}


def test_the_checker_catches_mistakes(exported: dict[str, tuple[str, set[str]]]) -> None:
    assert check_expr("rate(hasten:generation_tokens_total[5m])", exported) == []
    assert check_expr("rate(hasten:generated_tokens_total[5m])", exported)              # renamed
    assert check_expr("hasten:generation_tokens_total", exported)                       # counter without rate
    assert check_expr("rate(hasten:num_requests_waiting[5m])", exported)                # rate of a gauge
    assert check_expr("rate(hasten:num_requests_waiting_bucket[5m])", exported)         # not a histogram
    assert check_expr('hasten:num_requests_waiting{model="x"}', exported)               # model_name, not model
    assert check_expr("histogram_quantile(0.9, sum(rate(hasten:e2e_request_latency_seconds_bucket[1m])))",
                      exported)                                                         # no by (le)
    assert check_expr("sum by (backend) (hasten:num_requests_waiting)", exported)       # no such label
    assert check_expr("max(hasten_gateway:backend_up)", exported) == []


def _adapter_rules() -> list[dict[str, Any]]:
    values = yaml.safe_load(ADAPTER.read_text())
    assert values["rules"]["default"] is False
    return values["rules"]["custom"]


def _exported_as(rule: dict[str, Any], metric: str) -> str:
    """The custom-metrics API name of `metric` under `rule` (the adapter's Go regexp replacement)."""
    replacement = re.sub(r"\$\{(\d+)\}|\$(\d+)", lambda m: "\\" + (m.group(1) or m.group(2)), rule["name"]["as"])
    return re.sub(rule["name"]["matches"], replacement, metric)


def test_adapter_rule_and_hpa_metric(exported: dict[str, tuple[str, set[str]]]) -> None:
    (rule,) = _adapter_rules()
    metric = promql_names(rule["seriesQuery"])
    assert metric == {"hasten:num_requests_waiting"}
    (name,) = metric
    assert exported[name][0] == "gauge" and "model_name" in exported[name][1]
    assert check_expr(rule["seriesQuery"], exported) == []
    overrides = rule["resources"]["overrides"]
    assert overrides == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    query = rule["metricsQuery"]
    assert all(t in query for t in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"))
    concrete = query.replace("<<.Series>>", name).replace("<<.LabelMatchers>>", 'namespace="hasten"') \
                    .replace("<<.GroupBy>>", "pod")
    assert check_expr(concrete, exported) == []
    hpa = by_key(build(BASE))[("HorizontalPodAutoscaler", "hasten-engine")]
    assert _exported_as(rule, name) == hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]


def test_scrape_configs_give_the_adapter_its_labels() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    targets = {r.get("target_label") for r in job["relabel_configs"]}
    (rule,) = _adapter_rules()
    assert set(rule["resources"]["overrides"]) <= targets
    keep = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    objects = by_key(build(BASE))
    for svc_name in ("hasten-engine", "hasten-gateway"):
        svc = objects[("Service", svc_name)]
        labels = {f"__meta_kubernetes_service_label_{k.replace('.', '_').replace('/', '_').replace('-', '_')}": v
                  for k, v in svc["metadata"]["labels"].items()}
        labels["__meta_kubernetes_endpoint_port_name"] = svc["spec"]["ports"][0]["name"]
        for r in keep:
            (source,) = r["source_labels"]
            assert re.fullmatch(r["regex"], labels.get(source, "")), f"{svc_name} dropped by {r}"
    redis = objects[("Service", "hasten-redis")]
    comp = redis["metadata"]["labels"]["app.kubernetes.io/component"]
    assert not any(re.fullmatch(r["regex"], comp) for r in keep if "component" in r["source_labels"][0])


def test_servicemonitor_interval_matches_prometheus_yml() -> None:
    sm = by_key(build(BASE))[("ServiceMonitor", "hasten")]
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert sm["spec"]["endpoints"][0]["interval"] == config["global"]["scrape_interval"]


def test_files_are_short() -> None:
    files = [p for p in Path(DEPLOY).rglob("*") if p.is_file()] + list(Path(__file__).parent.glob("*.py"))
    long = {str(p): n for p in files if (n := len(p.read_text().splitlines())) >= 600}
    assert long == {}
