"""A client that goes away gets its engine request aborted and every KV block back in the pool."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from .fake_engine import FakeAsyncLLM
from .harness import ServerThread

LONG = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv(fake_tokenizer) -> Iterator[ServerThread]:
    engine = FakeAsyncLLM(fake_tokenizer, max_model_len=1024, max_num_seqs=2, step_time=0.005, num_blocks=128)
    with ServerThread(lambda: engine) as s:
        yield s


def wait_all_free(srv: ServerThread, timeout: float = 2.0) -> int:
    """Wait until no request holds blocks; returns the engine steps that took."""
    engine = srv.engine
    start = srv.call(lambda: engine.steps)
    deadline = time.monotonic() + timeout
    while srv.call(lambda: (engine.free_blocks, len(engine.running), len(engine.waiting))) != (
            engine.num_blocks, 0, 0):
        assert time.monotonic() < deadline, srv.call(engine.get_stats)
        time.sleep(0.001)
    return srv.call(lambda: engine.steps) - start


def test_stream_disconnect_frees_blocks(srv: ServerThread) -> None:
    engine = srv.engine
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "x" * 40, "stream": True, **LONG},
                      headers={"X-Request-ID": "gone-1"}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(10)]
            assert any(line.startswith("data: {") for line in got)
            assert srv.call(lambda: engine.num_blocks - engine.free_blocks) > 0
    steps = wait_all_free(srv)
    assert steps <= 3, f"blocks came back only after {steps} engine steps"
    assert "gone-1" in engine.aborted


def test_openai_client_break_frees_blocks(srv: ServerThread) -> None:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                            stream=True, extra_body={"ignore_eos": True}, max_tokens=400)
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    assert wait_all_free(srv) <= 3


def test_non_streaming_disconnect_frees_blocks(srv: ServerThread) -> None:
    engine = srv.engine
    host, port = srv.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "hello", **LONG}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"X-Request-ID: gone-2\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 5
    while srv.call(lambda: len(engine.running)) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    sock.close()
    assert wait_all_free(srv) <= 3
    assert "gone-2" in engine.aborted


def test_disconnect_while_queued(srv: ServerThread) -> None:
    engine = srv.engine
    with httpx.Client(base_url=srv.url, timeout=10) as c1, httpx.Client(base_url=srv.url, timeout=10) as c2:
        busy = [c1.stream("POST", "/v1/completions", json={"prompt": "a", "stream": True, **LONG}) for _ in range(2)]
        for b in busy:
            b.__enter__()
        host, port = srv.url.removeprefix("http://").split(":")
        body = json.dumps({"prompt": "queued", "stream": True, **LONG}).encode()
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"X-Request-ID: gone-3\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 5
        while srv.call(lambda: len(engine.waiting)) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        sock.close()
        deadline = time.monotonic() + 2
        while srv.call(lambda: len(engine.waiting)) != 0:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        assert "gone-3" in engine.aborted
        for b in busy:
            b.__exit__(None, None, None)
        del c2
    wait_all_free(srv)
