"""An OpenAI-compatible streaming server with known timings, for tests and benchmarks.

Serves POST /v1/completions and /v1/chat/completions (streaming SSE or not), GET /health and
GET /v1/models. The first token leaves `ttft_ms` after the request got a slot, then one
token every `itl_ms`, on an absolute schedule (no drift). The number of tokens is the
request's `max_tokens` (capped by `max_output_len`), else `output_len`. With
`stream_options.include_usage` the last chunk carries `usage`. Chat streams start with a
role-only chunk (no content), as OpenAI and vLLM do.

Run it: python -m hasten.bench.fake_server --port 8000 --ttft-ms 50 --itl-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FakeServerConfig:
    ttft_ms: float = 50.0
    itl_ms: float = 20.0
    output_len: int = 16  # tokens when the request gives no max_tokens
    max_output_len: int = 4096
    max_concurrency: int = 0  # slots; 0 = unlimited. Queued requests wait (TTFT grows)
    fail_every: int = 0  # every Nth completion request gets HTTP 503 (0 = never)
    fail_status: int = 503
    chunk_tokens: int = 1  # tokens per SSE chunk
    model: str = "fake-model"
    strict_model: bool = False  # a request naming another model gets 404, as from `hasten serve`
    record: bool = False  # keep per-request send times in `FakeServer.log`


@dataclass
class StreamLog:
    """What the server actually did for one request (when `record=True`)."""

    received: float
    prompt: str = ""  # the prompt, or the messages as JSON
    slot: float = 0.0
    sends: list[float] = field(default_factory=list)
    tokens: int = 0


def _chunk(payload: bytes) -> bytes:
    return f"{len(payload):x}\r\n".encode() + payload + b"\r\n"


def _count_prompt_tokens(req: dict[str, Any]) -> int:
    """Whitespace-separated words in the prompt or the messages' contents."""
    if "messages" in req:
        return sum(len(str(m.get("content", "")).split()) for m in req.get("messages") or [])
    prompt = req.get("prompt", "")
    if isinstance(prompt, list):
        prompt = " ".join(str(p) for p in prompt)
    return len(str(prompt).split())


