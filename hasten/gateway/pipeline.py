"""The request pipeline: a framework-neutral request context, response type and middleware chain.

A request flows through ``middlewares`` (outermost first) and ends in a terminal handler
(the proxy). Each middleware is ``async def mw(ctx, call_next) -> GatewayResponse`` and may
short-circuit (return a response or raise :class:`GatewayError`), annotate ``ctx`` (for
example ``ctx.attrs["priority"]``), or wrap the returned response's stream. This is the
hook for later features (Redis-backed rate limits, priorities, response/semantic caches,
cascades, SLO control): they are middlewares inserted between the built-in stages and
the proxy, with no change to the transport frontends.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from hasten.gateway.config import TenantConfig
    from hasten.gateway.routing import Pool


class GatewayError(Exception):
    """An error returned to the client as an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code)


def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


_ID_PREFIX = os.urandom(6).hex()  # per process: ids from several gateway instances do not collide
_ID_COUNTER = itertools.count(int.from_bytes(os.urandom(4), "big"))


def new_request_id() -> str:
    """24 hex digits: a random per-process prefix and a counter (unique, no syscall per request)."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER) & 0xFFFFFFFFFFFF:012x}"


@dataclass
class GatewayResponse:
    """A response: either a complete ``body`` or an async ``stream`` of already-encoded bytes."""

    status: int
    headers: dict[str, str]
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None

    @classmethod
    def json(cls, status: int, payload: Any, headers: Mapping[str, str] | None = None) -> GatewayResponse:
        h = {"content-type": "application/json"}
        h.update(headers or {})
        return cls(status=status, headers=h, body=json.dumps(payload).encode())

    @classmethod
    def from_error(cls, err: GatewayError) -> GatewayResponse:
        h = {"content-type": "application/json"}
        h.update(err.headers)
        return cls(status=err.status, headers=h, body=err.body())


@dataclass(slots=True)
class RequestContext:
    """Everything the pipeline knows about one client request."""

    method: str
    path: str
    headers: Mapping[str, str]  # header names in lower case
    body: bytes
    request_id: str
    received_at: float = field(default_factory=time.perf_counter)
    client: str | None = None
    # the parsed body; for a body of LARGE_BODY_BYTES or more only the JSON text is kept and
    # ``payload`` parses it again on each use (see :meth:`keep_payload`)
    _payload: dict[str, Any] | None = field(default=None, repr=False)
    model: str | None = None
    pool: Pool | None = None
    tenant: TenantConfig | None = None
    region: str | None = None
    stream: bool = False
    attrs: dict[str, Any] = field(default_factory=dict)
    _reparse: bool = field(default=False, repr=False)

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    @property
    def payload(self) -> dict[str, Any] | None:
        if self._reparse:
            return orjson.loads(self.body)  # valid: it parsed to a JSON object once already
        return self._payload

    @payload.setter
    def payload(self, value: dict[str, Any] | None) -> None:
        self._payload, self._reparse = value, False

    def keep_payload(self, payload: dict[str, Any]) -> None:
        """Hold the parsed body, unless the body is large: then hold only its bytes. A large body
        parses to up to ~50 bytes of small objects per byte of JSON (a 1.3 MB 100,000-value enum:
        ~7 MB); held while the request waits on a replica, other requests' long-lived objects
        settle between them, and once they are freed the allocator's arenas stay pinned half
        empty: RSS ratchets up with every such request (docs/benchmarks.md, the soak). Parsed
        and dropped within one synchronous stage, they free whole arenas."""
        if len(self.body) >= LARGE_BODY_BYTES:
            self._payload, self._reparse = None, True
        else:
            self.payload = payload


LARGE_BODY_BYTES = 64 * 1024

Handler = Callable[[RequestContext], Awaitable[GatewayResponse]]
Middleware = Callable[[RequestContext, Handler], Awaitable[GatewayResponse]]


def build_chain(middlewares: list[Middleware], terminal: Handler) -> Handler:
    """Compose middlewares (outermost first) around ``terminal`` into a single handler."""
    handler = terminal
    for mw in reversed(middlewares):
        handler = _bind(mw, handler)
    return handler


def _bind(mw: Middleware, nxt: Handler) -> Handler:
    async def call(ctx: RequestContext) -> GatewayResponse:
        return await mw(ctx, nxt)

    return call
