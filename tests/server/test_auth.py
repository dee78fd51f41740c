"""`hasten serve --api-key` / HASTEN_API_KEY as a real process (fake engine): OpenAI-style 401s on /v1/*,
/health and /metrics open unless --protect-metrics."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from hasten.server.auth import presented_key

pytestmark = pytest.mark.slow  # starts processes or loads the embedded model

ROOT = Path(__file__).resolve().parents[2]
FACTORY = "tests.server.fake_engine:FakeAsyncLLM.from_options"
KEY = "sk-test-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(tmp: Path, *flags: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    log = open(tmp / f"serve-{port}.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen([sys.executable, "-m", "hasten.cli", "serve", "--port", str(port), "--engine-factory",
                             FACTORY, "--served-model-name", "tiny", *flags], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, (tmp / f"serve-{port}.log").read_text()
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("auth")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        flag, flag_url = serve(tmp, "--api-key", KEY, "--protect-metrics")
        procs.append(flag)
        env, env_url = serve(tmp, env={"HASTEN_API_KEY": KEY})
        procs.append(env)
        yield {"flag": flag_url, "env": env_url}
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


@pytest.mark.parametrize("which", ["flag", "env"])
def test_key_accepted_and_rejected(servers: dict[str, str], which: str) -> None:
    url = servers[which]
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model="tiny", prompt="x", max_tokens=2).choices
    assert [m.id for m in good.models.list().data] == ["tiny"]
    assert httpx.post(url + "/v1/completions", json=body, headers={"x-api-key": KEY}).status_code == 200
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert info.value.code == "invalid_api_key"
    for headers in ({}, {"Authorization": "Bearer " + KEY[:-1]}, {"Authorization": f"Basic {KEY}"},
                    {"x-api-key": KEY + "x"}):
        r = httpx.post(url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401, headers
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error" and err["message"]
        assert r.headers.get("x-request-id")
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/version").json() == {"version": __import__("hasten").__version__}


def test_metrics_open_unless_protected(servers: dict[str, str]) -> None:
    assert httpx.get(servers["env"] + "/metrics").status_code == 200
    assert httpx.get(servers["flag"] + "/metrics").status_code == 401
    assert httpx.get(servers["flag"] + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_presented_key() -> None:
    assert presented_key([(b"authorization", b"Bearer abc")]) == b"abc"
    assert presented_key([(b"Authorization", b"bearer  abc ")]) == b"abc"
    assert presented_key([(b"x-api-key", b"abc")]) == b"abc"
    assert presented_key([(b"authorization", b"Basic abc")]) is None
    assert presented_key([]) is None


def test_protect_metrics_needs_a_key() -> None:
    r = subprocess.run([sys.executable, "-m", "hasten.cli", "serve", "--protect-metrics", "--engine-factory",
                        FACTORY], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if k != "HASTEN_API_KEY"})
    assert r.returncode != 0 and "--protect-metrics needs --api-key" in r.stderr
