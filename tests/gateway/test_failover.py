"""Failover, retries, timeouts, circuit breaking and active health probes, with real processes."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

from gw_helpers import Cluster, StreamResult, chat, metric, request, stream, wait_until

FAST_HEALTH = {"interval_s": 0.3, "timeout_s": 0.5, "failure_threshold": 2, "cooldown_s": 1.0}


def pool(*backends: Any, policy: str = "round_robin", name: str = "m", **extra: Any) -> dict[str, Any]:
    return {"name": name, "policy": policy, "backends": [{"url": b.url} for b in backends], **extra}


def test_retry_before_first_byte_on_503_and_broken_connections(cluster: Cluster) -> None:
    """503 answers fail over; with ``retry.on_failure`` so do connections a replica drops (by default
    those are charged to the request and not retried: test_retry_policy.py)."""
    bad_status = cluster.backend("bad503", "--status", "503")
    aborts = cluster.backend("aborts", "--fail-after", "0")  # sends headers, then drops the connection
    good = cluster.backend("good", "--tokens", "3", "--interval-ms", "1")
    gw = cluster.gateway({"models": [pool(bad_status, aborts, good, retry={"on_failure": True})],
                          "health": FAST_HEALTH, "max_retries": 2})
    for i in range(6):
        res = stream(gw, chat(f"s{i}", model="m"))
        assert res.status == 200
        assert {p["backend"] for p in res.payloads()} == {"good"}
        r = request(gw, "POST", "/v1/chat/completions", chat(f"n{i}", model="m"))
        assert r.status == 200 and r.json()["backend"] == "good"
    text = request(gw, "GET", "/metrics").body.decode()
    assert metric(text, "retries_total", model="m") >= 1
    assert metric(text, "backend_errors_total", backend=bad_status.url, kind="status") >= 1
    assert metric(text, "backend_errors_total", backend=aborts.url) >= 1
    # repeated failures opened the breakers of both bad replicas
    assert metric(text, "breaker_opened_total", backend=bad_status.url) >= 1
    assert metric(text, "breaker_opened_total", backend=aborts.url) >= 1


def test_a_500_stays_on_one_replica_and_its_repeats_are_refused(cluster: Cluster) -> None:
    """The request a replica answered 500 is not sent to the next replica: one request cannot take
    the pool down, and the client's automatic retries of it are refused without reaching any."""
    a = cluster.backend("a", "--status", "500")
    b = cluster.backend("b", "--status", "500")
    gw = cluster.gateway({"models": [pool(a, b)], "health": FAST_HEALTH})
    r = request(gw, "POST", "/v1/chat/completions", chat("crash", model="m"))
    assert r.status == 500 and "says 500" in r.json()["error"]["message"]  # the replica's own body
    for _ in range(2):
        r = request(gw, "POST", "/v1/chat/completions", chat("crash", model="m"))
        assert r.status == 500 and r.json()["error"]["code"] == "poison_request"
    seen = request(a, "GET", "/stats").json()["requests"] + request(b, "GET", "/stats").json()["requests"]
    assert seen == 1
    assert metric(request(gw, "GET", "/metrics").body.decode(), "poison_rejected_total", model="m") == 2


def test_backend_connections_are_pooled_and_reused(cluster: Cluster) -> None:
    """Keep-alive to backends: many requests, also 5xx answers, reuse one upstream connection."""
    good = cluster.backend("good", "--tokens", "3", "--interval-ms", "1")
    bad = cluster.backend("bad", "--status", "503")
    health = {**FAST_HEALTH, "interval_s": 30.0, "failure_threshold": 100}  # probes use their own connections
    gw = cluster.gateway({"models": [pool(good, name="g"), pool(bad, name="b")], "health": health})
    for i in range(5):
        assert stream(gw, chat(f"s{i}", model="g")).status == 200
        assert request(gw, "POST", "/v1/chat/completions", chat(f"n{i}", model="g")).status == 200
        assert request(gw, "POST", "/v1/chat/completions", chat(f"b{i}", model="b")).status == 503
    stats_good = request(good, "GET", "/stats").json()
    stats_bad = request(bad, "GET", "/stats").json()
    assert stats_good["requests"] == 10 and stats_bad["requests"] == 5
    # one connection for the first probe, one for our /stats call, one pooled for all proxied requests
    assert stats_good["connections"] <= 3, stats_good
    assert stats_bad["connections"] <= 3, stats_bad


def test_client_disconnect_releases_the_backend(cluster: Cluster) -> None:
    """A client that goes away (before the first byte, or mid-stream) frees its backend slot."""
    slow = cluster.backend("slow", "--tokens", "200", "--interval-ms", "50")
    gw = cluster.gateway({"models": [pool(slow)], "health": FAST_HEALTH})
    assert stream(gw, chat("warm", model="m", hasten_fake={"tokens": 1, "ttft_ms": 0})).status == 200
    body = json.dumps(chat("x", model="m", stream=True)).encode()
    raw = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
    slow_first = json.dumps(chat("y", model="m", stream=True, hasten_fake={"ttft_ms": 5000})).encode()
    raw_slow = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                % len(slow_first)) + slow_first
    for req in (raw_slow, raw):  # gone before the first byte; gone mid-stream (10 s streams)
        s = socket.create_connection((gw.host, gw.port), timeout=5)
        s.sendall(req)
        time.sleep(0.3)
        s.close()

    def idle() -> bool:
        text = request(gw, "GET", "/metrics").body.decode()
        return metric(text, "backend_in_flight", backend=slow.url) == 0

    assert wait_until(idle, 2)  # released at once, not when the backend finishes (5-10 s later)
    res = stream(gw, chat("after", model="m", hasten_fake={"tokens": 2, "ttft_ms": 0}))
    assert res.status == 200 and len(res.payloads()) == 2


