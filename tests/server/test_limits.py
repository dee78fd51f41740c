"""Request-body limits (413 before the body is read), the --max-request-bytes flag, FastAPI-identical
400s from the routes that read their own bodies, and large bodies handled off the event loop."""

from __future__ import annotations

import gc
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import Response
from starlette.testclient import TestClient

from hasten.server import protocol as P
from hasten.server.app import build_app
from hasten.server.cli import http_limits, parse_args, uvicorn_limits
from hasten.server.errors import install_error_handlers
from hasten.server.limits import MIB, OFFLOAD_BYTES, HTTPLimits, encode_large, read_json_model

from .fake_engine import FakeAsyncLLM
from .harness import ServerThread

LIMIT = 100_000


class LimitedServer(ServerThread):
    """The test harness's server, with `limits` (body limit and the `hasten serve` protocol)."""

    def __init__(self, engine_factory: Callable[[], Any], limits: HTTPLimits) -> None:
        super().__init__(engine_factory)
        self.app = build_app(engine_factory, limits=limits)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                                **uvicorn_limits(limits, "httptools"))
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def small(fake_tokenizer) -> Iterator[LimitedServer]:
    with LimitedServer(lambda: FakeAsyncLLM(fake_tokenizer, max_model_len=512),
                       HTTPLimits(max_request_bytes=LIMIT)) as srv:
        yield srv


def _connect(srv: ServerThread) -> socket.socket:
    host, port = srv.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", "0")):
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _assert_413(status: int, headers: dict[str, str], body: bytes) -> None:
    assert status == 413, body
    err = orjson.loads(body)["error"]
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert str(LIMIT) in err["message"]
    assert headers.get("x-request-id")


def _head(path: str, extra: str) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n{extra}\r\n".encode()


def test_too_large_content_length_answered_before_the_body(small: LimitedServer) -> None:
    with _connect(small) as sock:
        sock.sendall(_head("/v1/completions", "Content-Length: 50000000\r\n"))  # the head only
        _assert_413(*_read_response(sock))
    # any route, and a client waiting for `100 Continue` is told to close
    with _connect(small) as sock:
        sock.sendall(_head("/no/such/path", "Content-Length: 50000000\r\nExpect: 100-continue\r\n"))
        status, headers, body = _read_response(sock)
        _assert_413(status, headers, body)
        assert headers.get("connection") == "close"


def test_chunked_body_over_the_limit_stops_early(small: LimitedServer) -> None:
    total, sent = 16 * MIB, 0
    piece = b"x" * 16384
    with _connect(small) as sock:
        sock.sendall(_head("/v1/chat/completions", "Transfer-Encoding: chunked\r\n"))
        while sent < total:
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            sent += len(piece)
            if select.select([sock], [], [], 0.01)[0]:
                break
        assert sent < total, "the server read the whole over-limit body before answering"
        _assert_413(*_read_response(sock))


