"""The server driven by the official `openai` client, on the fake engine."""

from __future__ import annotations

import math

import openai
import pytest

from .fake_engine import FAKE_TEXT

MSG = [{"role": "user", "content": "Say something."}]


def test_models_and_health(client: openai.OpenAI, http) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert http.get("/health").json() == {"status": "ok"}


def test_chat_non_streaming_usage_and_headers(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="fake-model", messages=MSG, max_tokens=8, temperature=0,
        extra_headers={"X-Request-ID": "req-abc.1"})
    resp = raw.parse()
    assert raw.headers["x-request-id"] == "req-abc.1"
    assert resp.id == "req-abc.1"
    timing = raw.headers["server-timing"]
    for phase in ("queue;dur=", "prefill;dur=", "decode;dur=", "total;dur="):
        assert phase in timing
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == FAKE_TEXT[:8]
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8
    assert resp.usage.prompt_tokens > 0


def test_generated_request_id(client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(model="fake-model", prompt="hi", max_tokens=2)
    assert raw.headers["x-request-id"] == raw.parse().id
    assert len(raw.parse().id) >= 16


def test_chat_streaming_with_usage_and_timing(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="fake-model", messages=MSG, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == FAKE_TEXT[:10]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10
    timing = last.usage.model_extra["timing"]
    assert set(timing) == {"queue", "prefill", "decode", "total"}
    assert timing["total"] >= timing["decode"] >= 0
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_streaming_and_not(client: openai.OpenAI) -> None:
    full = client.completions.create(model="fake-model", prompt="Once upon", max_tokens=12, temperature=0)
    assert full.choices[0].text == FAKE_TEXT[:12]
    assert full.object == "text_completion"
    parts = list(client.completions.create(model="fake-model", prompt="Once upon", max_tokens=12,
                                           temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == full.choices[0].text
    assert parts[-1].choices[0].finish_reason == "length"


def test_stop_strings(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="fake-model", prompt="x", max_tokens=30, temperature=0, stop=["fox"])
    assert resp.choices[0].text == "the quick brown "
    assert resp.choices[0].finish_reason == "stop"
    streamed = list(client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=30, temperature=0,
                                                   stop="brown", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "the quick "


def test_eos_finishes_with_stop(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="fake-model", prompt="x", max_tokens=100, temperature=0)
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == 41  # 40 tokens, then EOS


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    def sample(seed: int | None) -> str:
        r = client.completions.create(model="fake-model", prompt="x", max_tokens=24, temperature=1.0, seed=seed)
        return r.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(6)}) > 1


def test_n_choices_and_echo(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="fake-model", prompt="Hello", max_tokens=4, n=3, temperature=0,
                                     echo=True)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert all(c.text == "Hello" + FAKE_TEXT[:4] for c in resp.choices)
    assert resp.usage.completion_tokens == 12


def test_batched_prompts(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="fake-model", prompt=["a", "bb"], max_tokens=3, n=2, temperature=0)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    assert resp.usage.prompt_tokens == 3 and resp.usage.completion_tokens == 12
    chunks = list(client.completions.create(model="fake-model", prompt=[[1, 2], [3]], max_tokens=3, stream=True,
                                            temperature=0))
    assert {c.choices[0].index for c in chunks} == {0, 1}


def test_chat_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(c.token for c in content) == resp.choices[0].message.content
    for item in content:
        assert item.logprob == pytest.approx(-0.5)
        assert len(item.top_logprobs) == 2
        assert item.bytes == list(item.token.encode())
        assert all(math.isfinite(t.logprob) for t in item.top_logprobs)


def test_completion_logprobs_stream(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model="fake-model", prompt="x", max_tokens=4, temperature=0,
                                            logprobs=3, stream=True))
    tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    assert "".join(tokens) == FAKE_TEXT[:4]
    full = client.completions.create(model="fake-model", prompt="x", max_tokens=4, temperature=0, logprobs=3)
    lp = full.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(len(t) == 3 for t in lp.top_logprobs)
    assert lp.text_offset == [0, 1, 2, 3]


def test_sampling_parameters_reach_the_engine(server, client: openai.OpenAI) -> None:
    client.chat.completions.create(
        model="fake-model", messages=MSG, max_completion_tokens=3, temperature=0.5, top_p=0.9, seed=3,
        presence_penalty=0.5, frequency_penalty=-0.5,
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True, "priority": -1})
    p = server.engine.seen_params[-1]
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (3, 0.5, 0.9, 5, 0.1, 3)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert p.ignore_eos is True
    assert server.engine.seen_priorities[-1] == -1


def test_chat_default_max_tokens_fills_context(server, client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="fake-model", messages=MSG, temperature=0)
    p = server.engine.seen_params[-1]
    assert p.max_tokens == 512 - resp.usage.prompt_tokens


def test_tokenize_and_detokenize(http, fake_tokenizer) -> None:
    r = http.post("/tokenize", json={"prompt": "hello"})
    assert r.status_code == 200
    assert r.json()["tokens"] == fake_tokenizer.encode("hello") and r.json()["count"] == 5
    r = http.post("/tokenize", json={"messages": MSG})
    assert r.json()["count"] > 5
    assert http.post("/detokenize", json={"tokens": r.json()["tokens"][:3]}).status_code == 200


def test_unusable_request_id_is_replaced(http) -> None:
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"X-Request-ID": "bad id\t!"})
    assert r.status_code == 200
    assert r.headers["x-request-id"] != "bad id\t!" and r.headers["x-request-id"] == r.json()["id"]
    err = http.post("/v1/completions", json={"prompt": ""}, headers={"X-Request-ID": "trace-me"})
    assert err.status_code == 400 and err.headers["x-request-id"] == "trace-me"


def test_request_id_reused_concurrently(server, http) -> None:
    import threading

    results = []

    def call() -> None:
        with server.client() as c:
            results.append(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 20},
                                  headers={"X-Request-ID": "same"}))

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200] * 3
    assert all(r.json()["id"] == "same" for r in results)
