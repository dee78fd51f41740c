"""HTTP/1.1 framing for both sides of the gateway, on httptools (llhttp, the parser Node.js ships).

llhttp runs in its strict mode (no lenient flags) and rejects, among others: Content-Length
together with Transfer-Encoding, duplicate or non-digit Content-Length, chunk sizes that are
not plain hex (``-6``, ``0x3``, ``1_0``, ``+3``) or overflow, bare CR or LF anywhere in the
framing, CTL bytes (NUL, CR, LF, ...) in header values, obs-fold and whitespace before the colon.
:class:`H1Reader` adds what llhttp leaves to its user: a head size limit (also for a head
arriving in many small pieces), a header count limit, a single Host, and only HTTP/1.0 and 1.1.

Each message is parsed once, as its bytes arrive: the work is linear in the input. While a
head (or a chunked body's trailer section) is incomplete its bytes are held back until a line
end (CR or LF) is in, so the parser, and the header values httptools joins from the pieces it
is given, see each line in a few pieces, also when the head is sent one byte at a time.
"""

from __future__ import annotations

import logging
import re
from collections import deque
from dataclasses import dataclass

from httptools import (
    HttpParserCallbackError,
    HttpParserError,
    HttpParserUpgrade,
    HttpRequestParser,
)

MAX_HEAD = 64 * 1024  # request line (status line) and header lines, bytes
MAX_HEADERS = 100  # header fields per message

log = logging.getLogger("hasten.gateway")


