"""uvicorn's httptools protocol with the connection limits it lacks: header timeout, body timeout,
request-head size.

uvicorn (httptools) only times out a connection that is idle *after* a response
(`timeout_keep_alive`), and any byte - even a lone CRLF - cancels that timer for good; it has
no limit on the size of a request head (h11's `h11_max_incomplete_event_size` applies to h11
only). So a client could hold a connection for ever by never finishing a head or a body. This
subclass adds, per connection, two timers (`loop.call_later`, armed once per request, never
per byte) and a byte count:

* **header timeout**: from the moment a connection opens, or the first byte of a request head
  arrives on a kept-alive one, until the head is complete. Expired: 408 and the connection is
  closed (closed silently if not one byte of a request came: there is nothing to answer, and a
  client could take a stray 408 for the answer to the request it sends next).
* **body timeout**: from the moment the app starts handling a request whose body has not all
  arrived until its last byte. Expired: 408 (or, once the app has answered, a plain close).
* **head size**: more than `max_header_bytes` of request line + headers: 431, closed.

The error bodies are OpenAI-style JSON, like every other error of the server. After such an
answer the server shuts its sending side and reads and drops whatever the client still sends
for up to LINGER_SECONDS before closing ("lingering close": closing with unread input sends a
TCP reset, which can destroy the answer before the client reads it). If a response is being
written on the connection when a limit trips (HTTP pipelining), it is finished first and the
connection closed after it, without reading more. The idle keep-alive timeout stays uvicorn's
(`timeout_keep_alive`); a connection that went idle after dropping the rest of an answered
request's body (a 413) gets it again.
"""

from __future__ import annotations

import asyncio
import http
import logging
from typing import Any, ClassVar

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from hasten.server.errors import error_body
from hasten.server.limits import HTTPLimits

logger = logging.getLogger("hasten.server")

LINGER_SECONDS = 2.0


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """Use `protocol_class(limits)`, which binds the limits; see the module docstring."""

    limits: ClassVar[HTTPLimits] = HTTPLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._close_timer: asyncio.TimerHandle | None = None
        self._in_head = True  # waiting for, or reading, a request head
        self._head_has_bytes = False  # a byte of the awaited head has come
        self._head_began = False  # set by the parser when a head starts in the chunk being fed
        self._head_bytes = 0
        self._discarding = False  # a limit tripped: input is dropped until the connection closes

    # ---- connection events ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        if self._in_head:
            self._head_has_bytes = True
            if self._head_timer is None:
                self._arm_head_timer()  # first byte of a head on a kept-alive connection (even a stray CRLF)
        was_in_head = self._in_head
        self._head_began = False
        super().data_received(data)
        if was_in_head and self._in_head and not self._head_began:
            # all of `data` belonged to one unfinished head (a chunk in which a head begins is not
            # counted, so a head may overshoot the limit by at most one read: bounded either way)
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                self._reject(431, f"The request line and headers are over this server's limit of "
                                  f"{self.limits.max_header_bytes} bytes.", "request_header_too_large",
                             own_cycle=False)

    # ---- parser callbacks -----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._unset_keepalive_if_required()  # (armed by on_message_complete below, in the same chunk)
        self._in_head = True
        self._head_began = True
        self._head_bytes = 0
        if self._head_timer is None:
            self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel(self._head_timer)
        self._head_timer = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True  # what comes next is the next request's head
        self._head_has_bytes = False
        self._cancel(self._body_timer)
        self._body_timer = None
        if self.cycle is not None and self.cycle.response_complete and self.timeout_keep_alive_task is None:
            # answered before its body was all read (e.g. a 413), and the rest has now been dropped: the
            # connection is idle. uvicorn armed its keep-alive timer at the response, but the body bytes
            # since then cancelled it.
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        # (also called for a pipelined request when its turn comes)
        if cycle.more_body and self._body_timer is None:
            self._body_timer = self.loop.call_later(self.limits.body_timeout, self._body_timed_out)
        super()._start_asgi_task(cycle, app)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request httptools cannot parse, as an OpenAI-style error."""
        self._reject(400, msg, None, own_cycle=not self._in_head)

    # ---- timers -----------------------------------------------------------------------------------
    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._head_has_bytes:
            self._close_quietly()
            return
        self._reject(408, f"The request head was not received within {self.limits.header_timeout:g}s.",
                     "request_timeout", own_cycle=False)

    def _body_timed_out(self) -> None:
        self._body_timer = None
        self._reject(408, f"The request body was not received within {self.limits.body_timeout:g}s.",
                     "request_timeout", own_cycle=True)

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer, self._close_timer):
            self._cancel(timer)
        self._head_timer = self._body_timer = self._close_timer = None

    # ---- answering and closing ----------------------------------------------------------------
    def _linger_close(self) -> None:
        """Shut our side now, drop the client's input for up to LINGER_SECONDS, then close."""
        self._cancel_timers()
        self._discarding = True
        transport = self.transport
        if transport.is_closing():
            return
        if transport.can_write_eof():
            transport.write_eof()  # the client reads our answer, then end-of-stream; when it closes, so do we
            self._close_timer = self.loop.call_later(LINGER_SECONDS, transport.close)
        else:
            transport.close()

    def _close_quietly(self) -> None:
        """Close without answering; a response under way is finished first."""
        cycle = self.cycle
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            self._cancel_timers()
            self._discarding = True
            cycle.keep_alive = False  # uvicorn closes the connection when this response ends
        else:
            self._linger_close()

    def _reject(self, status: int, message: str, code: str | None, *, own_cycle: bool) -> None:
        """Answer `status` and close. `own_cycle`: the problem is with the request of `self.cycle` (its
        body), else with a head not yet a request. If a response has been started (to the request in
        question, or to an earlier one and is still being written), no answer: close after it."""
        transport = self.transport
        if transport is None or transport.is_closing():
            self._cancel_timers()
            return
        cycle = self.cycle
        if cycle is not None and cycle.response_started and (own_cycle or not cycle.response_complete):
            self._close_quietly()
            return
        self._cancel_timers()
        peer = f"{self.client[0]}:{self.client[1]}" if self.client else "client"
        logger.info("%s: answered %d and closed the connection: %s", peer, status, message)
        body = orjson.dumps(error_body(status, message, code=code))
        head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n".encode()]
        for name, value in self.server_state.default_headers:
            head.append(name + b": " + value + b"\r\n")
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                    % len(body))
        transport.write(b"".join(head) + body)
        if own_cycle and cycle is not None:
            cycle.disconnected = True  # the app's own answer (if any) must not follow ours
            cycle.message_event.set()
        self._linger_close()


def protocol_class(limits: HTTPLimits) -> type[LimitedHttpToolsProtocol]:
    """The protocol class to give uvicorn (`Config(http=...)`), bound to `limits`."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})
