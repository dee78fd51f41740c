"""One streamed OpenAI-compatible request -> one `RequestResult`."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from hasten.bench.datasets import RequestSpec
from hasten.bench.httpclient import HttpClient, HttpError
from hasten.bench.metrics import RequestResult
from hasten.bench.sse import parse_error_body, parse_stream
from hasten.bench.tokens import TokenCounter

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class Target:
    """A server under test."""

    name: str
    base_url: str
    model: str


@dataclass
class ClientOptions:
    endpoint: str = "completions"  # "completions" | "chat"
    api_key: str | None = None
    timeout: float = 300.0
    ignore_eos: bool = False
    temperature: float | None = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    keepalive: bool = True


class BenchClient:
    """Sends `RequestSpec`s to one target; all SSE parsing happens after the stream ends."""

    def __init__(self, target: Target, opts: ClientOptions, tokenizer: TokenCounter | None = None) -> None:
        if opts.endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {opts.endpoint!r}")
        self.target = target
        self.opts = opts
        self.tokenizer = tokenizer
        self.chat = opts.endpoint == "chat"
        self.path = ENDPOINTS[opts.endpoint]
        base = target.base_url.rstrip("/")
        if base.endswith("/v1"):  # accept both http://h:p and http://h:p/v1
            base = base[:-3]
        headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
        self.http = HttpClient(base, headers=headers, keepalive=opts.keepalive)

    def body(self, spec: RequestSpec) -> bytes:
        payload: dict[str, Any] = {"model": self.target.model, "max_tokens": spec.output_len,
                                   "stream": True, "stream_options": {"include_usage": True}}
        if self.chat:
            payload["messages"] = spec.messages
        else:
            payload["prompt"] = spec.prompt
        if self.opts.temperature is not None:
            payload["temperature"] = self.opts.temperature
        if self.opts.ignore_eos:
            payload["ignore_eos"] = True
        payload.update(self.opts.extra_body)
        return json.dumps(payload).encode()

    async def send(self, index: int, spec: RequestSpec) -> RequestResult:
        """Send one request. Only transport-level outcome is known on return; call
        `finalize()` (after the run) to parse the stream into chunks, text and token counts."""
        body = self.body(spec)
        result = RequestResult(index=index, start=time.perf_counter(), session=spec.session,
                               turn=spec.turn, prompt_tokens=spec.prompt_len)
        try:
            resp = await self.http.post(self.path, body, self.opts.timeout)
        except HttpError as exc:
            result.error, result.error_detail = exc.kind, exc.detail
            result.end = time.perf_counter()
            return result
        result.start, result.end = resp.start, resp.end
        if resp.status != 200:
            result.error = f"http_{resp.status}"
            result.error_detail = parse_error_body(resp.body)
            return result
        result.success = True  # provisional until finalize()
        result.raw = resp
        return result

    def finalize(self, result: RequestResult) -> RequestResult:
        """Parse a streamed response kept by `send()`; idempotent."""
        resp, result.raw = result.raw, None
        if resp is None:
            return result
        result.success = False
        parsed = parse_stream(resp.pieces, self.chat)
        result.chunk_times = parsed.chunk_times
        result.generated_text = parsed.text
        if parsed.error:
            result.error = parsed.error
            return result
        if not parsed.chunk_times:
            result.error = "empty_response"
            result.error_detail = "stream finished without any content chunk"
            return result
        usage = parsed.usage or {}
        if isinstance(usage.get("completion_tokens"), int):
            result.output_tokens, result.output_tokens_source = usage["completion_tokens"], "usage"
        elif self.tokenizer is not None:
            result.output_tokens = self.tokenizer.count(parsed.text)
            result.output_tokens_source = "tokenizer"
        else:
            result.output_tokens, result.output_tokens_source = len(parsed.chunk_times), "chunks"
        if isinstance(usage.get("prompt_tokens"), int):
            result.prompt_tokens = usage["prompt_tokens"]
        result.success = True
        return result

    async def request(self, index: int, spec: RequestSpec) -> RequestResult:
        """Send and parse at once (convenience for single requests, not for load runs)."""
        return self.finalize(await self.send(index, spec))

    def close(self) -> None:
        self.http.close()
