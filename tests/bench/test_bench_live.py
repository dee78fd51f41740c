"""The client and runner against the fake SSE server with known timings (same process)."""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from pathlib import Path

import pytest

from hasten.bench.client import BenchClient, ClientOptions, Target
from hasten.bench.datasets import RequestSpec, WorkloadConfig, build_workload
from hasten.bench.fake_server import FakeServer, FakeServerConfig
from hasten.bench.metrics import summarize
from hasten.bench.runner import LoadPoint, RunOptions, arrival_offsets, run_load, warm_up


def spec(out: int = 8, prompt: str = "one two three") -> RequestSpec:
    return RequestSpec(prompt=prompt, messages=[{"role": "user", "content": prompt}], prompt_len=3,
                       output_len=out)


async def with_server(cfg: FakeServerConfig, fn, **client_kw):  # type: ignore[no-untyped-def]
    server = FakeServer(cfg)
    await server.start()
    client = BenchClient(Target("fake", server.base_url + "/v1", "m"), ClientOptions(**client_kw))
    try:
        return await fn(server, client)
    finally:
        client.close()
        await server.stop()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_known_pace_is_measured(endpoint: str) -> None:
    cfg = FakeServerConfig(ttft_ms=40, itl_ms=10, record=True)

    async def go(server: FakeServer, client: BenchClient):  # type: ignore[no-untyped-def]
        await warm_up(client, [spec()] * 8, 8)
        server.log.clear()
        return await run_load(client, [spec(out=12)] * 16, LoadPoint("c8", concurrency=8)), server.log

    run, log = asyncio.run(with_server(cfg, go, endpoint=endpoint))
    assert len(run.results) == 16 and all(r.success for r in run.results)
    for r in run.results:
        assert r.output_tokens == 12 and r.output_tokens_source == "usage"
        assert len(r.chunk_times) == 12  # chat's role-only first chunk is not content
        assert r.generated_text == "".join(f" t{i}" for i in range(12))
    s = summarize(run.results, run.duration)
    # generous sanity bounds around the server's nominal pace (shared, noisy CPUs)
    assert 40.0 <= s["median_ttft_ms"] < 40.0 + 15.0
    assert abs(s["median_tpot_ms"] - 10.0) < 2.0
    assert abs(s["median_itl_ms"] - 10.0) < 3.0
    # against what the server really did: each chunk seen after it was sent, and soon after
    sends = sorted(t for entry in log for t in entry.sends)
    seen = sorted(t for r in run.results for t in r.chunk_times)
    assert len(sends) == len(seen) == 16 * 12
    lags = [b - a for a, b in zip(sends, seen, strict=True)]
    assert min(lags) >= 0.0
    assert statistics.median(lags) < 0.001  # the client adds well under 1 ms at 8 streams


def test_error_types_are_counted() -> None:
    cfg = FakeServerConfig(ttft_ms=5, itl_ms=1, fail_every=3)

    async def go(server: FakeServer, client: BenchClient):  # type: ignore[no-untyped-def]
        return await run_load(client, [spec(out=3)] * 9, LoadPoint("c1", concurrency=1))

    run = asyncio.run(with_server(cfg, go))
    s = summarize(run.results, run.duration)
    assert s["completed"] == 6 and s["error_counts"] == {"http_503": 3}
    bad = [r for r in run.results if not r.success]
    assert all("injected failure" in r.error_detail for r in bad)


def test_connect_error_and_timeout() -> None:
    async def refused() -> list:
        server = FakeServer()
        port = await server.start()
        await server.stop()  # nothing listens there any more
        client = BenchClient(Target("gone", f"http://127.0.0.1:{port}", "m"), ClientOptions())
        run = await run_load(client, [spec()] * 2, LoadPoint("c1", concurrency=1))
        return run.results

    assert [r.error for r in asyncio.run(refused())] == ["connect_error", "connect_error"]

    async def go(server: FakeServer, client: BenchClient):  # type: ignore[no-untyped-def]
        return await run_load(client, [spec(out=100)], LoadPoint("c1", concurrency=1))

    run = asyncio.run(with_server(FakeServerConfig(ttft_ms=10, itl_ms=50), go, timeout=0.2))
    assert [r.error for r in run.results] == ["timeout"]


