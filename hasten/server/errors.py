"""OpenAI-style error bodies and the exception handlers that produce them.

Every failure a client can cause maps to a 4xx with
`{"error": {"message", "type", "param", "code"}}`; only genuine server bugs are 500.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

logger = logging.getLogger("hasten.server")

RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    """An error to return to the client as-is."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code
        self.headers = headers or {}


def _default_type(status: int) -> str:
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status == 503:
        return "service_unavailable_error"
    if status >= 500:
        return "internal_server_error"
    return "invalid_request_error"


def error_body(status: int, message: str, type: str | None = None, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type or _default_type(status), "param": param,
                      "code": code}}


def error_response(err: APIError, request_id: str | None = None) -> Response:
    if err.status == 503:  # health probes while loading: not worth a line each
        logger.debug("answered %d: %s", err.status, err.message)
    elif err.status >= 500:
        logger.error("answered %d: %s", err.status, err.message)
    else:
        logger.info("answered %d: %s", err.status, err.message)
    headers = dict(err.headers)
    if request_id:
        headers["X-Request-ID"] = request_id
    body = error_body(err.status, err.message, err.type, err.param, err.code)
    return Response(orjson.dumps(body), status_code=err.status, headers=headers,
                    media_type="application/json")


def is_queue_full(exc: BaseException) -> bool:
    # Matched by name so the server does not have to import the engine (and torch) to know it.
    return any(cls.__name__ == "QueueFullError" for cls in type(exc).__mro__)


def engine_error(exc: Exception) -> APIError:
    """Translate an exception raised by `engine.generate` into what the client sees."""
    if isinstance(exc, APIError):
        return exc
    if is_queue_full(exc):
        return APIError(429, f"Server is overloaded: {exc}", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, ValueError):
        return APIError(400, str(exc) or "invalid request")
    if any(cls.__name__ == "EngineUnavailableError" for cls in type(exc).__mro__):
        return APIError(503, f"The engine is not available: {exc}", code="engine_unavailable",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if any(cls.__name__ == "EngineFailedError" for cls in type(exc).__mro__):
        reason = (str(exc).strip().splitlines() or ["?"])[-1]
        if getattr(exc, "stopped_from_outside", False):
            # not this request's doing: retryable (a gateway sends it to another replica)
            return APIError(503, f"The engine process was stopped while this request was in flight ({reason}); "
                                 "it is being restarted, retry the request", code="engine_restarting",
                            headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        return APIError(500, f"The engine failed while this request was in flight ({reason}); it is being "
                             "restarted", code="engine_failed")
    if any(cls.__name__ == "RequestFailedError" for cls in type(exc).__mro__):
        # the engine failed on this request alone and logged the traceback; the server carries on
        return APIError(500, f"The engine failed while generating this request: {exc}",
                        code="engine_request_failed")
    logger.exception("engine failure")
    return APIError(500, f"Internal error: {type(exc).__name__}")


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc[1:] if loc] if loc and loc[0] == "body" else [str(p) for p in loc]
    return ".".join(p for p in parts if not _is_union_tag(p)) or None


def _is_union_tag(part: str) -> bool:
    """pydantic puts the union branch it tried into `loc` ('str', 'list[int]', 'TextPart', ...)."""
    return (part in ("str", "int", "float", "bool", "none", "dict") or part[:1].isupper()
            or part.startswith(("list[", "dict[", "function-", "constrained-", "literal[")))


async def _validation_handler(request: Request, exc: RequestValidationError) -> Response:
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    loc = tuple(first.get("loc", ()))
    param = _loc_to_param(loc)
    if first.get("type") == "json_invalid":
        message = f"Request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
        param = None
    elif param is None and first.get("type") in ("model_attributes_type", "dict_type"):
        message = "The request body must be a JSON object (send it with Content-Type: application/json)."
    else:
        message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem(s))"
    return error_response(APIError(400, message, param=param), _rid(request))


async def _http_handler(request: Request, exc: StarletteHTTPException) -> Response:
    try:
        phrase = HTTPStatus(exc.status_code).phrase
    except ValueError:
        phrase = "Error"
    message = exc.detail if isinstance(exc.detail, str) else phrase
    err = APIError(exc.status_code, message, headers=dict(exc.headers or {}))
    return error_response(err, _rid(request))


async def _api_handler(request: Request, exc: APIError) -> Response:
    return error_response(exc, _rid(request))


async def _unhandled_handler(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error")
    return error_response(APIError(500, f"Internal error: {type(exc).__name__}"), _rid(request))


def _rid(request: Request) -> str | None:
    return request.scope.get("state", {}).get("request_id")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_handler)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_handler)  # type: ignore[arg-type]
    app.add_exception_handler(APIError, _api_handler)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unhandled_handler)
