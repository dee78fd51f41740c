"""The FastAPI application: routes, readiness, engine lifecycle, OpenAPI document.

`build_app(engine_factory)` returns an app that starts listening at once and loads the
engine in the background (`engine_factory` is blocking and runs in a worker thread),
then runs `engine.start()` (which includes a warm-up step). Until that is done
`/health` and every model endpoint answer 503, so a load balancer never routes to a
cold replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from starlette.responses import Response

from hasten import __version__
from hasten.runtime.heap import freeze_heap
from hasten.server import protocol as P
from hasten.server.auth import APIKeyMiddleware
from hasten.server.chat import chat_prompt, create_chat_completion
from hasten.server.completions import create_completion
from hasten.server.embeddings import EmbedServing
from hasten.server.errors import RETRY_AFTER_SECONDS, APIError, install_error_handlers
from hasten.server.grammar_limits import StructuredLimits
from hasten.server.limits import (
    BodyLimitMiddleware,
    HTTPLimits,
    add_body_schemas,
    json_body_doc,
    offload,
    read_json_model,
)
from hasten.server.metrics import CONTENT_TYPE, ServerMetrics
from hasten.server.responses import create_response
from hasten.server.serving import Serving
from hasten.server.supervisor import EngineSupervisor, SupervisionConfig
from hasten.server.tracing import RequestIdMiddleware

logger = logging.getLogger("hasten.server")

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": P.ErrorResponse, "description": desc}
    for code, desc in ((400, "Invalid request"), (404, "Unknown model"),
                       (429, "Waiting queue full; retry after Retry-After seconds"),
                       (503, "Model still loading"))
}
# Routes with a JSON body read and validate it themselves (hasten/server/limits.py: large bodies off the
# event loop); their documented body and the 413 every body route may answer:
_BODY_MODELS: list[type[Any]] = [P.CompletionRequest, P.ChatCompletionRequest, P.TokenizeRequest,
                                 P.DetokenizeRequest, P.EmbeddingRequest, P.ResponsesRequest]
_TOO_LARGE: dict[int | str, dict[str, Any]] = {
    413: {"model": P.ErrorResponse, "description": "Request body over --max-request-bytes"}}
# With "stream": true: Server-Sent Events, each `data:` a JSON chunk, the last one `[DONE]`.
_SSE = {"text/event-stream": {"schema": {
    "type": "object", "description": "One server-sent event; `data` is a chunk as JSON, or [DONE].",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}}, "required": ["data"]}}}


@dataclass
class ServerState:
    engine_factory: Callable[[], Any]
    served_names: list[str] | None
    on_load_failure: Callable[[BaseException], None] | None = None
    engine: Any = None
    serving: Serving | None = None
    embedding: EmbedServing | None = None  # set instead of `serving` by `hasten serve --task embed`
    ready: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    startup_seconds: float | None = None
    supervision: SupervisionConfig = field(default_factory=SupervisionConfig)
    supervisor: EngineSupervisor | None = None
    down_reason: str | None = None  # set while a failed engine is being replaced
    structured: StructuredLimits | None = None  # response_format budgets (grammar_limits.py)
    # `hasten serve`: the server process owns its heap, so once an engine is up everything allocated
    # so far leaves the collector's scans (runtime/heap.py); never for an app built inside another program
    freeze_heap_after_load: bool = False
    metrics: ServerMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(lambda: self.engine if self.ready else None, self.model_name)

    def model_name(self) -> str:
        if self.serving is not None:
            return self.serving.model_name
        if self.embedding is not None:
            return self.embedding.model_name
        return (self.served_names or ["-"])[0]

    async def load(self) -> None:
        t0 = time.perf_counter()
        try:
            engine = await asyncio.to_thread(self.engine_factory)
            t_loaded = time.perf_counter()
            await engine.start()
            t_warm = time.perf_counter()
            names = self.served_names or [engine.model_name]
            self.engine = engine
            if getattr(engine, "task", None) == "embed":
                self.embedding = EmbedServing(engine, names)
            else:
                self.serving = Serving(engine, self.metrics, names, self.structured)
                await self.serving.structured.prestarted()  # its start-up CPU before the first request's
            t_ready = time.perf_counter()
            self.ready = True
            self.startup_seconds = t_ready - t0
            if self.freeze_heap_after_load:
                logger.debug("%d objects of the server's start-up heap frozen", freeze_heap())
            logger.info("ready: serving %s (max_model_len=%d) after %.2fs (engine build %.2fs, start %.2fs; "
                        "weights loaded and warm-up step run; grammar compiler %.2fs)", names[0],
                        engine.max_model_len, t_ready - t0, t_loaded - t0, t_warm - t_loaded, t_ready - t_warm)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            # `hasten serve` (on_load_failure) exits 1 with one line; the traceback only with --log-level debug
            logger.log(logging.DEBUG if self.on_load_failure is not None else logging.ERROR,
                       "engine failed to load: %s", exc, exc_info=logger.isEnabledFor(logging.DEBUG))
            if self.on_load_failure is not None:
                self.on_load_failure(exc)
            return
        self.supervisor = EngineSupervisor(self.supervision, engine, self._build_engine, self._install,
                                           self._engine_down, self._give_up, self.metrics.engine_restarts.inc)
        self.supervisor.start()

    async def _build_engine(self) -> Any:
        engine = await asyncio.to_thread(self.engine_factory)
        await engine.start()
        if self.freeze_heap_after_load:  # a thread-mode engine's new objects live as long as it does
            freeze_heap()
        return engine

    def _install(self, engine: Any) -> None:
        self.engine = engine
        if self.serving is not None:
            self.serving.engine = engine
            if "tokenizer" in vars(engine):  # a restarted engine process sent its own copy: keep one
                engine.tokenizer = self.serving.tokenizer
        self.down_reason = None
        self.ready = True

    def _engine_down(self, reason: str) -> None:
        self.ready = False
        self.down_reason = reason

    def _give_up(self, message: str) -> None:
        if self.on_load_failure is not None:
            self.on_load_failure(RuntimeError(message))

    def healthy(self) -> bool:
        return self.ready and (self.supervisor is None or self.supervisor.healthy)

    def require(self) -> Serving:
        """The text-generation serving; 503 while loading, 400 on an embedding server."""
        if self.ready and self.embedding is not None:
            raise APIError(400, f"The model `{self.embedding.model_name}` is an embedding model (hasten serve "
                                "--task embed): this server answers /v1/embeddings, not text generation.",
                           code="model_not_supported")
        if not self.ready or self.serving is None:
            message = ("The engine failed and is being restarted." if self.down_reason is not None
                       else "The model is still loading.")
            raise APIError(503, message, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        return self.serving

    def require_any(self) -> Serving | EmbedServing:
        """Whatever this server serves (generation or embeddings); 503 while loading."""
        if self.ready and self.embedding is not None:
            return self.embedding
        return self.require()

    def require_embed(self) -> EmbedServing:
        serving = self.require_any()
        if not isinstance(serving, EmbedServing):
            raise APIError(400, f"The model `{serving.model_name}` generates text; /v1/embeddings needs an "
                                "embedding model (hasten serve --task embed).", code="model_not_supported")
        return serving


def _request_id(request: Request) -> str:
    return request.scope["state"]["request_id"]


def _json(body: Any) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


def _model_card(state: ServerState, serving: Serving | EmbedServing, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "hasten",
            "max_model_len": serving.max_model_len}


def build_app(engine_factory: Callable[[], Any], served_names: list[str] | None = None,
              on_load_failure: Callable[[BaseException], None] | None = None,
              supervision: SupervisionConfig | None = None, limits: HTTPLimits | None = None,
              structured: StructuredLimits | None = None, api_key: str | None = None,
              protect_metrics: bool = False, tool_call_parser: str | None = None,
              freeze_heap_after_load: bool = False) -> FastAPI:
    """`tool_call_parser`: the tool-call format `tool_choice: "auto"` recognises (default: the chat template's).
    `freeze_heap_after_load`: this process is the server's own (`hasten serve`): freeze its heap once the engine is up."""
    state = ServerState(engine_factory, served_names, on_load_failure, structured=structured,
                        freeze_heap_after_load=freeze_heap_after_load)
    limits = limits or HTTPLimits()
    if supervision is not None:
        state.supervision = supervision

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(state.load())
        yield
        state.ready = False
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if state.supervisor is not None:
            await state.supervisor.stop()
        if state.engine is not None:
            logger.info("shutting down the engine")
            await state.engine.shutdown()
        if state.serving is not None:
            await state.serving.structured.aclose()  # the grammar compiler process

    app = FastAPI(title="hasten", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of the hasten LLM serving stack.")
    app.state.server = state
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_request_bytes)
    if api_key:  # inside the request-id middleware (a 401 gets an X-Request-ID), before any body is read
        app.add_middleware(APIKeyMiddleware, api_key=api_key, protect_metrics=protect_metrics)
    app.add_middleware(RequestIdMiddleware)  # added last = outermost: the 413 above gets an X-Request-ID
    install_error_handlers(app)

    @app.get("/health", responses={200: {"model": P.HealthResponse}, 503: _ERRORS[503]})
    async def health() -> Response:
        state.require_any()
        if getattr(state.engine, "errored", None) is not None:
            raise APIError(503, f"The engine failed: {(str(state.engine.errored).strip().splitlines() or ['?'])[-1]}")
        if not state.healthy():
            raise APIError(503, "The engine has requests in flight but has not finished a step for "
                                f"{state.supervision.watchdog_s:g}s.", code="engine_stalled")
        return _json({"status": "ok"})

    @app.get("/v1/models", responses={200: {"model": P.ModelList}, 503: _ERRORS[503]})
    async def models() -> Response:
        serving = state.require_any()
        data = [_model_card(state, serving, name) for name in sorted(serving.served_names)]
        data.sort(key=lambda d: d["id"] != serving.model_name)
        return _json({"object": "list", "data": data})

    @app.get("/v1/models/{model_id:path}", responses={200: {"model": P.ModelCard}, 404: _ERRORS[404],
                                                      503: _ERRORS[503]})
    async def model(model_id: str) -> Response:
        serving = state.require_any()
        if model_id not in serving.served_names:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return _json(_model_card(state, serving, model_id))

    @app.post("/v1/embeddings", openapi_extra=json_body_doc(P.EmbeddingRequest),
              responses={200: {"model": P.EmbeddingResponse}, **_ERRORS, **_TOO_LARGE})
    async def embeddings(request: Request) -> Response:
        body, _ = await read_json_model(request, P.EmbeddingRequest)
        return _json(await state.require_embed().create(body))

    @app.get("/version", responses={200: {"model": P.VersionResponse}})
    async def version() -> Response:
        return _json({"version": __version__})

    @app.post("/v1/completions", openapi_extra=json_body_doc(P.CompletionRequest),
              responses={200: {"model": P.CompletionResponse, "content": _SSE}, **_ERRORS, **_TOO_LARGE})
    async def completions(request: Request) -> Response:
        body, large = await read_json_model(request, P.CompletionRequest)
        return await create_completion(state.require(), request, body, _request_id(request), large=large)

    @app.post("/v1/chat/completions", openapi_extra=json_body_doc(P.ChatCompletionRequest),
              responses={200: {"model": P.ChatCompletionResponse, "content": _SSE}, **_ERRORS, **_TOO_LARGE})
    async def chat_completions(request: Request) -> Response:
        body, large = await read_json_model(request, P.ChatCompletionRequest)
        return await create_chat_completion(state.require(), request, body, _request_id(request), large=large,
                                            parser_flag=tool_call_parser)

    @app.post("/v1/responses", openapi_extra=json_body_doc(P.ResponsesRequest),
              responses={200: {"content": _SSE}, **_ERRORS, **_TOO_LARGE})
    async def responses(request: Request) -> Response:
        body, large = await read_json_model(request, P.ResponsesRequest)
        return await create_response(state.require(), request, body, _request_id(request), large=large,
                                     parser_flag=tool_call_parser)

    @app.post("/tokenize", openapi_extra=json_body_doc(P.TokenizeRequest),
              responses={200: {"model": P.TokenizeResponse}, **_ERRORS, **_TOO_LARGE})
    async def tokenize(request: Request) -> Response:
        body, large = await read_json_model(request, P.TokenizeRequest)
        serving = state.require()
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "Give exactly one of `prompt` and `messages`.", param="prompt")

        def encode() -> bytes:
            if body.messages is not None:
                ids = chat_prompt(serving, body.messages, body.add_generation_prompt)
            else:
                ids = serving.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            return orjson.dumps({"tokens": list(ids), "count": len(ids), "max_model_len": serving.max_model_len})

        return Response(await offload(large, encode), media_type="application/json")

    @app.post("/detokenize", openapi_extra=json_body_doc(P.DetokenizeRequest),
              responses={200: {"model": P.DetokenizeResponse}, **_ERRORS, **_TOO_LARGE})
    async def detokenize(request: Request) -> Response:
        body, large = await read_json_model(request, P.DetokenizeRequest)
        serving = state.require()
        serving.check_model(body.model)

        def decode() -> str:
            serving.check_token_ids(body.tokens, "tokens")
            return serving.tokenizer.decode(body.tokens)

        return _json({"prompt": await offload(large, decode)})

    @app.get("/metrics", responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE)

    def openapi() -> dict[str, Any]:
        # FastAPI documents a 422 for every body; this server answers 400 instead.
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            add_body_schemas(schema, _BODY_MODELS)
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            comps = schema.get("components", {}).get("schemas", {})
            comps.pop("HTTPValidationError", None)
            comps.pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
