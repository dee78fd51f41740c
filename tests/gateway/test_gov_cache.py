"""Exact response cache: same body / same stream on a hit, never across tenants; shared through Redis."""

from __future__ import annotations

import asyncio
from typing import Any

from gov_helpers import gateway_env, get, post
from gw_helpers import Cluster, metric

from hasten.gateway.cache import MemoryCache, exact_key
from hasten.gateway.testing import FakeBackendOptions

CONFIG = {"models": [{"name": "m", "backends": ["@b"]}],
          "tenants": [{"name": "a", "key": "sk-a"}, {"name": "b", "key": "sk-b"}],
          "cache": {"exact": True, "ttl_s": 60, "max_entries": 100}}


def _chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "temperature": 0, **extra}


def test_exact_hit_same_body_and_stream_and_tenant_isolation() -> None:
    async def run() -> None:
        async with gateway_env(CONFIG, {"b": FakeBackendOptions(name="b", tokens=4, interval_ms=20)}) as env:
            fake = env.backends["b"]
            first = await post(env.port, _chat("What is 2+2?"), "sk-a")
            await asyncio.sleep(0.05)
            # whitespace differences normalise to the same key
            second = await post(env.port, _chat("What   is 2+2? "), "sk-a")
            assert first.status == second.status == 200
            assert second.headers["x-hasten-cache"] == "hit" and second.json() == first.json()
            assert fake.requests == 1
            # another tenant never sees a's answer
            other = await post(env.port, _chat("What is 2+2?"), "sk-b")
            assert "x-hasten-cache" not in other.headers and fake.requests == 2
            # streaming: captured as it is forwarded, replayed as a stream with the same events
            s1 = await post(env.port, _chat("Stream it", stream=True), "sk-a")
            await asyncio.sleep(0.05)
            s2 = await post(env.port, _chat("Stream it", stream=True), "sk-a")
            assert s2.headers["x-hasten-cache"] == "hit" and s2.headers["transfer-encoding"] == "chunked"
            assert s2.headers["content-type"].startswith("text/event-stream")
            assert s2.events == s1.events and s1.events[-1] == "[DONE]" and len(s1.events) == 5
            assert fake.requests == 3
            # a stream and a non-stream request never share an entry; different params neither
            await post(env.port, _chat("Stream it"), "sk-a")
            await post(env.port, _chat("What is 2+2?", max_tokens=3), "sk-a")
            assert fake.requests == 5
            # non-deterministic requests (no temperature 0) are not cached by default
            for _ in range(2):
                await post(env.port, {"model": "m", "messages": [{"role": "user", "content": "poem"}]}, "sk-a")
            assert fake.requests == 7
            text = await get(env.port, "/metrics")
            assert metric(text, "cache_requests_total", result="hit") == 2
            assert metric(text, "cache_requests_total", result="bypass") == 2
            assert metric(text, "cache_hit_seconds_count") == 2

    asyncio.run(run())


def test_errors_and_broken_streams_are_not_cached() -> None:
    async def run() -> None:
        opts = FakeBackendOptions(name="b", tokens=6, interval_ms=5, fail_after=2)
        async with gateway_env(CONFIG, {"b": opts}) as env:
            for _ in range(2):
                r = await post(env.port, _chat("broken", stream=True), "sk-a")
                assert "x-hasten-cache" not in r.headers
                await asyncio.sleep(0.05)
            assert env.backends["b"].requests >= 2

    asyncio.run(run())


def test_memory_cache_ttl_and_size_bound() -> None:
    now = [0.0]
    c = MemoryCache(max_entries=2, clock=lambda: now[0])

    async def run() -> None:
        await c.set("k1", b"1", 10)
        await c.set("k2", b"2", 10)
        assert await c.get("k1") == b"1"  # k1 is now the most recent
        await c.set("k3", b"3", 10)  # evicts k2, the least recently used
        assert await c.get("k2") is None and len(c) == 2
        now[0] = 11
        assert await c.get("k1") is None and await c.get("k3") is None

    asyncio.run(run())
    p = {"messages": [{"role": "user", "content": "x"}], "temperature": 0}
    assert exact_key("a", "m", p, False) != exact_key("b", "m", p, False)


def test_cache_in_redis_is_shared_by_two_gateways(cluster: Cluster, redis_server: Any) -> None:
    backend = cluster.backend("b1", "--tokens", "3", "--interval-ms", "1")
    cfg = {"redis": redis_server.url, "models": [{"name": "m", "backends": [{"url": backend.url}]}],
           "tenants": [{"name": "a", "key": "sk-a"}, {"name": "b", "key": "sk-b"}],
           "cache": {"exact": True, "store": "redis", "ttl_s": 30}}
    g1, g2 = cluster.gateway(cfg), cluster.gateway(cfg)

    async def run() -> None:
        r1 = await post(g1.port, _chat("shared?", stream=True), "sk-a")
        await asyncio.sleep(0.2)
        r2 = await post(g2.port, _chat("shared?", stream=True), "sk-a")
        r3 = await post(g2.port, _chat("shared?", stream=True), "sk-b")
        assert r2.headers.get("x-hasten-cache") == "hit" and r2.events == r1.events
        assert "x-hasten-cache" not in r3.headers

    asyncio.run(run())
