"""Routing policies, region ordering and the circuit breaker, in-process (no network)."""

from __future__ import annotations

from collections import Counter

from hasten.gateway.config import parse_config
from hasten.gateway.health import BreakerState, CircuitBreaker
from hasten.gateway.routing import Pool, PrefixAware, RouteInput, prompt_text


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
