"""Helpers of the deploy/ tests: a small kustomize (kustomize itself is not installed), the metric names
hasten really exports (built from its own metrics classes), and a PromQL reader good enough to pull
metric and label names out of the dashboard's and the adapter's queries."""

from __future__ import annotations

import copy
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
BASE = K8S / "base"
OVERLAYS = sorted(p for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())

# ------------------------------------------------------------------------------------------ kustomize

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "patches", "images", "namespace"}  # what build() does
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "ClusterRole", "ClusterRoleBinding", "StorageClass",
                  "CustomResourceDefinition", "APIService"}
# strategic-merge-patch merge keys of the lists this repo patches (the others are replaced, as in k8s)
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
              "volumeMounts": "mountPath", "ports": "containerPort", "imagePullSecrets": "name"}


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def kustomization(directory: Path) -> dict[str, Any]:
    return yaml.safe_load((directory / "kustomization.yaml").read_text(encoding="utf-8"))


def key(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def strategic_merge(target: Any, patch: Any, field: str = "") -> Any:
    """Kubernetes' strategic merge patch, for mappings and the merge-keyed lists of MERGE_KEYS."""
    if isinstance(target, dict) and isinstance(patch, dict):
        out = dict(target)
        for k, v in patch.items():
            out[k] = strategic_merge(out[k], v, k) if k in out else copy.deepcopy(v)
        return out
    if isinstance(target, list) and isinstance(patch, list) and field in MERGE_KEYS:
        mk = MERGE_KEYS[field]
        out = [copy.deepcopy(x) for x in target]
        for item in patch:
            match = next((i for i, x in enumerate(out) if x.get(mk) == item.get(mk)), None)
            if match is None:
                out.append(copy.deepcopy(item))
            else:
                out[match] = strategic_merge(out[match], item, field)
        return out
    return copy.deepcopy(patch)


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    return doc.get("spec", {}).get("template", {}).get("spec")


def containers(doc: dict[str, Any], init: bool = True) -> list[dict[str, Any]]:
    spec = _pod_spec(doc) or {}
    return [*(spec.get("initContainers", []) if init else []), *spec.get("containers", [])]


def split_image(image: str) -> tuple[str, str | None]:
    name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "")
    return name, tag or None


def build(directory: Path) -> list[dict[str, Any]]:
    """`kustomize build directory` for the features listed in KUSTOMIZATION_KEYS."""
    k = kustomization(directory)
    unknown = set(k) - KUSTOMIZATION_KEYS
    assert not unknown, f"{directory}: kustomization keys this test cannot render: {sorted(unknown)}"
    docs: list[dict[str, Any]] = []
    for entry in k.get("resources", []):
        path = (directory / entry).resolve()
        assert path.exists(), f"{directory}/kustomization.yaml lists {entry}, which does not exist"
        docs.extend(build(path) if path.is_dir() else load_docs(path))
    keys = [key(d) for d in docs]
    assert len(keys) == len(set(keys)), f"{directory}: duplicate resources {sorted(keys)}"
    for patch in k.get("patches", []):
        path = directory / patch["path"]
        assert path.is_file(), f"{directory}: patch {patch['path']} does not exist"
        (body,) = load_docs(path)
        target = patch.get("target") or {"kind": body["kind"], "name": body["metadata"]["name"]}
        index = next((i for i, d in enumerate(docs) if key(d) == (target["kind"], target["name"])), None)
        assert index is not None, f"{directory}: patch {patch['path']} targets {target}, not a resource"
        docs[index] = strategic_merge(docs[index], body)
    for image in k.get("images", []):
        used = False
        for doc in docs:
            for c in containers(doc):
                name, tag = split_image(c["image"])
                if name == image["name"]:
                    used = True
                    c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag or 'latest')}"
        assert used, f"{directory}: images entry {image['name']} matches no container image"
    if k.get("namespace"):
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = k["namespace"]
    return docs


def by_key(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {key(d): d for d in docs}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels + matchExpressions), or a Service's plain selector map."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        present, value = e["key"] in labels, labels.get(e["key"])
        op = e["operator"]
        if (op == "In" and value not in e["values"]) or (op == "NotIn" and value in e.get("values", [])) \
                or (op == "Exists" and not present) or (op == "DoesNotExist" and present):
            return False
    return True


# --------------------------------------------------------------------------------- exported metrics

TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "container", "endpoint"}  # added by Prometheus


def _populate_prometheus_client(obj: Any) -> None:
    from prometheus_client import Counter, Gauge, Histogram

    for metric in vars(obj).values():
        if isinstance(metric, Counter | Gauge | Histogram):
            child = metric.labels(*["x"] * len(metric._labelnames)) if metric._labelnames else metric
            child.observe(0.1) if isinstance(metric, Histogram) else child.inc()


