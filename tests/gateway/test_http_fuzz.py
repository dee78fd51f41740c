"""Property-based fuzzing of the gateway's HTTP/1.1 handling (hypothesis), both directions.

Inputs are built from HTTP parts, valid and hostile (smuggling headers, bad chunk sizes,
CR/LF/NUL in values, wrong line ends, random bytes), then mutated and cut into random
pieces. Invariants, for every input: the gateway finishes within a generous CPU bound; what
it writes upstream and to the client is well-formed HTTP/1.1 with safe header lines; one
request in gives at most one request upstream; a valid input is served exactly.
"""

from __future__ import annotations

import asyncio
import time

from h1_harness import BODY, Harness, read_responses, well_formed_head
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CPU_BOUND_S = 5.0  # per input; the real cost is milliseconds (a hang or quadratic blow-up fails)

EOL = st.sampled_from([b"\r\n"] * 8 + [b"\n", b"\r", b"\r\r\n", b"\n\r"])
VALUES = st.one_of(
    st.sampled_from([b"chunked", b" chunked", b"chunked, chunked", b"gzip, chunked", b"identity", b"5", b"+5",
                     b"-5", b"0x5", b"6_5", b"5, 5", b"100-continue", b"close", b"keep-alive", b"upgrade",
                     b"h2c", b"abc\nSet-Cookie: x=1", b"a\rb", b"a\x00b", b"a\tb", b"\xff\xfe", b""]),
    st.binary(max_size=12),
)
NAMES = st.one_of(
    st.sampled_from([b"Content-Length", b"Transfer-Encoding", b"Host", b"X-Request-ID", b"Expect",
                     b"Connection", b"Upgrade", b"Content-Type", b"X-A", b"X-A ", b" X-A", b"X\x00A"]),
    st.binary(min_size=1, max_size=8),
)


GOOD_SIZES = ["%x", "%X", "%x;ext=1", "0%x"]
GOOD_TRAILERS = [b"", b"X-T: 1\r\n", b"X-Request-ID: smuggled\r\n"]


@st.composite
def chunked_body(draw: st.DrawFn, body: bytes) -> tuple[bytes, bool]:
    """``(wire, valid)``: ``body`` in chunks, with good or bad chunk sizes, line ends, trailers."""
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=4)))
    parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True) if b > a]
    size = draw(st.sampled_from(GOOD_SIZES * 2 + ["0x%x", "-%x", "+%x", "%x ", " %x", "%x_0"]))
    eol = draw(EOL)
    wire = b"".join((size % len(p)).encode() + eol + p + b"\r\n" for p in parts)
    trailer = draw(st.sampled_from([*GOOD_TRAILERS, b"X-T: a\nb\r\n", b"X T: 1\r\n"]))
    valid = (size in GOOD_SIZES and eol == b"\r\n" or not parts) and trailer in GOOD_TRAILERS
    return wire + b"0\r\n" + trailer + b"\r\n", valid


