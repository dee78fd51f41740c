"""The HTTP/1.1 fast path with in-memory transports: exact bytes on each side, no sockets."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from gw_helpers import ROOT

from hasten.gateway.app import ClientConnection
from hasten.gateway.config import parse_config
from hasten.gateway.core import Gateway
from hasten.gateway.testing import MemoryTransport
from hasten.gateway.upstream import UpstreamConnection


def _request(rid: str) -> bytes:
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Request-ID: {rid}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode()


def _frame(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _setup(**cfg: object) -> tuple[Gateway, UpstreamConnection, ClientConnection, MemoryTransport]:
    gateway = Gateway(parse_config({"models": [{"name": "m", "backends": [{"url": "http://127.0.0.1:9"}]}],
                                    **cfg}))
    upstream = UpstreamConnection(gateway.proxy._pools["http://127.0.0.1:9"])
    upstream.connection_made(MemoryTransport())
    upstream.pool.release(upstream)
    client = ClientConnection(gateway, set())
    client_tx = MemoryTransport()
    client.connection_made(client_tx)
    return gateway, upstream, client, client_tx


async def test_stream_end_leaves_in_one_write_and_the_connection_is_reused() -> None:
    gateway, upstream, client, client_tx = _setup()
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    for rid in ("r1", "r2"):  # the second request checks that per-response state was reset
        client.data_received(_request(rid))
        sent = b"".join(upstream.transport.out)  # type: ignore[union-attr]
        assert sent.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:9\r\n")
        assert f"x-request-id: {rid}\r\n".encode() in sent
        upstream.transport.out.clear()  # type: ignore[union-attr]
        upstream.data_received(head + _frame(b"data: a\n\n"))
        first = client_tx.out[-1]
        assert first.startswith(b"HTTP/1.1 200 OK\r\n") and first.endswith(_frame(b"data: a\n\n"))
        assert f"x-request-id: {rid}\r\n".encode() in first
        upstream.data_received(_frame(b"data: b\n\n"))
        assert client_tx.out[-1] == _frame(b"data: b\n\n")
        n = len(client_tx.out)
        upstream.data_received(_frame(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        # the last chunk and the terminator: one write, written from the same callback
        assert client_tx.out[n:] == [_frame(b"data: [DONE]\n\n") + b"0\r\n\r\n"]
        client_tx.out.clear()
        assert upstream.pool.idle == 1 and not client._busy
    series = gateway.metrics.pool_series("m")
    assert series.ttft.n == 2 and series.e2e.n == 2 and series.chunk.n == 4
    await gateway.close()


async def test_terminator_alone_is_still_written() -> None:
    gateway, upstream, client, client_tx = _setup()
    client.data_received(_request("r1"))
    upstream.data_received(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                           b"transfer-encoding: chunked\r\n\r\n" + _frame(b"data: a\n\n"))
    upstream.data_received(b"0\r\n\r\n")
    assert client_tx.out[-1] == b"0\r\n\r\n"
    await gateway.close()


async def test_first_byte_deadline_is_enforced_by_the_watchdog() -> None:
    gateway, upstream, client, client_tx = _setup(timeouts={"first_byte_s": 0.2})
    await gateway.proxy.start()
    client.data_received(_request("slow"))
    assert gateway.proxy.awaiting  # sent, waiting for the first byte
    await asyncio.sleep(0.5)  # deadline 0.2 s, checked every 0.025 s; the retry finds no other backend
    for _ in range(20):
        if client_tx.out:
            break
        await asyncio.sleep(0.05)
    assert not gateway.proxy.awaiting
    reply = b"".join(client_tx.out)
    assert reply.startswith(b"HTTP/1.1 50") and b"no response within 0.2s" in reply
    await gateway.close()


def test_hot_path_benchmark_runs() -> None:
    r = subprocess.run([sys.executable, "benchmarks/gateway_hot_path.py", "--requests", "50", "--chunks", "4"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "per-request work" in r.stdout and "each further chunk" in r.stdout
