"""Tenant isolation of the replicas' prefix caches: the gateway sets each tenant's ``cache_salt``.

In-process gateway and scripted backends (gw_inproc.py) that keep every body they receive.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from gw_inproc import Backends, chat, post, running_gateway

from hasten.gateway.config import ConfigError, parse_config
from hasten.gateway.routing import Pool

SECRET = "correct horse battery staple 42"
TENANTS = [{"name": "alpha", "key": "ka"}, {"name": "beta", "key": "kb"}, {"name": "alpha", "key": "ka2"}]




def config(b: Any, **extra: Any) -> dict[str, Any]:
    return {"models": [{"name": "m", "backends": [{"url": b.url}]}], "tenants": TENANTS, **extra}


async def salts_seen(backends: Backends, cfg_extra: dict[str, Any], requests: list[tuple[str, dict[str, Any]]],
                     path: str = "/v1/chat/completions") -> list[Any]:
    (b,) = await backends("b")
    async with running_gateway(config(b, **cfg_extra)) as gw:
        for key, payload in requests:
            assert (await post(gw, payload, key=key, path=path)).status_code == 200
    return [body.get("cache_salt") for body in b.bodies]


async def test_each_tenant_gets_its_own_salt_and_the_client_cannot_choose_it(backends: Backends) -> None:
    got = await salts_seen(backends, {"cache_salt": {"secret": SECRET}}, [
        ("ka", chat("hello")),
        ("kb", chat("hello")),
        ("ka", chat("hello", cache_salt="beta-guess")),  # overridden
        ("kb", chat("again", stream=True)),  # the second request of a tenant: fast path (pooled connection)
        ("ka2", {"model": "m", "prompt": "hi"}),  # the tenant's other key; /v1/chat vs completions below
    ])
    alpha, beta = got[0], got[1]
    assert isinstance(alpha, str) and len(alpha) == 32 and alpha != beta
    assert "alpha" not in alpha and "beta" not in beta
    assert got == [alpha, beta, alpha, beta, alpha]


async def test_completions_are_salted_and_other_endpoints_are_left_alone(backends: Backends) -> None:
    salted = await salts_seen(backends, {"cache_salt": {"secret": SECRET}},
                              [("ka", {"model": "m", "prompt": "hi", "cache_salt": "mine"})], path="/v1/completions")
    assert salted[0] not in (None, "mine")
    untouched = await salts_seen(backends, {"cache_salt": {"secret": SECRET}},
                                 [("ka", {"model": "m", "input": "hi"})], path="/v1/embeddings")
    assert untouched == [None]


async def test_the_salt_is_stable_across_gateway_instances_with_the_same_secret(backends: Backends) -> None:
    first = await salts_seen(backends, {"cache_salt": {"secret": SECRET}}, [("ka", chat("x")), ("kb", chat("x"))])
    second = await salts_seen(backends, {"cache_salt": {"secret": SECRET}}, [("ka", chat("y")), ("kb", chat("y"))])
    other = await salts_seen(backends, {"cache_salt": {"secret": SECRET + "!"}}, [("ka", chat("x"))])
    assert first == second and other[0] != first[0]


async def test_without_a_secret_salts_are_random_per_instance(backends: Backends,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hasten.gateway"):
        first = await salts_seen(backends, {}, [("ka", chat("x")), ("kb", chat("x"))])
    assert any("cache_salt.secret is not set" in r.getMessage() for r in caplog.records)
    second = await salts_seen(backends, {}, [("ka", chat("x"))])
    assert first[0] != first[1] and second[0] != first[0]


async def test_no_tenants_or_disabled_leaves_the_client_value_alone(backends: Backends) -> None:
    (b,) = await backends("b")
    async with running_gateway({"models": [{"name": "m", "backends": [{"url": b.url}]}]}) as gw:
        await post(gw, chat("x", cache_salt="client-salt"))
        await post(gw, chat("y"))
    got = await salts_seen(backends, {"cache_salt": {"enabled": False}}, [("ka", chat("z", cache_salt="c"))])
    assert [body.get("cache_salt") for body in b.bodies] == ["client-salt", None] and got == ["c"]


async def test_salt_and_backend_model_rewrite_together(backends: Backends) -> None:
    (b,) = await backends("b")
    cfg = {"models": [{"name": "m", "backend_model": "real-name", "backends": [{"url": b.url}]}],
           "tenants": TENANTS, "cache_salt": {"secret": SECRET}}
    async with running_gateway(cfg) as gw:
        for _ in range(2):  # cold (async path), then warm (fast path)
            assert (await post(gw, chat("x", temperature=0.5), key="kb")).status_code == 200
    assert b.bodies[0] == b.bodies[1]
    assert b.bodies[0]["model"] == "real-name" and b.bodies[0]["temperature"] == 0.5
    assert len(b.bodies[0]["cache_salt"]) == 32


def test_prefix_routing_is_per_salt() -> None:
    """Same tenant, same prompt: same replica (it shares the cached prefix); the block hashes of
    different tenants differ, as the replicas' cache keys do."""
    cfg = parse_config({"models": [{"name": "m", "policy": "prefix_aware", "backends": [
        {"url": f"http://127.0.0.1:{9000 + i}"} for i in range(4)]}]})
    pool = Pool(cfg.models[0])
    payload = {"prompt": "the same long system prompt " * 20}
    a1 = pool.route_input(payload, None, None, "salt-a")
    a2 = pool.route_input(payload, None, None, "salt-a")
    b1 = pool.route_input(payload, None, None, "salt-b")
    home = pool.candidates(a1)[0]
    pool.policy.commit(a1, home)
    assert pool.candidates(a2)[0] is home
    unsalted = pool.route_input(payload, None, None)
    for other in (b1, unsalted):
        pool.candidates(other)
        assert other.block_hashes and set(other.block_hashes).isdisjoint(a2.block_hashes)


def test_config_validation_of_the_secret() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"models": [{"name": "m", "backends": [{"url": "http://h:1"}]}],
                      "cache_salt": {"secret": "short", "enabled": "yes", "other": 1}})
    problems = "\n".join(err.value.problems)
    assert "cache_salt.secret: must be at least 16 characters" in problems
    assert "cache_salt.enabled: expected true or false" in problems
    assert "cache_salt.other: unknown key" in problems


async def test_a_large_body_is_salted_and_forwarded_whole_without_being_held_parsed(backends: Backends) -> None:
    from hasten.gateway.pipeline import LARGE_BODY_BYTES

    enum = [f"v{i}" for i in range(LARGE_BODY_BYTES // 4)]  # ~8 bytes of JSON each: well over the bound
    big = chat("hello", response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"x": {"enum": enum}}}}})
    (b,) = await backends("b")
    async with running_gateway(config(b, cache_salt={"secret": SECRET})) as gw:
        assert (await post(gw, big, key="ka")).status_code == 200
        assert (await post(gw, chat("hello"), key="ka")).status_code == 200
    large, small = b.bodies
    assert large["cache_salt"] == small["cache_salt"] and isinstance(large["cache_salt"], str)
    assert large["response_format"]["json_schema"]["schema"]["properties"]["x"]["enum"] == enum
