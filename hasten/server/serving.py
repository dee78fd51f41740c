"""What completions and chat share: model checks, structured output, usage, timing, running.

`Serving.run()` is the one place an HTTP request meets the engine: it plans the engine
requests, and either collects them (non-streaming, raced against a client disconnect)
or primes the first output before answering 200 (so queue-full and invalid-input errors
still get their 4xx status) and returns an SSE response for the rest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from hasten.outputs import RequestOutput, TokenLogprobs
from hasten.sampling_params import SamplingParams
from hasten.server.errors import APIError, engine_error
from hasten.server.generation import Generation, Plan, SubRequest, build_plan
from hasten.server.grammar_limits import StructuredLimits
from hasten.server.metrics import ServerMetrics
from hasten.server.protocol import SamplingFields
from hasten.server.sse import DONE, ClientDisconnected, SSEResponse, race_disconnect, sse
from hasten.server.structured import Grammar, StructuredOutput, wants_grammar
from hasten.server.tracing import Timing

logger = logging.getLogger("hasten.server")

# Turns (sub-request, output) into the SSE payloads for the new tokens.
ChunkFn = Callable[[SubRequest, RequestOutput], list[dict[str, Any]]]


@dataclass
class Streamer:
    """What an endpoint supplies for streaming: opening chunks, per-output chunks, final chunk shape."""

    opening: list[dict[str, Any]]
    chunks: ChunkFn
    usage_chunk: Callable[[dict[str, Any]], dict[str, Any]]


class TokenText:
    """Cached single-token strings (for logprobs), so each vocab entry is decoded once."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text

    def top(self, entry: TokenLogprobs, k: int) -> list[tuple[int, float]]:
        return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]


