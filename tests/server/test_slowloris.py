"""A real `hasten serve` (fake engine) with short timeouts against slow and idle clients: slow heads,
silent connections, idle keep-alive connections, CRLF drips, slow bodies, oversized heads - all
closed in bounded time, while normal requests keep being served."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from .test_cli import FACTORY, ROOT, free_port

pytestmark = pytest.mark.slow  # starts processes or loads the embedded model

HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.5
KEEP_ALIVE = 1.0
SLACK = 10.0  # generous: a loaded CI box may be slow to close, never early
HEAD = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("slowloris") / "server.log"
    cmd = [sys.executable, "-c", "import sys; from hasten.cli import main; sys.exit(main())", "serve",
           "--port", str(port), "--engine-factory", FACTORY, "-O", "step_time=0.01",
           "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
           "--timeout-keep-alive", str(KEEP_ALIVE), "--max-request-bytes", "100000",
           "--max-header-bytes", "8192"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        yield port, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=HEADER_TIMEOUT + SLACK)


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket timeout fails the test)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def _status(data: bytes) -> int | None:
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else None


def _error_code(data: bytes) -> str:
    return orjson.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"]


class Traffic:
    """Normal requests, one after another, in the background; all must succeed."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10) as c:
            while not self._stop.is_set():
                try:
                    r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "temperature": 0})
                    if r.status_code == 200:
                        self.ok += 1
                    else:
                        self.failures.append(f"{r.status_code} {r.text}")
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                time.sleep(0.02)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        assert not self.failures, self.failures[:3]
        assert self.ok > 0


def test_slow_heads_are_cut_off_while_normal_requests_go_on(serve: tuple[int, Path]) -> None:
    port, _ = serve
    n = 40
    socks = [_connect(port) for _ in range(n)]
    closed_at: dict[int, float] = {}
    answers: dict[int, bytes] = {}
    t0 = time.monotonic()
    with Traffic(port):
        sent = 0
        while len(closed_at) < n and time.monotonic() - t0 < HEADER_TIMEOUT + SLACK:
            for i, sock in enumerate(socks):  # one more byte of the head on each open connection
                if i in closed_at:
                    continue
                try:
                    sock.send(HEAD[sent % (len(HEAD) - 4):][:1])
                except OSError:
                    pass
                sock.setblocking(False)
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    continue
                except ConnectionResetError:
                    data = b""
                finally:
                    sock.setblocking(True)
                answers[i] = answers.get(i, b"") + data
                sock.settimeout(HEADER_TIMEOUT + SLACK)
                answers[i] += _read_until_closed(sock)
                closed_at[i] = time.monotonic() - t0
            sent += 1
            time.sleep(0.05)
    for sock in socks:
        sock.close()
    assert len(closed_at) == n, f"{n - len(closed_at)} slow heads still open after {HEADER_TIMEOUT + SLACK}s"
    assert min(closed_at.values()) >= HEADER_TIMEOUT * 0.9
    assert all(_status(a) == 408 and _error_code(a) == "request_timeout" for a in answers.values()), answers


def test_idle_connections_are_closed(serve: tuple[int, Path]) -> None:
    port, _ = serve
    # connected, never a byte: closed without an answer after the header timeout
    with _connect(port) as silent:
        t0 = time.monotonic()
        assert _read_until_closed(silent) == b""
        assert HEADER_TIMEOUT * 0.9 <= time.monotonic() - t0 < HEADER_TIMEOUT + SLACK
    # one request, then idle on a kept-alive connection: closed after the keep-alive timeout
    with _connect(port) as idle:
        idle.sendall(HEAD)
        t0 = time.monotonic()
        data = _read_until_closed(idle)
        assert _status(data) == 200 and data.count(b"HTTP/1.1 ") == 1
        assert KEEP_ALIVE * 0.9 <= time.monotonic() - t0 < KEEP_ALIVE + SLACK
    # a kept-alive connection fed a lone CRLF now and then (each cancels uvicorn's keep-alive timer)
    with _connect(port) as drip:
        drip.sendall(HEAD)
        t0 = time.monotonic()
        drip.settimeout(0.2)
        data, closed = b"", False
        while not closed and time.monotonic() - t0 < HEADER_TIMEOUT + KEEP_ALIVE + SLACK:
            try:
                drip.sendall(b"\r\n")
                chunk = drip.recv(65536)
                data += chunk
                closed = not chunk
            except TimeoutError:
                continue
            except OSError:
                closed = True
        assert closed and _status(data) == 200


def test_slow_body_is_cut_off(serve: tuple[int, Path]) -> None:
    port, log_path = serve
    with Traffic(port), _connect(port) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{")
        t0 = time.monotonic()
        sock.settimeout(0.1)
        data = b""
        while time.monotonic() - t0 < BODY_TIMEOUT + SLACK:
            try:
                sock.sendall(b" ")
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            data += chunk
            if not chunk:
                break
        elapsed = time.monotonic() - t0
    assert _status(data) == 408 and _error_code(data) == "request_timeout", data
    assert BODY_TIMEOUT * 0.9 <= elapsed < BODY_TIMEOUT + SLACK


def test_oversized_head_and_body(serve: tuple[int, Path]) -> None:
    port, _ = serve
    with _connect(port) as sock:
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"a" * 2048)
            for _ in range(64):
                sock.sendall(b"a" * 2048)
        except OSError:
            pass
        data = _read_until_closed(sock)
    assert _status(data) == 431 and _error_code(data) == "request_header_too_large", data
    with _connect(port) as sock:  # --max-request-bytes reaches the server
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100001\r\nExpect: 100-continue\r\n\r\n")
        data = _read_until_closed(sock)
    assert _status(data) == 413 and _error_code(data) == "request_too_large", data


def test_limit_during_a_response_lets_it_finish(serve: tuple[int, Path]) -> None:
    """A pipelined head that stalls while a stream is being written: the stream ends normally, then the
    connection is closed (no 408 written into the middle of the stream)."""
    port, _ = serve
    body = orjson.dumps({"prompt": "x", "max_tokens": 200, "stream": True, "ignore_eos": True})  # 2 s
    with _connect(port) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body) + b"GET /health HTTP/1.1\r\n")
        data = _read_until_closed(sock)
    assert _status(data) == 200 and data.count(b"HTTP/1.1 ") == 1
    assert b"data: [DONE]" in data[-64:] and data.endswith(b"0\r\n\r\n"), data[-200:]
