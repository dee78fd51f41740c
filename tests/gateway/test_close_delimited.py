"""Backends that close every connection (``Connection: close``, close-delimited SSE bodies) and
health probes that must not eject a backend busy with real traffic."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from typing import Any

import pytest
from gw_helpers import Cluster, chat, metric, request, stream, wait_until

from hasten.gateway.config import HealthConfig, parse_config
from hasten.gateway.health import BackendState, HealthChecker
from hasten.gateway.testing import FakeBackend, FakeBackendOptions
from hasten.gateway.upstream import StatusSink, UpstreamPool


def pool(*backends: Any, name: str = "m", policy: str = "round_robin") -> dict[str, Any]:
    return {"name": name, "policy": policy, "backends": [{"url": b.url} for b in backends]}


def test_close_delimited_streams_pass_through_and_client_keep_alive_holds(cluster: Cluster) -> None:
    b = cluster.backend("closer", "--framing", "close", "--tokens", "5", "--interval-ms", "2")
    direct = stream(b, chat("hi", model="m"))
    assert direct.status == 200 and direct.headers.get("connection") == "close"
    assert "transfer-encoding" not in direct.headers and "content-length" not in direct.headers
    gw = cluster.gateway({"models": [pool(b)], "health": {"interval_s": 30.0}})
    conn = http.client.HTTPConnection(gw.host, gw.port, timeout=10)
    try:
        for i in range(4):  # one client connection for all four streams
            conn.request("POST", "/v1/chat/completions", body=json.dumps(chat(f"q{i}", model="m", stream=True)),
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            assert r.status == 200 and r.getheader("transfer-encoding") == "chunked"
            assert r.getheader("connection") != "close"
            body = r.read().decode()
            events = [line[6:] for line in body.split("\n") if line.startswith("data: ")]
            # the same events as the backend sends directly (their timestamps and request ids aside)
            assert [_delta(e) for e in events] == [_delta(e) for _, e in direct.events]
            assert events[-1] == "[DONE]" and len(events) == 6
    finally:
        conn.close()
    text = request(gw, "GET", "/metrics").body.decode()
    assert metric(text, "backend_errors_total") == 0
    # the gateway learnt that the backend closes its connections and keeps spares open to it
    assert wait_until(lambda: metric(request(gw, "GET", "/metrics").body.decode(), "backend_idle_connections",
                                     backend=b.url) >= 1, 5)


def _delta(event: str) -> str:
    return event if event == "[DONE]" else json.loads(event)["choices"][0]["delta"]["content"]


async def test_preconnect_keeps_spares_for_a_closing_backend_only() -> None:
    """A pool learns from response heads: spares for a closing backend (bounded), none for keep-alive."""
    closer = FakeBackend(FakeBackendOptions(name="c", framing="close", tokens=2, interval_ms=0))
    keeper = FakeBackend(FakeBackendOptions(name="k", tokens=2, interval_ms=0))
    servers = [await closer.serve("127.0.0.1", 0), await keeper.serve("127.0.0.1", 0)]
    try:
        ports = [s.sockets[0].getsockname()[1] for s in servers]
        pools = [UpstreamPool("127.0.0.1", p, 2.0, preconnect=4) for p in ports]
        reused = {}
        for p in pools:
            outcomes = [await _stream_once(p) for _ in range(10)]
            assert all(status == 200 for status, _ in outcomes)
            reused[p.port] = sum(r for _, r in outcomes)
        await asyncio.sleep(0.2)
        closing, keeping = pools
        assert closing.closes_connections and not keeping.closes_connections
        assert 1 <= closing.idle <= 4 and closing.preconnected >= 1
        assert keeping.preconnected == 0 and keeping.idle == 1  # one keep-alive connection, reused
        assert keeper.connections == 1
        # the requests after the first rode on spares (or the keep-alive connection), not on new connects
        assert reused[ports[0]] >= 7 and reused[ports[1]] == 9
        off = UpstreamPool("127.0.0.1", ports[0], 2.0, preconnect=0)
        for _ in range(3):
            assert (await _stream_once(off))[0] == 200
        await asyncio.sleep(0.1)
        assert off.preconnected == 0 and off.idle == 0
        for p in [*pools, off]:
            p.close()
    finally:
        for s in servers:
            s.close()


async def _stream_once(p: UpstreamPool) -> tuple[int, bool]:
    """One streaming request on a pooled (or new) connection, read to its end: (status, pooled?)."""

    body = json.dumps({"model": "m", "stream": True, "messages": []}).encode()
    raw = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body)) + body
    conn = await p.acquire()
    sink = StatusSink()
    sink.result = asyncio.get_running_loop().create_future()
    conn.start(raw, sink)
    return await asyncio.wait_for(sink.result, 5), conn.reused


def test_slow_probes_do_not_eject_a_backend_that_serves(cluster: Cluster) -> None:
    """Probes time out (the health endpoint answers after 0.6 s, the budget is 0.2 s) while streams
    keep succeeding: the backend stays up. Without traffic the same probes mark it down."""
    b = cluster.backend("busy", "--framing", "close", "--health-delay-ms", "600", "--tokens", "20",
                        "--interval-ms", "10")
    health = {"interval_s": 0.2, "timeout_s": 0.2, "unhealthy_threshold": 2}
    gw = cluster.gateway({"models": [pool(b)], "health": health})
    stop = threading.Event()
    results: list[int] = []

    def client() -> None:
        while not stop.is_set():
            results.append(stream(gw, chat("x", model="m")).status)

    threads = [threading.Thread(target=client) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(3.0)  # 15 probe rounds, each timing out
    stop.set()
    for t in threads:
        t.join()
    assert len(results) > 20 and set(results) == {200}
    text = request(gw, "GET", "/metrics").body.decode()
    assert metric(text, "probe_down_total") == 0 and metric(text, "backend_up", backend=b.url) == 1
    # no traffic now: two failed probes in a row and it is out
    assert wait_until(lambda: metric(request(gw, "GET", "/metrics").body.decode(), "probe_down_total") == 1, 5)


def test_probe_thresholds_and_explicit_answers() -> None:
    """Down after ``unhealthy_threshold`` consecutive failures, up after ``healthy_threshold`` good
    probes; an explicit non-200 answer counts even while traffic succeeds, a timeout does not."""
    cfg = parse_config({"listen": "127.0.0.1:0", "models": [{"name": "m", "backends": [
        {"url": "http://127.0.0.1:9"}]}]})
    state = BackendState(cfg.models[0].backends[0])
    answers: list[int | BaseException] = []

    async def probe(url: str, path: str, timeout_s: float) -> int:
        a = answers.pop(0)
        if isinstance(a, BaseException):
            raise a
        return a

    changes: list[bool] = []
    hc = HealthChecker([state], HealthConfig(interval_s=1.0, timeout_s=0.5, unhealthy_threshold=3,
                                             healthy_threshold=2), probe, lambda s, up: changes.append(up))

    def run(*outcomes: int | BaseException) -> None:
        answers.extend(outcomes)
        for _ in outcomes:
            asyncio.run(hc.probe_all())

    run(TimeoutError(), 503)
    assert state.probe_ok and not changes  # two failures: not yet
    run(200, TimeoutError(), OSError("refused"))
    assert state.probe_ok  # the 200 reset the count
    run(TimeoutError())
    assert not state.probe_ok and changes == [False]
    run(200)
    assert not state.probe_ok  # one good probe of the two needed
    run(200)
    assert state.probe_ok and changes == [False, True]
    state.last_success = time.monotonic()  # real traffic is being answered
    run(TimeoutError(), TimeoutError(), TimeoutError(), TimeoutError())
    assert state.probe_ok and state.probe_failures == 0
    run(503, 503, 503)  # the backend itself says it is unhealthy: believed
    assert not state.probe_ok and changes == [False, True, False]


@pytest.mark.parametrize("key,value", [("unhealthy_threshold", 0), ("healthy_threshold", 1.5)])
def test_health_threshold_config_is_checked(key: str, value: Any) -> None:
    from hasten.gateway.config import ConfigError

    with pytest.raises(ConfigError, match=f"health.{key}"):
        parse_config({"listen": "127.0.0.1:0", "health": {key: value},
                      "models": [{"name": "m", "backends": [{"url": "http://127.0.0.1:9"}]}]})


def test_preconnect_config_is_checked() -> None:
    from hasten.gateway.config import ConfigError

    base = {"listen": "127.0.0.1:0", "models": [{"name": "m", "backends": [{"url": "http://127.0.0.1:9"}]}]}
    assert parse_config(base).preconnect == 32
    assert parse_config({**base, "preconnect": 0}).preconnect == 0
    with pytest.raises(ConfigError, match="preconnect"):
        parse_config({**base, "preconnect": -1})
