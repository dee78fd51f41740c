"""Turning one HTTP request into engine requests, and running them.

One HTTP request becomes one or more engine requests ("sub-requests"): one per prompt
for batched /v1/completions prompts, and one per choice when `response_format` needs
a grammar (a logits processor follows exactly one sequence, so n>1 is fanned out with
seeds seed, seed+1, ...). `Generation.stream()` merges their outputs; leaving it early
(client gone, error, cancellation) closes every engine generator, which aborts the
engine request and frees its KV blocks, and the explicit `abort` afterwards makes sure
of it even if a generator never started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from hasten.outputs import RequestOutput
from hasten.sampling_params import SamplingParams
from hasten.server.errors import APIError
from hasten.server.metrics import ServerMetrics
from hasten.server.protocol import SamplingFields

logger = logging.getLogger("hasten.server")


@dataclass
class SubRequest:
    engine_id: str
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    choice_base: int  # choice index of this sub-request's first sequence


@dataclass
class Plan:
    request_id: str
    subs: list[SubRequest]
    prompt_lens: list[int]
    n: int

    @property
    def num_choices(self) -> int:
        return len(self.prompt_lens) * self.n


def check_context(prompt_len: int, max_tokens: int, max_model_len: int, what: str) -> None:
    if prompt_len == 0:
        raise APIError(400, f"The {what} is empty after tokenization.", param="prompt")
    if prompt_len >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens, but the "
                       f"{what} has {prompt_len} tokens.", param="messages" if what == "messages" else "prompt",
                       code="context_length_exceeded")
    if prompt_len + max_tokens > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                       f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {what}, "
                       f"{max_tokens} in the completion). Please reduce the length of the {what} or "
                       "the max_tokens.", param="max_tokens", code="context_length_exceeded")


def make_params(req: SamplingFields, *, max_tokens: int, logprobs: int | None,
                prompt_logprobs: int | None = None) -> SamplingParams:
    """Map the OpenAI fields onto SamplingParams (which validates itself: ValueError -> 400)."""
    bias: dict[int, float] | None = None
    if req.logit_bias:
        bias = {}
        for key, value in req.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
    kwargs: dict[str, Any] = dict(
        n=req.n,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=bias,
    )
    for name in ("temperature", "top_p", "top_k", "min_p"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    if req.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})",
                       param="min_tokens")
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


def build_plan(request_id: str, prompts: list[list[int]], params: SamplingParams,
               processor_factory: Any = None) -> Plan:
    n = params.n
    subs: list[SubRequest] = []
    multi = len(prompts) > 1 or processor_factory is not None
    for p_idx, ids in enumerate(prompts):
        if processor_factory is None:
            eid = f"{request_id}/{p_idx}" if multi else request_id
            subs.append(SubRequest(eid, p_idx, ids, params, p_idx * n))
            continue
        for i in range(n):
            seed = None if params.seed is None else params.seed + i
            sub_params = params.clone(n=1, seed=seed, logits_processors=[processor_factory()])
            subs.append(SubRequest(f"{request_id}/{p_idx}.{i}", p_idx, ids, sub_params, p_idx * n + i))
    return Plan(request_id, subs, [len(p) for p in prompts], n)


@dataclass
class Generation:
    """Runs a plan on the engine; yields (sub-request, cumulative RequestOutput) pairs."""

    engine: Any
    plan: Plan
    metrics: ServerMetrics
    priority: int = 0
    cache_salt: str | None = None
    last: list[RequestOutput | None] = field(default_factory=list)
    client_gone: bool = False
    failed: bool = False

    def __post_init__(self) -> None:
        self.last = [None] * len(self.plan.subs)

    @property
    def engine_id(self) -> str:
        return self.plan.request_id

    def _open(self, sub: SubRequest) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(sub.prompt_ids, sub.params, sub.engine_id, priority=self.priority,
                                    cache_salt=self.cache_salt)

    async def stream(self) -> AsyncIterator[tuple[SubRequest, RequestOutput]]:
        try:
            if len(self.plan.subs) == 1:
                sub = self.plan.subs[0]
                gen = self._open(sub)
                async with contextlib.aclosing(gen):  # type: ignore[type-var]
                    async for out in gen:
                        self.last[0] = out
                        yield sub, out
            else:
                async for idx, out in self._merged():
                    self.last[idx] = out
                    yield self.plan.subs[idx], out
        except Exception as exc:
            self.failed = True
            if type(exc).__name__ == "RequestFailedError":
                self.metrics.engine_request_failures.labels(self.metrics.model_name()).inc()
            raise
        finally:
            await self._finish()

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

        async def pump(idx: int, sub: SubRequest) -> None:
            try:
                gen = self._open(sub)
                async with contextlib.aclosing(gen):  # type: ignore[type-var]
                    async for out in gen:
                        queue.put_nowait((idx, out, None))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
                queue.put_nowait((idx, None, exc))
                return
            queue.put_nowait((idx, None, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.plan.subs)]
        try:
            remaining = len(tasks)
            while remaining:
                idx, out, exc = await queue.get()
                if exc is not None:
                    raise exc
                if out is None:
                    remaining -= 1
                    continue
                yield idx, out
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _finish(self) -> None:
        for sub, out in zip(self.plan.subs, self.last, strict=True):
            if out is None or not out.finished:
                with contextlib.suppress(Exception):
                    await self.engine.abort(sub.engine_id)
                if out is not None:
                    logger.info("aborted %s after %d tokens%s", sub.engine_id,
                                sum(len(c.token_ids) for c in out.outputs),
                                " (client disconnected)" if self.client_gone else "")
            if out is not None or not self.failed:
                self.metrics.observe_request(out, sub.params.n, client_gone=self.client_gone)

    async def collect(self) -> list[RequestOutput]:
        """Run to completion (non-streaming); returns the final output of every sub-request."""
        async for _ in self.stream():
            pass
        finals = [o for o in self.last if o is not None]
        if len(finals) != len(self.last):
            raise APIError(500, "engine ended a request without output")
        return finals
