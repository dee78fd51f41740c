"""API-key authentication (`hasten serve --api-key KEY`, or the HASTEN_API_KEY environment variable).

Requests to `/v1/*` (and to `/metrics` with --protect-metrics) must carry the key as
`Authorization: Bearer KEY` or `x-api-key: KEY`; otherwise they get an OpenAI-style 401
(`invalid_api_key`) before their body is read. Keys are compared in constant time.
`/health`, `/version` and (by default) `/metrics` stay open for probes and scrapers.
"""

from __future__ import annotations

import hmac

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from hasten.server.errors import error_body

API_KEY_ENV = "HASTEN_API_KEY"


def presented_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key a request carries (Bearer token first, then x-api-key), or None."""
    bearer = api_key = None
    for name, value in headers:
        lname = name.lower()
        if lname == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer":
                bearer = token.strip()
        elif lname == b"x-api-key":
            api_key = value.strip()
    return bearer if bearer is not None else api_key


class APIKeyMiddleware:
    """Pure ASGI middleware: no BaseHTTPMiddleware, so streaming and disconnects are untouched."""

    def __init__(self, app: ASGIApp, api_key: str, protect_metrics: bool = False) -> None:
        if not api_key:
            raise ValueError("the API key must not be empty")
        self.app = app
        self._key = api_key.encode()
        self._protect_metrics = protect_metrics

    def protects(self, path: str) -> bool:
        return path.startswith("/v1/") or path == "/v1" or (self._protect_metrics and path == "/metrics")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.protects(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        key = presented_key(scope.get("headers", []))
        if key is not None and hmac.compare_digest(key, self._key):
            await self.app(scope, receive, send)
            return
        message = ("Missing API key: send it as `Authorization: Bearer KEY` or `x-api-key: KEY`."
                   if key is None else "Incorrect API key provided.")
        body = orjson.dumps(error_body(401, message, type="invalid_request_error", code="invalid_api_key"))
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
