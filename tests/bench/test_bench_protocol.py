"""HTTP framing and SSE parsing, including reads split at every possible byte."""

from __future__ import annotations

import json

import pytest

from hasten.bench.httpclient import HttpError, ResponseParser
from hasten.bench.sse import iter_events, parse_stream


def chunked(*payloads: bytes) -> bytes:
    return b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in payloads) + b"0\r\n\r\n"


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENTS = [b'data: {"choices":[{"text":"Hello"}]}\n\n', b'data: {"choices":[{"text":" world"}]}\n\n',
          b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n', b"data: [DONE]\n\n"]


def test_chunked_body_survives_any_split() -> None:
    raw = HEAD + chunked(*EVENTS)
    for cut in range(1, len(raw)):
        p = ResponseParser()
        body = p.feed(raw[:cut]) + p.feed(raw[cut:])
        assert p.finished and p.status == 200 and p.keep_alive
        assert body == b"".join(EVENTS)
    p = ResponseParser()  # one byte at a time
    body = b"".join(p.feed(raw[i:i + 1]) for i in range(len(raw)))
    assert p.finished and body == b"".join(EVENTS)


def test_content_length_and_close() -> None:
    p = ResponseParser()
    assert p.feed(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 5\r\nConnection: close\r\n\r\nbu") == b"bu"
    assert not p.finished
    assert p.feed(b"sy") == b"sy" and p.feed(b"!") == b"!" and p.finished
    assert p.status == 503 and not p.keep_alive
    with pytest.raises(HttpError):
        ResponseParser().feed(b"garbage\r\n\r\n")


def test_event_time_is_read_that_completes_it() -> None:
    e1, e2 = EVENTS[0], EVENTS[1]
    pieces = [(1.0, e1[:10]), (2.0, e1[10:] + e2[:5]), (3.0, e2[5:])]
    events = iter_events(pieces)
    assert [t for t, _ in events] == [2.0, 3.0]


def test_completions_stream_with_usage() -> None:
    pieces = [(float(i), e) for i, e in enumerate(EVENTS)]
    s = parse_stream(pieces, chat=False)
    assert s.chunk_times == [0.0, 1.0] and s.text == "Hello world"
    assert s.usage == {"prompt_tokens": 3, "completion_tokens": 2} and s.done and not s.error


def test_chat_role_chunk_and_crlf_events_are_not_content() -> None:
    def ev(delta: dict) -> bytes:
        return b"data: " + json.dumps({"choices": [{"delta": delta}]}).encode() + b"\r\n\r\n"

    pieces = [(0.1, b": keep-alive comment\r\n\r\n"), (0.2, ev({"role": "assistant", "content": ""})),
              (0.5, ev({"content": "Hi"})), (0.6, ev({"content": None})), (0.7, ev({"content": "!"})),
              (0.8, b"data: [DONE]\r\n\r\n")]
    s = parse_stream(pieces, chat=True)
    assert s.chunk_times == [0.5, 0.7] and s.text == "Hi!" and s.usage is None


def test_error_event_is_reported() -> None:
    s = parse_stream([(0.1, b'data: {"error": {"type": "overloaded", "message": "x"}}\n\n')], chat=False)
    assert s.error == "stream_error:overloaded"
