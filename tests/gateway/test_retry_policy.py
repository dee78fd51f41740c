"""The retry policy and the poison set, in-process (gw_inproc.py), on the fast and the async path.

"warm": the backends have pooled keep-alive connections, so the first attempt runs on the
callback fast path (checked with a spy); "cold": none yet, so it runs on the async path.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from gw_inproc import Backends, ScriptedBackend, chat, post, running_gateway, served_by, settle

from hasten.gateway.config import ConfigError, RetryConfig, parse_config
from hasten.gateway.core import Gateway
from hasten.gateway.retry import PoisonSet, request_key

PATHS = ["warm", "cold"]




def pool(*bs: ScriptedBackend, policy: str = "round_robin", **retry: Any) -> dict[str, Any]:
    p: dict[str, Any] = {"name": "m", "policy": policy, "backends": [{"url": b.url} for b in bs]}
    if retry:
        p["retry"] = retry
    return p


class PathSpy:
    """Records which path made the first attempt after it was installed."""

    def __init__(self, gateway: Gateway) -> None:
        self.first: str | None = None
        proxy = gateway.proxy
        fast, attempt = proxy._fast_outcome, proxy._attempt

        def fast_outcome(*a: Any, **k: Any) -> Any:
            self.first = self.first or "fast"
            return fast(*a, **k)

        async def slow(*a: Any, **k: Any) -> Any:
            self.first = self.first or "async"
            return await attempt(*a, **k)

        proxy._fast_outcome = fast_outcome  # type: ignore[method-assign]
        proxy._attempt = slow  # type: ignore[method-assign]


async def prepare(gateway: Gateway, path: str, bs: list[ScriptedBackend]) -> PathSpy:
    """Warm: one request per backend leaves a pooled connection to each (round robin). Cold: the
    connections the first probe round left in the pools are closed."""
    if path == "cold":
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while gateway.health.rounds < 1 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for b in bs:
            gateway.proxy.upstream(b.url).close()
    if path == "warm":
        for _ in bs:
            assert (await post(gateway, chat("warm-up"))).status_code == 200
        for b in bs:
            b.bodies.clear()
    return PathSpy(gateway)


def check_path(spy: PathSpy, path: str) -> None:
    assert spy.first == ("fast" if path == "warm" else "async")


@pytest.mark.parametrize("path", PATHS)
async def test_a_500_is_not_retried_and_repeats_are_refused(path: str, backends: Backends) -> None:
    a, b = await backends("a", "b")
    async with running_gateway({"models": [pool(a, b)]}) as gw:
        spy = await prepare(gw, path, [a, b])
        r = await post(gw, chat("POISON please"))
        # the replica's own answer, not a 502 that hides it; the other replica never saw the request
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        assert len(a.bodies) + len(b.bodies) == 1
        check_path(spy, path)
        again = await post(gw, chat("POISON please"))
        assert again.status_code == 500
        err = again.json()["error"]
        assert err["code"] == "poison_request" and err["type"] == "server_error" and "param" in err
        assert len(a.bodies) + len(b.bodies) == 1  # answered without contacting any backend
        assert gw.metrics.poison_rejected.get("m") == 1
        # other requests are served as usual, by both replicas
        ok = [await post(gw, chat(f"fine {i}")) for i in range(4)]
        assert all(x.status_code == 200 for x in ok)
        assert {n for x in ok for n in served_by(x.text)} == {"a", "b"}
        assert await settle(gw) == {a.url: 0, b.url: 0}


async def test_the_poison_set_is_per_tenant_and_per_body(backends: Backends) -> None:
    a, b = await backends("a", "b")
    tenants = [{"name": "t1", "key": "k1"}, {"name": "t2", "key": "k2"}]
    async with running_gateway({"models": [pool(a, b)], "tenants": tenants}) as gw:
        assert (await post(gw, chat("POISON x"), key="k1")).status_code == 500
        assert (await post(gw, chat("POISON x"), key="k1")).json()["error"]["code"] == "poison_request"
        # the same body from another tenant is not refused: no tenant learns what another one sent
        r = await post(gw, chat("POISON x"), key="k2")
        assert r.json()["error"]["code"] == "engine_error"
        r = await post(gw, chat("POISON y"), key="k1")  # another body
        assert r.json()["error"]["code"] == "engine_error"
        assert len(a.bodies) + len(b.bodies) == 3


@pytest.mark.parametrize("path", PATHS)
async def test_503_429_connect_errors_and_timeouts_still_fail_over(path: str, backends: Backends) -> None:
    busy, limited, good = await backends("busy", "limited", "good")
    (gone,) = await backends("gone")
    async with running_gateway({"models": [pool(busy, limited, gone, good)],
                                "timeouts": {"first_byte_s": 0.3}, "max_retries": 3,
                                "health": {"interval_s": 60.0, "failure_threshold": 100}}) as gw:
        spy = await prepare(gw, path, [busy, limited, gone, good])
        busy.status, limited.status = 503, 429
        await gone.stop()  # connections refused from now on
        for i in range(4):  # round robin: each request starts on another replica
            r = await post(gw, chat(f"q{i}", stream=True))
            assert r.status_code == 200 and served_by(r.text) == {"good"}, r.text
        check_path(spy, path)
        busy.status = limited.status = 200
        busy.ttft_s = 2.0  # no first byte within first_byte_s: retried elsewhere
        loop = asyncio.get_running_loop()
        served = set()
        for i in range(4):
            t0 = loop.time()
            r = await post(gw, chat(f"t{i}", stream=True))
            assert r.status_code == 200 and loop.time() - t0 < busy.ttft_s  # did not wait for busy
            served |= served_by(r.text)
        assert "busy" not in served
        errors = gw.metrics.backend_errors
        assert errors.get("m", busy.url, "timeout") >= 1 and errors.get("m", gone.url, "connect") >= 1
        assert len(gw.pools["m"].poison) == 0  # none of these is charged to the request
        busy.ttft_s = 0.0
        assert await settle(gw) == {busy.url: 0, limited.url: 0, gone.url: 0, good.url: 0}


@pytest.mark.parametrize("path", PATHS)
async def test_4xx_answers_are_never_retried(path: str, backends: Backends) -> None:
    a, b = await backends("a", "b")
    async with running_gateway({"models": [pool(a, b, on_status=[503])]}) as gw:
        spy = await prepare(gw, path, [a, b])
        a.status = b.status = 400
        r = await post(gw, chat("bad"))
        assert r.status_code == 400 and len(a.bodies) + len(b.bodies) == 1
        a.status = b.status = 429  # not in on_status here: the client gets it
        r = await post(gw, chat("slow down"))
        assert r.status_code == 429 and len(a.bodies) + len(b.bodies) == 2
        check_path(spy, path)
        assert len(gw.pools["m"].poison) == 0


@pytest.mark.parametrize("path", PATHS)
async def test_on_failure_restores_retrying(path: str, backends: Backends) -> None:
    bad, good = await backends("bad", "good")
    async with running_gateway({"models": [pool(bad, good, on_failure=True)]}) as gw:
        spy = await prepare(gw, path, [bad, good])
        bad.status = 500
        for i in range(2):
            r = await post(gw, chat(f"q{i}"))
            assert r.status_code == 200 and served_by(r.text) == {"good"}
        assert len(bad.bodies) == 1  # round robin tried it once, then it failed over
        check_path(spy, path)
        r = await post(gw, chat("POISON"))  # fails everywhere: every replica saw it
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unavailable"
        assert any("POISON" in str(x) for x in bad.bodies) and any("POISON" in str(x) for x in good.bodies)
        assert len(gw.pools["m"].poison) == 0


@pytest.mark.parametrize("path", PATHS)
async def test_a_dropped_connection_is_charged_to_the_request(path: str, backends: Backends) -> None:
    a, b = await backends("a", "b", poison_action="drop")
    async with running_gateway({"models": [pool(a, b)]}) as gw:
        spy = await prepare(gw, path, [a, b])
        r = await post(gw, chat("POISON", stream=True))
        assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed_upstream"
        check_path(spy, path)
        # warm: the pooled connection looked stale, so the request went once more to the same replica
        # on a fresh connection (which dropped it too); never to the other replica
        assert sorted([len(a.bodies), len(b.bodies)]) == [0, 1 if path == "cold" else 2]
        r = await post(gw, chat("POISON", stream=True))
        assert r.json()["error"]["code"] == "poison_request"
        assert await settle(gw) == {a.url: 0, b.url: 0}


@pytest.mark.parametrize("path", PATHS)
async def test_a_replica_crash_on_a_pooled_connection_is_not_taken_for_a_stale_one(path: str, backends: Backends) -> None:
    a, b = await backends("a", "b", poison_action="crash")
    async with running_gateway({"models": [pool(a, b)]}) as gw:
        spy = await prepare(gw, path, [a, b])
        r = await post(gw, chat("POISON"))
        assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed_upstream"
        assert len(a.bodies) == 1 and not b.bodies  # a died; b never saw it
        check_path(spy, path)
        assert (await post(gw, chat("POISON"))).json()["error"]["code"] == "poison_request"
        r = await post(gw, chat("fine"))  # a is gone (refused): served by b
        assert r.status_code == 200 and served_by(r.text) == {"b"}
        assert await settle(gw) == {a.url: 0, b.url: 0}


async def test_a_crash_with_bystanders_in_flight_makes_everyone_a_suspect(backends: Backends) -> None:
    """The culprit cannot be told from the other requests a crashed replica held: nobody is refused
    after one crash; the bystanders' retries succeed; the culprit is refused after its second."""
    a, b = await backends("a", "b", poison_action="crash", ttft_s=0.3)
    async with running_gateway({"models": [pool(a, b, policy="least_outstanding")]}) as gw:
        await prepare(gw, "cold", [a, b])  # no pooled connection to a that its crash could make look stale
        pool_state = gw.pools["m"]
        pool_state.backends[1].in_flight = 10  # route everything to a for now
        bystanders = [asyncio.ensure_future(post(gw, chat(f"by {i}", stream=True))) for i in range(3)]
        while len(a.bodies) < 3:
            await asyncio.sleep(0.01)
        culprit = await post(gw, chat("POISON", stream=True))
        results = await asyncio.gather(*bystanders)
        pool_state.backends[1].in_flight = 0
        assert culprit.json()["error"]["code"] == "request_failed_upstream"
        assert all(r.json()["error"]["code"] == "request_failed_upstream" for r in results)
        assert not b.bodies
        for i in range(3):  # the bystanders' own retries are not refused (a is down: b serves them)
            r = await post(gw, chat(f"by {i}", stream=True))
            assert r.status_code == 200 and served_by(r.text) == {"b"}
        r = await post(gw, chat("POISON", stream=True))  # a suspect: sent again, and b dies of it too
        assert r.json()["error"]["code"] == "request_failed_upstream"
        r = await post(gw, chat("POISON", stream=True))
        assert r.json()["error"]["code"] == "poison_request"
        assert await settle(gw) == {a.url: 0, b.url: 0}


