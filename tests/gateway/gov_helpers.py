"""Helpers for the governance tests: an in-process gateway over in-process fake backends,
a tiny async HTTP client, and a real redis-server on a free loopback port."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hasten.gateway.app import serve
from hasten.gateway.config import parse_config
from hasten.gateway.core import Gateway
from hasten.gateway.pipeline import Middleware
from hasten.gateway.testing import FakeBackend, FakeBackendOptions


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes  # de-chunked

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def events(self) -> list[str]:
        return [ln[6:] for ln in self.body.decode().split("\n") if ln.startswith("data: ")]


def _dechunk(data: bytes) -> bytes:
    out, pos = [], 0
    while True:
        end = data.index(b"\r\n", pos)
        n = int(data[pos:end], 16)
        if n == 0:
            return b"".join(out)
        out.append(data[end + 2:end + 2 + n])
        pos = end + 2 + n + 2


async def post(port: int, payload: dict[str, Any], key: str | None = None, headers: dict[str, str] | None = None,
               path: str = "/v1/chat/completions", timeout: float = 20.0) -> Reply:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        body = json.dumps(payload).encode()
        h = dict(headers or {})
        if key:
            h["authorization"] = f"Bearer {key}"
        extra = "".join(f"{k}: {v}\r\n" for k, v in h.items())
        writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}"
                     f"Connection: close\r\n\r\n".encode() + body)
        data = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    if hdrs.get("transfer-encoding") == "chunked":
        rest = _dechunk(rest)
    return Reply(int(lines[0][9:12]), hdrs, rest)


async def get(port: int, path: str) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return data.partition(b"\r\n\r\n")[2].decode()


@dataclass
class Env:
    gateway: Gateway
    port: int
    backends: dict[str, FakeBackend] = field(default_factory=dict)


@asynccontextmanager
async def gateway_env(config: dict[str, Any], backends: dict[str, FakeBackendOptions],
                      middlewares: list[Middleware] | None = None) -> AsyncIterator[Env]:
    """``config['models'][i]['backends']`` may name fake backends as ``"@name"``."""
    servers, fakes, ports = [], {}, {}
    for name, opts in backends.items():
        fb = FakeBackend(opts)
        srv = await fb.serve("127.0.0.1", 0)
        servers.append(srv)
        fakes[name] = fb
        ports[name] = srv.sockets[0].getsockname()[1]
    cfg = json.loads(json.dumps(config))
    for m in cfg["models"]:
        m["backends"] = [{"url": f"http://127.0.0.1:{ports[b[1:]]}"} if isinstance(b, str) else b
                         for b in m["backends"]]
    gw = Gateway(parse_config({"listen": "127.0.0.1:0", **cfg}), middlewares=middlewares)
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(serve(gw, "127.0.0.1", 0, ready, stop))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        assert gw.address is not None
        yield Env(gw, gw.address[1], fakes)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        for s in servers:
            s.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def start_redis(tmp: Path) -> RedisServer:
    binary = shutil.which("redis-server")
    assert binary is not None
    for _ in range(3):
        port = free_port()
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", str(tmp), "--protected-mode", "yes"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return RedisServer(proc, port)
            except OSError:
                time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    raise RuntimeError("redis-server did not start")
