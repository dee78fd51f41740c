"""Minimal HTTP/1.1 message parsing shared by the frontend server and the upstream client.

Only what a proxy needs: request/response heads, ``Content-Length`` and ``chunked``
bodies (decoded incrementally, never waiting for more than the bytes at hand).
"""

from __future__ import annotations

MAX_HEAD = 64 * 1024

_SIZE, _DATA, _CRLF, _TRAILER = range(4)


class ProtocolError(ValueError):
    """Malformed HTTP/1.1 input."""


def parse_headers(lines: list[str]) -> dict[str, str]:
    """Header lines (latin-1 text) into a dict with lower-case names; repeats are joined with ', '."""
    headers: dict[str, str] = {}
    for line in lines:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name[0] in " \t" or name[-1] in " \t":
            raise ProtocolError(f"malformed header line {line[:80]!r}")
        key = name.lower()
        if key in headers:
            headers[key] = f"{headers[key]}, {value.strip()}"
        else:
            headers[key] = value.strip()
    return headers


def parse_request_head(head: bytes) -> tuple[str, str, str, dict[str, str]]:
    """``(method, target, version, headers)`` from the bytes before the blank line."""
    lines = head.decode("latin-1").split("\r\n")  # latin-1 maps every byte: decoding cannot fail
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ProtocolError(f"malformed request line {lines[0][:80]!r}")
    return parts[0], parts[1], parts[2], parse_headers(lines[1:])


def parse_response_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    status_line = lines[0]
    if not status_line.startswith("HTTP/1.") or len(status_line) < 12:
        raise ProtocolError(f"malformed status line {status_line[:80]!r}")
    try:
        status = int(status_line[9:12])
    except ValueError:
        raise ProtocolError(f"malformed status line {status_line[:80]!r}") from None
    return status, parse_headers(lines[1:])


def keep_alive(version: str, headers: dict[str, str]) -> bool:
    conn = headers.get("connection", "").lower()
    if version == "HTTP/1.0":
        return "keep-alive" in conn
    return "close" not in conn


class ChunkedDecoder:
    """Incremental ``Transfer-Encoding: chunked`` decoder.

    ``feed`` returns the payload bytes decodable from the input so far (possibly a part of
    a chunk: nothing is held back waiting for a chunk to complete). After the terminating
    zero-size chunk and trailers, ``done`` is True and ``extra`` holds any bytes that follow.
    """

    __slots__ = ("state", "remaining", "pending", "done", "extra")

    def __init__(self) -> None:
        self.state = _SIZE
        self.remaining = 0
        self.pending = b""
        self.done = False
        self.extra = b""

    def feed(self, data: bytes) -> list[bytes]:
        if self.state == _SIZE and not self.pending:
            # fast paths: exactly one complete chunk (the common case for SSE token streams), or one
            # complete chunk and the terminating zero-size chunk without trailers (the usual end)
            eol = data.find(b"\r\n")
            if 0 < eol <= 8:
                try:
                    size = int(data[:eol], 16)
                except ValueError:
                    size = 0
                end = eol + 2 + size
                if size and len(data) == end + 2 and data.endswith(b"\r\n"):
                    return [data[eol + 2:end]]
                if size and len(data) == end + 7 and data.endswith(b"\r\n0\r\n\r\n"):
                    self.done = True
                    return [data[eol + 2:end]]
        if self.pending:
            data = self.pending + data
            self.pending = b""
        out: list[bytes] = []
        pos, n = 0, len(data)
        while pos < n and not self.done:
            state = self.state
            if state == _DATA:
                take = min(self.remaining, n - pos)
                out.append(data[pos:pos + take])
                pos += take
                self.remaining -= take
                if not self.remaining:
                    self.state = _CRLF
            elif state == _CRLF:
                if n - pos < 2:
                    self.pending = data[pos:]
                    break
                if data[pos:pos + 2] != b"\r\n":
                    raise ProtocolError("missing CRLF after chunk data")
                pos += 2
                self.state = _SIZE
            else:
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    if n - pos > 4096:
                        raise ProtocolError("chunk size line too long")
                    self.pending = data[pos:]
                    break
                line = data[pos:eol]
                pos = eol + 2
                if state == _TRAILER:
                    if not line:
                        self.done = True
                        self.extra = data[pos:]
                    continue
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size {line[:40]!r}") from None
                if size:
                    self.remaining = size
                    self.state = _DATA
                else:
                    self.state = _TRAILER
        return out


def frame_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"

REASONS = {200: "OK", 201: "Created", 204: "No Content", 400: "Bad Request", 401: "Unauthorized",
           403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
           411: "Length Required", 413: "Payload Too Large", 422: "Unprocessable Entity",
           429: "Too Many Requests", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
           502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}


def response_head(status: int, headers: dict[str, str], extra: bytes = b"") -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}"]
    lines.extend(f"{k}: {v}" for k, v in headers.items())
    return ("\r\n".join(lines) + "\r\n").encode("latin-1") + extra + b"\r\n"
