"""AsyncLLM: the engine loop in its own thread, with an asyncio streaming interface.

The event loop never runs model work: requests and aborts go to the engine thread through
a queue, and each step's outputs come back in one `call_soon_threadsafe` hop. The engine
thread never waits on HTTP: if nobody reads a request's outputs they simply queue up.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future

from hasten.config import EngineConfig
from hasten.engine.engine import LLMEngine
from hasten.engine.stats import (
    EngineFailedError,
    EngineStats,
    EngineUnavailableError,
    QueueFullError,
    RequestFailedError,
)
from hasten.outputs import RequestOutput
from hasten.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "QueueFullError", "EngineStats", "RequestFailedError"]

_STOP = object()


class AsyncLLM:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stats = engine.get_stats()
        self.step_count = 0
        self.errored: BaseException | None = None
        self.progress_at = time.monotonic()  # when the engine thread last finished a step or went idle

    @classmethod
    def from_options(cls, model: str | None = None, **options) -> AsyncLLM:
        return cls(LLMEngine(EngineConfig.from_options(model=model, **options)))

    # ------------------------------------------------------------ passthroughs

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.engine.apply_chat_template(messages, add_generation_prompt)

    def get_stats(self) -> EngineStats:
        """A snapshot refreshed by the engine thread after every step (safe to read anywhere)."""
        return self._stats

    @property
    def num_pending(self) -> int:
        """Requests in flight (their streams are open)."""
        return len(self._streams)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------ lifecycle

    async def start(self, warmup: bool = True) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        if warmup:
            await asyncio.to_thread(self._warmup)
        self._thread = threading.Thread(target=self._run, name="hasten-engine", daemon=True)
        self._thread.start()

    def _warmup(self) -> None:
        t0 = time.time()
        self.engine.warm_up()
        logger.info("warm-up step done in %.3fs", time.time() - t0)

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join, 30)
        self._thread = None
        close = getattr(self.engine, "close", None)
        if close is not None:  # the tensor/pipeline-parallel ranks and their process group
            await asyncio.to_thread(close)

    # ------------------------------------------------------------ requests

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if not self.is_running:
            raise EngineUnavailableError("the engine is not running")
        ids = self.engine.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        text = prompt if isinstance(prompt, str) else None
        stream: asyncio.Queue = asyncio.Queue()
        added: Future = Future()
        if not self._streams:
            self.progress_at = time.monotonic()  # idle until now: the watchdog counts from here
        self._streams[request_id] = stream
        self._commands.put(("add", request_id, ids, text, params, priority, cache_salt, time.time(), added))
        finished = False
        try:
            await asyncio.wrap_future(added)  # re-raises ValueError / QueueFullError
            while True:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                if out.error is not None:
                    raise RequestFailedError(out.error)
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    # ------------------------------------------------------------ engine thread

    def _handle(self, cmd) -> bool:
        if cmd is _STOP:
            return False
        if cmd[0] == "add":
            _, rid, ids, text, params, priority, salt, arrival, fut = cmd
            if fut.set_running_or_notify_cancel():
                try:
                    self.engine.add_request(rid, ids, params, priority, salt, arrival)
                    if text is not None:
                        self.engine.groups[rid].prompt = text
                    fut.set_result(None)
                except Exception as e:  # invalid request: report to its caller only
                    fut.set_exception(e)
        elif cmd[0] == "abort":
            self.engine.abort_request(cmd[1])
        return True

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _run(self) -> None:
        engine = self.engine
        loop = self._loop
        try:
            while True:
                block = not engine.has_unfinished_requests()
                try:
                    cmd = self._commands.get(block=block, timeout=0.5 if block else None)
                    if not self._handle(cmd):
                        return
                    while True:  # drain everything that arrived
                        if not self._handle(self._commands.get_nowait()):
                            return
                except queue.Empty:
                    pass
                if engine.has_unfinished_requests():
                    outs = engine.step()
                    self.step_count += 1
                    if outs:
                        loop.call_soon_threadsafe(self._deliver, outs)
                self._stats = engine.get_stats()
                self.progress_at = time.monotonic()
        except BaseException as e:  # a bug in the engine: fail every stream instead of hanging
            logger.exception("engine loop died")
            self.errored = e
            err = EngineFailedError(f"the engine loop died: {type(e).__name__}: {e}")
            loop.call_soon_threadsafe(lambda: [s.put_nowait(err) for s in self._streams.values()])
