"""Routing policies, region ordering and the circuit breaker, in-process; at the end, bursts
through the real frontend (in-process gateway and backends on 127.0.0.1, gw_inproc.py)."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from typing import Any

import pytest
from gw_inproc import Backends, ScriptedBackend, burst, chat, running_gateway, settle

from hasten.gateway.app import ClientConnection
from hasten.gateway.config import parse_config
from hasten.gateway.core import Gateway
from hasten.gateway.health import BreakerState, CircuitBreaker
from hasten.gateway.routing import Pool, PrefixAware, RouteInput, prompt_text
from hasten.gateway.testing import MemoryTransport


def make_pool(policy: str, backends: list[dict] | None = None) -> Pool:
    backends = backends or [{"url": f"http://127.0.0.1:{9000 + i}"} for i in range(3)]
    cfg = parse_config({"models": [{"name": "m", "policy": policy, "backends": backends}]})
    return Pool(cfg.models[0])


def test_weighted_round_robin() -> None:
    pool = make_pool("round_robin", backends=[{"url": "http://h:1", "weight": 3}, {"url": "http://h:2"}])
    picks = Counter(pool.candidates(RouteInput())[0].url for _ in range(40))
    assert picks == {"http://h:1": 30, "http://h:2": 10}
    # the failover order contains every other backend
    assert len(pool.candidates(RouteInput())) == 2


def test_least_outstanding() -> None:
    pool = make_pool("least_outstanding")
    pool.backends[0].in_flight = 5
    pool.backends[1].in_flight = 1
    pool.backends[2].in_flight = 3
    order = [b.url[-4:] for b in pool.candidates(RouteInput())]
    assert order == ["9001", "9002", "9000"]


def route_and_commit(pool: Pool, text: str) -> str:
    """Route one chat prompt, commit the choice as the proxy does, return the chosen URL."""
    inp = pool.route_input({"messages": [{"role": "user", "content": text}]}, None, None)
    b = pool.candidates(inp)[0]
    pool.policy.commit(inp, b)
    return b.url


def test_prefix_aware_affinity_and_bounded_load() -> None:
    pool = make_pool("prefix_aware")
    assert isinstance(pool.policy, PrefixAware)
    shared = "system: house rules. " * 30

    def route(text: str) -> str:
        return route_and_commit(pool, text)

    first = route(shared + "q1")
    assert all(route(shared + f"q{i}") == first for i in range(20))
    # overload the owner: bounded load spills the prefix to another replica...
    owner = next(b for b in pool.backends if b.url == first)
    owner.in_flight = 10
    spill = route(shared + "q-over")
    assert spill != first
    # ...and once the owner is back to normal load, the longest known prefix wins again
    owner.in_flight = 0
    assert route(shared + "q-over") == spill  # that exact prompt was last served there
    assert route(shared + "another") in (first, spill)


def test_prefix_spill_adds_a_holder_instead_of_moving_the_prefix() -> None:
    pool = make_pool("prefix_aware")
    shared = "system: house rules. " * 30

    def route(text: str) -> str:
        return route_and_commit(pool, text)

    home = route(shared + "q0")
    owner = next(b for b in pool.backends if b.url == home)
    owner.in_flight = 10
    spill = route(shared + "q1")
    assert spill != home
    # the prefix now has two copies: new questions go to the less loaded one and never to the third
    # replica, and the first copy is still used once it has room (it was not moved away)
    third = next(b for b in pool.backends if b.url not in (home, spill))
    other = next(b for b in pool.backends if b.url == spill)
    owner.in_flight, other.in_flight = 0, 3
    assert route(shared + "q2") == home
    owner.in_flight, other.in_flight = 3, 0
    assert route(shared + "q3") == spill
    assert third.url not in {route(shared + f"r{i}") for i in range(10)}


def test_load_slack_keeps_small_imbalances_on_the_prefix_holder() -> None:
    backends = [{"url": "http://127.0.0.1:9000"}, {"url": "http://127.0.0.1:9001"}]
    texts = [f"tenant {i} system prompt " * 10 for i in range(4)]
    for slack, expect_home in ((0, False), (1, True)):
        cfg = parse_config({"models": [{"name": "m", "policy": "prefix_aware", "load_slack": slack,
                                        "backends": backends}]})
        pool = Pool(cfg.models[0])
        inp = pool.route_input({"prompt": texts[0]}, None, None)
        home = pool.candidates(inp)[0]
        home.in_flight = 3  # 3 vs 0: bound ceil(1.25 * 4 / 2) = 3, so a 4th request is over it by one
        assert (pool.candidates(inp)[0] is home) is expect_home


def test_prefix_placement_is_stable_across_instances() -> None:
    """Two gateway instances with no shared state place new prefixes identically."""
    a, b = make_pool("prefix_aware"), make_pool("prefix_aware")
    for i in range(20):
        payload = {"prompt": f"tenant {i} system prompt " * 10}
        assert a.candidates(a.route_input(payload, None, None))[0].url == \
            b.candidates(b.route_input(payload, None, None))[0].url


def test_session_affinity_and_failover() -> None:
    pool = make_pool("session")
    home = pool.candidates(RouteInput(session="alice"))[0]
    assert all(pool.candidates(RouteInput(session="alice"))[0] is home for _ in range(5))
    home.probe_ok = False
    other = pool.candidates(RouteInput(session="alice"))[0]
    assert other is not home
    home.probe_ok = True
    assert pool.candidates(RouteInput(session="alice"))[0] is home


def test_region_preference_and_latency_failover() -> None:
    pool = make_pool("round_robin", backends=[
        {"url": "http://eu:1", "region": "eu"}, {"url": "http://us:1", "region": "us"},
        {"url": "http://ap:1", "region": "ap"}])
    eu, us, ap = pool.backends
    us.latency_ms, ap.latency_ms, eu.latency_ms = 80.0, 20.0, 1.0
    assert [b.url for b in pool.candidates(RouteInput(region="eu"))] == ["http://eu:1", "http://ap:1",
                                                                          "http://us:1"]
    eu.probe_ok = False  # region down: fail over to the lowest-latency remote region
    assert pool.candidates(RouteInput(region="eu"))[0] is ap
    assert pool.candidates(RouteInput(region="us"))[0] is us


def test_unavailable_backends_are_skipped() -> None:
    pool = make_pool("round_robin")
    for b in pool.backends:
        b.probe_ok = False
    assert pool.candidates(RouteInput()) == []


def test_circuit_breaker_half_open() -> None:
    br = CircuitBreaker(failure_threshold=2, cooldown_s=5.0)
    assert br.allows(0.0)
    assert not br.on_failure(0.0)
    assert br.on_failure(1.0) and br.state is BreakerState.OPEN
    assert not br.allows(2.0)
    assert br.allows(6.5)  # cooldown over: one trial allowed
    br.on_attempt(6.5)
    assert br.state is BreakerState.HALF_OPEN and not br.allows(6.6)  # only one trial at a time
    br.on_failure(7.0)
    assert br.state is BreakerState.OPEN and not br.allows(8.0)
    br.on_attempt(12.5)
    br.on_success()
    assert br.state is BreakerState.CLOSED and br.allows(12.6)


def test_prompt_text_shapes() -> None:
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": ["abc", "def"]}) == "abc"
    assert prompt_text({"prompt": [1, 2, 3]}) == "1,2,3"
    chat = prompt_text({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert chat is not None and "hi" in chat
    assert prompt_text({}) is None


# -- bursts: every request of a burst is routed before any of them is sent ----------------------




def shares(bs: list[ScriptedBackend]) -> dict[str, int]:
    return {b.name: len(b.bodies) for b in bs}


async def warm_up_then_restart(gw: Any, bs: list[ScriptedBackend], restarted: ScriptedBackend) -> None:
    """Every backend gets a pooled connection, then ``restarted`` comes back with none."""
    pools = [gw.proxy._pools[b.url] for b in bs]
    for i in range(50):  # (prefix_aware places each new prompt on its ring: try until every one is hit)
        if all(p.idle for p in pools):
            break
        (raw,) = await burst(gw, [chat(f"warm {i}")])
        assert raw.startswith(b"HTTP/1.1 200")
    await restarted.restart()
    await asyncio.sleep(0.05)  # the gateway sees its pooled connection close
    assert gw.proxy._pools[restarted.url].idle == 0
    assert all(gw.proxy._pools[b.url].idle == 1 for b in bs if b is not restarted)
    for b in bs:
        b.bodies.clear()


@pytest.mark.parametrize("policy", ["least_outstanding", "prefix_aware"])
async def test_a_burst_spreads_over_the_replicas_even_one_just_restarted(policy: str, backends: Backends) -> None:
    bs = await backends("a", "b", "c", tokens=3, interval_s=0.05)
    async with running_gateway({"models": [{"name": "m", "policy": policy,
                                            "backends": [{"url": b.url} for b in bs]}]}) as gw:
        await warm_up_then_restart(gw, bs, bs[2])
        system = "You are a helpful assistant. " * 20  # prefix_aware: every request shares this prefix
        answers = await burst(gw, [chat(f"q{i}", stream=True, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]) for i in range(24)])
        assert all(a.startswith(b"HTTP/1.1 200") and a.count(b"data: ") == 4 for a in answers)
        got = shares(bs)
        assert sum(got.values()) == 24
        if policy == "least_outstanding":  # in proportion to free capacity: 8 each
            assert max(got.values()) <= math.ceil(24 / 3) + 1, got
        else:  # the prefix's replica takes up to its load bound, the rest spills
            assert max(got.values()) <= math.ceil(1.25 * 24 / 3) + 1, got
        assert await settle(gw) == {b.url: 0 for b in bs}


async def test_in_flight_counts_return_to_zero_on_every_exit(backends: Backends) -> None:
    bs = await backends("a", "b", "c", tokens=20, interval_s=0.02)
    async with running_gateway({"models": [{"name": "m", "policy": "least_outstanding",
                                            "backends": [{"url": b.url} for b in bs]}],
                                "health": {"interval_s": 60.0, "failure_threshold": 1000}}) as gw:
        await warm_up_then_restart(gw, bs, bs[0])
        zero = {b.url: 0 for b in bs}
        # failures: 503 everywhere (retried, then given up), and requests that fail a replica (500)
        for b in bs:
            b.status = 503
        answers = await burst(gw, [chat(f"busy {i}", stream=True) for i in range(12)])
        assert all(a.startswith(b"HTTP/1.1 503") for a in answers)
        assert await settle(gw) == zero
        for b in bs:
            b.status = 200
        answers = await burst(gw, [chat(f"POISON {i}", stream=True) for i in range(12)])
        assert all(a.startswith(b"HTTP/1.1 500") for a in answers)
        assert await settle(gw) == zero
        # clients that go away: at once (some before their request was even routed), before the
        # first byte, and in the middle of their streams
        for b in bs:
            b.ttft_s = 0.3
        for abort_after_s in (0.0, 0.1, 0.5):
            await burst(gw, [chat(f"gone {i}", stream=True) for i in range(12)], abort_after_s=abort_after_s)
            assert await settle(gw) == zero, abort_after_s
        for b in bs:
            b.ttft_s = 0.0
        answers = await burst(gw, [chat(f"after {i}", stream=True) for i in range(12)])
        assert all(a.startswith(b"HTTP/1.1 200") for a in answers)
        assert await settle(gw) == zero


async def test_a_reservation_is_released_when_the_client_leaves_before_the_async_path_runs() -> None:
    """No pooled connection: the fast path reserves the backend and hands the request to a task;
    the client goes away before that task ever runs."""
    gateway = Gateway(parse_config({"models": [{"name": "m", "policy": "least_outstanding",
                                                "backends": [{"url": "http://127.0.0.1:9"}]}]}))
    backend = gateway.pools["m"].backends[0]
    client = ClientConnection(gateway, set())
    client.connection_made(MemoryTransport())
    body = b'{"model": "m", "prompt": "hi"}'
    client.data_received(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(body), body))
    assert backend.in_flight == 1  # counted as soon as it was routed
    client.connection_lost(None)
    assert backend.in_flight == 0
    await asyncio.sleep(0.01)  # the cancelled task does not release it a second time
    assert backend.in_flight == 0
    await gateway.close()
