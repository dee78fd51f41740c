"""Rate limits: two gateway processes sharing one real Redis enforce one limit exactly."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from gov_helpers import post
from gw_helpers import Cluster

from hasten.gateway.govconfig import LimitConfig
from hasten.gateway.ratelimit import MemoryLimitStore, specs_for


def _config(redis_url: str, backend_url: str, limits: dict[str, Any]) -> dict[str, Any]:
    return {"redis": redis_url,
            "models": [{"name": "m", "backends": [{"url": backend_url}]}],
            "tenants": [{"name": "a", "key": "sk-a", "limits": limits}, {"name": "b", "key": "sk-b"}]}


async def _burst(ports: list[int], n: int, key: str, payload: dict[str, Any]) -> list[Any]:
    return await asyncio.gather(*(post(ports[i % len(ports)], payload, key) for i in range(n)))


def test_two_gateways_share_one_rpm_and_concurrency_limit(cluster: Cluster, redis_server: Any) -> None:
    backend = cluster.backend("b1", "--tokens", "2", "--interval-ms", "1")
    cfg = _config(redis_server.url, backend.url, {"rpm": 12, "concurrency": 50})
    g1, g2 = cluster.gateway(cfg), cluster.gateway(cfg)
    ports = [g1.port, g2.port]
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    replies = asyncio.run(_burst(ports, 40, "sk-a", payload))
    ok = [r for r in replies if r.status == 200]
    limited = [r for r in replies if r.status == 429]
    assert len(ok) == 12 and len(limited) == 28  # exactly the limit, across both instances
    err = limited[0].json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
    assert 1 <= int(limited[0].headers["retry-after"]) <= 60
    # both instances took part, and tenant b is not affected by a's limit
    assert {r.headers.get("x-request-id") is not None for r in ok} == {True}
    other = asyncio.run(_burst(ports, 6, "sk-b", payload))
    assert [r.status for r in other] == [200] * 6


def test_concurrency_limit_across_instances(cluster: Cluster, redis_server: Any) -> None:
    backend = cluster.backend("b1", "--tokens", "2", "--ttft-ms", "1500")
    cfg = _config(redis_server.url, backend.url, {"concurrency": 3})
    g1, g2 = cluster.gateway(cfg), cluster.gateway(cfg)
    payload = {"model": "m", "messages": [{"role": "user", "content": "slow"}], "stream": True}
    replies = asyncio.run(_burst([g1.port, g2.port], 10, "sk-a", payload))
    assert sorted(r.status for r in replies) == [200] * 3 + [429] * 7
    # the slots are released at the end of the streams: the next request is admitted
    again = asyncio.run(_burst([g2.port], 1, "sk-a", {**payload, "hasten_fake": {"ttft_ms": 0}}))
    assert again[0].status == 200


def test_tpm_reserved_at_admission_and_corrected_by_usage(cluster: Cluster, redis_server: Any) -> None:
    backend = cluster.backend("b1", "--interval-ms", "1")
    cfg = _config(redis_server.url, backend.url, {"tpm": 500})
    g1, g2 = cluster.gateway(cfg), cluster.gateway(cfg)
    # each request reserves ~200 tokens (max_tokens) but really uses 3 (the fake reports usage)
    small = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 200,
             "hasten_fake": {"tokens": 2}}

    async def sequential() -> list[int]:
        return [(await post((g1.port, g2.port)[i % 2], small, "sk-a")).status for i in range(8)]

    assert asyncio.run(sequential()) == [200] * 8  # without the correction the 3rd would be refused
    # a burst is judged on reservations: 200+ tokens each, 500 allowed -> at most 2 at once
    burst = asyncio.run(_burst([g1.port, g2.port], 6, "sk-a", {**small, "hasten_fake": {"tokens": 2, "ttft_ms": 800}}))
    assert sum(r.status == 200 for r in burst) == 2
    big = asyncio.run(_burst([g1.port], 1, "sk-a", {**small, "max_tokens": 5000}))[0]
    assert big.status == 429 and big.json()["error"]["type"] == "tokens"


def test_memory_store_sliding_window_and_retry_after() -> None:
    now = [1000.0]
    store = MemoryLimitStore(clock=lambda: now[0])
    specs = specs_for("t", "a", LimitConfig(rpm=2, tpm=100), 40)

    def take(member: str) -> Any:
        return store.acquire_now(specs, member)

    assert take("r1").ok
    now[0] += 10
    assert take("r2").ok
    d = take("r3")
    assert not d.ok and d.failed is not None and d.failed.key.endswith(":rpm")
    assert abs(d.retry_after_s - 50.0) < 1e-6  # r1 leaves the window 60 s after it came
    now[0] += 50.001
    assert take("r3").ok  # r1 expired; rpm 2 in use again, tpm 80
    asyncio.run(store.adjust(["hasten:rl:t:a:tpm"], "r2", 5))
    assert store.usage("hasten:rl:t:a:tpm") == 45
    # all-or-nothing: a refused tpm check must not take an rpm slot
    now[0] += 11
    specs_big = specs_for("t", "a", LimitConfig(rpm=2, tpm=100), 90)
    assert not store.acquire_now(specs_big, "r4").ok
    assert store.usage("hasten:rl:t:a:rpm") == 1


def test_in_memory_limits_keep_the_fast_path_and_release_on_disconnect() -> None:
    from gov_helpers import free_port, gateway_env

    from hasten.gateway.testing import FakeBackendOptions

    config = {"models": [{"name": "m", "backends": ["@b"]}],
              "tenants": [{"name": "a", "key": "sk-a", "limits": {"rpm": 5, "concurrency": 1, "tpm": 10000}}]}

    async def run() -> None:
        async with gateway_env(config, {"b": FakeBackendOptions(name="b", tokens=3, interval_ms=1)}) as env:
            gw = env.gateway
            assert gw.fast_path and gw.governance is not None and gw.governance.sync_only
            store: Any = gw.governance.limits
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
            assert (await post(env.port, body, "sk-a")).status == 200
            assert (await post(env.port, body, "sk-a")).status == 200  # concurrency 1 was released
            assert store.usage("hasten:rl:t:a:conc") == 0
            assert store.usage("hasten:rl:t:a:tpm") < 20  # corrected from ~257 reserved to the real usage
            # a client that disconnects before its first byte still releases its slot
            reader, writer = await asyncio.open_connection("127.0.0.1", env.port)
            slow = json.dumps({**body, "hasten_fake": {"ttft_ms": 2000}}).encode()
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-a\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(slow), slow))
            await writer.drain()
            await asyncio.sleep(0.3)
            assert store.usage("hasten:rl:t:a:conc") == 1
            assert (await post(env.port, body, "sk-a")).status == 429  # concurrency
            writer.close()
            await asyncio.sleep(0.2)
            assert store.usage("hasten:rl:t:a:conc") == 0
            replies = [await post(env.port, body, "sk-a") for _ in range(3)]
            assert [r.status for r in replies] == [200, 200, 429]  # rpm 5: the refused one did not count
            assert replies[2].json()["error"]["code"] == "rate_limit_exceeded"
        assert free_port() > 0

    asyncio.run(run())


def test_limits_fail_open_when_redis_is_down() -> None:
    from gov_helpers import free_port, gateway_env, get

    from hasten.gateway.testing import FakeBackendOptions

    config = {"redis": f"redis://127.0.0.1:{free_port()}/0", "models": [{"name": "m", "backends": ["@b"]}],
              "tenants": [{"name": "a", "key": "sk-a", "limits": {"rpm": 1}}]}

    async def run() -> None:
        async with gateway_env(config, {"b": FakeBackendOptions(name="b", tokens=2, interval_ms=1)}) as env:
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            assert [(await post(env.port, body, "sk-a")).status for _ in range(2)] == [200, 200]
            assert "governance_store_errors_total{store=\"limits\"} 2" in await get(env.port, "/metrics")

    asyncio.run(run())
