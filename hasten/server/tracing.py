"""Request ids and per-request latency breakdowns.

The id comes from the client's `X-Request-ID` header (if it is sane) or is generated;
it is echoed in the response headers, used as the response `id`, and attached to every
log record emitted while the request is handled (through a context variable, so tasks
spawned for the request inherit it).
"""

from __future__ import annotations

import contextvars
import logging
import re
import uuid
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hasten.outputs import RequestMetrics

REQUEST_ID_HEADER = b"x-request-id"
_VALID_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


def new_request_id() -> str:
    return uuid.uuid4().hex


def valid_request_id(value: str) -> bool:
    return bool(_VALID_ID.match(value))


class RequestIdFilter(logging.Filter):
    """Adds `%(request_id)s` to every record (the current request's id, or '-')."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        return True


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


def configure_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(RequestIdFilter())
    for name in ("hasten", "uvicorn"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False


class RequestIdMiddleware:
    """Pure ASGI middleware (no BaseHTTPMiddleware: it would break streaming and disconnects)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = None
        for name, value in scope.get("headers", ()):
            if name == REQUEST_ID_HEADER:
                candidate = value.decode("latin-1").strip()
                rid = candidate if valid_request_id(candidate) else None
                break
        rid = rid or new_request_id()
        scope.setdefault("state", {})["request_id"] = rid
        token = request_id_var.set(rid)
        raw = rid.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER]
                headers.append((REQUEST_ID_HEADER, raw))
                message["headers"] = headers
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)


@dataclass
class Timing:
    """Seconds spent in each phase of one request (None where it never got there)."""

    queue: float | None
    prefill: float | None
    decode: float | None
    total: float | None

    @classmethod
    def from_metrics(cls, metrics: RequestMetrics | None, fallback_total: float | None = None) -> Timing:
        if metrics is None:
            return cls(None, None, None, fallback_total)
        total = metrics.e2e if metrics.e2e is not None else fallback_total
        return cls(metrics.queue_time, metrics.prefill_time, metrics.decode_time, total)

    def as_dict(self) -> dict[str, float | None]:
        return {k: (None if v is None else round(v, 6)) for k, v in self.__dict__.items()}

    def server_timing(self) -> str:
        """The `Server-Timing` header value, durations in milliseconds."""
        parts = []
        for name, value in self.__dict__.items():
            if value is not None:
                parts.append(f"{name};dur={value * 1000:.3f}")
        return ", ".join(parts)
