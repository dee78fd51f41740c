"""Exact response cache, and stream observation shared by the governance features.

The key is a hash of (tenant, model, stream flag, normalized messages or prompt, every
other request field: the sampling parameters). The tenant is always part of the key, so
an answer is never served to another tenant. By default only deterministic requests are
cached (``temperature: 0``, or ``top_k: 1``). Streaming answers are captured chunk by
chunk as they are forwarded and replayed later as a stream with the same bytes.
Only complete 200 answers are stored; a stream that broke or carried an error event is not.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from hasten.gateway.pipeline import GatewayResponse
from hasten.gateway.relay import Relay

# request fields that do not change the answer
_IGNORED = frozenset({"model", "stream", "user", "priority", "metadata", "stream_options"})


def normalize_text(text: str) -> str:
    return " ".join(text.split())


def prompt_text(payload: dict[str, Any]) -> str:
    """The request's prompt as one string: chat messages joined with their roles."""
    msgs = payload.get("messages")
    if isinstance(msgs, list):
        parts = []
        for m in msgs:
            if isinstance(m, dict):
                content = m.get("content")
                if not isinstance(content, str):
                    content = json.dumps(content, sort_keys=True)
                parts.append(f"{m.get('role', '')}: {normalize_text(content)}")
        return "\n".join(parts)
    prompt = payload.get("prompt")
    return normalize_text(prompt) if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def last_user_text(payload: dict[str, Any]) -> str:
    msgs = payload.get("messages")
    if isinstance(msgs, list):
        for m in reversed(msgs):
            if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str):
                return m["content"]
        return ""
    prompt = payload.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def params_of(payload: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in payload.items() if k not in _IGNORED and k not in ("messages", "prompt")}


def is_deterministic(payload: dict[str, Any]) -> bool:
    return payload.get("temperature") == 0 or payload.get("top_k") == 1


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def exact_key(tenant: str, model: str, payload: dict[str, Any], stream: bool) -> str:
    return "hasten:cache:" + _digest([tenant, model, stream, prompt_text(payload), params_of(payload)])


def partition_key(tenant: str, model: str, payload: dict[str, Any], stream: bool) -> str:
    """Semantic-cache partition: everything but the prompt text must match exactly."""
    return "hasten:sem:" + _digest([tenant, model, stream, params_of(payload)])


@dataclass
class CachedResponse:
    status: int
    content_type: str
    body: bytes = b""
    chunks: list[bytes] | None = None  # a stream: the body pieces as they were forwarded

    @property
    def size(self) -> int:
        return len(self.body) + sum(len(c) for c in self.chunks or ())

    def to_bytes(self) -> bytes:
        enc = base64.b64encode
        return json.dumps({"s": self.status, "ct": self.content_type, "b": enc(self.body).decode(),
                           "c": None if self.chunks is None else [enc(c).decode() for c in self.chunks]}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> CachedResponse:
        d = json.loads(raw)
        dec = base64.b64decode
        return cls(d["s"], d["ct"], dec(d["b"]), None if d["c"] is None else [dec(c) for c in d["c"]])

    def response(self, cache_status: str) -> GatewayResponse:
        headers = {"content-type": self.content_type, "x-hasten-cache": cache_status}
        if self.chunks is None:
            return GatewayResponse(self.status, headers, body=self.body)
        return GatewayResponse(self.status, headers, stream=_replay(self.chunks))


async def _replay(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for c in chunks:
        yield c


class MemoryCache:
    """LRU with a TTL per entry and a bound on the number of entries."""

    def __init__(self, max_entries: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self._clock = clock
        self._data: OrderedDict[str, tuple[float, bytes]] = OrderedDict()

    async def get(self, key: str) -> bytes | None:
        item = self._data.get(key)
        if item is None:
            return None
        if item[0] <= self._clock():
            del self._data[key]
            return None
        self._data.move_to_end(key)
        return item[1]

    async def set(self, key: str, value: bytes, ttl_s: float) -> None:
        self._data[key] = (self._clock() + ttl_s, value)
        self._data.move_to_end(key)
        while len(self._data) > self.max_entries:
            self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)


# -- observing a response without changing how it is delivered ----------------------------


def observe(resp: GatewayResponse, on_chunk: Callable[[bytes], None] | None,
            on_end: Callable[[bool], None]) -> None:
    """Call ``on_chunk`` for each body piece sent and ``on_end(clean)`` once at the end.

    A :class:`Relay` stream keeps its push mode (taps run in the socket callback); any
    other stream is wrapped. A plain body counts as one chunk, delivered now.
    """
    stream = resp.stream
    if stream is None:
        if on_chunk is not None:
            on_chunk(resp.body)
        on_end(True)
        return
    if isinstance(stream, Relay):
        if on_chunk is not None:
            stream.taps.append(on_chunk)
        stream.finishers.append(on_end)
        return
    resp.stream = _wrapped(stream, on_chunk, on_end)


async def _wrapped(inner: AsyncIterator[bytes], on_chunk: Callable[[bytes], None] | None,
                   on_end: Callable[[bool], None]) -> AsyncIterator[bytes]:
    clean = False
    try:
        async for chunk in inner:
            if on_chunk is not None:
                on_chunk(chunk)
            yield chunk
        clean = True
    finally:
        aclose = getattr(inner, "aclose", None)
        if aclose is not None:
            await aclose()
        on_end(clean)


class StreamCapture:
    """Collects a response's pieces for the cache; gives up past ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.chunks: list[bytes] | None = []
        self.size = 0
        self.error = False

    def __call__(self, data: bytes) -> None:
        if self.chunks is None:
            return
        self.size += len(data)
        if self.size > self.max_bytes:
            self.chunks = None
            return
        if b'data: {"error"' in data:
            self.error = True
        self.chunks.append(data)