def test_bodies_up_to_the_limit_are_served(small: LimitedServer) -> None:
    base = orjson.dumps({"prompt": "hi", "max_tokens": 2, "temperature": 0})
    exact = base + b" " * (LIMIT - len(base))  # JSON may end in whitespace
    with small.client() as c:
        assert c.post("/v1/completions", content=exact, headers={"content-type": "application/json"}
                      ).status_code == 200
        _assert_413_http(c.post("/v1/completions", content=exact + b" ",
                                headers={"content-type": "application/json"}))
        # chunked (no Content-Length) under the limit
        chunks = iter([exact[:40_000], exact[40_000:]])
        r = c.post("/v1/completions", content=chunks, headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def _assert_413_http(r: httpx.Response) -> None:
    _assert_413(r.status_code, dict(r.headers), r.content)


def test_max_request_bytes_flag(fake_tokenizer) -> None:
    assert http_limits(parse_args([])).max_request_bytes == 8 * MIB
    raised = http_limits(parse_args(["--max-request-bytes", str(16 * MIB)]))
    assert raised.max_request_bytes == 16 * MIB
    with pytest.raises(SystemExit):
        http_limits(parse_args(["--max-request-bytes", "0"]))
    # 9 MiB, nearly all of it in a field the server ignores: 413 by default, served with the flag
    body = orjson.dumps({"prompt": "hi", "max_tokens": 1, "user": "u" * (9 * MIB)})
    factory = lambda: FakeAsyncLLM(fake_tokenizer, max_model_len=512)  # noqa: E731
    for limits, status in ((http_limits(parse_args([])), 413), (raised, 200)):
        with LimitedServer(factory, limits) as srv, srv.client() as c:
            r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == status, r.text


# ---- the routes read their own bodies: the same answers as a FastAPI body parameter ------------------

def _twin_apps() -> TestClient:
    """`/typed` declares its body (FastAPI parses it), `/own` reads it with read_json_model."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/typed")
    async def typed(body: P.CompletionRequest) -> Response:
        return Response(body.model_dump_json(), media_type="application/json")

    @app.post("/own")
    async def own(request: Request) -> Response:
        body, _ = await read_json_model(request, P.CompletionRequest)
        return Response(body.model_dump_json(), media_type="application/json")

    return TestClient(app)


BIG = "z" * (2 * OFFLOAD_BYTES)  # makes a body large: parsed in a worker thread
CASES: list[tuple[bytes, str | None]] = [
    (b'{"prompt": "x", "max_tokens": 3}', "application/json"),
    (b'{"prompt": "x"}', "application/json; charset=utf-8"),
    (b'{"prompt": "x"}', "application/vnd.api+json"),
    (b'{"prompt": "x"}', None),
    (b'{"prompt": "x"}', "text/plain"),
    (b"", "application/json"),
    (b"", None),
    (b'{"prompt": ', "application/json"),
    (b'{"prompt": "x"} trailing', "application/json"),
    (b"[1, 2]", "application/json"),
    (b"null", "application/json"),
    (b"{}", "application/json"),
    (b'{"prompt": 5}', "application/json"),
    (b'{"prompt": "x", "temperature": "hot", "top_p": 9}', "application/json"),
    (b'{"prompt": "x", "seed": 99999999999999999999999}', "application/json"),
    (b'{"prompt": "x", "temperature": NaN}', "application/json"),
    (b'{"prompt": "x", "max_tokens": 1e400}', "application/json"),
    (b'{"prompt": "\\ud800"}', "application/json"),
    (b'{"prompt": "\xff"}', "application/json"),
    (b'\xef\xbb\xbf{"prompt": "x"}', "application/json"),
    ('{"prompt": "x"}'.encode("utf-16"), "application/json"),
    (b"[" * 500 + b"]" * 500, "application/json"),
    (b"[" * 100_000 + b"]" * 100_000, "application/json"),
    (orjson.dumps({"prompt": BIG, "max_tokens": "many"}), "application/json"),
    (orjson.dumps({"prompt": BIG, "n": 2}), "application/json"),
    (orjson.dumps({"prompt": BIG})[:-1], "application/json"),
    (orjson.dumps([BIG]), "application/json"),
]


@pytest.mark.parametrize("body,content_type", CASES, ids=[str(i) for i in range(len(CASES))])
def test_same_answers_as_a_fastapi_body_parameter(body: bytes, content_type: str | None) -> None:
    client = _twin_apps()
    headers = {"content-type": content_type} if content_type else {}
    typed = client.post("/typed", content=body, headers=headers)
    own = client.post("/own", content=body, headers=headers)
    assert (own.status_code, own.json()) == (typed.status_code, typed.json())


def test_published_request_bodies_are_fastapis() -> None:
    typed = FastAPI()
    for model in (P.CompletionRequest, P.ChatCompletionRequest, P.TokenizeRequest, P.DetokenizeRequest):
        async def endpoint(body: Any) -> None:
            return None
        endpoint.__annotations__ = {"body": model, "return": None}
        typed.add_api_route(f"/{model.__name__}", endpoint, methods=["POST"])
    reference = typed.openapi()
    served = build_app(lambda: None).openapi()
    for path, model in (("/v1/completions", P.CompletionRequest), ("/v1/chat/completions", P.ChatCompletionRequest),
                        ("/tokenize", P.TokenizeRequest), ("/detokenize", P.DetokenizeRequest)):
        op = served["paths"][path]["post"]
        assert op["requestBody"] == reference["paths"][f"/{model.__name__}"]["post"]["requestBody"]
        assert "413" in op["responses"]
    for name, schema in reference["components"]["schemas"].items():
        if name not in ("HTTPValidationError", "ValidationError"):
            assert served["components"]["schemas"][name] == schema, name


# ---- large bodies off the event loop ------------------------------------------------------------------

def test_large_body_is_handled_off_the_event_loop(server: ServerThread) -> None:
    """A 1.5 MB prompt (1.5 M tokens for this one-token-per-byte tokenizer) takes a while to parse and
    tokenize; /health, asked all the while, must keep answering - it could not if that ran on the event loop."""
    prompt = "ab" * 750_000
    with server.client() as c:  # the large path gives the same answers
        r = c.post("/tokenize", json={"prompt": prompt[:100_000]})
        assert r.status_code == 200 and r.json()["count"] == 100_000
    result: dict[str, Any] = {}

    def post() -> None:
        with server.client() as c:
            t0 = time.perf_counter()
            result["response"] = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            result["seconds"] = time.perf_counter() - t0

    worker = threading.Thread(target=post)
    health: list[float] = []
    gc.collect()
    gc.disable()  # a full collection pauses every thread of this process, the server's included
    try:
        with server.client() as c:
            worker.start()
            while worker.is_alive():
                t0 = time.perf_counter()
                assert c.get("/health").status_code == 200
                health.append(time.perf_counter() - t0)
                time.sleep(0.005)
        worker.join()
    finally:
        gc.enable()
    r = result["response"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    # on the event loop, one /health would wait out (nearly) the whole post
    assert len(health) >= 3, (health, result["seconds"])
    assert max(health) < 0.5 * result["seconds"], (sorted(health)[-5:], result["seconds"])


def test_encode_large_is_encode(fake_tokenizer) -> None:
    texts = ["", "plain text", "héllo wörld ✓ <|im_start|>user<|im_end|>", "x" * 200_000]
    for text in texts:
        for special in (True, False):
            seen: list[int] = []
            assert encode_large(fake_tokenizer, text, special, seen.append) == \
                fake_tokenizer.encode(text, add_special_tokens=special)
            assert seen == [len(fake_tokenizer.encode(text, add_special_tokens=special))]

    def refuse(count: int) -> None:
        raise ValueError(count)

    with pytest.raises(ValueError, match="200000"):
        encode_large(fake_tokenizer, "x" * 200_000, False, refuse)


def test_large_conversation_gives_the_same_prompt_ids(fake_tokenizer) -> None:
    """A large chat body takes the offloaded path (template rendered to text, `encode_large`): the same
    prompt ids as the small path, and a conversation that cannot fit is refused before its ids exist."""
    from hasten.server.chat import chat_prompt
    from hasten.server.protocol import ChatMessage

    engine = FakeAsyncLLM(fake_tokenizer, max_model_len=1 << 20)
    serving = type("S", (), {"engine": engine, "tokenizer": fake_tokenizer, "max_model_len": 1 << 20})()
    msgs = [ChatMessage(role="system", content="be brief"),
            ChatMessage(role="user", content="the quick brown fox " * (OFFLOAD_BYTES // 10))]
    small = chat_prompt(serving, msgs, True)  # type: ignore[arg-type]
    assert chat_prompt(serving, msgs, True, large=True) == small  # type: ignore[arg-type]
    serving.max_model_len = len(small) - 1  # type: ignore[attr-defined]
    with pytest.raises(Exception, match="maximum context length") as info:
        chat_prompt(serving, msgs, True, large=True)  # type: ignore[arg-type]
    assert getattr(info.value, "code", None) == "context_length_exceeded"
