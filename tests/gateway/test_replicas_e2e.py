"""Two real `hasten serve` replicas (tiny random llama) behind one gateway: a poison request fails on
one replica alone and is never spread to the other; tenants never share cached prefixes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gw_helpers import ROOT, Cluster, Proc, _env, request, wait_until
from poison_engine import POISON_SEED

pytestmark = pytest.mark.slow  # starts processes or loads the embedded model

SERVE = ["--max-model-len", "256", "--num-kv-blocks", "64", "-O", "num_threads=1", "--log-level", "warning"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model: Path, *flags: str) -> Proc:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hasten.cli", "serve", str(model), "--port", str(port), *SERVE,
                             *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(), cwd=ROOT)
    p = Proc(proc, "127.0.0.1", port)
    ok = wait_until(lambda: proc.poll() is None and _health(p) == 200 or proc.poll() is not None, 120, 0.2)
    assert ok and proc.poll() is None, "hasten serve did not become ready"
    return p


def _health(p: Proc) -> int:
    try:
        return request(p, "GET", "/health", timeout=2).status
    except OSError:
        return 0


def _replica_metric(p: Proc, name: str) -> float:
    text = request(p, "GET", "/metrics").body.decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.split("{")[0].split(" ")[0] == name)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hasten.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama")


@pytest.fixture(scope="module")
def replicas(tiny_model: Path) -> Iterator[list[Proc]]:
    procs = [_serve(tiny_model, "--engine-factory", "tests.gateway.poison_engine:make") for _ in range(2)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()


def _completion(model: str = "tiny", **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "hello there", "max_tokens": 4, **extra}


def test_poison_request_stays_on_one_replica(replicas: list[Proc], tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    try:
        gw = cluster.gateway({"models": [{"name": "tiny", "policy": "round_robin", "backend_model": "llama",
                                          "backends": [{"url": p.url} for p in replicas]}],
                              "health": {"interval_s": 0.5}})
        poison = _completion(seed=POISON_SEED, temperature=0.7)
        r = request(gw, "POST", "/v1/completions", poison)
        assert r.status == 500, r.body
        failures = [_replica_metric(p, "hasten:engine_request_failures_total") for p in replicas]
        assert sorted(failures) == [0.0, 1.0], failures  # one replica saw it, the other never did
        # the same body again is answered by the gateway without reaching any replica
        t0 = time.monotonic()
        r = request(gw, "POST", "/v1/completions", poison)
        assert r.status >= 500 and "error" in r.json()
        assert time.monotonic() - t0 < 2.0
        assert [_replica_metric(p, "hasten:engine_request_failures_total") for p in replicas] == failures
        # the request that once killed an engine for good is a 400 and is not retried
        vocab_poison = _completion(min_tokens=2, stop_token_ids=[10**6])
        r = request(gw, "POST", "/v1/completions", vocab_poison)
        assert r.status == 400, r.body
        # both replicas keep serving: 100 normal requests all succeed
        statuses = [request(gw, "POST", "/v1/completions", _completion(prompt=f"request {i}")).status
                    for i in range(100)]
        assert statuses == [200] * 100
        assert all(_health(p) == 200 for p in replicas)
        assert [_replica_metric(p, "hasten:engine_restarts_total") for p in replicas] == [0.0, 0.0]
    finally:
        cluster.close()


def test_tenants_never_share_cached_prefixes(replicas: list[Proc], tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    try:
        gw = cluster.gateway({"models": [{"name": "tiny", "backend_model": "llama",
                                          "backends": [{"url": replicas[0].url}]}],
                              "tenants": [{"name": "a", "key": "sk-a"}, {"name": "b", "key": "sk-b"}]})
        prompt = "The quick brown fox jumps over the lazy dog. " * 4

        def cached(key: str, salt: str | None = None) -> int:
            body = _completion(prompt=prompt, max_tokens=1, **({"cache_salt": salt} if salt else {}))
            r = request(gw, "POST", "/v1/completions", body, {"Authorization": f"Bearer {key}"})
            assert r.status == 200, r.body
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        cached("sk-a")
        assert cached("sk-a") > 0  # tenant A's own prefix is reused
        assert cached("sk-b") == 0  # tenant B learns nothing about A's prompt
        assert cached("sk-b", salt="whatever-a-used") > 0  # B's own earlier request; a client salt is overridden
    finally:
        cluster.close()


def test_an_engine_killed_from_outside_is_not_charged_to_its_request(tiny_model: Path, tmp_path: Path) -> None:
    """kill -9 of a replica's engine process while it holds a request: the replica answers 503
    `engine_restarting`, the gateway sends the request to the other replica (the client gets 200),
    and the same body is not refused afterwards as a poison request."""
    import json
    import os
    import signal
    import threading

    flags = ("--max-model-len", "2048", "--num-kv-blocks", "520")
    procs = [_serve(tiny_model, *flags) for _ in range(2)]
    cluster = Cluster(tmp_path)
    try:
        gw = cluster.gateway({"models": [{"name": "tiny", "policy": "round_robin", "backend_model": "llama",
                                          "backends": [{"url": p.url} for p in procs]}],
                              "health": {"interval_s": 0.5}})
        body = _completion(prompt="tell me a story", max_tokens=1800, ignore_eos=True, temperature=0)
        answers: list[Any] = []
        client = threading.Thread(target=lambda: answers.append(
            request(gw, "POST", "/v1/completions", body, timeout=120)))
        client.start()
        holder = wait_until(lambda: next((p for p in procs
                                          if _replica_metric(p, "hasten:num_requests_running") > 0), None), 30, 0.01)
        assert holder is not None, "the request never started"
        engine_pids = [int(x) for task in Path(f"/proc/{holder.proc.pid}/task").iterdir()
                       for x in (task / "children").read_text().split()]  # started from any thread
        assert engine_pids, "no engine process under the replica"
        os.kill(engine_pids[0], signal.SIGKILL)
        client.join(120)
        (answer,) = answers
        assert answer.status == 200, answer.body
        assert len(json.loads(answer.body)["choices"][0]["text"]) > 0
        other = procs[1 - procs.index(holder)]
        assert _replica_metric(other, "hasten:request_success_total") >= 1
        assert wait_until(lambda: _health(holder) == 200, 120, 0.5), "the killed engine was not restarted"
        assert _replica_metric(holder, "hasten:engine_restarts_total") == 1.0
        # the same body again: served, not refused as a poison request
        again = request(gw, "POST", "/v1/completions", {**body, "max_tokens": 4}, timeout=60)
        assert again.status == 200, again.body
        retry_again = request(gw, "POST", "/v1/completions", body, timeout=120)
        assert retry_again.status == 200, retry_again.body
        text = request(gw, "GET", "/metrics").body.decode()
        assert "poison_rejected_total{" not in text or all(
            line.endswith(" 0") for line in text.splitlines() if line.startswith("hasten_gateway:poison_rejected_total{"))
    finally:
        cluster.close()
        for p in procs:
            p.kill()