def test_mid_stream_failure_ends_with_error_event_and_is_not_retried(cluster: Cluster) -> None:
    dies = cluster.backend("dies", "--fail-after", "2", "--interval-ms", "20")
    good = cluster.backend("good")
    gw = cluster.gateway({"models": [pool(dies, good)], "health": FAST_HEALTH})
    started = time.monotonic()
    res = stream(gw, chat("x", model="m"), timeout=10)  # round robin: first request goes to "dies"
    assert time.monotonic() - started < 5
    data = [d for _, d in res.events]
    assert len(data) == 3, data
    assert [p["backend"] for p in res.payloads()[:2]] == ["dies", "dies"]
    assert '"error"' in data[-1] and "upstream_stream_error" in data[-1]
    assert request(good, "GET", "/stats").json()["requests"] == 0  # never retried after bytes were sent


def test_all_backends_down_gives_json_503_or_502(cluster: Cluster) -> None:
    b = cluster.backend("b")
    gw = cluster.gateway({"models": [pool(b)], "health": FAST_HEALTH})
    b.kill()
    r = request(gw, "POST", "/v1/chat/completions", chat("x", model="m"))
    assert r.status in (502, 503)
    assert r.json()["error"]["code"] in ("upstream_unavailable", "no_healthy_backend")
    # once the probe has noticed, the gateway answers 503 without trying
    assert wait_until(lambda: request(gw, "GET", "/health").status == 503, 5)
    r = request(gw, "POST", "/v1/chat/completions", chat("x", model="m"))
    assert r.status == 503 and r.json()["error"]["code"] == "no_healthy_backend"


def test_first_byte_timeout_fails_over(cluster: Cluster) -> None:
    slow = cluster.backend("slow", "--ttft-ms", "4000")
    good = cluster.backend("good")
    gw = cluster.gateway({"models": [pool(slow, good)], "health": FAST_HEALTH,
                          "timeouts": {"connect_s": 0.5, "first_byte_s": 0.4}})
    t0 = time.monotonic()
    res = stream(gw, chat("x", model="m"))
    assert res.status == 200 and {p["backend"] for p in res.payloads()} == {"good"}
    assert time.monotonic() - t0 < 3
    text = request(gw, "GET", "/metrics").body.decode()
    assert metric(text, "backend_errors_total", backend=slow.url, kind="timeout") == 1


def test_active_probe_ejects_and_readmits(cluster: Cluster) -> None:
    a = cluster.backend("a")
    b = cluster.backend("b")
    gw = cluster.gateway({"models": [pool(a, b)], "health": FAST_HEALTH})
    request(a, "POST", "/admin/health", {"status": 503})
    assert wait_until(lambda: metric(request(gw, "GET", "/metrics").body.decode(), "backend_up",
                                     backend=a.url) == 0, 5)
    served = {request(gw, "POST", "/v1/chat/completions", chat("x", model="m")).json()["backend"]
              for _ in range(4)}
    assert served == {"b"}
    request(a, "POST", "/admin/health", {"status": 200})
    assert wait_until(lambda: metric(request(gw, "GET", "/metrics").body.decode(), "backend_up",
                                     backend=a.url) == 1, 5)


def test_backend_killed_mid_test_loses_no_unstarted_request(cluster: Cluster) -> None:
    """Kill one of two replicas while streams run on both.

    Streams already running on the killed replica end with an error event (bounded time, no
    hang); every request that had not started streaming is served by the survivor.
    """
    victim = cluster.backend("victim", "--tokens", "40", "--interval-ms", "50")
    survivor = cluster.backend("survivor", "--tokens", "40", "--interval-ms", "50")
    gw = cluster.gateway({"models": [pool(victim, survivor, policy="least_outstanding")],
                          "health": FAST_HEALTH})
    results: list[StreamResult] = []
    lock = threading.Lock()

    def run_stream(i: int) -> None:
        r = stream(gw, chat(f"long {i}", model="m"), timeout=15)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=run_stream, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.6)  # streams are now mid-flight on both replicas
    victim.kill()
    # requests sent right after the kill, before any probe ran: must all succeed
    after = [request(gw, "POST", "/v1/chat/completions", chat(f"after {i}", model="m",
                                                              hasten_fake={"tokens": 2, "interval_ms": 1}))
             for i in range(8)]
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    assert all(r.status == 200 and r.json()["backend"] == "survivor" for r in after), \
        [(r.status, r.body[:100]) for r in after]
    broken = [r for r in results if '"error"' in r.events[-1][1]]
    complete = [r for r in results if r.events[-1][1] == "[DONE]"]
    assert len(broken) + len(complete) == 6
    assert broken, "no stream was running on the killed replica"
    assert complete, "no stream was running on the survivor"
    for r in broken:
        assert {p["backend"] for p in r.payloads() if "backend" in p} == {"victim"}
    for r in complete:
        assert len(r.payloads()) == 40
