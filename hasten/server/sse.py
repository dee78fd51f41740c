"""Server-Sent Events and client-disconnect detection.

Both streaming and non-streaming generation run in a task raced against a watcher
that waits for `http.disconnect`. When the client goes away first the generation task
is cancelled, which closes the engine generators and so aborts the engine requests
right away - even while a request is still queued and has produced nothing to send.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger("hasten.server")

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


class ClientDisconnected(Exception):
    pass


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(receive: Receive, work: Awaitable[T], on_disconnect: Callable[[], None]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
    if work_task.done():
        return work_task.result()
    on_disconnect()
    work_task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await work_task
    raise ClientDisconnected()


class SSEResponse(StreamingResponse):
    """Streams `data:` events from an async iterator of ready-made bytes, racing a disconnect watcher."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str],
                 on_disconnect: Callable[[], None]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
                         media_type="text/event-stream")
        self.events = events
        self.on_disconnect = on_disconnect

    async def _stream(self, send: Send) -> None:
        async with contextlib.aclosing(self.events):  # type: ignore[type-var]
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            await race_disconnect(receive, self._stream(send), self.on_disconnect)
        except ClientDisconnected:
            logger.info("client disconnected mid-stream")
        except OSError:
            self.on_disconnect()
            logger.info("client disconnected mid-stream (send failed)")
