"""Engine supervision on the real engine (tiny random llama): a killed or failed engine ends every
in-flight request with an error at once, /health turns 503, the engine is restarted and serves
again; too many failures in the window give up; a stalled engine is reported unhealthy."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from hasten.engine.async_engine import AsyncLLM
from hasten.server.engine_process import ProcessEngine
from hasten.server.supervisor import SupervisionConfig
from hasten.testing import make_tiny_model

from .harness import ServerThread

pytestmark = pytest.mark.slow  # starts processes or loads the embedded model

OPTIONS = dict(dtype="float32", max_model_len=256, max_num_seqs=8, num_kv_blocks=64, num_threads=1)
# long enough that no stream can finish before the kill, even when the four start far apart
LONG = {"prompt": "tell me a story", "max_tokens": 1800, "ignore_eos": True, "temperature": 0}
LONG_OPTIONS = {**OPTIONS, "max_model_len": 2048, "num_kv_blocks": 520}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama")


def _wait(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.01)
    return time.monotonic() - t0


def _stream_until_error(url: str, started: threading.Event, ended: list[tuple[float, str]]) -> None:
    """Stream one long completion; record when and how it ended."""
    with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", "/v1/completions",
                                                             json={**LONG, "stream": True}) as r:
        kind = f"status {r.status_code}"
        try:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"choices"' in line:
                    started.set()
                if '"error"' in line:
                    kind = "error event"
                if line == "data: [DONE]":
                    break
        except httpx.HTTPError as exc:
            kind = f"transport error {type(exc).__name__}"
    ended.append((time.monotonic(), kind))


def _metric(c: httpx.Client, name: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exported")


def test_kill_9_under_load_restarts_the_engine(tiny_model: Path) -> None:
    factory = lambda: ProcessEngine.from_options(str(tiny_model), **LONG_OPTIONS)  # noqa: E731
    with ServerThread(factory) as srv, srv.client() as c:
        first_pid = srv.engine.pid
        started = [threading.Event() for _ in range(4)]
        ended: list[tuple[float, str]] = []
        threads = [threading.Thread(target=_stream_until_error, args=(srv.url, ev, ended)) for ev in started]
        answers: list[httpx.Response] = []  # a non-streaming request in flight too
        threads.append(threading.Thread(target=lambda: answers.append(
            httpx.post(srv.url + "/v1/completions", json=LONG, timeout=60))))
        for t in threads:
            t.start()
        for ev in started:
            assert ev.wait(60), "streams did not start"
        killed_at = time.monotonic()
        os.kill(first_pid, signal.SIGKILL)
        for t in threads:
            t.join(30)
        assert len(ended) == 4
        assert all(kind == "error event" for _, kind in ended), ended
        assert max(t for t, _ in ended) - killed_at < 1.0, "in-flight requests took over 1 s to fail"
        # killed from outside, not by what it computed: a retryable 503 (a gateway tries another replica
        # and does not hold the request responsible)
        (answer,) = answers
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_restarting", answer.text
        assert "SIGKILL" in answer.json()["error"]["message"] and answer.headers.get("retry-after")
        # 503 at once, then the restarted engine serves again
        assert c.get("/health").status_code == 503
        _wait(lambda: c.get("/health").status_code == 200, 120, "the restarted engine")
        assert srv.engine.pid != first_pid
        rs = [c.post("/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 4}) for i in range(5)]
        assert [r.status_code for r in rs] == [200] * 5
        assert _metric(c, "hasten:engine_restarts_total") == 1.0
        stats = srv.engine.get_stats()
        assert stats.num_running == stats.num_waiting == 0
        assert stats.num_free_blocks == stats.num_total_blocks, "KV blocks leaked"
        assert srv.failures == []


def test_step_failure_in_thread_mode_restarts(tiny_model: Path) -> None:
    broken = {"armed": True}

    def factory() -> AsyncLLM:
        llm = AsyncLLM.from_options(str(tiny_model), **OPTIONS)
        real_step = llm.engine.step

        def step():  # the first engine built fails its first real step, as an engine bug would
            if broken["armed"] and llm.engine.has_unfinished_requests() and llm.step_count > 0:
                broken["armed"] = False
                raise RuntimeError("simulated bug in the step")
            return real_step()

        llm.engine.step = step  # type: ignore[method-assign]
        return llm

    with ServerThread(factory) as srv, srv.client() as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 8})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_failed", r.text
        _wait(lambda: c.get("/health").status_code == 200 and srv.state.supervisor.restarts == 1, 60,
              "the restart")
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 8})
        assert r.status_code == 200, r.text


def test_gives_up_after_too_many_failures(tiny_model: Path) -> None:
    factory = lambda: ProcessEngine.from_options(str(tiny_model), **OPTIONS)  # noqa: E731
    sup = SupervisionConfig(max_restarts=1, restart_window_s=600)
    with ServerThread(factory, supervision=sup) as srv, srv.client() as c:
        os.kill(srv.engine.pid, signal.SIGKILL)
        _wait(lambda: srv.state.supervisor.restarts == 1 and c.get("/health").status_code == 200, 120, "restart")
        assert srv.failures == []
        os.kill(srv.engine.pid, signal.SIGKILL)
        _wait(lambda: bool(srv.failures), 30, "giving up")
        assert "giving up" in str(srv.failures[0])
        assert c.get("/health").status_code == 503


def test_stalled_engine_is_unhealthy(tiny_model: Path) -> None:
    stall = threading.Event()

    def factory() -> AsyncLLM:
        llm = AsyncLLM.from_options(str(tiny_model), **OPTIONS)
        real_step = llm.engine.step

        def step():
            while stall.is_set():  # a step that does not finish
                time.sleep(0.01)
            return real_step()

        llm.engine.step = step  # type: ignore[method-assign]
        return llm

    sup = SupervisionConfig(watchdog_s=0.5)
    with ServerThread(factory, supervision=sup) as srv, srv.client() as c:
        assert c.get("/health").status_code == 200
        stall.set()
        result: list[int] = []
        t = threading.Thread(target=lambda: result.append(
            httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=60).status_code))
        t.start()
        _wait(lambda: c.get("/health").status_code == 503, 10, "the watchdog")
        assert c.get("/health").json()["error"]["code"] == "engine_stalled"
        stall.clear()
        t.join(30)
        assert result == [200]
        _wait(lambda: c.get("/health").status_code == 200, 10, "healthy again")


def _spawned_ranks(pid: int) -> list[int]:
    """The tensor-parallel ranks an engine process started (children running hasten.distributed.rank_main)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"hasten.distributed.rank_main" in cmd:
            out.append(int(stat.parent.name))
    return out


def test_a_dead_tensor_parallel_rank_fails_fast_and_the_engine_restarts_with_new_ranks(tiny_model: Path) -> None:
    options = {**LONG_OPTIONS, "tensor_parallel_size": 2}
    factory = lambda: ProcessEngine.from_options(str(tiny_model), **options)  # noqa: E731
    with ServerThread(factory) as srv, srv.client() as c:
        first_pid = srv.engine.pid
        (rank1,) = _spawned_ranks(first_pid)
        started, ended = threading.Event(), []
        stream = threading.Thread(target=_stream_until_error, args=(srv.url, started, ended))
        stream.start()
        assert started.wait(60), "the stream did not start"
        killed_at = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        stream.join(30)
        assert ended and ended[0][1] == "error event", ended
        assert ended[0][0] - killed_at < 10, "the stream took over 10 s to fail"
        _wait(lambda: c.get("/health").status_code == 200 and srv.engine.pid != first_pid, 120,
              "the restarted engine")
        assert len(_spawned_ranks(srv.engine.pid)) == 1, "the restarted engine has its own rank 1"
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        assert r.status_code == 200, r.text
