"""The fake server as others use it (subprocess, non-streaming) and the raw reference client."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import urllib.request

import pytest

from hasten.bench.fake_server import FakeServer, FakeServerConfig, ServerThread
from hasten.bench.rawclient import run_raw
from hasten.bench.runner import Progress


def test_module_cli_serves_health_and_completions() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "hasten.bench.fake_server", "--port", "0", "--ttft-ms", "5",
                             "--itl-ms", "1", "--max-seconds", "30"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line
        url = line.strip().rsplit(" ", 1)[-1]
        with urllib.request.urlopen(url + "/health", timeout=10) as resp:
            assert resp.status == 200
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
            {"model": "m", "prompt": "a b c", "max_tokens": 4}).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["choices"][0]["text"] == " t0 t1 t2 t3"
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    finally:
        proc.terminate()
        proc.wait(10)


def test_non_streaming_chat_in_thread() -> None:
    with ServerThread(FakeServerConfig(ttft_ms=5, itl_ms=1)) as srv:
        req = urllib.request.Request(srv.base_url + "/v1/chat/completions", data=json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2}).encode())
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = json.loads(resp.read())
    assert body["choices"][0]["message"]["content"] == " t0 t1" and body["usage"]["prompt_tokens"] == 2


@pytest.mark.parametrize("mode", ["protocol", "sock_recv"])
def test_raw_reference_client_sees_the_pace(mode: str) -> None:
    async def go() -> list:
        server = FakeServer(FakeServerConfig(ttft_ms=20, itl_ms=5))
        port = await server.start()
        try:
            return await run_raw("127.0.0.1", port, streams=4, requests_per_stream=2, max_tokens=6, mode=mode)
        finally:
            await server.stop()

    timings = asyncio.run(go())
    assert len(timings) == 8 and all(len(t.token_times) == 6 for t in timings)
    assert all(0.020 <= t.ttft < 0.020 + 0.05 for t in timings)
    assert all(t.tpot is not None and 0.003 < t.tpot < 0.010 for t in timings)


def test_progress_bar_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    bar = Progress(4, "demo", enabled=True)
    for ok in (True, False, True, True):
        bar.update(ok)
    bar.close()
    out = buf.getvalue()
    assert "4/4" in out and "1 failed" in out and "#" * 30 in out
    quiet = Progress(4, "demo", enabled=False)
    quiet.update(True)
    quiet.close()
    assert buf.getvalue() == out
