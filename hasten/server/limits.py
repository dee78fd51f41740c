"""Request-size limits and large request bodies, at the ASGI level.

* `BodyLimitMiddleware` answers 413 (OpenAI-style body) as soon as a request's
  `Content-Length` is over `HTTPLimits.max_request_bytes` - before the app runs or a single
  body byte is read - and, for bodies without a length (chunked), as soon as the bytes read
  so far pass the limit. Nothing over the limit is ever buffered: uvicorn reads and drops the
  rest of the body (a client that is still sending would otherwise get a connection reset
  instead of the 413), for at most the body timeout (`http_protocol`), then the connection
  is closed. A client that sent `Expect: 100-continue` is not sending the body: it gets
  `Connection: close` at once.
* `read_json_model` reads a route's JSON body and validates it with a pydantic model the
  way FastAPI does for a body parameter (same errors, so the same 400 bodies from
  `errors._validation_handler`), but parses with pydantic-core's JSON parser (as fast as
  orjson; unlike orjson it keeps integers over 64 bits and NaN as `json` does), and - for bodies over
  `OFFLOAD_BYTES` - parses and validates in a worker thread so a multi-megabyte body
  never stalls the event loop (other requests' streams). `offload` does the same for
  the work that follows (tokenizing a large prompt).

The timeouts (header, body, keep-alive) and the request-head size limit live in the
HTTP protocol: `hasten.server.http_protocol`.
"""

from __future__ import annotations

import asyncio
import email.message
import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hasten.server.errors import APIError, error_response

KIB = 1024
MIB = 1024 * KIB
OFFLOAD_BYTES = 64 * KIB  # bodies (and the prompts in them) above this are handled in a worker thread

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")


@dataclass(frozen=True)
class HTTPLimits:
    """What one client connection may cost `hasten serve` (flags of the same names, docs/server.md)."""

    max_request_bytes: int = 8 * MIB  # request body; more -> 413
    max_header_bytes: int = 64 * KIB  # request line + headers; more -> 431
    header_timeout: float = 10.0  # connection open / first byte of a request head -> head complete; else 408
    body_timeout: float = 30.0  # request handling starts -> whole body received; else 408
    timeout_keep_alive: float = 5.0  # idle between requests on a kept-alive connection; then closed

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_header_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("header_timeout", "body_timeout", "timeout_keep_alive"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {getattr(self, name)}")


def too_large(limit: int, close: bool = False) -> APIError:
    return APIError(413, f"The request body is larger than this server's limit of {limit} bytes.",
                    code="request_too_large", headers={"Connection": "close"} if close else None)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


def _content_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


class BodyLimitMiddleware:
    """Pure ASGI (it must not buffer or delay streams). See the module docstring."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            rid = scope.get("state", {}).get("request_id")
            expecting = (_header(scope, b"expect") or b"").lower() == b"100-continue"
            await error_response(too_large(limit, close=expecting), rid)(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise too_large(limit)  # the app's APIError handler answers it
            return message

        await self.app(scope, limited_receive, send)


# ---- reading and validating JSON bodies ---------------------------------------------------------

async def read_body(request: Request) -> bytes:
    try:
        return await request.body()
    except ClientDisconnect:
        raise APIError(400, "The client disconnected before sending the whole request body.") from None


@functools.lru_cache(maxsize=64)
def _is_json(content_type: str | None) -> bool:
    """FastAPI's rule: application/json or application/*+json; no Content-Type is not JSON."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _loads(body: bytes) -> Any:
    try:
        return from_json(body)
    except ValueError:
        pass
    # What FastAPI used, for the same answers: its error message and position, and what it accepts that
    # pydantic-core does not (lone surrogates, a UTF-8 BOM, UTF-16, nesting deeper than 200) for pydantic to judge.
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": exc.msg}}]) from None
    except (UnicodeDecodeError, RecursionError):
        raise HTTPException(400, "There was an error parsing the body") from None


def parse_model(model: type[M], body: bytes, content_type: str | None) -> M:
    """`body` as `model`, with the errors FastAPI gives for a body parameter of that type."""
    if not body:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    value: Any = _loads(body) if _is_json(content_type) else body
    try:
        return model.model_validate(value, from_attributes=True)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None


async def read_json_model(request: Request, model: type[M]) -> tuple[M, bool]:
    """The request body as `model`, and whether it was large (then it was handled off the event loop)."""
    body = await read_body(request)
    content_type = request.headers.get("content-type")
    if len(body) > OFFLOAD_BYTES:
        return await asyncio.to_thread(parse_model, model, body, content_type), True
    return parse_model(model, body, content_type), False


async def offload(large: bool, fn: Callable[..., R], *args: Any) -> R:
    """`fn(*args)` in a worker thread for a large request, inline (faster) for a small one."""
    if large:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def encode_large(tokenizer: Any, text: str, add_special_tokens: bool,
                 check_length: Callable[[int], None]) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=...)` for a large text, in a worker thread, holding the
    GIL (which stalls the event loop) as little as possible. A worker thread alone is not enough: the Rust
    tokenizer releases the GIL while it encodes, but building the offsets and turning the ids into a Python
    list do not (about 0.4 s for 10 million tokens). So with a fast tokenizer this encodes without offsets
    (`encode_batch_fast`: the same ids) and calls `check_length(count)` - which raises for a prompt that
    cannot fit - before the ids become a list; otherwise it falls back to `encode`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast") or backend.truncation is not None \
            or backend.padding is not None \
            or backend.encode_special_tokens != getattr(tokenizer, "split_special_tokens", False):
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        check_length(len(ids))
        return ids
    encoding = backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
    try:
        check_length(len(encoding))
    except BaseException:
        del encoding  # freed here, not later by whoever holds the traceback (the event loop)
        raise
    return encoding.ids


# ---- the OpenAPI document: routes that read their own body still publish its schema ---------------

def json_body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route reading `model` itself: what FastAPI writes for a body parameter."""
    return {"requestBody": {"content": {"application/json": {"schema": {
        "$ref": f"#/components/schemas/{model.__name__}"}}}, "required": True}}


def _doc_endpoint(model: type[BaseModel]) -> Callable[..., Any]:
    async def endpoint(body: Any) -> None:
        return None

    endpoint.__annotations__ = {"body": model, "return": None}
    return endpoint


def add_body_schemas(schema: dict[str, Any], models: list[type[BaseModel]]) -> None:
    """Add the component schemas `json_body_doc` refers to (and the ones they refer to), exactly as FastAPI
    writes them for body parameters: taken from a throwaway app whose routes declare those bodies."""
    doc = FastAPI()
    for model in models:
        doc.add_api_route(f"/{model.__name__}", _doc_endpoint(model), methods=["POST"])
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, definition in doc.openapi().get("components", {}).get("schemas", {}).items():
        if name not in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422, never answered here
            components.setdefault(name, definition)
