"""The HTTP/1.1 reader (llhttp via httptools) on both sides of the gateway, without sockets."""

from __future__ import annotations

import random

import pytest

from hasten.gateway.config import parse_config
from hasten.gateway.h1 import (
    MAX_HEAD,
    ProtocolError,
    Request,
    RequestReader,
    frame_chunk,
    response_head,
)
from hasten.gateway.testing import MemoryTransport
from hasten.gateway.upstream import UpstreamConnection, UpstreamPool


class Reader(RequestReader):
    def __init__(self, max_body: int = 1 << 20) -> None:
        self._init_requests(max_body)
        self.continues = 0

    def _send_continue(self) -> None:
        self.continues += 1

    def feed_all(self, data: bytes, step: int | None = None, rng: random.Random | None = None) -> None:
        pos = 0
        while pos < len(data):
            n = step or (rng.randint(1, 40) if rng else len(data))
            err = self._feed(data[pos:pos + n])
            if err is not None:
                self.requests.append(err)
                return
            pos += n


PIPELINE = (b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: a\r\nX-Dup: 1\r\nx-dup: 2\r\nContent-Length: 5\r\n\r\nhello"
            b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
            + frame_chunk(b"data: one\n\n") + b"a;ext=1\r\n" + b"x" * 10 + b"\r\n0\r\nX-Trailer: 1\r\n\r\n"
            b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
            b"GET /v1/models HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
EXPECTED = [
    Request("POST", "/v1/chat/completions?x=1", {"host": "a", "x-dup": "1, 2", "content-length": "5"}, b"hello",
            True),
    Request("POST", "/v1/completions", {"host": "a", "transfer-encoding": "chunked"},
            b"data: one\n\n" + b"x" * 10, True),
    Request("GET", "/health", {"connection": "keep-alive"}, b"", True),
    Request("GET", "/v1/models", {"host": "a", "connection": "close"}, b"", False),
]


@pytest.mark.parametrize("split", ["whole", "bytewise", "random"])
def test_pipelined_requests_any_split(split: str) -> None:
    for seed in range(20 if split == "random" else 1):
        r = Reader()
        r.feed_all(PIPELINE, step=1 if split == "bytewise" else None,
                   rng=random.Random(seed) if split == "random" else None)
        assert list(r.requests) == EXPECTED


def test_nothing_is_read_after_a_request_that_closes() -> None:
    r = Reader()
    r.feed_all(b"GET /health HTTP/1.0\r\n\r\nGET /health HTTP/1.1\r\n\r\n")
    first, second = r.requests
    assert isinstance(first, Request) and not first.keep_alive
    assert isinstance(second, ProtocolError)  # after the answer to the first, the connection closes


def test_partial_chunks_and_trailing_whitespace() -> None:
    r = Reader()
    r.feed_all(b"POST / HTTP/1.1\r\nHost: a\r\nX-A: v  \r\nTransfer-Encoding: chunked\r\n\r\nA\r\nhello")
    assert not r.requests and r._body == [b"hello"]  # a partial chunk is taken as it comes
    r.feed_all(b"world\r\n0\r\n\r\n")
    (req,) = r.requests
    assert isinstance(req, Request) and req.body == b"helloworld"
    assert req.headers["x-a"] == "v  "  # forwarded as sent; no CR, LF or NUL can be in it


def test_body_limit_from_declared_length_and_from_chunks() -> None:
    r = Reader(max_body=10)
    r.feed_all(b"POST / HTTP/1.1\r\nContent-Length: 11\r\n\r\n")  # no body byte needed for the 413
    (err,) = r.requests
    assert isinstance(err, ProtocolError) and err.status == 413
    r = Reader(max_body=10)
    r.feed_all(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\nworld!\r\n")
    (err,) = r.requests
    assert isinstance(err, ProtocolError) and err.status == 413


def test_trailers_are_dropped_and_bounded() -> None:
    head = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n"
    r = Reader()
    r.feed_all(head + b"X-Request-ID: smuggled\r\n\r\n", step=1)
    (req,) = r.requests
    assert isinstance(req, Request) and req.body == b"{}" and "x-request-id" not in req.headers
    for trailers in (b"X-Long: " + b"a" * MAX_HEAD, b"X-T: v\r\n" * 101 + b"\r\n"):
        r = Reader()
        r.feed_all(head + trailers, step=1)
        (err,) = r.requests
        assert isinstance(err, ProtocolError) and err.status == 431


def test_trailer_limits_are_per_request() -> None:
    r = Reader()
    trailers = b"X-T: v\r\n" * 60 + b"X-Big: " + b"a" * (MAX_HEAD // 3) + b"\r\n"
    one = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n" + trailers + b"\r\n"
    r.feed_all(one * 5)
    assert [type(x) for x in r.requests] == [Request] * 5


def test_expect_continue_is_owed_behind_earlier_requests() -> None:
    r = Reader()
    r.feed_all(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
    assert r.continues == 1  # nothing before it: answered at once
    r.feed_all(b"{}")
    r.feed_all(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
    assert r.continues == 1 and r.continue_owed  # the first request is not answered yet
    r = Reader()
    r.feed_all(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 0\r\n\r\n")
    assert r.continues == 0  # no body: nothing to continue


def test_head_limit_holds_for_a_head_sent_byte_by_byte() -> None:
    line = b"GET / HTTP/1.1\r\n"
    ok = line + b"X-Big: " + b"a" * (MAX_HEAD - len(line) - 40) + b"\r\n\r\n"
    r = Reader()
    r.feed_all(ok, step=1)
    assert isinstance(r.requests[0], Request)
    r = Reader()
    r.feed_all(line + b"X-Big: " + b"a" * MAX_HEAD, step=1)  # no line end ever comes
    (err,) = r.requests
    assert isinstance(err, ProtocolError) and err.status == 431


def test_head_after_a_large_chunked_body_is_not_measured_with_it() -> None:
    big = b"x" * (4 * MAX_HEAD)
    r = Reader(max_body=1 << 22)
    # a read that ends right after a chunk-size line, then one with the rest and half a head
    r.feed_all(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n1\r\n" % (len(big), big))
    r.feed_all(b"y\r\n0\r\n\r\nGET / HTTP/1.1\r\nHost: a")
    r.feed_all(b"\r\n\r\n")
    assert [type(x) for x in r.requests] == [Request, Request] and r.requests[0].body == big + b"y"


def test_upgrade_requests() -> None:
    r = Reader()
    r.feed_all(b"GET /health HTTP/1.1\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n")
    (req,) = r.requests
    assert isinstance(req, Request) and not req.keep_alive  # answered in HTTP/1.1, then closed
    r = Reader()
    r.feed_all(b"POST / HTTP/1.1\r\nConnection: upgrade\r\nUpgrade: h2c\r\nContent-Length: 2\r\n\r\n{}")
    (err,) = r.requests
    assert isinstance(err, ProtocolError) and err.status == 501  # llhttp would drop the body


def test_response_head_never_writes_unsafe_header_lines() -> None:
    head = response_head(200, {"a": "1", "x-evil": "abc\r\nset-cookie: x=1", "x-nul": "a\0b", "x-wide": "\u20ac",
                               "b": "2\t3"})
    assert head == b"HTTP/1.1 200 OK\r\na: 1\r\nb: 2\t3\r\n\r\n"
    assert response_head(404, {"content-length": "0"}) == b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_head(self, status: int, headers: dict[str, str]) -> None:
        self.events.append(("head", status, dict(headers)))

    def on_data(self, data: bytes, last: bool = False) -> None:
        self.events.append(("data", data, last))

    def on_end(self) -> None:
        self.events.append(("end",))

    def on_error(self, exc: BaseException) -> None:
        self.events.append(("error", exc))

    @property
    def body(self) -> bytes:
        return b"".join(e[1] for e in self.events if e[0] == "data")


def _upstream() -> tuple[UpstreamPool, UpstreamConnection, MemoryTransport]:
    parse_config({"models": [{"name": "m", "backends": [{"url": "http://127.0.0.1:9"}]}]})
    pool = UpstreamPool("127.0.0.1", 9, 1.0)
    conn = UpstreamConnection(pool)
    tx = MemoryTransport()
    conn.connection_made(tx)
    return pool, conn, tx


SSE = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
       b"transfer-encoding: chunked\r\n\r\n" + frame_chunk(b"data: a\n\n") + frame_chunk(b"data: b\n\n")
       + b"0\r\n\r\n")


def test_upstream_response_any_split_and_reuse() -> None:
    rng = random.Random(3)
    pool, conn, tx = _upstream()
    for i in range(30):
        sink = Sink()
        conn.start(b"POST / HTTP/1.1\r\n\r\n", sink)
        pos = 0
        while pos < len(SSE):
            n = 1 if i == 0 else rng.randint(1, 30)
            conn.data_received(SSE[pos:pos + n])
            pos += n
        assert sink.events[0] == ("head", 200, {"content-type": "text/event-stream", "transfer-encoding": "chunked"})
        assert sink.body == b"data: a\n\ndata: b\n\n" and sink.events[-1] == ("end",)
        assert [e for e in sink.events if e[0] == "data"][-1][2] or sink.events[-2][0] == "data"
        assert pool.idle == 1 and pool.take_idle() is conn


def test_upstream_last_piece_is_marked_and_extra_bytes_close() -> None:
    pool, conn, tx = _upstream()
    sink = Sink()
    conn.start(b"x", sink)
    conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}HTTP/1.1 200 OK\r\n")
    assert sink.events[1:] == [("data", b"{}", True), ("end",)]
    assert pool.idle == 0 and tx.closing  # out of sync: not reused


def test_upstream_close_delimited_head_and_head_only() -> None:
    pool, conn, tx = _upstream()
    sink = Sink()
    conn.start(b"x", sink)
    conn.data_received(b"HTTP/1.1 200 OK\r\n\r\nab")
    conn.data_received(b"cd")
    conn.connection_lost(None)
    assert sink.body == b"abcd" and sink.events[-1] == ("end",)
    pool, conn, tx = _upstream()
    sink = Sink()
    conn.start(b"HEAD / HTTP/1.1\r\n\r\n", sink, expect_body=False)
    conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n")
    assert [e[0] for e in sink.events] == ["head", "end"]


def test_upstream_rejects_a_bad_response_and_drops_the_connection() -> None:
    pool, conn, tx = _upstream()
    sink = Sink()
    conn.start(b"x", sink)
    conn.data_received(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n-6\r\nabcdef\r\n")
    assert len(sink.events) == 1 and sink.events[0][0] == "error" and isinstance(sink.events[0][1], ProtocolError)
    assert tx.closing and pool.idle == 0
