"""In-memory harness for the gateway's HTTP/1.1 handling: the real ClientConnection, proxy,
relay and UpstreamConnection, with MemoryTransports instead of sockets.

``Harness.send`` feeds client bytes (in the given pieces) and answers every request that
reaches the backend with ``reply``, so that the next pipelined request can use the pooled
connection again. Everything the gateway wrote on each side is kept for the assertions.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable
from typing import Any

from hasten.gateway.app import ClientConnection
from hasten.gateway.config import parse_config
from hasten.gateway.core import Gateway
from hasten.gateway.testing import MemoryTransport
from hasten.gateway.upstream import UpstreamConnection

OK_REPLY = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}'
BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'

# a header line the gateway may write: a token, ": ", then no CTL but HTAB
HEADER_LINE = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+: [^\x00-\x08\x0a-\x1f\x7f]*")
STATUS = re.compile(rb"HTTP/1\.1 (\d{3}) ")


def post(headers: bytes = b"", body: bytes = BODY, target: bytes = b"/v1/chat/completions",
         length: bool = True) -> bytes:
    """A completion request; ``headers``: extra header lines, each ending in CRLF."""
    cl = b"Content-Length: %d\r\n" % len(body) if length else b""
    return b"POST " + target + b" HTTP/1.1\r\nHost: gw\r\n" + cl + headers + b"\r\n" + body


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def split_heads(wire: bytes) -> list[list[bytes]]:
    """The header lines of every request head in ``wire`` (what the gateway sent upstream)."""
    heads = []
    for part in wire.split(b"\r\n\r\n")[:-1]:
        lines = part.split(b"\r\n")
        start = next((i for i, line in enumerate(lines) if line.startswith((b"POST ", b"GET ", b"HTTP/1.1 "))),
                     None)
        if start is not None:
            heads.append(lines[start + 1:])
    return heads


def well_formed_head(head: bytes) -> bool:
    """Every line of a head (without its blank line) a status/request line or a safe header line."""
    lines = head.split(b"\r\n")
    return all(HEADER_LINE.fullmatch(line) for line in lines[1:]) and b"\n" not in lines[0] \
        and b"\r" not in lines[0] and b"\0" not in lines[0]


class Harness:
    def __init__(self, **cfg: Any) -> None:
        config = {"models": [{"name": "m", "backends": [{"url": "http://127.0.0.1:9"}]}], **cfg}
        self.gateway = Gateway(parse_config(config))
        self.pool = self.gateway.proxy._pools["http://127.0.0.1:9"]
        self.upstream = UpstreamConnection(self.pool)
        self.upstream_tx = MemoryTransport()
        self.upstream.connection_made(self.upstream_tx)
        self.pool.release(self.upstream)
        self.client = ClientConnection(self.gateway, set())
        self.client_tx = MemoryTransport()
        self.client.connection_made(self.client_tx)
        self.forwarded: list[bytes] = []  # one entry per request written upstream

    @property
    def out(self) -> bytes:
        return b"".join(self.client_tx.out)

    @property
    def statuses(self) -> list[int]:
        return [int(s) for s in STATUS.findall(self.out)]

    @property
    def closed(self) -> bool:
        return self.client_tx.closing

    async def send(self, data: bytes, pieces: Iterable[int] | None = None, reply: bytes = OK_REPLY) -> None:
        """Feed ``data`` (cut at the given piece sizes, else at once), answering upstream requests."""
        pos = 0
        for size in pieces or [len(data)]:
            if pos >= len(data):
                break
            self.client.data_received(data[pos:pos + size])
            pos += size
            await self.settle(reply)
        if pos < len(data):
            self.client.data_received(data[pos:])
            await self.settle(reply)

    async def settle(self, reply: bytes = OK_REPLY) -> None:
        """Answer what reached the backend and let the loop run what the gateway scheduled."""
        idle = 0
        for _ in range(2000):
            if self.upstream_tx.out:
                self.forwarded.append(b"".join(self.upstream_tx.out))
                self.upstream_tx.out.clear()
                self.upstream.data_received(reply)
                idle = 0
            busy = asyncio.all_tasks() - {asyncio.current_task()}
            await asyncio.sleep(0.001 if busy else 0)
            idle += not busy
            if idle > 3:
                return

    async def close(self) -> None:
        await self.gateway.close()


def read_responses(out: bytes) -> list[tuple[int, bytes, bytes]]:
    """Walk what the gateway wrote to a client: ``(status, head, body)`` per response. Strict on
    purpose (independent of the gateway's parser): a malformed head or framing fails the test."""
    responses = []
    pos = 0
    while pos < len(out):
        end = out.find(b"\r\n\r\n", pos)
        assert end > 0, f"incomplete head at {pos}: {out[pos:pos + 80]!r}"
        head = out[pos:end]
        assert re.fullmatch(rb"HTTP/1\.1 \d{3} [A-Za-z -]+", head.split(b"\r\n", 1)[0]), head[:80]
        assert well_formed_head(head), head
        status = int(head[9:12])
        fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
        pos = end + 4
        if status < 200:
            body = b""
        elif fields.get(b"transfer-encoding") == b"chunked":
            parts = []
            while True:
                eol = out.find(b"\r\n", pos)
                assert eol > 0 and re.fullmatch(rb"[0-9a-f]+", out[pos:eol]), out[pos:pos + 20]
                size = int(out[pos:eol], 16)
                if not size:
                    assert out[eol:eol + 4] == b"\r\n\r\n"
                    pos = eol + 4
                    break
                parts.append(out[eol + 2:eol + 2 + size])
                assert out[eol + 2 + size:eol + 4 + size] == b"\r\n"
                pos = eol + 4 + size
            body = b"".join(parts)
        else:
            n = int(fields[b"content-length"])
            body = out[pos:pos + n]
            assert len(body) == n
            pos += n
        responses.append((status, head, body))
    return responses
