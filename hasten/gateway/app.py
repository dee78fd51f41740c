"""HTTP/1.1 frontend on aiohttp (the default, lowest-latency transport).

Streams are written chunk by chunk with ``StreamResponse.write``: each upstream chunk is
handed to the socket as soon as it arrives (TCP_NODELAY is on), never buffered.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from hasten.gateway.core import Gateway
from hasten.gateway.pipeline import GatewayResponse, RequestContext, error_body, new_request_id

log = logging.getLogger("hasten.gateway")

_GATEWAY_KEY = web.AppKey("gateway", Gateway)


def _json_error(status: int, message: str, type_: str, code: str, rid: str | None = None) -> web.Response:
    headers = {"X-Request-ID": rid} if rid else None
    return web.Response(status=status, body=error_body(message, type_, code), content_type="application/json",
                        headers=headers)


@web.middleware
async def _errors(request: web.Request, handler: web.Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status, "error")
        return _json_error(exc.status, exc.reason or "error", "invalid_request_error", code)


async def _proxy(request: web.Request) -> web.StreamResponse:
    received = time.perf_counter()
    gateway = request.app[_GATEWAY_KEY]
    rid = request.headers.get("X-Request-ID") or new_request_id()
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _json_error(413, "request body too large", "invalid_request_error", "request_too_large", rid)
    ctx = RequestContext(method=request.method, path=request.path_qs, headers=request.headers, body=body,
                         request_id=rid, received_at=received, client=request.remote)
    resp = await gateway.handle(ctx)
    return await write_response(request, resp)


async def write_response(request: web.Request, resp: GatewayResponse) -> web.StreamResponse:
    if resp.stream is None:
        return web.Response(status=resp.status, body=resp.body, headers=resp.headers)
    out = web.StreamResponse(status=resp.status, headers=resp.headers)
    stream = resp.stream
    try:
        await out.prepare(request)
        async for chunk in stream:
            await out.write(chunk)
        await out.write_eof()
    except (ConnectionError, asyncio.CancelledError) as exc:
        log.info("client went away mid-stream: %r", exc)
        if isinstance(exc, asyncio.CancelledError):
            raise
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    return out


async def _models(request: web.Request) -> web.Response:
    return web.json_response(request.app[_GATEWAY_KEY].models_payload())


async def _health(request: web.Request) -> web.Response:
    status, payload = request.app[_GATEWAY_KEY].health_payload()
    return web.json_response(payload, status=status)


async def _metrics(request: web.Request) -> web.Response:
    text = request.app[_GATEWAY_KEY].metrics.render()
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


async def _not_found(request: web.Request) -> web.Response:
    return _json_error(404, f"no route for {request.method} {request.path}", "invalid_request_error",
                       "not_found")


def make_app(gateway: Gateway) -> web.Application:
    app = web.Application(client_max_size=gateway.config.max_body_bytes, middlewares=[_errors])
    app[_GATEWAY_KEY] = gateway
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/{tail:.+}", _proxy)
    app.router.add_route("*", "/{tail:.*}", _not_found)
    return app


async def serve(gateway: Gateway, host: str, port: int, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Run the HTTP/1.1 frontend until ``stop`` is set; prints the bound address once listening."""
    await gateway.start()
    runner = web.AppRunner(make_app(gateway), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=2048, reuse_address=True)
    try:
        await site.start()
        bound = runner.addresses[0]
        print(f"hasten gateway listening on http://{bound[0]}:{bound[1]} (HTTP/1.1, "
              f"{len(gateway.pools)} model pool(s))", flush=True)
        if ready is not None:
            ready.set()
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()
        await gateway.close()

