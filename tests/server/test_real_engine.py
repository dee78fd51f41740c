"""The server on the real engine with a tiny random llama from `hasten.testing`, in both engine modes:
`AsyncLLM` (engine loop in a thread) and `ProcessEngine` (engine loop in a child process)."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from .harness import ServerThread

if importlib.util.find_spec("hasten.engine.async_engine") is None:
    pytest.skip("hasten.engine.async_engine (AsyncLLM) is not in the tree yet", allow_module_level=True)
if importlib.util.find_spec("hasten.testing") is None:
    pytest.skip("hasten.testing (make_tiny_model) is not in the tree yet", allow_module_level=True)

from hasten.engine.async_engine import AsyncLLM  # noqa: E402
from hasten.server.engine_process import ProcessEngine  # noqa: E402
from hasten.testing import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow  # starts processes or loads the embedded model


def _process_engine(model: str, **options: object) -> ProcessEngine:
    # One torch thread in the child: on a small shared CPU box, an OpenMP team per process thrashes.
    return ProcessEngine.from_options(model, **{"num_threads": 1, **options})


MODES = {"thread": AsyncLLM.from_options, "process": _process_engine}

OPTIONS = dict(dtype="float32", max_model_len=256, max_num_seqs=8, num_kv_blocks=64)
MSG = [{"role": "user", "content": "Tell me about foxes."}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama")


@pytest.fixture(scope="module", params=list(MODES))
def real(request, tiny_model: Path) -> Iterator[ServerThread]:
    """The server with the engine loop in a thread of its own (AsyncLLM) or in a process (ProcessEngine)."""
    factory = MODES[request.param]
    with ServerThread(lambda: factory(str(tiny_model), **OPTIONS)) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(real: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=real.url + "/v1", api_key="x", max_retries=0, timeout=60)


def model_name(oai: openai.OpenAI) -> str:
    return oai.models.list().data[0].id


def test_chat_and_completions_stream_match(oai: openai.OpenAI) -> None:
    name = model_name(oai)
    full = oai.chat.completions.create(model=name, messages=MSG, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"
    chunks = list(oai.chat.completions.create(model=name, messages=MSG, max_tokens=12, temperature=0, stream=True,
                                              stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12
    assert set(chunks[-1].usage.model_extra["timing"]) == {"queue", "prefill", "decode", "total"}
    comp = oai.completions.create(model=name, prompt="The quick brown", max_tokens=8, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert comp.choices[0].text.startswith("The quick brown")
    assert comp.usage.completion_tokens == 8


def test_seed_stop_logprobs_n(oai: openai.OpenAI) -> None:
    name = model_name(oai)

    def sample(seed: int) -> str:
        return oai.completions.create(model=name, prompt="Once", max_tokens=16, temperature=1.0, seed=seed,
                                      extra_body={"ignore_eos": True}).choices[0].text

    assert sample(11) == sample(11)
    resp = oai.chat.completions.create(model=name, messages=MSG, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, n=2, extra_body={"ignore_eos": True})
    assert len(resp.choices) == 2
    for choice in resp.choices:
        content = choice.logprobs.content
        assert len(content) == 6 and all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    text = oai.completions.create(model=name, prompt="Once", max_tokens=30, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    if len(text) > 6:
        stop = text[3:6]
        cut = oai.completions.create(model=name, prompt="Once", max_tokens=30, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True})
        assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text


def test_json_schema_output_validates(oai: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"}}, "required": ["color", "count", "ok"]}
    resp = oai.chat.completions.create(
        model=model_name(oai), messages=MSG, max_tokens=60, temperature=1.0, seed=5, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}})
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_disconnect_returns_every_block(real: ServerThread) -> None:
    engine = real.engine
    total = engine.get_stats().num_total_blocks
    with httpx.Client(base_url=real.url, timeout=30) as c:
        body = {"prompt": "a b c d e f g", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            assert engine.get_stats().num_free_blocks < total
    deadline = time.monotonic() + 5
    while (s := engine.get_stats()).num_free_blocks != total or s.num_running:
        assert time.monotonic() < deadline, s
        time.sleep(0.005)


def test_errors_and_metrics(real: ServerThread) -> None:
    with real.client() as c:
        r = c.post("/v1/completions", json={"prompt": "x " * 300, "max_tokens": 10})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 250, "stream": True})
        assert r.status_code in (200, 400)
        metrics = c.get("/metrics").text
        for name in ("hasten:time_to_first_token_seconds_count", "hasten:kv_cache_usage_perc",
                     "hasten:prefix_cache_queries_total", "hasten:generation_tokens_total"):
            assert name in metrics
        line = next(x for x in metrics.splitlines() if x.startswith("hasten:prefix_cache_queries_total"))
        assert float(line.split()[-1]) > 0


@pytest.mark.parametrize("mode", list(MODES))
def test_queue_full_is_429(tiny_model: Path, mode: str) -> None:
    options = {**OPTIONS, "max_num_seqs": 1, "max_waiting_requests": 1, "max_model_len": 4096,
               "num_kv_blocks": 300}
    # long enough that the first request is still running when the second and third arrive
    # (1,000 tokens took under 2 s on the tiny model once linears were oneDNN-packed: flaky)
    long = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
    with ServerThread(lambda: MODES[mode](str(tiny_model), **options)) as srv:
        engine = srv.engine
        # On a loaded machine the first request can finish before the second one is queued;
        # then the scene (one running, one waiting) never happens: set it up again.
        for _attempt in range(3):
            results: list[int] = []

            def call(results: list[int]) -> None:
                with httpx.Client(base_url=srv.url, timeout=180) as c:
                    results.append(c.post("/v1/completions", json=long).status_code)

            threads = [threading.Thread(target=call, args=(results,)) for _ in range(2)]
            for t in threads:
                t.start()
            full = False
            while any(t.is_alive() for t in threads):
                s = engine.get_stats()
                if s.num_running == 1 and s.num_waiting == 1:
                    full = True
                    break
                time.sleep(0.001)
            if full:
                with srv.client() as c:
                    r = c.post("/v1/completions", json={"prompt": "y", "max_tokens": 4})
            for t in threads:
                t.join(timeout=180)
            if full:
                break
        assert full, "never saw one request running and one waiting"
    assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert results == [200, 200]


def test_hostile_ids_salt_bias_and_stop(real: ServerThread) -> None:
    """The request that once killed the engine is a 400; cache_salt separates prefix caches;
    logit_bias is honoured; a single stop string of any length is accepted."""
    with real.client() as c:
        vocab = len(real.engine.tokenizer)
        poison = {"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [vocab]}
        r = c.post("/v1/completions", json=poison)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "logit_bias": {str(vocab + 3): 5}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "logit_bias": {"x": 5}})
        assert r.status_code == 400, r.text
        assert c.get("/health").status_code == 200
        body = {"prompt": "hi there", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                "logit_bias": {"42": 100}}
        r = c.post("/v1/completions", json={**body, "logprobs": 0})
        assert r.status_code == 200, r.text
        expected = real.engine.tokenizer.decode([42] * 5)
        assert r.json()["choices"][0]["text"] == expected
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stop": "a stop string longer than 16"})
        assert r.status_code == 200, r.text
        long_prompt = "The quick brown fox jumps over the lazy dog. " * 4

        def cached(salt: str | None) -> int:
            req = {"prompt": long_prompt, "max_tokens": 1, **({"cache_salt": salt} if salt else {})}
            resp = c.post("/v1/completions", json=req)
            assert resp.status_code == 200, resp.text
            return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        cached("tenant-a")
        assert cached("tenant-a") > 0
        assert cached("tenant-b") == 0
        assert cached(None) == 0


def test_engine_process_death_is_reported(tiny_model: Path) -> None:
    with ServerThread(lambda: _process_engine(str(tiny_model), **OPTIONS)) as srv, srv.client() as c:
        assert c.get("/health").status_code == 200
        srv.engine._proc.kill()
        deadline = time.monotonic() + 10
        while c.get("/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code in (500, 503), r.text  # failed engine, then restarting: never a hang


def test_engine_process_freezes_its_start_up_heap(tiny_model: Path) -> None:
    """EngineConfig.gc_freeze: the engine process freezes what start-up allocated (its objects leave the
    cyclic collector's full scans); gc_freeze=False leaves them in."""
    engines = [_process_engine(str(tiny_model), **OPTIONS),
               _process_engine(str(tiny_model), **OPTIONS, gc_freeze=False)]
    try:
        frozen, unfrozen = (e.gc_frozen_objects for e in engines)
        assert frozen > 50_000 and unfrozen == 0, (frozen, unfrozen)
    finally:
        for e in engines:
            e._proc.kill()
            e._proc.wait()
