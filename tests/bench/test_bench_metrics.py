"""Every metric computed exactly as defined (vllm bench serve), on hand-made timings."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hasten.bench.metrics import SLO, RequestResult, capacity, percentile, summarize


def req(index: int, start: float, chunks: list[float], tokens: int, prompt: int = 10,
        ok: bool = True, error: str = "") -> RequestResult:
    return RequestResult(index=index, start=start, success=ok, error=error, chunk_times=chunks,
                         output_tokens=tokens, prompt_tokens=prompt, end=chunks[-1] if chunks else start,
                         output_tokens_source="usage")


def test_per_request_definitions() -> None:
    # start 1.0; content chunks at 1.1, 1.13, 1.17, 1.25 -> 4 chunks, 6 tokens (multi-token chunks)
    r = req(0, 1.0, [1.1, 1.13, 1.17, 1.25], tokens=6)
    assert r.ttft == pytest.approx(0.1)
    assert r.e2el == pytest.approx(0.25)
    assert r.tpot == pytest.approx((0.25 - 0.1) / (6 - 1))  # (E2E - TTFT) / (tokens - 1)
    assert r.itls == pytest.approx([0.03, 0.04, 0.08])  # gaps between content chunks
    one = req(1, 0.0, [0.2], tokens=1)
    assert one.tpot is None and one.itls == []


def test_summary_pools_and_excludes_exactly() -> None:
    results = [
        req(0, 0.0, [0.10, 0.12, 0.15], tokens=3, prompt=5),     # tpot 25 ms, itl 20, 30
        req(1, 0.5, [0.70, 0.75, 0.80, 0.95], tokens=4, prompt=7),  # tpot 83.33 ms, itl 50,50,150
        req(2, 1.0, [1.30], tokens=1, prompt=9),                 # 1 token: no tpot, no itl
        req(3, 1.0, [], tokens=0, ok=False, error="http_503"),
        req(4, 1.2, [], tokens=0, ok=False, error="timeout"),
        req(5, 1.3, [], tokens=0, ok=False, error="http_503"),
    ]
    s = summarize(results, duration=2.0)
    assert s["completed"] == 3 and s["failed"] == 3 and s["num_prompts"] == 6
    assert s["error_counts"] == {"http_503": 2, "timeout": 1}
    assert s["total_input_tokens"] == 5 + 7 + 9  # failed requests are not counted
    assert s["total_output_tokens"] == 8
    assert s["request_throughput"] == pytest.approx(3 / 2.0)
    assert s["output_throughput"] == pytest.approx(8 / 2.0)
    assert s["total_token_throughput"] == pytest.approx((21 + 8) / 2.0)
    ttfts = [100.0, 200.0, 300.0]
    tpots = [25.0, (0.95 - 0.70) / 3 * 1000]
    itls = [20.0, 30.0, 50.0, 50.0, 150.0]
    e2els = [150.0, 450.0, 300.0]
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        assert s[f"mean_{name}_ms"] == pytest.approx(np.mean(values))
        assert s[f"median_{name}_ms"] == pytest.approx(np.median(values))
        assert s[f"std_{name}_ms"] == pytest.approx(np.std(values))
        for p in (90, 95, 99):
            assert s[f"p{p}_{name}_ms"] == pytest.approx(np.percentile(values, p))
    assert s["request_goodput"] is None and s["goodput"] is None


def test_vllm_key_names_present() -> None:
    s = summarize([req(0, 0.0, [0.1, 0.2], tokens=2)], duration=1.0, slo=SLO(ttft_ms=500))
    for key in ("completed", "request_throughput", "output_throughput", "total_token_throughput",
                "total_input_tokens", "total_output_tokens", "duration", "request_goodput", "goodput"):
        assert key in s
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p95", "p99"):
            assert f"{stat}_{metric}_ms" in s


def test_percentile_is_numpy_linear() -> None:
    rng = random.Random(3)
    for n in (1, 2, 5, 17, 100):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 37.5, 50, 90, 95, 99, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([], 50) == 0.0


def test_goodput_requires_every_slo() -> None:
    results = [
        req(0, 0.0, [0.1, 0.2, 0.3], tokens=3),   # ttft 100, tpot 100, e2e 300
        req(1, 0.0, [0.3, 0.4, 0.5], tokens=3),   # ttft 300 -> misses ttft
        req(2, 0.0, [0.1, 0.5, 0.9], tokens=3),   # tpot 400 -> misses tpot
        req(3, 0.0, [0.05], tokens=1),            # 1 token: tpot counts as 0 (vllm)
        req(4, 0.0, [], tokens=0, ok=False, error="timeout"),
    ]
    slo = SLO.parse("ttft_ms=200,tpot_ms=150")
    assert slo == SLO(ttft_ms=200, tpot_ms=150)
    s = summarize(results, duration=4.0, slo=slo)
    assert s["request_goodput"] == pytest.approx(2 / 4.0)  # requests 0 and 3
    assert s["goodput"] == s["request_goodput"]
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    s2 = summarize(results, duration=4.0, slo=SLO.parse("e2e_ms=350"))
    assert s2["request_goodput"] == pytest.approx(2 / 4.0)  # e2e 300 and 50
    with pytest.raises(ValueError):
        SLO.parse("latency=3")


def test_capacity_is_highest_passing_rate() -> None:
    assert capacity([(1.0, 1.0), (2.0, 0.95), (3.0, 0.5), (4.0, 0.91)]) == 4.0
    assert capacity([(1.0, 0.8)]) is None
    assert capacity([(1.0, 0.9), (2.0, 0.89)]) == 1.0