async def test_poison_entries_expire(backends: Backends) -> None:
    a, b = await backends("a", "b")
    async with running_gateway({"models": [pool(a, b, poison_ttl_s=0.3)]}) as gw:
        assert (await post(gw, chat("POISON"))).json()["error"]["code"] == "engine_error"
        assert (await post(gw, chat("POISON"))).json()["error"]["code"] == "poison_request"
        await asyncio.sleep(0.4)
        assert (await post(gw, chat("POISON"))).json()["error"]["code"] == "engine_error"
        assert len(a.bodies) + len(b.bodies) == 2


async def test_the_poison_set_is_bounded(backends: Backends) -> None:
    bs = await backends("a", "b", "c")
    async with running_gateway({"models": [pool(*bs, poison_max_entries=2)]}) as gw:
        for i in range(3):  # round robin: each on another healthy replica, so each one is certain
            assert (await post(gw, chat(f"POISON {i}"))).json()["error"]["code"] == "engine_error"
        assert len(gw.pools["m"].poison) == 2
        codes = [(await post(gw, chat(f"POISON {i}"))).json()["error"]["code"] for i in (2, 1, 0)]
        assert codes == ["poison_request", "poison_request", "engine_error"]  # the oldest was evicted


# -- PoisonSet on its own (explicit clock) -----------------------------------------------------