@st.composite
def request(draw: st.DrawFn) -> bytes:
    method = draw(st.sampled_from([b"POST"] * 6 + [b"GET", b"HEAD", b"PUT", b"FOO", b"post", b"CONNECT"]))
    target = draw(st.sampled_from([b"/v1/chat/completions"] * 6 + [b"/health", b"/v1/models", b"/x", b"*",
                                                                   b"/a b", b"/a\x00"]))
    version = draw(st.sampled_from([b"HTTP/1.1"] * 6 + [b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.2", b"HTTP/0.9"]))
    eol = draw(EOL)
    body = draw(st.sampled_from([BODY, b"", b"{}", b"not json"]))
    framing = draw(st.sampled_from(["length", "length", "chunked", "none", "wrong_length", "both"]))
    headers = [(b"Host", b"gw")]
    if framing in ("length", "both"):
        headers.append((b"Content-Length", b"%d" % len(body)))
    elif framing == "wrong_length":
        headers.append((b"Content-Length", b"%d" % (len(body) + draw(st.integers(-3, 3)))))
    if framing in ("chunked", "both"):
        headers.append((b"Transfer-Encoding", b"chunked"))
    headers += draw(st.lists(st.tuples(NAMES, VALUES), max_size=4))
    order = draw(st.permutations(headers))
    head = method + b" " + target + b" " + version + eol + b"".join(n + b": " + v + eol for n, v in order) + eol
    payload = draw(chunked_body(body))[0] if framing in ("chunked", "both") else body
    return head + payload


@st.composite
def mutated(draw: st.DrawFn, parts: st.SearchStrategy[bytes]) -> bytes:
    wire = bytearray(draw(parts))
    for _ in range(draw(st.integers(0, 3))):
        if not wire:
            break
        i = draw(st.integers(0, len(wire) - 1))
        op = draw(st.sampled_from(["set", "insert", "delete"]))
        byte = draw(st.sampled_from([0, 10, 13, 32, 9, 58, 48, 255]) | st.integers(0, 255))
        if op == "set":
            wire[i] = byte
        elif op == "insert":
            wire.insert(i, byte)
        else:
            del wire[i]
    return bytes(wire)


def pieces(data: st.DataObject, n: int) -> list[int]:
    return data.draw(st.lists(st.integers(1, max(1, n)), min_size=1, max_size=12))


def count_requests(wire: bytes) -> int:
    """An upper bound of the requests a client stream holds: every request has a head end."""
    return wire.count(b"\r\n\r\n") + wire.count(b"\n\n")


def check_upstream(sent: bytes) -> None:
    """One request, well-formed, its body exactly as long as its Content-Length says."""
    head, sep, body = sent.partition(b"\r\n\r\n")
    assert sep and well_formed_head(head), sent[:300]
    assert head.startswith(b"POST /v1/") and head.count(b"\r\n\r\n") == 0
    lengths = [line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length: ")]
    assert len(lengths) == 1 and int(lengths[0][16:]) == len(body), head
    assert b"transfer-encoding" not in head.lower()


def run_client(wire: bytes, cuts: list[int]) -> Harness:
    async def go() -> Harness:
        h = Harness(max_body_bytes=4096)
        await h.send(wire, cuts)
        await h.close()
        return h

    t0 = time.process_time()
    h = asyncio.run(go())
    assert time.process_time() - t0 < CPU_BOUND_S
    return h


@SETTINGS
@given(wire=st.lists(request(), min_size=1, max_size=3).map(b"".join).flatmap(lambda w: mutated(st.just(w))),
       data=st.data())
def test_client_side_fuzz(wire: bytes, data: st.DataObject) -> None:
    h = run_client(wire, pieces(data, len(wire)))
    assert len(h.forwarded) <= count_requests(wire)
    for sent in h.forwarded:
        check_upstream(sent)
    responses = read_responses(h.out)  # complete, well-formed responses only
    finals = [r for r in responses if r[0] >= 200]
    assert len(finals) <= count_requests(wire) + 1  # +1: an error answer to an unfinished request


@SETTINGS
@given(wire=st.lists(request(), min_size=1, max_size=3).map(b"".join), data=st.data())
def test_client_side_fuzz_unmutated_is_served_like_whole(wire: bytes, data: st.DataObject) -> None:
    """Whatever the cut, a stream gets the same answers and forwards the same requests."""
    whole = run_client(wire, [len(wire)])
    cut = run_client(wire, pieces(data, 64))
    assert [r[0] for r in read_responses(cut.out)] == [r[0] for r in read_responses(whole.out)]
    strip = [s.split(b"x-request-id:")[0] for s in whole.forwarded]
    assert [s.split(b"x-request-id:")[0] for s in cut.forwarded] == strip
    assert len(whole.forwarded) <= wire.count(b"POST /v1/chat/completions")


# -- responses from a (possibly malicious) backend --------------------------------------------


@st.composite
def response(draw: st.DrawFn) -> tuple[bytes, bytes | None]:
    """``(wire, body)``: ``body`` is what a correct reader delivers, None when the wire is invalid."""
    status = draw(st.sampled_from([b"200 OK"] * 6 + [b"404 Not Found", b"204 No Content", b"2000 X", b"20 X"]))
    version = draw(st.sampled_from([b"HTTP/1.1"] * 6 + [b"HTTP/1.0", b"HTTP/2.0"]))
    eol = draw(EOL)
    body = draw(st.sampled_from([b"data: a\n\n", b"{}", b"", b"x" * 300]))
    framing = draw(st.sampled_from(["length", "chunked", "chunked", "both", "wrong_length"]))
    headers = [(b"content-type", b"text/event-stream")]
    if framing in ("length", "both"):
        headers.append((b"content-length", b"%d" % len(body)))
    elif framing == "wrong_length":
        headers.append((b"content-length", b"%d" % (len(body) + 1)))
    if framing in ("chunked", "both"):
        headers.append((b"transfer-encoding", b"chunked"))
    extra = draw(st.lists(st.tuples(NAMES, VALUES), max_size=3))
    interim = draw(st.sampled_from([b"", b"", b"HTTP/1.1 100 Continue\r\n\r\n"]))
    head = (interim + version + b" " + status + eol + b"".join(n + b": " + v + eol for n, v in headers + extra)
            + eol)
    valid = (not extra and eol == b"\r\n" and version == b"HTTP/1.1" and status == b"200 OK"
             and framing in ("length", "chunked"))
    payload = body
    if framing in ("chunked", "both"):
        payload, good = draw(chunked_body(body))
        valid = valid and good
    return head + payload, body if valid else None


@SETTINGS
@given(case=response(), data=st.data())
def test_upstream_side_fuzz(case: tuple[bytes, bytes | None], data: st.DataObject) -> None:
    from test_h1 import Sink, _upstream

    wire, _ = case
    wire = data.draw(mutated(st.just(wire)))
    pool, conn, tx = _upstream()
    sink = Sink()
    conn.start(b"POST / HTTP/1.1\r\n\r\n", sink)
    t0 = time.process_time()
    pos = 0
    for n in pieces(data, len(wire)):
        if conn.sink is None:
            break
        conn.data_received(wire[pos:pos + n])
        pos += n
    if conn.sink is not None and pos < len(wire):
        conn.data_received(wire[pos:])
    conn.connection_lost(None)  # the backend is gone: the exchange must end now if it did not
    assert time.process_time() - t0 < CPU_BOUND_S
    kinds = [e[0] for e in sink.events]
    assert kinds.count("end") + kinds.count("error") == 1 and kinds[-1] in ("end", "error")
    assert kinds.count("head") <= 1 and ("data" not in kinds or kinds.index("head") < kinds.index("data"))
    for event in sink.events:
        if event[0] == "head":
            for k, v in event[2].items():
                assert well_formed_head(b"HTTP/1.1 200 OK\r\n" + f"{k}: {v}".encode("latin-1"))


@SETTINGS
@given(case=response(), data=st.data())
def test_backend_answers_reach_the_client_well_formed(case: tuple[bytes, bytes | None],
                                                      data: st.DataObject) -> None:
    wire, body = case

    async def go() -> Harness:
        h = Harness()
        h.client.data_received(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
        await asyncio.sleep(0)
        assert h.upstream_tx.out
        pos = 0
        for n in pieces(data, len(wire)):
            if h.upstream.sink is None:
                break
            h.upstream.data_received(wire[pos:pos + n])
            pos += n
            await asyncio.sleep(0)
        if h.upstream.sink is not None and pos < len(wire):
            h.upstream.data_received(wire[pos:])
        if h.upstream.sink is not None:
            h.upstream.connection_lost(None)
        await h.settle()
        await h.close()
        return h

    t0 = time.process_time()
    h = asyncio.run(go())
    assert time.process_time() - t0 < CPU_BOUND_S
    (resp,) = [r for r in read_responses(h.out) if r[0] >= 200]
    if body is not None:  # a valid answer is passed on exactly
        assert resp[0] == 200 and resp[2] == body, (wire, h.out)
