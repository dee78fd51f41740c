"""Sweep logic, warm-up exclusion and interleaved comparisons against fake servers."""

from __future__ import annotations

import asyncio

import pytest

from hasten.bench.campaign import Campaign, CampaignConfig, split_rounds, sweep_rates
from hasten.bench.client import Target
from hasten.bench.datasets import WorkloadConfig, build_workload
from hasten.bench.fake_server import FakeServer, FakeServerConfig
from hasten.bench.metrics import SLO
from hasten.bench.report import capacities, ratio_rows
from hasten.bench.runner import LoadPoint


def test_sweep_rates_strictly_between() -> None:
    assert sweep_rates(2.0, 10.0, 3) == pytest.approx([4.0, 6.0, 8.0])
    assert sweep_rates(5.0, 5.0, 3) == [] and sweep_rates(6.0, 5.0, 3) == [] and sweep_rates(1.0, 2.0, 0) == []


def test_split_rounds_keeps_dependencies_inside_a_slice() -> None:
    specs = build_workload(WorkloadConfig(dataset="multi-turn", num_requests=8, num_turns=2, input_len=2,
                                          output_len=2))
    parts = split_rounds(specs, 2)
    assert [len(p) for p in parts] == [4, 4]
    assert [s.prompt for p in parts for s in p] == [s.prompt for s in specs]
    for part in parts:
        for i, s in enumerate(part):
            assert s.depends_on is None or 0 <= s.depends_on < i


def test_each_point_gets_its_own_requests_with_the_same_system_prompts() -> None:
    wl = WorkloadConfig(dataset="shared-prefix", num_requests=12, input_len=8, output_len=4, prefix_len=30,
                        num_prefixes=3, seed=4)
    camp = Campaign(CampaignConfig(targets=[Target("t", "http://127.0.0.1:9", "m")], workload=wl))
    first, second = camp.point_specs(0), camp.point_specs(1)
    assert first == build_workload(wl) and second == camp.point_specs(1)  # deterministic
    assert not {s.prompt for s in first} & {s.prompt for s in second}
    system = {s.messages[0]["content"] for s in first}
    assert {s.messages[0]["content"] for s in second} <= system
    camp.cfg.fresh_requests_per_point = False
    assert camp.point_specs(1) == first


async def _campaign(cfg: CampaignConfig, servers: list[FakeServer]) -> Campaign:
    for s in servers:
        await s.start()
    cfg.targets = [Target(f"s{i}", s.base_url, "m") for i, s in enumerate(servers)]
    camp = Campaign(cfg)
    try:
        await camp.run_all()
    finally:
        for s in servers:
            await s.stop()
    return camp


def test_sweep_finds_sync_and_saturation_and_rates_between() -> None:
    # 2 server slots, 5 tokens: E2E ~ 10 + 4*5 = 30 ms; sync ~ 1/E2E; saturation ~ 2/E2E
    server = FakeServer(FakeServerConfig(ttft_ms=10, itl_ms=5, max_concurrency=2))
    cfg = CampaignConfig(targets=[], workload=WorkloadConfig(num_requests=16, input_len=4, output_len=5),
                         sweep=True, sweep_points=2, sweep_max_concurrency=8, warmup=2)
    camp = asyncio.run(_campaign(cfg, [server]))
    labels = [r.point.label for r in camp.results]
    assert labels[:2] == ["sync", "saturation"] and len(labels) == 4
    sync, sat, *mid = camp.results
    assert sync.point.concurrency == 1 and sat.point.concurrency == 8 and sat.point.closed_loop
    s_rate, t_rate = sync.summary["request_throughput"], sat.summary["request_throughput"]
    assert t_rate > 1.3 * s_rate  # two slots really serve more
    rates = [m.point.request_rate for m in mid]
    assert rates == pytest.approx(sweep_rates(s_rate, t_rate, 2))
    assert all(not m.point.closed_loop and m.point.concurrency == 8 for m in mid)
    assert server.max_active == 2
    # warm-up requests were sent but are not in any result
    assert server.requests == 4 * (16 + 2)
    assert all(len(r.run.results) == 16 for r in camp.results)


def test_compare_interleaves_same_requests_and_ratios() -> None:
    # paces far above scheduling jitter on a busy 2-core machine (4 vs 8 ms flaked in CI)
    fast = FakeServer(FakeServerConfig(ttft_ms=10, itl_ms=20, record=True))
    slow = FakeServer(FakeServerConfig(ttft_ms=10, itl_ms=40, record=True))
    cfg = CampaignConfig(targets=[], workload=WorkloadConfig(num_requests=8, input_len=6, output_len=6, seed=9),
                         points=[LoadPoint("c2", concurrency=2), LoadPoint("c4", concurrency=4)],
                         rounds=2, warmup=0, slo=SLO(tpot_ms=30.0))
    camp = asyncio.run(_campaign(cfg, [fast, slow]))
    # both servers received exactly the same prompts, in the same order
    assert [e.prompt for e in fast.log] == [e.prompt for e in slow.log] and len(fast.log) == 16
    # interleaving: runs alternate between the targets, rotating which goes first
    firsts = sorted([(e.received, "s0") for e in fast.log] + [(e.received, "s1") for e in slow.log])
    order = [name for _, name in firsts]
    switches = sum(1 for a, b in zip(order, order[1:], strict=False) if a != b)
    assert switches >= 3
    rows = ratio_rows(camp.results)
    assert [r["load"] for r in rows] == ["c2", "c4"] and all(r["target"] == "s1" for r in rows)
    for row in rows:
        assert row["median_tpot_ms"] == pytest.approx(2.0, rel=0.25)  # 40 ms vs 20 ms per token
        assert row["output_throughput"] < 1.0
    caps = capacities(camp.results)
    assert caps["s0"] is not None and caps["s1"] is None  # only the fast one meets TPOT <= 30 ms