class ProtocolError(ValueError):
    """Malformed or unacceptable HTTP/1.1 input; ``status`` is the answer a client gets for it."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class H1Reader:
    """Parser callbacks and feeding shared by the client side (requests) and the upstream side
    (responses). A subclass sets ``_parser`` (an httptools parser with itself as the protocol),
    calls ``_reset_head`` from ``on_message_begin`` and ``_end_head`` from
    ``on_headers_complete``, and clears ``_chunk_open`` in ``on_body``.

    Limits cost nothing per header on the common path: a head that arrived within one feed of
    at most ``MAX_HEAD`` bytes cannot be larger; only bigger feeds get the head measured, and
    only a repeated header (joined with the earlier value) is counted as it comes. Trailer
    fields (after a chunked body) are counted against the same limits and then dropped.
    """

    _parser: object  # httptools.HttpRequestParser | httptools.HttpResponseParser
    headers: dict[str, str]
    _url: bytes
    _repeats: int  # header fields joined to an earlier one of the same name, and trailer fields
    _trailer_bytes: int
    _in_head: bool  # the parser holds part of a head (message begun, headers not complete)
    _chunk_open: bool  # a chunk header was parsed and no data of it yet: chunk data or trailers follow
    _span: int  # bytes fed to the parser since the current head began (an upper bound of its size)
    _hold: list[bytes] | None  # bytes held back from the parser until a line of them is complete
    _held: int
    _error: ProtocolError | None  # raised by one of our callbacks during feed_data

    def _init_reader(self) -> None:
        self.headers = {}
        self._url = b""
        self._repeats = 0
        self._trailer_bytes = 0
        self._in_head = False
        self._chunk_open = False
        self._span = 0
        self._hold = None
        self._held = 0
        self._error = None

    def _reset_head(self) -> None:
        self.headers = {}
        self._repeats = 0
        self._trailer_bytes = 0
        self._in_head = True
        self._chunk_open = False

    def _reject(self, message: str, status: int = 400) -> ProtocolError:
        """Record the error for ``_feed`` (httptools wraps what a callback raises) and return it."""
        err = self._error = ProtocolError(message, status)
        return err

    def _head_size(self) -> int:
        """The head's bytes as parsed so far (complete lines; the line breaks and separators counted)."""
        return len(self._url) + sum(len(k) + len(v) + 4 for k, v in self.headers.items())

    def _end_head(self) -> None:
        """The head is complete (``on_headers_complete``): raise if it is over a limit. Only a
        head fed in more than ``MAX_HEAD`` bytes needs measuring."""
        self._in_head = False
        if len(self.headers) + self._repeats > MAX_HEADERS or self._span > MAX_HEAD:
            self._check_head()

    def _check_head(self) -> None:
        if len(self.headers) + self._repeats > MAX_HEADERS:
            raise self._reject(f"more than {MAX_HEADERS} header fields", 431)
        if self._head_size() > MAX_HEAD:
            raise self._reject(f"head larger than {MAX_HEAD} bytes", 431)

    # -- llhttp callbacks ----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            self._trailer(name, value)
            return
        key = name.decode("latin-1").lower()
        headers = self.headers
        if key in headers:
            self._repeat(key, value)
        else:
            headers[key] = value.decode("latin-1")  # llhttp strips the leading whitespace, not the trailing

    def _repeat(self, key: str, value: bytes) -> None:
        if key == "host":
            raise self._reject("more than one Host header")
        self._repeats += 1
        if self._repeats > MAX_HEADERS:
            raise self._reject(f"more than {MAX_HEADERS} header fields", 431)
        joined = f"{self.headers[key]}, {value.decode('latin-1')}"
        if len(joined) > MAX_HEAD:
            raise self._reject(f"head larger than {MAX_HEAD} bytes", 431)
        self.headers[key] = joined

    def _trailer(self, name: bytes, value: bytes) -> None:
        self._repeats += 1
        self._trailer_bytes += len(name) + len(value) + 4
        if self._repeats > MAX_HEADERS or self._trailer_bytes > MAX_HEAD:
            raise self._reject(f"trailer section over {MAX_HEADERS} fields or {MAX_HEAD} bytes", 431)

    def on_chunk_header(self) -> None:
        self._chunk_open = True

    def on_chunk_complete(self) -> None:
        self._chunk_open = False

    # -- feeding ---------------------------------------------------------------------------

    def _feed(self, data: bytes) -> ProtocolError | None:
        """Parse ``data``; returns the error that ends this connection's input, if any."""
        hold = self._hold
        capped = False
        if hold is not None:  # inside a head or trailer section: give the parser whole lines only
            # (released at a CR too: a bare CR is then rejected without waiting for an LF)
            hold.append(data)
            self._held += len(data)
            if b"\n" not in data and b"\r" not in data:
                if self._in_head:
                    if self._held + self._span > MAX_HEAD:
                        return ProtocolError(f"head larger than {MAX_HEAD} bytes", 431)
                    return None
                if self._held < MAX_HEAD:
                    return None
                capped = True  # chunk data without a line break, or an oversize trailer line
            data = b"".join(hold)
            self._hold = None
            self._held = 0
            self._span = self._span + len(data) if self._in_head else len(data)
        else:
            self._span = len(data)
        try:
            self._parser.feed_data(data)  # type: ignore[attr-defined]
        except HttpParserUpgrade:
            return self._upgraded()
        except HttpParserError as exc:
            err, self._error = self._error, None
            if err is None and isinstance(exc, HttpParserCallbackError):  # a bug in a callback
                log.error("HTTP/1.1 parser callback failed", exc_info=exc.__context__)
                return ProtocolError("internal error while reading the message", 500)
            return err or ProtocolError(f"malformed HTTP/1.1 message: {exc}")
        if self._in_head:  # hold the rest of this head
            self._hold = []
            if self._span > len(data):  # not the feed it began in: the bytes fed so far bound it
                if self._span > MAX_HEAD:
                    return ProtocolError(f"head larger than {MAX_HEAD} bytes", 431)
            else:  # it began in this feed, maybe after other messages: its complete lines + the rest
                last = data.rfind(b"\n")
                self._span = len(data) if last < 0 else self._head_size() + len(data) - last - 1
                if self._span > MAX_HEAD:
                    return ProtocolError(f"head larger than {MAX_HEAD} bytes", 431)
        elif self._chunk_open:  # chunk data or a trailer section comes next
            if capped:  # no line break in MAX_HEAD bytes and still no chunk data: a trailer line
                return ProtocolError(f"trailer line longer than {MAX_HEAD} bytes", 431)
            self._hold = []
        return None

    def _upgraded(self) -> ProtocolError | None:
        """llhttp stopped at a protocol upgrade (``Connection: upgrade``, ``CONNECT``, 101)."""
        return ProtocolError("protocol upgrades are not supported", 501)


# where a client connection is in its current request (for the read timeouts)
IDLE, HEAD, BODY, CLOSING = range(4)


_METHODS = {m.encode(): m for m in ("GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH")}


@dataclass(slots=True)
class Request:
    method: str
    target: str
    headers: dict[str, str]  # lower-case names, repeated fields joined with ", "
    body: bytes
    keep_alive: bool


