"""`hasten serve` as a real process: 503 until ready, start-up time logged, request ids in the log,
SIGTERM drains in-flight streams before exiting."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow  # starts processes or loads the embedded model

ROOT = Path(__file__).resolve().parents[2]
FACTORY = "tests.server.fake_engine:FakeAsyncLLM.from_options"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_lifecycle(tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "server.log"
    cmd = [sys.executable, "-c", "import sys; from hasten.cli import main; sys.exit(main())", "serve",
           "--port", str(port), "--engine-factory", FACTORY, "-O", "start_delay=1.0", "-O", "step_time=0.01",
           "-O", "eos_after=10000", "--graceful-timeout", "20", "--served-model-name", "tiny", "alias"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        url = f"http://127.0.0.1:{port}"
        saw_503 = False
        deadline = time.monotonic() + 60
        with httpx.Client(base_url=url, timeout=10) as c:
            while True:
                assert time.monotonic() < deadline, log_path.read_text()
                assert proc.poll() is None, log_path.read_text()
                try:
                    r = c.get("/health")
                except httpx.TransportError:
                    time.sleep(0.05)
                    continue
                if r.status_code == 503:
                    saw_503 = True
                elif r.status_code == 200:
                    break
                time.sleep(0.05)
            assert saw_503, "the server should answer 503 while the engine loads"
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny", "alias"]
            ok = c.post("/v1/completions", json={"model": "alias", "prompt": "x", "max_tokens": 3},
                        headers={"X-Request-ID": "cli-req-7"})
            assert ok.status_code == 200 and ok.json()["model"] == "tiny"

        # a long stream is in flight when SIGTERM arrives: it must still complete
        result: dict[str, str] = {}

        def stream() -> None:
            with httpx.Client(base_url=url, timeout=30) as c2:
                body = {"prompt": "x", "max_tokens": 120, "stream": True, "temperature": 0}
                with c2.stream("POST", "/v1/completions", json=body, headers={"X-Request-ID": "drain-me"}) as r:
                    result["text"] = r.read().decode()

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(0.4)
        proc.send_signal(signal.SIGTERM)
        t.join(timeout=30)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    text = result.get("text", "")
    assert text.count('"text_completion"') == 120 and text.endswith("data: [DONE]\n\n"), log
    assert proc.returncode in (0, -signal.SIGTERM, 128 + signal.SIGTERM), log
    assert "ready: serving tiny" in log and "after" in log
    assert "[cli-req-7] start:" in log and "[cli-req-7] done: 3 tokens" in log
    assert "[drain-me] done: 120 tokens" in log
    assert log.index("[drain-me] done") < log.index("shutting down the engine")