def test_token_counting_fallbacks(tmp_path: Path) -> None:
    """No usage: count with --tokenizer when given, else one token per content chunk."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"t{i}": i + 1 for i in range(64)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    from hasten.bench.tokens import HFTokenizer

    cfg = FakeServerConfig(ttft_ms=5, itl_ms=2, chunk_tokens=3)
    no_usage = {"extra_body": {"stream_options": {"include_usage": False}}}

    async def go(server: FakeServer, client: BenchClient):  # type: ignore[no-untyped-def]
        return (await run_load(client, [spec(out=9)], LoadPoint("c1", concurrency=1))).results[0]

    r = asyncio.run(with_server(cfg, go, **no_usage))
    assert (r.output_tokens, r.output_tokens_source, len(r.chunk_times)) == (3, "chunks", 3)

    async def go_tok(server: FakeServer, client: BenchClient):  # type: ignore[no-untyped-def]
        client.tokenizer = HFTokenizer(str(path))
        return await go(server, client)

    r = asyncio.run(with_server(cfg, go_tok, **no_usage))
    assert (r.output_tokens, r.output_tokens_source) == (9, "tokenizer")
    assert r.tpot == pytest.approx((r.chunk_times[-1] - r.chunk_times[0]) / 8)


def test_closed_loop_keeps_exactly_n_in_flight() -> None:
    cfg = FakeServerConfig(ttft_ms=20, itl_ms=5)

    async def go(server: FakeServer, client: BenchClient):  # type: ignore[no-untyped-def]
        run = await run_load(client, [spec(out=4)] * 12, LoadPoint("c3", concurrency=3))
        return run, server.max_active

    run, max_active = asyncio.run(with_server(cfg, go))
    assert len(run.results) == 12 and max_active == 3
    assert 2.0 < summarize(run.results, run.duration)["mean_concurrency"] <= 3.0 + 1e-6


def test_gamma_arrivals() -> None:
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    for burstiness in (1.0, 0.25, 4.0):
        t = arrival_offsets(20000, rate=50.0, burstiness=burstiness, seed=1)
        gaps = [b - a for a, b in zip([0.0] + t[:-1], t, strict=True)]
        mean = statistics.fmean(gaps)
        cv2 = statistics.pvariance(gaps) / mean**2
        assert mean == pytest.approx(1 / 50.0, rel=0.05)  # mean gap = 1/rate
        assert cv2 == pytest.approx(1 / burstiness, rel=0.1)  # shape k -> CV^2 = 1/k
    assert arrival_offsets(5, 10.0, 1.0, 7) == arrival_offsets(5, 10.0, 1.0, 7)


def test_open_loop_is_bounded_by_time() -> None:
    cfg = FakeServerConfig(ttft_ms=5, itl_ms=1)

    async def go(server: FakeServer, client: BenchClient):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        run = await run_load(client, [spec(out=2)] * 10000, LoadPoint("r", request_rate=40.0),
                             RunOptions(max_duration=0.5, seed=3))
        return run, time.perf_counter() - t0

    run, wall = asyncio.run(with_server(cfg, go))
    expected = sum(1 for t in arrival_offsets(10000, 40.0, 1.0, 3) if t <= 0.5)
    assert len(run.results) == expected and all(r.success for r in run.results)
    assert wall < 5.0


def test_hard_stop_cancels_in_flight_requests() -> None:
    cfg = FakeServerConfig(ttft_ms=10, itl_ms=100)  # each request would take ~10 s

    async def go(server: FakeServer, client: BenchClient):  # type: ignore[no-untyped-def]
        return await run_load(client, [spec(out=100)] * 50, LoadPoint("c2", concurrency=2),
                              RunOptions(max_duration=0.2, drain_timeout=0.2))

    run = asyncio.run(with_server(cfg, go))
    assert [r.error for r in run.results] == ["deadline", "deadline"]


def test_multi_turn_waits_for_previous_turn() -> None:
    specs = build_workload(WorkloadConfig(dataset="multi-turn", num_requests=6, num_turns=3, input_len=4,
                                          output_len=3, seed=1))
    cfg = FakeServerConfig(ttft_ms=5, itl_ms=2, record=True)

    async def go(server: FakeServer, client: BenchClient):  # type: ignore[no-untyped-def]
        return await run_load(client, specs, LoadPoint("c4", concurrency=4))

    run = asyncio.run(with_server(cfg, go, endpoint="chat"))
    by_index = {r.index: r for r in run.results}
    for i, s in enumerate(specs):
        if s.depends_on is not None:
            assert by_index[i].start >= by_index[s.depends_on].chunk_times[-1]
