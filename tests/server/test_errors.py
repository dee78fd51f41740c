"""Bad inputs get their 4xx status and an OpenAI-style error body; nothing a client sends causes a 5xx."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from .fake_engine import CRASH_MARKER, FakeAsyncLLM
from .harness import ServerThread

MSG = [{"role": "user", "content": "hi"}]


def assert_error(r: httpx.Response, status: int, param: str | None = "any", code: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                           429: "rate_limit_error", 503: "service_unavailable_error"}[status]
    if param != "any":
        assert err["param"] == param
    if code != "any":
        assert err["code"] == code
    assert r.headers["x-request-id"]
    return err


def test_malformed_json(http) -> None:
    r = http.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert "not valid JSON" in assert_error(r, 400)["message"]
    assert_error(http.post("/v1/completions", json=[1, 2]), 400)
    assert_error(http.post("/v1/completions", content=b"prompt=hi"), 400)


@pytest.mark.parametrize("body, param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, None),
    ({"messages": MSG, "temperature": "hot"}, "temperature"),
    ({"messages": MSG, "temperature": 3}, "temperature"),
    ({"messages": MSG, "top_p": 0}, "top_p"),
    ({"messages": MSG, "top_k": -2}, "top_k"),
    ({"messages": MSG, "min_p": 1.5}, "min_p"),
    ({"messages": MSG, "n": 0}, "n"),
    ({"messages": MSG, "n": 1000}, "n"),
    ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSG, "max_tokens": "ten"}, "max_tokens"),
    ({"messages": MSG, "presence_penalty": 5}, "presence_penalty"),
    ({"messages": MSG, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": MSG, "seed": 2**80}, "seed"),
    ({"messages": MSG, "stop": [""]}, None),
    ({"messages": MSG, "stop": ["x"] * 50}, "stop"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MSG, "min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ({"messages": MSG, "tools": [{"type": "function"}]}, "tools.0.function"),
    ({"messages": MSG, "response_format": {"type": "xml"}}, None),
    ({"messages": MSG, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"messages": MSG, "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
])
def test_bad_chat_parameters(http, body: dict, param: str | None) -> None:
    err = assert_error(http.post("/v1/chat/completions", json=body), 400)
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("body", [
    {},
    {"prompt": ""},
    {"prompt": []},
    {"prompt": [[]]},
    {"prompt": [-1]},
    {"prompt": [10**6]},
    {"prompt": [[1], [10**6]]},
    {"prompt": "x", "logprobs": 21},
    {"prompt": "x", "suffix": "y"},
    {"prompt": "x", "echo": "yes"},
    {"prompt": "x", "max_tokens": 1.5},
])
def test_bad_completion_parameters(http, body: dict) -> None:
    assert_error(http.post("/v1/completions", json=body), 400)


def test_nan_and_infinity_rejected(http) -> None:
    for literal in (b"NaN", b"Infinity"):
        r = http.post("/v1/completions", content=b'{"prompt": "x", "temperature": ' + literal + b"}",
                      headers={"content-type": "application/json"})
        assert_error(r, 400)


def test_unknown_model(http) -> None:
    err = assert_error(http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": MSG}), 404,
                       param="model", code="model_not_found")
    assert "gpt-9" in err["message"]
    assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x", "stream": True}), 404)
    assert_error(http.post("/tokenize", json={"model": "gpt-9", "prompt": "x"}), 404)


def test_context_window(http) -> None:
    r = http.post("/v1/completions", json={"prompt": "x" * 100, "max_tokens": 500})
    err = assert_error(r, 400, param="max_tokens", code="context_length_exceeded")
    assert "512" in err["message"]
    assert_error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 600}]}),
                 400, code="context_length_exceeded")
    assert_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2**62, "stream": True}), 400)


def test_unknown_route_and_method(http) -> None:
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_tokenize_needs_exactly_one_input(http) -> None:
    assert_error(http.post("/tokenize", json={}), 400)
    assert_error(http.post("/tokenize", json={"prompt": "a", "messages": MSG}), 400)
    assert_error(http.post("/detokenize", json={"tokens": [10**7]}), 400)


def test_not_ready_is_503(fake_tokenizer) -> None:
    with ServerThread(lambda: FakeAsyncLLM(fake_tokenizer, start_delay=1.0), wait_ready=False) as srv:
        with srv.client() as c:
            assert_error(c.get("/health"), 503)
            r = c.post("/v1/completions", json={"prompt": "x"})
            assert_error(r, 503)
            assert r.headers["retry-after"]
            assert c.get("/metrics").status_code == 200
            deadline = time.monotonic() + 10
            while c.get("/health").status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_queue_full_is_429_and_others_unaffected(fake_tokenizer) -> None:
    # The queue is filled deterministically: one stream starts running, then the engine is paused
    # (no steps) while two more queue up, so a slow machine cannot drain it before the check.
    engine = FakeAsyncLLM(fake_tokenizer, max_num_seqs=1, max_waiting=2, step_time=0.005)
    results: dict[int, tuple[int, str]] = {}

    def long_stream(i: int) -> None:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            body = {"prompt": "x", "max_tokens": 60, "temperature": 0, "stream": True, "ignore_eos": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                results[i] = (r.status_code, r.read().decode())

    def wait_for(state: tuple[int, int]) -> None:
        deadline = time.monotonic() + 20
        while (seen := srv.call(lambda: (len(engine.running), len(engine.waiting)))) != state:
            assert time.monotonic() < deadline, f"engine (running, waiting) = {seen}, waited for {state}"
            time.sleep(0.005)

    with ServerThread(lambda: engine) as srv:
        threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(3)]
        threads[0].start()
        wait_for((1, 0))
        srv.call(lambda: setattr(engine, "paused", True))
        for t in threads[1:]:
            t.start()
        wait_for((1, 2))
        with srv.client() as c:
            for stream in (False, True):
                r = c.post("/v1/completions", json={"prompt": "x", "stream": stream})
                assert_error(r, 429, code="queue_full")
                assert r.headers["retry-after"] == "1"
            # and a pile of bad requests while the good ones are running
            for body in ({"prompt": ""}, {"prompt": "x", "n": 0}, {"model": "m", "prompt": "x"}):
                assert c.post("/v1/completions", json=body).status_code in (400, 404)
        srv.call(lambda: setattr(engine, "paused", False))
        for t in threads:
            t.join(timeout=30)
    for status, text in results.values():
        assert status == 200
        assert text.count('"text_completion"') == 60 and text.endswith("data: [DONE]\n\n")


def test_engine_failure_is_isolated(server, http) -> None:
    results: dict[str, object] = {}

    def good() -> None:
        with server.client() as c:
            results["good"] = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 30, "temperature": 0})

    t = threading.Thread(target=good)
    t.start()
    bad = http.post("/v1/completions", json={"prompt": CRASH_MARKER, "max_tokens": 30})
    assert bad.status_code == 500 and bad.json()["error"]["type"] == "internal_server_error"
    streamed = http.post("/v1/completions", json={"prompt": CRASH_MARKER, "max_tokens": 30, "stream": True})
    assert streamed.status_code == 200 and '"error"' in streamed.text and streamed.text.endswith("[DONE]\n\n")
    t.join(timeout=30)
    good_resp = results["good"]
    assert isinstance(good_resp, httpx.Response) and good_resp.status_code == 200
    assert good_resp.json()["usage"]["completion_tokens"] == 30
    assert server.call(lambda: server.engine.free_blocks) == server.engine.num_blocks
