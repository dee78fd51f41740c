"""Slow clients against a real gateway on loopback: with short read timeouts, connections that
trickle a head, trickle a body, or sit idle are closed on time, while normal requests keep
being served with their usual latency."""

from __future__ import annotations

import asyncio
import json
import statistics
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

from hasten.gateway.app import serve
from hasten.gateway.config import parse_config
from hasten.gateway.core import Gateway
from hasten.gateway.testing import FakeBackend, FakeBackendOptions

TIMEOUT_S = 0.6  # header_read_s, body_read_s and keep_alive_s
SLOW = 20  # connections of each slow kind
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
           b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY))


@asynccontextmanager
async def gateway_on_loopback() -> AsyncIterator[tuple[str, int]]:
    backend = await FakeBackend(FakeBackendOptions(name="b", tokens=2, interval_ms=0)).serve("127.0.0.1", 0)
    bport = backend.sockets[0].getsockname()[1]
    gateway = Gateway(parse_config({
        "listen": "127.0.0.1:0",
        "models": [{"name": "m", "backends": [{"url": f"http://127.0.0.1:{bport}"}]}],
        "timeouts": {"header_read_s": TIMEOUT_S, "body_read_s": TIMEOUT_S, "keep_alive_s": TIMEOUT_S}}))
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.get_running_loop().create_task(serve(gateway, "127.0.0.1", 0, ready, stop))
    await asyncio.wait_for(ready.wait(), 10)
    try:
        assert gateway.address is not None
        yield gateway.address
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        backend.close()


async def normal_request(host: str, port: int) -> float:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(REQUEST)
    data = await asyncio.wait_for(reader.read(), 10)  # Connection: close: read to the end
    writer.close()
    assert data.startswith(b"HTTP/1.1 200 "), data[:200]
    return loop.time() - t0


async def slow_client(host: str, port: int, first: bytes, trickle: bytes | None) -> tuple[bytes, float]:
    """Send ``first``, then one byte of ``trickle`` every 50 ms (None: stay silent); returns what
    came back and the seconds from the last byte of ``first`` until the gateway closed."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(first)
    await writer.drain()
    t0 = loop.time()

    async def drip() -> None:
        with suppress(ConnectionError, RuntimeError):
            while trickle is not None:
                await asyncio.sleep(0.05)
                writer.write(trickle)

    dripper = loop.create_task(drip())
    try:
        data = await asyncio.wait_for(reader.read(), 10 + 10 * TIMEOUT_S)  # until the gateway closes
    finally:
        dripper.cancel()
        writer.close()
    return data, loop.time() - t0


async def test_slow_clients_are_closed_on_time_and_others_are_served() -> None:
    async with gateway_on_loopback() as (host, port):
        baseline = [await normal_request(host, port) for _ in range(20)]
        kinds = {
            "head": (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Slow: ", b"a"),
            "body": (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 1000\r\n\r\n{", b" "),
            "idle_after_request": (b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n", None),
            "silent": (b"", None),
        }
        loop = asyncio.get_running_loop()
        slow = {k: [loop.create_task(slow_client(host, port, first, trickle)) for _ in range(SLOW)]
                for k, (first, trickle) in kinds.items()}
        during: list[float] = []
        while not all(t.done() for ts in slow.values() for t in ts):
            during.append(await normal_request(host, port))
        results = {k: [t.result() for t in ts] for k, ts in slow.items()}

    for kind in ("head", "body"):
        for data, closed_after in results[kind]:
            assert data.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), (kind, data[:200])
            assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
            assert TIMEOUT_S * 0.9 < closed_after < TIMEOUT_S + 5, (kind, closed_after)
    for data, closed_after in results["idle_after_request"]:
        assert data.startswith(b"HTTP/1.1 200 OK\r\n") and data.count(b"HTTP/1.1") == 1  # just closed
        assert TIMEOUT_S * 0.9 < closed_after < TIMEOUT_S + 5, closed_after
    for data, closed_after in results["silent"]:
        assert data == b"" and TIMEOUT_S * 0.9 < closed_after < TIMEOUT_S + 5, closed_after
    assert len(during) >= 3  # normal requests went on while the slow ones were held
    assert statistics.median(during) < 5 * statistics.median(baseline) + 0.05, (baseline, during)


def test_read_timeouts_are_configurable_and_validated() -> None:
    from hasten.gateway.config import ConfigError, TimeoutConfig

    models = [{"name": "m", "backends": [{"url": "http://127.0.0.1:9"}]}]
    cfg = parse_config({"models": models, "timeouts": {"header_read_s": 2, "body_read_s": 3.5, "keep_alive_s": 4}})
    assert (cfg.timeouts.header_read_s, cfg.timeouts.body_read_s, cfg.timeouts.keep_alive_s) == (2, 3.5, 4)
    assert parse_config({"models": models}).timeouts == TimeoutConfig()
    try:
        parse_config({"models": models, "timeouts": {"header_read_s": 0, "keep_alive_s": "x"}})
    except ConfigError as exc:
        text = str(exc)
        assert "timeouts.header_read_s" in text and "timeouts.keep_alive_s" in text
    else:
        raise AssertionError("invalid timeouts were accepted")


async def test_expire_answers_by_phase() -> None:
    """The sweep's per-connection check, with a clock in hand (no sockets, no waiting)."""
    from h1_harness import Harness

    t = parse_config({"models": [{"name": "m", "backends": [{"url": "http://127.0.0.1:9"}]}]}).timeouts
    cases = [(b"", None), (b"POST /v1/chat/completions HTTP/1.1\r\nX-A: 1", 408),
             (b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 10\r\n\r\n{", 408)]
    for sent, status in cases:
        h = Harness()
        if sent:
            h.client.data_received(sent)
        start = h.client.phase_at
        limit = {None: t.keep_alive_s, 408: t.header_read_s if b"Length" not in sent else t.body_read_s}[status]
        h.client.expire(start + limit * 0.9, t)
        assert not h.closed and h.out == b""
        h.client.expire(start + limit * 1.1, t)
        assert h.closed and h.statuses == ([status] if status else [])
        await h.close()