class _Stream:
    """One in-progress streaming response, driven by `loop.call_at` (no coroutine per token)."""

    def __init__(self, conn: _FakeConnection, req: dict[str, Any], chat: bool, n_tokens: int,
                 log: StreamLog | None) -> None:
        self.conn, self.req, self.chat, self.n, self.log = conn, req, chat, n_tokens, log
        self.sent = 0
        self.first_at = 0.0
        self.id = f"cmpl-{id(self):x}"
        self.created = int(time.time())

    def _obj(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.conn.server.config.model, "choices": choices}

    def start(self) -> None:
        cfg = self.conn.server.config
        loop = self.conn.server.loop
        if self.log is not None:
            self.log.slot = time.perf_counter()
        if self.chat:  # role-only first chunk: must not count as the first token
            role = self._obj([{"index": 0, "delta": {"role": "assistant", "content": ""},
                               "finish_reason": None}])
            self.conn.write(_chunk(b"data: " + json.dumps(role).encode() + b"\n\n"))
        self.first_at = loop.time() + cfg.ttft_ms / 1000.0
        loop.call_at(self.first_at, self.emit)

    def emit(self) -> None:
        server = self.conn.server
        cfg = server.config
        if self.conn.closed:
            server.release()
            return
        k = min(max(1, cfg.chunk_tokens), self.n - self.sent)
        text = "".join(f" t{self.sent + j}" for j in range(k))
        self.sent += k
        last = self.sent >= self.n
        finish = "length" if last else None
        choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if self.chat
                  else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
        out = [b"data: " + json.dumps(self._obj([choice])).encode() + b"\n\n"]
        if last:
            if (self.req.get("stream_options") or {}).get("include_usage"):
                p = _count_prompt_tokens(self.req)
                usage = self._obj([])
                usage["usage"] = {"prompt_tokens": p, "completion_tokens": self.n, "total_tokens": p + self.n}
                out.append(b"data: " + json.dumps(usage).encode() + b"\n\n")
            out.append(b"data: [DONE]\n\n")
        payload = b"".join(_chunk(o) for o in out)
        if last:
            payload += b"0\r\n\r\n"
        self.conn.write(payload)
        if self.log is not None:
            self.log.sends.append(time.perf_counter())
            self.log.tokens = self.sent
        if last:
            server.release()
            self.conn.response_done()
        else:
            steps = -(-self.sent // max(1, cfg.chunk_tokens))
            server.loop.call_at(self.first_at + steps * cfg.itl_ms / 1000.0, self.emit)


class _FakeConnection(asyncio.Protocol):
    def __init__(self, server: FakeServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.busy = False
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next_request()

    def response_done(self) -> None:
        self.busy = False
        if self.buf:
            self._next_request()

    def _next_request(self) -> None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].decode("latin-1").split("\r\n")
        headers = {}
        for line in head[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        length = int(headers.get("content-length", "0") or 0)
        if len(self.buf) < end + 4 + length:
            return
        body = self.buf[end + 4:end + 4 + length]
        self.buf = self.buf[end + 4 + length:]
        method, path = (head[0].split(" ") + ["", ""])[:2]
        self.busy = True
        self.server.handle(self, method, path.split("?")[0], body)

    def send_json(self, status: int, obj: Any) -> None:
        body = json.dumps(obj).encode()
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(status, "Error")
        self.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        self.response_done()

    def send_stream_head(self) -> None:
        self.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n")


class FakeServer:
    """The server object; `start()` inside a running loop, or use `serve_in_thread()`."""

    def __init__(self, config: FakeServerConfig | None = None) -> None:
        self.config = config or FakeServerConfig()
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self.port = 0
        self.requests = 0
        self.active = 0
        self.max_active = 0
        self.log: list[StreamLog] = []
        self._waiting: deque[Callable[[], None]] = deque()
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(lambda: _FakeConnection(self), host, port,
                                                     reuse_address=True, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    def release(self) -> None:
        self.active -= 1
        if self._waiting:
            self._acquire(self._waiting.popleft())

    def _acquire(self, start: Callable[[], None]) -> None:
        limit = self.config.max_concurrency
        if limit and self.active >= limit:
            self._waiting.append(start)
            return
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        start()

    def handle(self, conn: _FakeConnection, method: str, path: str, body: bytes) -> None:
        if method == "GET" and path in ("/health", "/healthz"):
            return conn.send_json(200, {"status": "ok"})
        if method == "GET" and path == "/v1/models":
            return conn.send_json(200, {"object": "list", "data": [{"id": self.config.model, "object": "model"}]})
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            return conn.send_json(404, {"error": {"message": f"no route {method} {path}", "type": "not_found"}})
        try:
            req = json.loads(body or b"{}")
        except json.JSONDecodeError:
            return conn.send_json(400, {"error": {"message": "bad JSON", "type": "invalid_request_error"}})
        self.requests += 1
        cfg = self.config
        if cfg.strict_model and req.get("model") not in (None, cfg.model):
            return conn.send_json(404, {"error": {"message": f"The model `{req.get('model')}` does not exist.",
                                                  "type": "not_found_error", "param": "model",
                                                  "code": "model_not_found"}})
        if cfg.fail_every and self.requests % cfg.fail_every == 0:
            return conn.send_json(cfg.fail_status, {"error": {"message": "injected failure", "type": "overloaded"}})
        chat = path.endswith("chat/completions")
        max_tokens = req.get("max_tokens") or req.get("max_completion_tokens") or cfg.output_len
        n = max(1, min(int(max_tokens), cfg.max_output_len))
        log = None
        if cfg.record:
            prompt = json.dumps(req["messages"]) if "messages" in req else str(req.get("prompt", ""))
            log = StreamLog(received=time.perf_counter(), prompt=prompt)
        if log is not None:
            self.log.append(log)
        if req.get("stream"):
            conn.send_stream_head()
            stream = _Stream(conn, req, chat, n, log)
            self._acquire(stream.start)
        else:
            self._acquire(lambda: self._complete_later(conn, req, chat, n))

    def _complete_later(self, conn: _FakeConnection, req: dict[str, Any], chat: bool, n: int) -> None:
        cfg = self.config
        delay = (cfg.ttft_ms + (n - 1) * cfg.itl_ms) / 1000.0

        def finish() -> None:
            self.release()
            text = "".join(f" t{i}" for i in range(n))
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "finish_reason": "length"})
            p = _count_prompt_tokens(req)
            conn.send_json(200, {"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion",
                                 "created": int(time.time()), "model": cfg.model, "choices": [choice],
                                 "usage": {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}})

        self.loop.call_later(delay, finish)


class ServerThread:
    """Run a `FakeServer` on its own event loop in a daemon thread (for synchronous tests).

    with ServerThread(FakeServerConfig(ttft_ms=10)) as srv: ... srv.base_url ...
    """

    def __init__(self, config: FakeServerConfig | None = None, port: int = 0) -> None:
        self.server = FakeServer(config)
        self._port = port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="fake-sse-server")

    def __enter__(self) -> FakeServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(port=self._port), self._loop).result(10)
        return self.server

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hasten.bench.fake_server", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    ap.add_argument("--ttft-ms", type=float, default=50.0)
    ap.add_argument("--itl-ms", type=float, default=20.0)
    ap.add_argument("--output-len", type=int, default=16, help="tokens when a request has no max_tokens")
    ap.add_argument("--max-output-len", type=int, default=4096)
    ap.add_argument("--max-concurrency", type=int, default=0, help="server slots (0 = unlimited)")
    ap.add_argument("--fail-every", type=int, default=0, help="every Nth request gets HTTP 503")
    ap.add_argument("--chunk-tokens", type=int, default=1)
    ap.add_argument("--model", default="fake-model")
    ap.add_argument("--strict-model", action="store_true", help="404 for requests naming another model")
    ap.add_argument("--max-seconds", type=float, default=0.0, help="exit after this long (0 = never)")
    args = ap.parse_args(argv)
    cfg = FakeServerConfig(ttft_ms=args.ttft_ms, itl_ms=args.itl_ms, output_len=args.output_len,
                           max_output_len=args.max_output_len, max_concurrency=args.max_concurrency,
                           fail_every=args.fail_every, chunk_tokens=args.chunk_tokens, model=args.model,
                           strict_model=args.strict_model)

    async def serve() -> None:
        server = FakeServer(cfg)
        port = await server.start(args.host, args.port)
        print(f"fake SSE server listening on http://{args.host}:{port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if args.max_seconds > 0:
            loop.call_later(args.max_seconds, stop.set)
        await stop.wait()
        await server.stop()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