class RequestReader(H1Reader):
    """The request side: client bytes into complete :class:`Request` objects, queued in arrival
    order in ``requests`` (a pipelining client may send several before the first is answered); a
    :class:`ProtocolError` in the queue ends the connection after the requests before it.

    Beyond llhttp's own checks it rejects: a body larger than ``max_body`` (413 from the declared
    Content-Length before any body byte, or as soon as a chunked body passes it), a
    Transfer-Encoding other than ``chunked`` (501) or in an HTTP/1.0 request (400), and
    versions other than HTTP/1.0 and 1.1 (505). ``phase`` and ``phase_at`` (set from ``_now``,
    which the owner keeps current) tell the read timeouts where the request is.
    """

    def _init_requests(self, max_body: int) -> None:
        self._init_reader()
        self._parser = HttpRequestParser(self)
        self.requests: deque[Request | ProtocolError] = deque()
        self._max_body = max_body
        self._url = b""
        self._method = ""
        self._keep = True
        self._declared = 0  # the body length the head declared (-1: chunked)
        self._body: list[bytes] = []
        self._body_size = 0
        self.phase = IDLE
        self.phase_at = 0.0
        self._now = 0.0
        self.continue_owed = False  # a 100 Continue is due once the earlier requests are answered

    def _send_continue(self) -> None:
        """Write ``HTTP/1.1 100 Continue`` (the owner has the transport)."""
        raise NotImplementedError

    def on_message_begin(self) -> None:
        self._reset_head()
        self._url = b""
        self._body = []
        self._body_size = 0
        self.continue_owed = False
        self.phase = HEAD
        self.phase_at = self._now

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_headers_complete(self) -> None:
        self._end_head()
        headers = self.headers
        parser = self._parser
        version = parser.get_http_version()  # type: ignore[attr-defined]
        if version != "1.1" and version != "1.0":
            raise self._reject(f"HTTP/{version} is not supported (HTTP/1.0 and 1.1 are)", 505)
        te = headers.get("transfer-encoding")
        length = 0
        if te is not None:
            if version == "1.0":
                raise self._reject("Transfer-Encoding in an HTTP/1.0 request")
            if te.strip(" \t").lower() != "chunked":
                raise self._reject(f"unsupported Transfer-Encoding {te[:40]!r} (only chunked)", 501)
            length = -1
        else:
            cl = headers.get("content-length")
            if cl is not None:  # llhttp accepted it: digits only, not repeated
                length = int(cl)
                if length > self._max_body:
                    raise self._reject(f"request body larger than {self._max_body} bytes", 413)
        self._declared = length
        self._keep = parser.should_keep_alive()  # type: ignore[attr-defined]
        method = parser.get_method()  # type: ignore[attr-defined]
        self._method = _METHODS.get(method) or method.decode("ascii")
        self.phase = BODY
        self.phase_at = self._now
        expect = headers.get("expect")
        if length and expect is not None and expect.strip(" \t").lower() == "100-continue":
            if self.requests:  # answered in order: after the responses to the earlier requests
                self.continue_owed = True
            else:
                self._send_continue()

    def on_body(self, body: bytes) -> None:
        self._chunk_open = False
        size = self._body_size = self._body_size + len(body)
        if size > self._max_body:
            raise self._reject(f"request body larger than {self._max_body} bytes", 413)
        self._body.append(body)

    def on_message_complete(self) -> None:
        parts = self._body
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        self.continue_owed = False
        self.requests.append(Request(self._method, self._url.decode("latin-1"), self.headers, body, self._keep))
        self.phase = IDLE
        self.phase_at = self._now

    def _upgraded(self) -> ProtocolError | None:
        """Upgrade (h2c, websocket) or CONNECT: the request is answered in HTTP/1.1, then the
        connection closes. llhttp does not read the body of an upgrade request: one that
        declares a body is refused rather than served without it."""
        requests = self.requests
        if not requests or not isinstance(requests[-1], Request):
            return ProtocolError("protocol upgrades are not supported", 501)
        if self._declared:
            requests.pop()
            return ProtocolError("a request body with an Upgrade header is not supported "
                                 "(send the request without 'Upgrade' and 'Connection: upgrade')", 501)
        requests[-1].keep_alive = False
        return None


def frame_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"

REASONS = {200: "OK", 201: "Created", 204: "No Content", 400: "Bad Request", 401: "Unauthorized",
           403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
           411: "Length Required", 413: "Payload Too Large", 422: "Unprocessable Entity",
           429: "Too Many Requests", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
           501: "Not Implemented", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout",
           505: "HTTP Version Not Supported"}

_UNSAFE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # CTLs other than HTAB: never in a header line


def response_head(status: int, headers: dict[str, str], extra: bytes = b"") -> bytes:
    """Status line and header lines. A header whose name or value holds a CR, LF, NUL (any CTL but
    HTAB) or a character latin-1 cannot encode is dropped, never written."""
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}"]
    lines.extend(f"{k}: {v}" for k, v in headers.items())
    try:
        head = ("\r\n".join(lines) + "\r\n").encode("latin-1")
    except UnicodeEncodeError:
        head = b""
    # every line ends in the one CRLF put there: any other CR, LF or NUL came with a name or value
    if not head or len(head) - len(head.translate(None, b"\r\n\0")) != 2 * len(lines):
        head = _safe_head(lines[0], headers)
    return head + extra + b"\r\n"


def _safe_head(status_line: str, headers: dict[str, str]) -> bytes:
    lines = [status_line]
    for k, v in headers.items():
        line = f"{k}: {v}"
        if _UNSAFE.search(line) or max(map(ord, line)) > 0xFF:
            log.warning("dropped response header %r: CR, LF, NUL or another control character", k[:40])
            continue
        lines.append(line)
    return ("\r\n".join(lines) + "\r\n").encode("latin-1")
