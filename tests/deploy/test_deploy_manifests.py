"""deploy/k8s: every manifest is valid against the Kubernetes JSON schemas (offline, kubernetes-validate),
the kustomizations render (our own small kustomize: the real one is not installed), and the pieces
agree with each other and with hasten itself (the serve flags, the gateway's backends, the probes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from deploy_helpers import (
    BASE,
    OVERLAYS,
    build,
    by_key,
    containers,
    kustomization,
    load_docs,
    selects,
)

try:
    import kubernetes_validate as kv
except ImportError:  # the schema tests skip; the rest of this file does not need it
    kv = None
needs_schemas = pytest.mark.skipif(kv is None, reason="pip install kubernetes-validate (the test extra)")

# The oldest Kubernetes release still commonly run, and the newest whose schemas are bundled.
K8S_VERSIONS = ("1.29.0", kv.latest_version() if kv is not None else "latest")
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}  # not in the core schemas: checked structurally
TREES = {"base": BASE, **{f"overlay-{p.name}": p for p in OVERLAYS}}


def test_both_overlays_exist() -> None:
    assert {p.name for p in OVERLAYS} == {"cpu", "gpu"}


@pytest.fixture(scope="module", params=sorted(TREES))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, build(TREES[request.param])


def test_every_base_file_is_listed() -> None:
    listed = {Path(r).name for r in kustomization(BASE)["resources"]}
    present = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert present == listed


def test_overlay_patches_target_base_resources() -> None:
    base = by_key(build(BASE))
    for overlay in OVERLAYS:
        for patch in kustomization(overlay).get("patches", []):
            (body,) = load_docs(overlay / patch["path"])
            assert (body["kind"], body["metadata"]["name"]) in base, f"{overlay.name}: {patch['path']}"


@needs_schemas
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_schemas(rendered: tuple[str, list[dict[str, Any]]], version: str) -> None:
    name, docs = rendered
    problems = []
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            continue
        try:
            kv.validate(doc, version, strict=True)  # strict: unknown fields are errors too
        except kv.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            problems.append(f"{doc['kind']}/{doc['metadata']['name']} {where}: {exc.message}")
        except kv.SchemaNotFoundError as exc:
            problems.append(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message}")
    assert not problems, f"{name} against Kubernetes {version}:\n" + "\n".join(problems)


@needs_schemas
def test_the_schema_check_catches_a_mistake() -> None:
    sts = by_key(build(BASE))[("StatefulSet", "hasten-engine")]
    sts["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(sts, K8S_VERSIONS[-1], strict=True)


def test_the_renderer_refuses_a_stray_patch(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{BASE}]\npatches:\n  - path: p.yaml\n")
    (tmp_path / "p.yaml").write_text("apiVersion: apps/v1\nkind: StatefulSet\nmetadata: {name: nope}\n")
    with pytest.raises(AssertionError, match="not a resource"):
        build(tmp_path)


def test_service_monitor_structure(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    (sm,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(sm) <= {"apiVersion", "kind", "metadata", "spec"}
    spec = sm["spec"]
    assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel", "targetLabels", "podTargetLabels",
                         "sampleLimit", "attachMetadata"}
    services = [d for d in docs if d["kind"] == "Service" and selects(spec["selector"], d["metadata"]["labels"])]
    assert sorted(s["metadata"]["name"] for s in services) == ["hasten-engine", "hasten-gateway"]
    endpoint_keys = {"port", "targetPort", "path", "scheme", "interval", "scrapeTimeout", "honorLabels",
                     "relabelings", "metricRelabelings", "params", "tlsConfig", "bearerTokenSecret"}
    for ep in spec["endpoints"]:
        assert set(ep) <= endpoint_keys
        assert ep["path"] == "/metrics"
        assert all(ep["port"] in {p["name"] for p in s["spec"]["ports"]} for s in services)
        assert ep["interval"].endswith("s") and int(ep["interval"][:-1]) <= 15


def _workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def test_selectors_and_ports_connect(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    workloads = _workloads(docs)
    for w in workloads:
        assert selects(w["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"]), w["metadata"]["name"]
    for svc in (d for d in docs if d["kind"] == "Service"):
        (target,) = [w for w in workloads if selects(svc["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]
        named = {p["name"]: p["containerPort"] for c in containers(target, init=False) for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in named, f"{svc['metadata']['name']}: {port['targetPort']}"
            assert named[port["targetPort"]] == port["port"]
    for pdb in (d for d in docs if d["kind"] == "PodDisruptionBudget"):
        assert [w for w in workloads if selects(pdb["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]


def test_volumes_reference_real_objects(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    objects = by_key(docs)
    for w in _workloads(docs):
        spec = w["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in containers(w):
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{w['metadata']['name']}/{c['name']}: {mount['name']}"
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                port = c.get(probe, {}).get("httpGet", {}).get("port")
                if port is not None:
                    assert port in {p["name"] for p in c["ports"]}
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in objects
            for kind, ref, field in (("ConfigMap", "configMap", "name"), ("Secret", "secret", "secretName")):
                if ref in v:
                    obj = objects[(kind, v[ref][field])]
                    keys = set(obj.get("data", {})) | set(obj.get("stringData", {}))
                    assert {i["key"] for i in v[ref].get("items", [])} <= keys


def test_engine_replicas(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    from hasten.server.cli import parse_args

    name, docs = rendered
    objects = by_key(docs)
    sts = objects[("StatefulSet", "hasten-engine")]
    headless = objects[("Service", sts["spec"]["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None"  # one DNS name per replica, for the gateway
    assert "replicas" not in sts["spec"], "the HPA owns the replica count; kubectl apply would reset it"
    (engine,) = containers(sts, init=False)
    assert engine["startupProbe"]["httpGet"]["path"] == "/health"
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health"
    probe = engine["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 600, "model loads take minutes"
    assert engine["livenessProbe"]["httpGet"]["path"] != "/health", "a restarting engine must not be killed"
    args = engine["args"]
    assert args[0] == "serve"
    if name == "overlay-gpu":
        assert args[args.index("--device") + 1] == "cuda"
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert engine["image"].endswith("-cuda")
    else:
        assert "--device" not in args and "nvidia.com/gpu" not in engine["resources"]["limits"]
    # The args are ones `hasten serve` accepts. `--device` belongs to the GPU engine, not built yet: until
    # the serve command knows it, it must be the only flag it does not know.
    try:
        parsed = parse_args(args[1:])
    except SystemExit:
        assert "--device" in args, f"hasten serve rejects {args}"
        i = args.index("--device")
        parsed = parse_args(args[1:i] + args[i + 2:])
    mounts = {m["name"]: m["mountPath"] for m in engine["volumeMounts"]}
    assert parsed.model.startswith(mounts["models"] + "/"), "the model comes from the models volume"
    assert parsed.host == "0.0.0.0" and parsed.port == engine["ports"][0]["containerPort"]
    assert parsed.served_model_name == ["smollm2"]
    if parsed.num_threads is not None:
        assert parsed.num_threads == int(engine["resources"]["limits"]["cpu"])
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > parsed.graceful_timeout
    assert all(v.get("persistentVolumeClaim", {}).get("readOnly", True)
               for v in sts["spec"]["template"]["spec"]["volumes"])


def test_hpa_scales_the_engines_on_queue_depth(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    (hpa,) = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert by_key(docs)[(ref["kind"], ref["name"])]["apiVersion"] == ref["apiVersion"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "hasten_num_requests_waiting"
    assert metric["pods"]["target"]["type"] == "AverageValue"
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]


def test_images_per_overlay() -> None:
    for overlay in OVERLAYS:
        images = {c["image"] for d in build(overlay) for c in containers(d)}
        assert all(i.startswith(("registry.example.com/hasten:", "redis:")) for i in images), images
    gpu = by_key(build(next(p for p in OVERLAYS if p.name == "gpu")))
    (init,) = gpu[("Deployment", "hasten-gateway")]["spec"]["template"]["spec"]["initContainers"]
    assert not init["image"].endswith("-cuda"), "the gateway stays on the CPU image"


def test_namespace_is_set_by_overlays() -> None:
    for overlay in OVERLAYS:
        docs = build(overlay)
        assert ("Namespace", "hasten") in by_key(docs)
        assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"hasten"}
