"""Minimal raw-socket streaming clients: the yardstick for the bench client's own overhead.

They do as little as possible: one keep-alive socket per stream, one `perf_counter()` per
read, no HTTP or SSE parsing; afterwards `"text"` fields are counted per read. They only
understand the fake server's completions stream (one token per SSE event, events not split
across reads on loopback, chunked body ending in `0\\r\\n\\r\\n`): measuring sticks, not clients.

mode="protocol" (the reference): an `asyncio.Protocol` whose `data_received` stamps and stores
each read - the least work asyncio allows between the socket and the timestamp.
mode="sock_recv": a coroutine looping on `loop.sock_recv` - simpler, but every read costs a
future, a task wake-up and epoll (un)registration, which shows up as latency.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass


@dataclass
class RawTiming:
    start: float
    token_times: list[float]

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


def _request_bytes(host: str, port: int, max_tokens: int, prompt: str) -> bytes:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


class _RecvStream:
    """mode="sock_recv": a coroutine looping on `loop.sock_recv`."""

    def __init__(self, host: str, port: int) -> None:
        self.addr = (host, port)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)

    async def connect(self) -> None:
        await asyncio.get_running_loop().sock_connect(self.sock, self.addr)

    async def request(self, raw: bytes) -> RawTiming:
        loop = asyncio.get_running_loop()
        reads: list[tuple[float, bytes]] = []
        start = time.perf_counter()
        await loop.sock_sendall(self.sock, raw)
        while True:
            data = await loop.sock_recv(self.sock, 65536)
            reads.append((time.perf_counter(), data))
            if not data or data.endswith(b"0\r\n\r\n"):
                break
        return RawTiming(start, [t for t, d in reads for _ in range(d.count(b'"text"'))])

    def close(self) -> None:
        self.sock.close()


class _Reader(asyncio.Protocol):
    def __init__(self) -> None:
        self.reads: list[tuple[float, bytes]] = []
        self.done: asyncio.Future[None] | None = None

    def data_received(self, data: bytes) -> None:
        self.reads.append((time.perf_counter(), data))
        if data.endswith(b"0\r\n\r\n") and self.done is not None and not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)


class _ProtocolStream:
    """mode="protocol": `data_received` stamps and stores each read, nothing else."""

    def __init__(self, host: str, port: int) -> None:
        self.addr = (host, port)
        self.transport: asyncio.Transport | None = None
        self.reader = _Reader()

    async def connect(self) -> None:
        transport, _ = await asyncio.get_running_loop().create_connection(lambda: self.reader, *self.addr)
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    async def request(self, raw: bytes) -> RawTiming:
        assert self.transport is not None
        reader = self.reader
        reader.reads = []
        reader.done = asyncio.get_running_loop().create_future()
        start = time.perf_counter()
        self.transport.write(raw)
        await reader.done
        return RawTiming(start, [t for t, d in reader.reads for _ in range(d.count(b'"text"'))])

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def run_raw(host: str, port: int, streams: int, requests_per_stream: int, max_tokens: int,
                  prompt: str = "hello world", mode: str = "protocol", warmup: int = 1,
                  ramp_up: float = 0.0) -> list[RawTiming]:
    """`streams` keep-alive connections; each sends `warmup` unmeasured requests, waits for all
    streams to get there, then (stream k after `ramp_up * k / streams` s) sends
    `requests_per_stream` measured requests back to back."""
    kinds = {"protocol": _ProtocolStream, "sock_recv": _RecvStream}
    if mode not in kinds:
        raise ValueError(f"unknown mode {mode!r}")
    raw = _request_bytes(host, port, max_tokens, prompt)
    barrier = asyncio.Barrier(streams)

    async def worker(k: int) -> list[RawTiming]:
        stream = kinds[mode](host, port)
        try:
            await stream.connect()
            for _ in range(warmup):
                await stream.request(raw)
            await barrier.wait()
            if ramp_up > 0:
                await asyncio.sleep(ramp_up * k / streams)
            return [await stream.request(raw) for _ in range(requests_per_stream)]
        finally:
            stream.close()

    per_worker = await asyncio.gather(*(worker(k) for k in range(streams)))
    return [t for timings in per_worker for t in timings if t.token_times]
