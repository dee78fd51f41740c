"""In-process helpers for gateway tests: scripted backends and a gateway on one event loop.

Everything runs on the test's own asyncio loop over real 127.0.0.1 sockets (no subprocess
start-up), so a test can look at the gateway's state (in-flight counts, poison set) between
requests and can make many requests arrive in the same event-loop turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from hasten.gateway.app import serve
from hasten.gateway.config import parse_config
from hasten.gateway.core import Gateway


@dataclass
class ScriptedBackend:
    """An OpenAI-like backend. Every completion body it receives is kept in ``bodies``.

    ``status``: the answer to every completion request (200, or e.g. 503 / 429 / 400).
    A prompt containing ``poison`` makes it fail the request: ``poison_action`` "500"
    answers HTTP 500 with an OpenAI error body; "drop" closes the connection without a
    byte; "crash" closes every connection it has (a replica process dying).
    Streams send ``tokens`` events, ``interval_s`` apart, after ``ttft_s``.
    """

    name: str
    status: int = 200
    poison: str = "POISON"
    poison_action: str = "500"
    tokens: int = 3
    interval_s: float = 0.0
    ttft_s: float = 0.0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0
    _server: asyncio.AbstractServer | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> ScriptedBackend:
        self._server = await asyncio.start_server(self._conn, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """Close the listening socket and every connection (the process went away)."""
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()
        for t in list(self._tasks):
            t.cancel()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
                n = int(headers.get("content-length", "0"))
                body = await reader.readexactly(n) if n else b""
                if not await self._handle(method, target, body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, asyncio.CancelledError):
            pass  # (cancelled by stop(): ends quietly, start_server's callback would log it otherwise)
        finally:
            self._writers.discard(writer)
            self._tasks.discard(task)
            with contextlib.suppress(Exception):
                writer.close()

    @staticmethod
    def _json(writer: asyncio.StreamWriter, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        writer.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                     % (status, len(data)) + data)

    async def _handle(self, method: str, target: str, body: bytes, writer: asyncio.StreamWriter) -> bool:
        if method == "GET":
            self._json(writer, 200, {"status": "ok"})
            return True
        req = json.loads(body)
        self.bodies.append(req)
        text = json.dumps(req.get("messages") or req.get("prompt"))
        if self.poison and self.poison in text:
            if self.poison_action == "500":
                self._json(writer, 500, {"error": {"message": f"{self.name}: engine error", "type": "server_error",
                                                   "param": None, "code": "engine_error"}})
                return True
            await asyncio.sleep(0.01)  # the replica worked on it for a moment
            if self.poison_action == "crash":  # the process dies: no listener, every connection reset
                if self._server is not None:
                    self._server.close()
                for w in list(self._writers):
                    w.transport.abort()
            writer.transport.abort()
            return False
        if self.status != 200:
            self._json(writer, self.status, {"error": {"message": f"{self.name} says {self.status}",
                                                       "type": "server_error", "param": None, "code": None}})
            return True
        if self.ttft_s:
            await asyncio.sleep(self.ttft_s)
        if not req.get("stream"):
            self._json(writer, 200, {"object": "chat.completion", "backend": self.name,
                                     "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]})
            return True
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(self.tokens):
            event = b'data: {"backend": "%s", "i": %d}\n\n' % (self.name.encode(), i)
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            if self.interval_s:
                await asyncio.sleep(self.interval_s)
        writer.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        return True


class Backends:
    """Starts scripted backends; ``close`` stops them all (the ``scripted`` fixture calls it)."""

    def __init__(self) -> None:
        self.made: list[ScriptedBackend] = []

    async def __call__(self, *names: str, **opts: Any) -> list[ScriptedBackend]:
        made = [await ScriptedBackend(n, **opts).start() for n in names]
        self.made.extend(made)
        return made

    async def close(self) -> None:
        for b in self.made:
            await b.stop()


@contextlib.asynccontextmanager
async def running_gateway(config: dict[str, Any]) -> AsyncIterator[Gateway]:
    """A gateway serving ``config`` on a free port of 127.0.0.1 (``gateway.address``)."""
    cfg = parse_config({"listen": "127.0.0.1:0", "health": {"interval_s": 60.0}, **config})
    gateway = Gateway(cfg)
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.get_running_loop().create_task(serve(gateway, "127.0.0.1", 0, ready, stop))
    await asyncio.wait_for(ready.wait(), 10)
    try:
        yield gateway
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def base_url(gateway: Gateway) -> str:
    assert gateway.address is not None
    return f"http://{gateway.address[0]}:{gateway.address[1]}"


def chat(content: str, model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


async def post(gateway: Gateway, payload: dict[str, Any], key: str | None = None,
               path: str = "/v1/chat/completions") -> httpx.Response:
    """One request on a fresh connection; streams are read to the end."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(base_url=base_url(gateway), timeout=10) as client:
        return await client.post(path, json=payload, headers=headers)


def in_flight(gateway: Gateway) -> dict[str, int]:
    return {b.url: b.in_flight for pool in gateway.pools.values() for b in pool.backends}


async def settle(gateway: Gateway, timeout_s: float = 5.0) -> dict[str, int]:
    """Wait until no backend has a request in flight (or the timeout); returns the counts."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while any(in_flight(gateway).values()) and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return in_flight(gateway)


def served_by(text: str) -> set[str]:
    """The backend names found in an SSE or JSON answer."""
    return set(re.findall(r'"backend": ?"([^"]+)"', text))


async def burst(gateway: Gateway, payloads: list[dict[str, Any]], abort_after_s: float | None = None,
                path: str = "/v1/chat/completions") -> list[bytes]:
    """Send every request at once: one connection each, all opened (and accepted) first, then every
    request written in one event-loop turn, so the gateway reads them all before any of its tasks
    runs. Returns the raw responses (``Connection: close``, read to EOF), or, with
    ``abort_after_s``, resets every connection after that long and returns nothing."""
    assert gateway.address is not None
    conns = [await asyncio.open_connection(*gateway.address) for _ in payloads]
    await asyncio.sleep(0.05)  # let the gateway accept them all
    for (_, writer), payload in zip(conns, payloads, strict=True):
        body = json.dumps(payload).encode()
        writer.write(b"POST %s HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\nconnection: close\r\n"
                     b"content-length: %d\r\n\r\n%s" % (path.encode(), len(body), body))
    if abort_after_s is not None:
        await asyncio.sleep(abort_after_s)
        for _, writer in conns:
            writer.transport.abort()
        return []
    return list(await asyncio.gather(*(reader.read() for reader, _ in conns)))
