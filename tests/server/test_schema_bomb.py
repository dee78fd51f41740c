"""A hostile `response_format`: a 100,000-value enum. It must get a 400 within the compile budget while
everything else keeps its latency, its compile process must be killed (on timeout, or once every client
waiting for it has gone), identical bombs must share one compile, and the next one must fail at once."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("xgrammar")

from hasten.server.grammar_limits import StructuredLimits  # noqa: E402

from .fake_engine import FakeAsyncLLM  # noqa: E402
from .harness import ServerThread  # noqa: E402

TIMEOUT_S = 4.0  # the compile budget of the test server (the default is 10 s)
LIMITS = StructuredLimits(max_schema_bytes=8 << 20, max_enum_values=10**6, compile_timeout_s=TIMEOUT_S,
                          max_compiles=2, prestart=True)
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def bomb(tag: str) -> dict:
    return {"type": "object", "properties": {"x": {"enum": [f"{tag}-{i}" for i in range(100_000)]}},
            "required": ["x"]}


def chat(schema: dict | None, max_tokens: int = 16) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": max_tokens, "temperature": 0}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    return body


@pytest.fixture(scope="module")
def srv(fake_tokenizer) -> Iterator[ServerThread]:
    server = ServerThread(lambda: FakeAsyncLLM(fake_tokenizer, max_model_len=512))
    server.state.structured = LIMITS
    with server:
        with server.client() as c:  # the compiler process is up once a first schema has compiled
            assert c.post("/v1/chat/completions", json=chat(SMALL)).status_code == 200
        yield server


def structured(srv: ServerThread) -> Any:
    return srv.state.serving.structured


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def wait_until(cond: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting: {what}")
        time.sleep(0.02)


def latencies(c: httpx.Client, n: int) -> tuple[list[float], list[float]]:
    """n plain and n structured (cached schema) chat requests, alternating; seconds each."""
    plain: list[float] = []
    small: list[float] = []
    for _ in range(n):
        for body, out in ((chat(None), plain), (chat(SMALL), small)):
            t0 = time.perf_counter()
            r = c.post("/v1/chat/completions", json=body)
            out.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
    return plain, small


def send(srv: ServerThread, body: dict, results: list, timeout: float = 60) -> threading.Thread:
    def go() -> None:
        t0 = time.perf_counter()
        with httpx.Client(base_url=srv.url, timeout=timeout) as c:
            r = c.post("/v1/chat/completions", json=body)
        results.append((r, time.perf_counter() - t0))

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def test_bomb_is_a_400_within_budget_and_nothing_else_slows_down(srv: ServerThread) -> None:
    so = structured(srv)
    with srv.client() as c:
        unloaded = latencies(c, 8)
        compiles = so.service.compiles
        results: list = []
        bombs = [send(srv, chat(bomb("a")), results) for _ in range(3)]  # identical: one compile
        wait_until(lambda: len(so.service.workers) == 1, "the bomb's compile to start")
        (worker,) = so.service.workers.values()
        loaded = latencies(c, 8)
        # a new small schema compiles in the other slot, an invalid one fails: neither waits for the bomb
        fresh = c.post("/v1/chat/completions", json=chat({"type": "array", "items": {"type": "integer"},
                                                          "maxItems": 2}))
        invalid = c.post("/v1/chat/completions", json=chat({"type": 5}))
        assert all(b.is_alive() for b in bombs), "the bomb finished before the measurements did"
        assert fresh.status_code == 200 and invalid.status_code == 400
        for b in bombs:
            b.join(60)
        after = latencies(c, 8)
    assert [r.status_code for r, _ in results] == [400] * 3
    error = results[0][0].json()["error"]
    assert error["code"] == "schema_too_complex" and error["param"] == "response_format.json_schema.schema"
    slowest = max(t for _, t in results)
    assert TIMEOUT_S * 0.9 <= slowest < TIMEOUT_S * 4  # cut by the budget (generous slack for a busy box)
    assert so.service.compiles == compiles + 3  # the bomb once, `fresh`, `invalid`
    wait_until(lambda: not alive(worker), "the timed-out compile process to be killed", 10)
    for name, i in (("plain", 0), ("structured", 1)):
        base = statistics.median(unloaded[i] + after[i])
        ratio = statistics.median(loaded[i]) / base
        assert ratio < 2.0, f"{name} requests slowed down {ratio:.2f}x while the bomb compiled"

    # The same bomb again: answered at once from the remembered failure, no compile
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json=chat(bomb("a")))
    assert r.status_code == 400 and r.json()["error"]["code"] == "schema_too_complex"
    assert so.service.compiles == compiles + 3


def test_disconnect_abandons_the_compile(srv: ServerThread) -> None:
    so = structured(srv)
    failures, abandoned = so.stats.failures, so.stats.abandoned
    results: list = []

    def give_up() -> None:
        with httpx.Client(base_url=srv.url, timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
            c.post("/v1/chat/completions", json=chat(bomb("b")))
        results.append("gave up")

    t = threading.Thread(target=give_up, daemon=True)
    t.start()
    wait_until(lambda: len(so.service.workers) == 1, "the compile to start")
    (worker,) = so.service.workers.values()
    t.join(30)
    assert results == ["gave up"]
    wait_until(lambda: so.stats.abandoned == abandoned + 1, "the compile to be abandoned")
    wait_until(lambda: not alive(worker), "the abandoned compile process to be killed", 10)
    assert so.stats.failures == failures  # abandoned, not timed out
    assert not so.service.workers


def test_default_limits_refuse_the_bomb_without_compiling(http: httpx.Client, server: ServerThread) -> None:
    so = server.state.serving.structured
    compiles = so.stats.compiles
    r = http.post("/v1/chat/completions", json=chat(bomb("c")))
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "schema_too_large" and "--max-schema-bytes" in error["message"]
    assert so.stats.compiles == compiles


@pytest.mark.parametrize("prestart", [True, False])
def test_ready_waits_for_the_prestarted_compiler(fake_tokenizer, prestart):
    """With prestart the compiler process is up before the server says it is ready (its start-up CPU
    is not shared with the first requests); without, nothing starts until the first schema."""
    server = ServerThread(lambda: FakeAsyncLLM(fake_tokenizer, max_model_len=512), wait_ready=False)
    server.state.structured = StructuredLimits(prestart=prestart)
    with server:
        wait_until(lambda: server.state.ready, "the server to become ready")
        service = structured(server).service
        assert service.running if prestart else service.pid is None
        with server.client() as c:
            assert c.get("/health").status_code == 200