def server_exposition() -> str:
    """/metrics text of `hasten serve`: its ServerMetrics with every series populated."""
    from hasten.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from hasten.server.metrics import ServerMetrics

    stats = SimpleNamespace(num_running=1, num_waiting=2, kv_cache_usage=0.5, prefix_cache_queries=10,
                            prefix_cache_hits=5, num_preemptions=1, spec_proposer="ngram", spec_proposed_tokens=4,
                            spec_accepted_tokens=2, spec_emitted_tokens=3)
    engine = SimpleNamespace(get_stats=lambda: stats)
    metrics = ServerMetrics(lambda: engine, lambda: "smollm2")
    t = time.time()
    output = RequestOutput(
        request_id="r", prompt="p", prompt_token_ids=[1, 2, 3], finished=True,
        outputs=[CompletionOutput(index=0, text="abc", token_ids=[4, 5, 6], finish_reason="length")],
        metrics=RequestMetrics(arrival_time=t - 1, first_scheduled_time=t - 0.9, first_token_time=t - 0.5,
                               last_token_time=t, finished_time=t, token_times=[t - 0.5, t - 0.2, t]))
    metrics.observe_request(output, n=1)
    _populate_prometheus_client(metrics)
    return metrics.exposition().decode()


def gateway_exposition(cfg: Any) -> str:
    """/metrics text of `hasten gateway` built from `cfg` (governance included), every series populated."""
    from hasten.gateway.core import Gateway
    from hasten.gateway.metrics import Counter, Histogram

    gateway = Gateway(cfg)
    m = gateway.metrics
    for metric in [*vars(m).values(), *m.extra]:
        if isinstance(metric, Histogram):
            metric.observe(0.01, *["x"] * len(metric.labels))
        elif isinstance(metric, Counter):
            metric.inc(*["x"] * len(metric.labels))
    return m.render()


def series(exposition: str) -> dict[str, tuple[str, set[str]]]:
    """Sample name -> (its family's type, its label names), from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, tuple[str, set[str]]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            _, labels = out.get(sample.name, (family.type, set()))
            out[sample.name] = (family.type, labels | set(sample.labels))
    return out


# ---------------------------------------------------------------------------------------- PromQL

_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
             "group_right", "inf", "nan", "start", "end"}
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)?\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
_IDENT = re.compile(r"(?<![\w:$.])([A-Za-z_:][\w:]*)(?![\w:]|\s*\()")
_COUNTER_FN = re.compile(r"(?:\b(rate|irate|increase)\(\s*)?(?<![\w:$])(hasten(?:_gateway)?:[\w:]+)")


def promql_names(expr: str) -> set[str]:
    """Metric names an expression reads (not functions, keywords, labels, durations, Grafana variables)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    return {m for m in _IDENT.findall(text) if m not in _KEYWORDS}


def promql_selector_labels(expr: str) -> list[tuple[str | None, set[str]]]:
    """(metric name or None, label names matched in its braces) for every selector."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    return [(m.group(1), set(_MATCHER.findall(m.group(2)))) for m in _SELECTOR.finditer(text)]


def promql_grouping_labels(expr: str) -> set[str]:
    return {label.strip() for group in _GROUPING.findall(expr) for label in group.split(",") if label.strip()}


def promql_counter_uses(expr: str) -> list[tuple[str, str]]:
    """(function directly around it or '', metric name) for every hasten metric in the expression."""
    return [(fn, name) for fn, name in _COUNTER_FN.findall(expr)]


def check_expr(expr: str, exported: dict[str, tuple[str, set[str]]], allowed: frozenset[str] = frozenset({"up"})
               ) -> list[str]:
    """Problems of one PromQL expression against the exported series (empty: none)."""
    problems: list[str] = []
    names = promql_names(expr)
    for name in sorted(names - set(exported) - allowed):
        problems.append(f"{name} is not exported by hasten")
    known = set().union(*(exported[n][1] for n in names if n in exported)) | TARGET_LABELS
    for name, labels in promql_selector_labels(expr):
        have = (exported[name][1] if name in exported else known) | TARGET_LABELS
        problems += [f"{name}: no label {label!r}" for label in sorted(labels - have)]
    problems += [f"grouping by unknown label {label!r}" for label in sorted(promql_grouping_labels(expr) - known)]
    for fn, name in promql_counter_uses(expr):
        if name not in exported:
            continue
        cumulative = exported[name][0] in ("counter", "histogram")
        if cumulative and not fn:
            problems.append(f"{name} is cumulative: read it through rate() or increase()")
        if not cumulative and fn:
            problems.append(f"{name} is a {exported[name][0]}: {fn}() of it means nothing")
    if "histogram_quantile" in expr:
        if not any(n.endswith("_bucket") for n in names):
            problems.append("histogram_quantile without a _bucket series")
        if "le" not in promql_grouping_labels(expr):
            problems.append("histogram_quantile needs `by (le)`")
    return problems