def make(ttl: float = 10.0, n: int = 100) -> PoisonSet:
    return PoisonSet(RetryConfig(poison_ttl_s=ttl, poison_max_entries=n))


def test_poison_set_certain_and_suspect() -> None:
    ps = make()
    k1, k2, k3 = (request_key("t", "/v1/chat/completions", b"%d" % i) for i in range(3))
    assert ps.charge(k1, "r1", 500, 0.0, replica_was_healthy=True).blocked
    # a different request failing on the same replica within BURST_S: a replica-wide failure
    assert not ps.charge(k2, "r1", 500, 0.5, replica_was_healthy=False).blocked
    assert ps.blocked(k1, 0.6) is None and ps.blocked(k2, 0.6) is None
    assert ps.charge(k2, "r2", 500, 5.0, replica_was_healthy=True).blocked  # second strike
    # a replica that was already failing is no evidence against the request
    assert not ps.charge(k3, "r3", None, 5.0, replica_was_healthy=False).blocked
    ps.forgive(k3)
    assert ps.get(k3, 5.1) is None


def test_poison_set_mid_stream_failure_downgrades_a_fresh_charge() -> None:
    ps = make()
    k = request_key(None, "/v1/completions", b"x")
    assert ps.charge(k, "r1", None, 0.0, replica_was_healthy=True).blocked
    ps.note_failure("r1", 0.2)  # a stream on the same replica broke right after: it crashed with others
    assert ps.blocked(k, 0.3) is None
    ps.note_failure("r1", 5.0)  # later failures do not touch older charges
    k2 = request_key(None, "/v1/completions", b"y")
    ps.charge(k2, "r1", 500, 10.0, replica_was_healthy=True)
    ps.note_failure("r2", 10.1)  # another replica
    assert ps.blocked(k2, 10.2) is not None