class Serving:
    def __init__(self, engine: Any, metrics: ServerMetrics, served_names: list[str],
                 structured: StructuredLimits | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.metrics = metrics
        self.model_name = served_names[0]
        self.served_names = set(served_names)
        self.max_model_len: int = engine.max_model_len
        self.vocab_limit = len(self.tokenizer)
        self.structured = StructuredOutput(self.tokenizer, structured)
        self.token_text = TokenText(self.tokenizer)
        self._in_flight: set[str] = set()

    # ---- request checks -------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_names:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        for t in ids:
            if t >= self.vocab_limit:
                raise APIError(400, f"token id {t} is out of range (vocabulary size {self.vocab_limit})",
                               param=param)

    def unique_id(self, request_id: str) -> str:
        """Engine request ids must be unique even if a client reuses an X-Request-ID. The suffixes use
        characters an X-Request-ID cannot contain ('~' here, '/' for sub-requests), so no collisions."""
        rid, k = request_id, 1
        while rid in self._in_flight:
            rid, k = f"{request_id}~{k}", k + 1
        return rid

    async def processor_factory(self, req: SamplingFields, request: Request | None = None
                                ) -> Callable[[], Any] | None:
        """Logits processors for `response_format`. A cached grammar costs no I/O; a new one is compiled
        in a worker process (see structured.py), abandoned if the client disconnects meanwhile."""
        fmt = req.response_format
        if not wants_grammar(fmt):
            return None
        assert fmt is not None
        grammar = self.structured.cached(fmt)
        if grammar is None:
            work = self.structured.grammar(fmt)
            try:
                grammar = await (race_disconnect(request.receive, work, lambda: None) if request is not None
                                 else work)
            except ClientDisconnected:
                raise APIError(499, "The client disconnected while its JSON schema was compiling.") from None
        if grammar.compiled is None and not self._engine_pickles_processors():
            await asyncio.to_thread(self.structured.load, grammar)  # the engine loop runs in this process
        compiled: Grammar = grammar
        return lambda: self.structured.processor(compiled)

    def _engine_pickles_processors(self) -> bool:
        """An engine in another process rebuilds processors there from the serialized grammar."""
        from hasten.server.engine_process import ProcessEngine

        return isinstance(self.engine, ProcessEngine)

    # ---- running ----------------------------------------------------------------------
    async def run(self, request: Request, request_id: str, prompts: list[list[int]], params: SamplingParams,
                  req: SamplingFields, build_response: Callable[[list[RequestOutput], Plan], dict[str, Any]],
                  streamer: Callable[[Plan], Streamer]) -> Response:
        for name, tok in params.token_ids_out_of_range(self.vocab_limit):
            raise APIError(400, f"token id {tok} is out of range (vocabulary size {self.vocab_limit})", param=name)
        factory = await self.processor_factory(req, request)
        engine_id = self.unique_id(request_id)
        plan = build_plan(engine_id, prompts, params, factory)
        gen = Generation(self.engine, plan, self.metrics, priority=req.priority, cache_salt=req.cache_salt)
        logger.info("start: %d prompt(s), %d prompt tokens, n=%d, max_tokens=%s, stream=%s",
                    len(prompts), sum(plan.prompt_lens), params.n, params.max_tokens, req.stream)
        self._in_flight.add(engine_id)
        started = time.perf_counter()
        streaming = False
        try:
            if not req.stream:
                return await self._run_full(request, request_id, gen, plan, started, build_response)
            response = await self._run_stream(request, request_id, gen, plan, started, req, streamer(plan))
            streaming = isinstance(response, SSEResponse)
            return response
        finally:
            if not streaming:  # a stream releases the id when it ends
                self._in_flight.discard(engine_id)

    def _mark_gone(self, gen: Generation) -> Callable[[], None]:
        def gone() -> None:
            gen.client_gone = True
        return gone

    async def _run_full(self, request: Request, request_id: str, gen: Generation, plan: Plan, started: float,
                        build_response: Callable[[list[RequestOutput], Plan], dict[str, Any]]) -> Response:
        try:
            finals = await race_disconnect(request.receive, gen.collect(), self._mark_gone(gen))
        except ClientDisconnected:
            logger.info("client disconnected before the response was ready")
            return Response(status_code=499)
        except Exception as exc:
            raise engine_error(exc) from exc
        body = build_response(finals, plan)
        body["id"] = request_id
        timing = self.timing(finals, started)
        body["usage"]["timing"] = timing.as_dict()
        self.log_done(finals, timing)
        return Response(orjson.dumps(body), media_type="application/json",
                        headers={"Server-Timing": timing.server_timing()})

    async def _run_stream(self, request: Request, request_id: str, gen: Generation, plan: Plan,
                          started: float, req: SamplingFields, streamer: Streamer) -> Response:
        outputs = gen.stream()
        try:
            first = await race_disconnect(request.receive, anext(outputs), self._mark_gone(gen))
        except ClientDisconnected:
            await outputs.aclose()
            return Response(status_code=499)
        except StopAsyncIteration as exc:
            raise APIError(500, "engine produced no output") from exc
        except Exception as exc:
            await outputs.aclose()
            raise engine_error(exc) from exc
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = self._events(gen, plan, first, outputs, streamer, include_usage, started)
        return SSEResponse(events, {}, self._mark_gone(gen))  # type: ignore[return-value]

    async def _events(self, gen: Generation, plan: Plan, first: tuple[SubRequest, RequestOutput],
                      outputs: AsyncIterator[tuple[SubRequest, RequestOutput]], streamer: Streamer,
                      include_usage: bool, started: float) -> AsyncIterator[bytes]:
        dumps = orjson.dumps
        try:
            usage_null = {"usage": None} if include_usage else {}
            for chunk in streamer.opening:
                yield sse(dumps({**chunk, **usage_null}))
            sub, out = first
            for chunk in streamer.chunks(sub, out):
                yield sse(dumps({**chunk, **usage_null}) if include_usage else dumps(chunk))
            try:
                async for sub, out in outputs:
                    for chunk in streamer.chunks(sub, out):
                        yield sse(dumps({**chunk, **usage_null}) if include_usage else dumps(chunk))
            except Exception as exc:  # the engine failed mid-stream: tell the client in-band
                err = engine_error(exc)
                yield sse(dumps({"error": {"message": err.message, "type": err.type, "param": err.param,
                                           "code": err.code}}))
                yield DONE
                return
            finals = [o for o in gen.last if o is not None]
            timing = self.timing(finals, started)
            if include_usage:
                usage = self.usage(finals, plan)
                usage["timing"] = timing.as_dict()
                yield sse(dumps(streamer.usage_chunk(usage)))
            yield DONE
            self.log_done(finals, timing)
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
            self._in_flight.discard(gen.engine_id)

    # ---- shared response pieces -------------------------------------------------------------
    def usage(self, finals: list[RequestOutput], plan: Plan) -> dict[str, Any]:
        prompt_tokens = sum(plan.prompt_lens)
        completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
        cached: dict[int, int] = {}
        for sub, out in zip(plan.subs, finals, strict=False):
            cached[sub.prompt_index] = out.num_cached_tokens
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}

    def timing(self, finals: list[RequestOutput], started: float) -> Timing:
        total = time.perf_counter() - started
        with_metrics = [o.metrics for o in finals if o.metrics is not None]
        if not with_metrics:
            return Timing(None, None, None, total)
        last = max(with_metrics, key=lambda m: m.finished_time or 0.0)
        t = Timing.from_metrics(last, total)
        t.total = total
        return t

    def log_done(self, finals: list[RequestOutput], timing: Timing) -> None:
        reasons = sorted({c.finish_reason or "none" for o in finals for c in o.outputs})
        generated = sum(len(c.token_ids) for o in finals for c in o.outputs)
        logger.info("done: %d tokens generated, finish=%s, %s", generated, ",".join(reasons),
                    timing.server_timing())
