"""Optional HTTP/2 frontend: the same gateway as an ASGI app served by hypercorn.

Enabled by ``http2: true`` in the config or ``--http2``. Hypercorn speaks HTTP/1.1 and
cleartext HTTP/2 (prior knowledge and ``Upgrade: h2c``) on one port, so HTTP/2 is used
whenever the client offers it. It is optional because hypercorn's per-request cost is
higher than the raw asyncio HTTP/1.1 frontend's (see docs/gateway.md for measured figures); install ``hypercorn``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from hasten.gateway.core import Gateway
from hasten.gateway.pipeline import GatewayError, GatewayResponse, RequestContext, new_request_id

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class AsgiGateway:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        import time

        received = time.perf_counter()
        headers: dict[str, str] = {}
        for k, v in scope["headers"]:
            name, value = k.decode("latin-1").lower(), v.decode("latin-1")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        rid = headers.get("x-request-id") or new_request_id()
        method, path = scope["method"], scope["path"]
        g = self.gateway
        if method == "GET" and path == "/health":
            status, payload = g.health_payload()
            resp = GatewayResponse.json(status, payload)
        elif method == "GET" and path == "/v1/models":
            resp = GatewayResponse.json(200, g.models_payload())
        elif method == "GET" and path == "/metrics":
            resp = GatewayResponse(200, {"content-type": "text/plain; charset=utf-8"},
                                   body=g.metrics.render().encode())
        elif method == "POST" and path.startswith("/v1/"):
            body = await self._read_body(receive, g.config.max_body_bytes)
            if body is None:
                resp = GatewayResponse.from_error(GatewayError(413, "request body too large",
                                                               code="request_too_large"))
            else:
                qs = scope.get("query_string", b"").decode("latin-1")
                ctx = RequestContext(method=method, path=path + (f"?{qs}" if qs else ""), headers=headers,
                                     body=body, request_id=rid, received_at=received,
                                     client=(scope.get("client") or [None])[0])
                resp = await g.handle(ctx)
        else:
            resp = GatewayResponse.from_error(GatewayError(404, f"no route for {method} {path}",
                                                           code="not_found"))
        resp.headers.setdefault("x-request-id", rid)
        await self._send(resp, send)

    @staticmethod
    async def _read_body(receive: Receive, limit: int) -> bytes | None:
        parts: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            parts.append(chunk)
            if not msg.get("more_body"):
                return b"".join(parts)

    @staticmethod
    async def _send(resp: GatewayResponse, send: Send) -> None:
        raw_headers = [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in resp.headers.items()]
        if resp.stream is None:
            raw_headers.append((b"content-length", str(len(resp.body)).encode()))
        await send({"type": "http.response.start", "status": resp.status, "headers": raw_headers})
        if resp.stream is None:
            await send({"type": "http.response.body", "body": resp.body})
            return
        stream = resp.stream
        try:
            async for chunk in stream:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await self.gateway.start()
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.gateway.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def serve_http2(gateway: Gateway, host: str, port: int, stop: asyncio.Event) -> None:
    try:
        from hypercorn.asyncio import serve
        from hypercorn.config import Config
    except ImportError as exc:
        raise SystemExit("http2 needs the 'hypercorn' package: pip install hypercorn") from exc
    import socket

    # bind ourselves so that port 0 works and the real address can be printed
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    bound = sock.getsockname()
    gateway.address = (bound[0], bound[1])
    cfg = Config()
    cfg.bind = [f"fd://{sock.fileno()}"]
    cfg.accesslog = None
    cfg.errorlog = None
    cfg.keep_alive_timeout = 75
    print(f"hasten gateway listening on http://{bound[0]}:{bound[1]} (HTTP/1.1 + h2c, "
          f"{len(gateway.pools)} model pool(s))", flush=True)
    try:
        await serve(AsgiGateway(gateway), cfg, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
    finally:
        sock.close()
