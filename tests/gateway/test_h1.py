"""The HTTP/1.1 parsing helpers used on both sides of the gateway."""

from __future__ import annotations

import random

import pytest

from hasten.gateway.h1 import (
    ChunkedDecoder,
    ProtocolError,
    frame_chunk,
    keep_alive,
    parse_request_head,
    parse_response_head,
)


def test_chunked_decoder_any_split() -> None:
    payloads = [b"data: one\n\n", b"x" * 5000, b"data: [DONE]\n\n"]
    wire = b"".join(frame_chunk(p) for p in payloads) + b"0\r\nX-Trailer: 1\r\n\r\nNEXT"
    rng = random.Random(7)
    for _ in range(50):
        dec = ChunkedDecoder()
        out = b""
        pos = 0
        while pos < len(wire) and not dec.done:
            step = rng.randint(1, 40)
            out += b"".join(dec.feed(wire[pos:pos + step]))
            pos += step
        assert dec.done and out == b"".join(payloads)
        assert (dec.extra + wire[pos:]) == b"NEXT"


def test_chunked_decoder_last_chunk_with_terminator() -> None:
    dec = ChunkedDecoder()
    assert dec.feed(b"5\r\nhello\r\n0\r\n\r\n") == [b"hello"]
    assert dec.done and dec.extra == b""
    dec = ChunkedDecoder()  # not the fast shape: trailers and extra bytes after the body
    assert dec.feed(b"5\r\nhello\r\n0\r\nx-t: 1\r\n\r\nGET") == [b"hello"]
    assert dec.done and dec.extra == b"GET"


def test_chunked_decoder_forwards_partial_chunks_immediately() -> None:
    dec = ChunkedDecoder()
    assert dec.feed(b"a;ext=1\r\nhello") == [b"hello"]  # no waiting for the rest of the chunk
    assert dec.feed(b"world\r\n0\r\n\r\n") == [b"world"]
    assert dec.done


def test_chunked_decoder_rejects_garbage() -> None:
    with pytest.raises(ProtocolError):
        ChunkedDecoder().feed(b"zz\r\n")
    with pytest.raises(ProtocolError):
        ChunkedDecoder().feed(b"2\r\nabXX")


def test_heads() -> None:
    method, target, version, headers = parse_request_head(
        b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: a\r\nX-Dup: 1\r\nx-dup: 2")
    assert (method, target, version) == ("POST", "/v1/chat/completions?x=1", "HTTP/1.1")
    assert headers == {"host": "a", "x-dup": "1, 2"}
    assert parse_response_head(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0") == (
        503, {"content-length": "0"})
    assert keep_alive("HTTP/1.1", {}) and not keep_alive("HTTP/1.1", {"connection": "close"})
    assert not keep_alive("HTTP/1.0", {}) and keep_alive("HTTP/1.0", {"connection": "keep-alive"})
    for bad in (b"GET /\r\n", b"GET / HTTP/2\r\n", b"GET / HTTP/1.1\r\nno-colon"):
        with pytest.raises(ProtocolError):
            parse_request_head(bad)
