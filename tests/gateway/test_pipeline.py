"""The middleware hook, in-process: short-circuit, annotate, and wrap a stream (pull-mode path)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from hasten.gateway.app import serve
from hasten.gateway.config import parse_config
from hasten.gateway.core import Gateway
from hasten.gateway.pipeline import GatewayError, GatewayResponse, Handler, RequestContext
from hasten.gateway.testing import FakeBackend, FakeBackendOptions


async def _post(port: int, payload: dict[str, Any], headers: dict[str, str]) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps(payload).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}"
                 f"Connection: close\r\n\r\n".encode() + body)
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return int(data[9:12]), data


def test_middlewares_short_circuit_annotate_and_wrap_streams() -> None:
    seen: list[str] = []

    async def block(ctx: RequestContext, call_next: Handler) -> GatewayResponse:
        if ctx.header("X-Block"):
            raise GatewayError(429, "rate limited", "rate_limit_error", "rate_limited")
        ctx.attrs["priority"] = int(ctx.header("x-priority") or 0)
        return await call_next(ctx)

    async def count_chunks(ctx: RequestContext, call_next: Handler) -> GatewayResponse:
        seen.append(f"{ctx.model}:{ctx.attrs['priority']}")
        resp = await call_next(ctx)
        if resp.stream is None:
            return resp
        inner = resp.stream

        async def wrapped() -> AsyncIterator[bytes]:
            n = 0
            try:
                async for chunk in inner:
                    n += chunk.count(b"data: ")
                    yield chunk
            finally:
                await inner.aclose()  # type: ignore[attr-defined]
                seen.append(f"events:{n}")

        resp.stream = wrapped()
        return resp

    async def run() -> None:
        backend = FakeBackend(FakeBackendOptions(name="b", tokens=3, interval_ms=5))
        server = await backend.serve("127.0.0.1", 0)
        bport = server.sockets[0].getsockname()[1]
        cfg = parse_config({"listen": "127.0.0.1:0",
                            "models": [{"name": "m", "backends": [{"url": f"http://127.0.0.1:{bport}"}]}]})
        gateway = Gateway(cfg, middlewares=[block, count_chunks])
        ready, stop = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(serve(gateway, "127.0.0.1", 0, ready, stop))
        try:
            await asyncio.wait_for(ready.wait(), 10)
            assert gateway.address is not None
            port = gateway.address[1]
            status, data = await _post(port, {"model": "m"}, {"X-Block": "1"})
            assert status == 429 and b'"rate_limited"' in data
            status, data = await _post(port, {"model": "m", "stream": True}, {"X-Priority": "7"})
            assert status == 200 and data.count(b"data: ") == 4 and data.endswith(b"0\r\n\r\n")
            await asyncio.sleep(0.05)
            assert seen == ["m:7", "events:4"]
            assert all(b.in_flight == 0 for b in gateway.pools["m"].backends)
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
            server.close()

    asyncio.run(run())



def test_a_large_body_is_kept_as_bytes_and_parsed_again_on_use() -> None:
    from hasten.gateway.pipeline import LARGE_BODY_BYTES

    small = {"model": "m", "prompt": "hi"}
    ctx = RequestContext(method="POST", path="/v1/completions", headers={}, body=json.dumps(small).encode(),
                         request_id="r")
    ctx.keep_payload(small)
    assert ctx.payload is small  # held as parsed
    big = {"model": "m", "prompt": "x" * LARGE_BODY_BYTES}
    ctx = RequestContext(method="POST", path="/v1/completions", headers={}, body=json.dumps(big).encode(),
                         request_id="r")
    ctx.keep_payload(big)
    first, second = ctx.payload, ctx.payload
    assert first == second == big and first is not second and first is not big  # parsed per use, not held
    ctx.payload = {"model": "other"}  # a stage that sets the payload holds it again
    assert ctx.payload == {"model": "other"}
