"""Gateway CPU per request and per streamed chunk on the HTTP/1.1 fast path, without sockets.

    python benchmarks/gateway_hot_path.py                  # 3000 streams of 32 chunks
    python benchmarks/gateway_hot_path.py --requests 500 --chunks 8 --profile

The real frontend (`ClientConnection`), proxy, relay and upstream client run in one event
loop with in-memory transports: a request is fed to the client connection, the upstream
answer (head + first chunk, then chunks, then the end) is fed to the pooled upstream
connection. Each phase is timed separately, so the figures are the gateway's own Python
work (no kernel, no other process). Why it matters on a small machine: streams that
finish in the same engine step come back as a burst of new requests, which the gateway
handles one after the other, so the per-request cost is multiplied by the burst size in
the last request's TTFT (see docs/benchmarks.md, gateway overhead).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hasten.gateway.app import ClientConnection  # noqa: E402
from hasten.gateway.config import parse_config  # noqa: E402
from hasten.gateway.core import Gateway  # noqa: E402
from hasten.gateway.testing import MemoryTransport  # noqa: E402
from hasten.gateway.upstream import UpstreamConnection  # noqa: E402


def sse_chunk(i: int) -> bytes:
    event = (b'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","model":"bench","choices":[{"index":0,'
             b'"delta":{"content":"t%d "},"finish_reason":null}]}\n\n' % i)
    return b"%x\r\n%s\r\n" % (len(event), event)


HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
        b"transfer-encoding: chunked\r\nx-request-id: abc\r\n\r\n")
END = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"


async def run(requests: int, chunks: int) -> dict[str, list[float]]:
    cfg = parse_config({"listen": "127.0.0.1:0", "models": [
        {"name": "bench", "policy": "round_robin", "backends": [{"url": "http://127.0.0.1:9"}]}]})
    gateway = Gateway(cfg)
    pool = gateway.proxy._pools["http://127.0.0.1:9"]
    upstream = UpstreamConnection(pool)
    upstream.connection_made(MemoryTransport())
    client = ClientConnection(gateway, set())
    client_tx = MemoryTransport()
    client.connection_made(client_tx)
    body = json.dumps({"model": "bench", "stream": True, "messages": [{"role": "user", "content": "hello"}]})
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n{body}").encode()
    first = HEAD + sse_chunk(0)
    body_chunks = [sse_chunk(i) for i in range(1, chunks)]
    phases: dict[str, list[float]] = {"request": [], "first_chunk": [], "chunk": [], "end": []}
    clock = time.perf_counter_ns
    pool.release(upstream)  # the gateway puts it back at the end of every stream
    for _ in range(requests):
        t0 = clock()
        client.data_received(request)  # parse, route, send upstream (fast path)
        t1 = clock()
        if not upstream.transport.out:  # type: ignore[union-attr]
            raise RuntimeError("the request did not take the fast path to the pooled connection")
        upstream.data_received(first)  # response head + first chunk: relay ready, client head written
        t2 = clock()
        for c in body_chunks:
            upstream.data_received(c)
        t3 = clock()
        upstream.data_received(END)
        if not client_tx.out or not client_tx.out[-1].endswith(b"0\r\n\r\n"):
            await asyncio.sleep(0)  # a done callback scheduled on the loop writes the terminator
        t4 = clock()
        if not client_tx.out or not client_tx.out[-1].endswith(b"0\r\n\r\n"):
            raise RuntimeError("the stream did not end on the client side")
        phases["request"].append((t1 - t0) / 1e3)
        phases["first_chunk"].append((t2 - t1) / 1e3)
        phases["chunk"].append((t3 - t2) / 1e3 / max(1, len(body_chunks)))
        phases["end"].append((t4 - t3) / 1e3)
        upstream.transport.out.clear()  # type: ignore[union-attr]
        client_tx.out.clear()
    await gateway.close()
    return phases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--chunks", type=int, default=32, help="SSE chunks per stream (incl. the first)")
    p.add_argument("--profile", action="store_true", help="print a cProfile of the run instead")
    args = p.parse_args()
    try:  # the gateway's default event loop
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    asyncio.run(run(200, args.chunks))  # warm up
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        asyncio.run(run(args.requests, args.chunks))
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    phases = asyncio.run(run(args.requests, args.chunks))
    print(f"gateway hot path, {args.requests} streams x {args.chunks} chunks, in-process (microseconds, "
          f"median / p90 over streams)")
    for name, label in (("request", "request in -> upstream request written"),
                        ("first_chunk", "response head + first chunk -> client head + chunk written"),
                        ("chunk", "each further chunk"), ("end", "last chunk + end of stream")):
        v = sorted(phases[name])
        print(f"  {label:<62} {statistics.median(v):7.2f} / {v[int(len(v) * 0.9)]:7.2f}")
    per_request = statistics.median([a + b + e for a, b, e in zip(phases["request"], phases["first_chunk"],
                                                                  phases["end"], strict=True)])
    print(f"  per-request work (request + first chunk + end)                  {per_request:7.2f}")


if __name__ == "__main__":
    main()
