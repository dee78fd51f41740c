"""Turn a finished, timestamped SSE body into timed content chunks.

This runs after the response has fully arrived, so its cost never shows up in latency.
An event is timestamped with the arrival of the read that completed it (its blank line).
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass, field
from typing import Any

_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


@dataclass
class ParsedStream:
    """Content chunks with their arrival times, plus what the server reported."""

    chunk_times: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: str = ""
    done: bool = False  # saw `data: [DONE]`

    @property
    def text(self) -> str:
        return "".join(self.texts)


def iter_events(pieces: list[tuple[float, bytes]]) -> list[tuple[float, bytes]]:
    """Split the body into SSE events, each with the time its last byte arrived."""
    ends: list[int] = []
    total = 0
    for _, piece in pieces:
        total += len(piece)
        ends.append(total)
    body = b"".join(p for _, p in pieces)
    events: list[tuple[float, bytes]] = []
    pos = 0
    for match in _EVENT_END.finditer(body):
        idx = bisect.bisect_left(ends, match.end())
        events.append((pieces[min(idx, len(pieces) - 1)][0], body[pos:match.start()]))
        pos = match.end()
    if body[pos:].strip():  # a final event without the trailing blank line
        events.append((pieces[-1][0], body[pos:]))
    return events


def _event_data(event: bytes) -> str | None:
    """Join the `data:` lines of one event (None for comments / other fields only)."""
    lines: list[str] = []
    for line in event.decode("utf-8", "replace").splitlines():
        if line.startswith("data:"):
            lines.append(line[5:].removeprefix(" "))
    return "\n".join(lines) if lines else None


def chunk_content(obj: dict[str, Any], chat: bool) -> str:
    """The generated text carried by one streamed JSON chunk ("" if none)."""
    parts: list[str] = []
    for choice in obj.get("choices") or ():
        if chat:
            delta = choice.get("delta") or {}
            for key in ("content", "reasoning_content", "reasoning"):
                value = delta.get(key)
                if isinstance(value, str) and value:
                    parts.append(value)
        else:
            value = choice.get("text")
            if isinstance(value, str) and value:
                parts.append(value)
    return "".join(parts)


def parse_stream(pieces: list[tuple[float, bytes]], chat: bool) -> ParsedStream:
    """Parse an OpenAI-style SSE stream (completions or chat.completions)."""
    out = ParsedStream()
    for t, event in iter_events(pieces):
        data = _event_data(event)
        if data is None:
            continue
        if data.strip() == "[DONE]":
            out.done = True
            continue
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            out.error = out.error or "bad_chunk"
            continue
        if not isinstance(obj, dict):
            continue
        if obj.get("error"):
            err = obj["error"]
            kind = (err.get("type") or err.get("code")) if isinstance(err, dict) else None
            out.error = f"stream_error:{kind or 'error'}"
            continue
        if obj.get("usage"):
            out.usage = obj["usage"]
        content = chunk_content(obj, chat)
        if content:
            out.chunk_times.append(t)
            out.texts.append(content)
    return out


def parse_error_body(body: bytes) -> str:
    """A short human-readable message from an error response body."""
    text = body.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
        if isinstance(obj, dict):
            err = obj.get("error", obj.get("detail", obj))
            if isinstance(err, dict):
                return str(err.get("message") or err)[:300]
            return str(err)[:300]
    except json.JSONDecodeError:
        pass
    return text[:300]