def test_poison_set_ttl_and_bound() -> None:
    ps = make(ttl=10.0, n=3)
    keys = [request_key(None, "/p", b"%d" % i) for i in range(5)]
    for i, k in enumerate(keys):
        ps.charge(k, f"r{i}", 500, float(i), replica_was_healthy=True)
    assert len(ps) == 3 and ps.get(keys[0], 5.0) is None and ps.get(keys[1], 5.0) is None
    assert ps.blocked(keys[4], 13.9) is not None
    ps.charge(request_key(None, "/p", b"new"), "r9", 500, 13.5, replica_was_healthy=True)
    assert len(ps) == 2  # expired entries are purged on the next charge
    assert ps.blocked(keys[4], 14.0) is None
    assert not PoisonSet(RetryConfig(poison_ttl_s=0)).enabled
    assert not PoisonSet(RetryConfig(on_failure=True)).enabled


def test_retry_config_validation() -> None:
    cfg = parse_config({"models": [{"name": "m", "backends": [{"url": "http://h:1"}],
                                    "retry": {"on_status": [503, 502, 429], "poison_ttl_s": 60}}]})
    assert cfg.models[0].retry == RetryConfig(on_status=(429, 502, 503), poison_ttl_s=60.0)
    assert parse_config({"models": [{"name": "m", "backends": [{"url": "http://h:1"}]}]}).models[0].retry \
        == RetryConfig()
    with pytest.raises(ConfigError) as err:
        parse_config({"models": [{"name": "m", "backends": [{"url": "http://h:1"}], "retry": {
            "on_status": [503, 404, "500"], "on_failure": "no", "poison_ttl_s": -1, "poison_max_entries": 0,
            "max": 3}}]})
    problems = "\n".join(err.value.problems)
    for expected in ("models[0].retry.on_status[1]: expected 429 or a 5xx status, got 404",
                     "models[0].retry.on_status[2]: expected 429 or a 5xx status, got '500'",
                     "models[0].retry.on_failure: expected true or false",
                     "models[0].retry.poison_ttl_s: must be >= 0",
                     "models[0].retry.poison_max_entries: must be >= 1",
                     "models[0].retry.max: unknown key"):
        assert expected in problems, problems
