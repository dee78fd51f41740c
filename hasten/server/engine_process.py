"""The engine in a process of its own, behind the same interface as `AsyncLLM`.

`hasten serve --engine-mode process` uses `ProcessEngine`: a spawned child process runs
`LLMEngine`'s step loop on its main thread, so neither the GIL nor the event loop's
HTTP/JSON work can delay a step. Per step the child sends one message with every
request's *deltas* (new text, token ids, logprobs; the full text and ids only once, at
the end), plus a stats snapshot; the parent rebuilds the cumulative `RequestOutput`s
that `AsyncLLM.generate` would yield. Commands (add, abort, stop) go the other way and
are drained between steps. If the child dies, `errored` is set at once (so `/health` turns 503)
and every open stream fails; a child stopped from outside (SIGKILL, SIGTERM, ...) fails them with
`EngineFailedError.stopped_from_outside` set, which the server answers 503 instead of 500.

Logits processors cross the process boundary by pickle: a structured-output processor
carries what the server's compile worker found cheapest to load - the schema (compiled
again here, bounded by the worker's measured time) or the serialized grammar - and the
child loads it once per schema, in a thread, holding the request back until it is loaded
while the step loop goes on; an unchecked schema never reaches it (see `structured.py`).
The child also reports at least once a second while it has work, for the server's step
watchdog; a step that raises makes it report the traceback and exit (the server restarts it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import AsyncIterator
from dataclasses import astuple
from multiprocessing.connection import Connection
from typing import Any

from hasten.engine.stats import (
    EngineFailedError,
    EngineStats,
    EngineUnavailableError,
    QueueFullError,
    RequestFailedError,
)
from hasten.outputs import CompletionOutput, RequestOutput
from hasten.sampling_params import SamplingParams

logger = logging.getLogger("hasten.server.engine")

_HEARTBEAT_S = 1.0  # a busy engine process sends a step message at least this often


# ---------------------------------------------------------------------------------- child process


def _compact(out: RequestOutput, first: bool) -> tuple:
    comps = []
    for c in out.outputs:
        full = (c.text, c.token_ids, c.logprobs) if c.finish_reason is not None else None
        comps.append((c.index, c.delta_text, c.delta_token_ids, c.delta_logprobs, c.cumulative_logprob,
                      c.finish_reason, c.stop_reason, full))
    return (out.request_id, out.finished, comps, out.num_cached_tokens,
            out.prompt_logprobs if first else None, out.metrics if out.finished else None, out.error)


def _grammars_ready(params: SamplingParams) -> bool:
    return all(getattr(p, "ready", _always)() for p in params.logits_processors)


def _always() -> bool:
    return True


def _child_main(conn: Connection) -> None:
    from hasten.config import EngineConfig
    from hasten.engine.engine import LLMEngine
    from hasten.runtime.heap import freeze_heap
    from hasten.server.structured import set_process_tokenizer

    try:
        model, options, send_tokenizer = conn.recv()
        t0 = time.time()
        engine = LLMEngine(EngineConfig.from_options(model=model, **options))
        engine.warm_up()
        set_process_tokenizer(engine.tokenizer)
        # this process lives for the engine: its start-up heap stays out of the collector's scans, so no
        # full collection walks it between two steps (EngineConfig.gc_freeze)
        frozen = freeze_heap() if engine.config.gc_freeze else 0
        conn.send(("ready", {"model_name": engine.model_name, "max_model_len": engine.max_model_len,
                             "tokenizer": engine.tokenizer if send_tokenizer else None,
                             "seconds": time.time() - t0, "gc_frozen": frozen}))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails start-up
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    seen: set[str] = set()
    # add commands whose grammars are still loading (in a thread: see ProcessGrammars); the step loop
    # goes on for everyone else meanwhile
    held: list[tuple] = []

    def add(cmd: tuple) -> None:
        _, rid, ids, params, priority, arrival, cache_salt = cmd
        try:
            engine.add_request(rid, ids, params, priority, cache_salt, arrival)
        except Exception as exc:  # invalid for this request only
            kind = "queue_full" if type(exc).__name__ == "QueueFullError" else (
                "value" if isinstance(exc, ValueError) else "other")
            conn.send(("error", rid, kind, str(exc)))

    def handle(cmd: tuple) -> bool:
        if cmd[0] == "stop":
            return False
        if cmd[0] == "add":
            if _grammars_ready(cmd[3]):
                add(cmd)
            else:
                held.append(cmd)
        elif cmd[0] == "abort":
            held[:] = [c for c in held if c[1] != cmd[1]]
            engine.abort_request(cmd[1])
            seen.discard(cmd[1])
        return True

    last_stats = None
    last_sent = 0.0
    while True:
        busy = engine.has_unfinished_requests()
        try:
            if conn.poll(0 if busy else 0.005 if held else 0.5):
                while True:
                    if not handle(conn.recv()):
                        return
                    if not conn.poll(0):
                        break
        except (EOFError, OSError):
            return  # the server is gone
        for cmd in [c for c in held if _grammars_ready(c[3])]:
            held.remove(cmd)
            add(cmd)
        try:
            outs = engine.step() if engine.has_unfinished_requests() else []
        except Exception:  # the step itself failed (not one request's rows): the server restarts us
            logger.exception("engine step failed")
            conn.send(("fatal", traceback.format_exc(limit=20)))
            sys.exit(1)
        msgs = []
        for out in outs:
            first = out.request_id not in seen
            seen.add(out.request_id)
            msgs.append(_compact(out, first))
            if out.finished:
                seen.discard(out.request_id)
        s = engine.get_stats()
        stats = astuple(s)  # every field, speculative-decoding counters included
        now = time.monotonic()
        # a busy engine reports at least once a second even when nothing changed: the server's step
        # watchdog reads silence with requests in flight as a stalled engine
        if msgs or stats != last_stats or ((busy or held) and now - last_sent >= _HEARTBEAT_S):
            conn.send(("step", msgs, stats))
            last_stats = stats
            last_sent = now


# ---------------------------------------------------------------------------------- parent side


def _frame(obj: Any) -> bytes:
    """`multiprocessing.Connection`'s wire format: a big-endian length, then the pickle."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > 0x7FFFFFFF:
        return struct.pack("!iQ", -1, len(data)) + data
    return struct.pack("!i", len(data)) + data


class _FrameProtocol(asyncio.Protocol):
    """Reads the child's `Connection.send` frames without blocking the event loop."""

    def __init__(self, on_message: Any, on_lost: Any) -> None:
        self._buf = bytearray()
        self._on_message = on_message
        self._on_lost = on_lost

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        while len(buf) >= 4:
            (size,) = struct.unpack_from("!i", buf)
            head = 4
            if size == -1:
                if len(buf) < 12:
                    return
                (size,) = struct.unpack_from("!Q", buf, 4)
                head = 12
            if len(buf) < head + size:
                return
            msg = pickle.loads(bytes(buf[head:head + size]))
            del buf[:head + size]
            self._on_message(msg)

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost(exc)


class _Stream:
    """Rebuilds one request's cumulative outputs from the child's deltas."""

    def __init__(self, prompt: str | None, prompt_ids: list[int], n: int) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.comps = [CompletionOutput(index=i, text="", token_ids=[]) for i in range(n)]
        self.prompt_logprobs: Any = None

    def apply(self, msg: tuple) -> RequestOutput:
        rid, finished, comps, cached, prompt_logprobs, metrics, error = msg
        if prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs
        outs = []
        for index, d_text, d_ids, d_lps, cum_lp, reason, stop_reason, full in comps:
            c = self.comps[index]
            if full is not None:
                c.text, c.token_ids, c.logprobs = full[0], list(full[1]), full[2]
            else:
                c.text += d_text
                c.token_ids.extend(d_ids)
                if d_lps is not None:
                    c.logprobs = (c.logprobs or []) + list(d_lps)
            c.cumulative_logprob, c.finish_reason, c.stop_reason = cum_lp, reason, stop_reason
            outs.append(CompletionOutput(c.index, c.text, list(c.token_ids), cum_lp, c.logprobs, reason,
                                         stop_reason, d_text, list(d_ids), d_lps))
        by_index = {o.index: o for o in outs}
        full_list = [by_index.get(c.index) or CompletionOutput(c.index, c.text, list(c.token_ids),
                                                               c.cumulative_logprob, c.logprobs,
                                                               c.finish_reason, c.stop_reason)
                     for c in self.comps]
        return RequestOutput(rid, self.prompt, self.prompt_ids, full_list, finished,
                             prompt_logprobs=self.prompt_logprobs, metrics=metrics, num_cached_tokens=cached,
                             error=error)


# signals that stop a process from outside (an operator, a supervisor, the OOM killer), not a crash
# of the engine on something it was computing: its in-flight requests are not to blame
_STOP_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
_EXIT_WAIT_S = 0.3
# the tokenizer of each (model, options) an engine process was started with: a restarted engine process
# does not send another copy (unpickled in a worker thread, it grew the server's RSS by ~17 MB for good)
_TOKENIZERS: dict[str, Any] = {}


class ProcessEngine:
    """`AsyncLLM`'s interface, with the engine loop in a child process."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, info: dict[str, Any]) -> None:
        self._proc = proc
        self._sock = sock
        self._transport: asyncio.Transport | None = None
        self._closing = False
        self.model_name: str = info["model_name"]
        self.max_model_len: int = info["max_model_len"]
        self.tokenizer = info["tokenizer"]
        self.load_seconds: float = info["seconds"]
        self.gc_frozen_objects: int = info["gc_frozen"]  # objects the engine process froze after start-up
        self._streams: dict[str, _Stream] = {}
        self._stats = EngineStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.errored: str | None = None
        self._failed = False  # in-flight requests were failed (and the reason logged)
        self.progress_at = time.monotonic()  # when the engine last reported a step (or went idle)

    @classmethod
    def from_options(cls, model: str | None = None, **options: Any) -> ProcessEngine:
        """Blocking: starts the engine process and waits until its weights are loaded and warmed up."""
        # A plain `python -m` child joined by a socket pair: unlike multiprocessing's spawn, it does not
        # re-import the parent's __main__ (which may be a test runner or a user's script).
        ours, theirs = socket.socketpair()
        # the child logs like the server: same format, the level of the "hasten" logger
        level = logging.getLevelName(logging.getLogger("hasten").getEffectiveLevel())
        proc = subprocess.Popen([sys.executable, "-m", "hasten.server.engine_process", str(theirs.fileno()),
                                 str(level)], pass_fds=[theirs.fileno()])
        theirs.close()
        handshake = Connection(os.dup(ours.fileno()))  # blocking, for start-up only
        try:
            known = _TOKENIZERS.get(repr((model, sorted(options.items()))))
            handshake.send((model, options, known is None))
            while not handshake.poll(0.2):
                if proc.poll() is not None:
                    raise RuntimeError(f"the engine process died during start-up (exit code {proc.returncode})")
            kind, payload = handshake.recv()
        except (EOFError, OSError) as exc:
            proc.kill()
            raise RuntimeError(f"the engine process died during start-up ({exc or 'EOF'})") from exc
        finally:
            handshake.close()
        if kind != "ready":
            proc.wait(5)
            raise RuntimeError(f"the engine process failed to start: {payload}")
        if known is None:
            _TOKENIZERS[repr((model, sorted(options.items())))] = payload["tokenizer"]
        else:
            payload["tokenizer"] = known
        return cls(proc, ours, payload)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def get_stats(self) -> EngineStats:
        return self._stats

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._transport, _ = await self._loop.create_connection(
            lambda: _FrameProtocol(self._on_message, self._on_lost), sock=self._sock)

    def _send(self, obj: tuple) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(_frame(obj))

    async def shutdown(self) -> None:
        self._closing = True
        self._send(("stop",))
        try:
            await asyncio.to_thread(self._proc.wait, 30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._transport is not None:
            self._transport.close()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def num_pending(self) -> int:
        """Requests in flight (their streams are open)."""
        return len(self._streams)

    def _on_message(self, msg: tuple) -> None:
        self.progress_at = time.monotonic()
        if msg[0] == "fatal":
            self._fail(f"the engine step failed:\n{msg[1]}")
        elif msg[0] == "step":
            self._stats = EngineStats(*msg[2])
            for out in msg[1]:
                stream = self._streams.get(out[0])
                if stream is not None:
                    stream.queue.put_nowait(stream.apply(out))
        elif msg[0] == "error":
            _, rid, kind, text = msg
            exc = QueueFullError(text) if kind == "queue_full" else (
                ValueError(text) if kind == "value" else RuntimeError(text))
            stream = self._streams.get(rid)
            if stream is not None:
                stream.queue.put_nowait(exc)

    def _on_lost(self, exc: BaseException | None) -> None:
        if self._closing:
            return
        reason = f"lost the engine process ({exc or 'it closed its end'})"
        if self.errored is None:
            self.errored = reason  # new requests get 503 from now on
        # in-flight requests fail once the exit status tells whether the process was stopped from
        # outside (waited for up to _EXIT_WAIT_S: a dead child is reaped within milliseconds)
        self._fail_on_exit(reason, time.monotonic() + _EXIT_WAIT_S)

    def _fail_on_exit(self, reason: str, deadline: float) -> None:
        code = self._proc.poll()
        if code is None and time.monotonic() < deadline and self._loop is not None:
            self._loop.call_later(0.005, self._fail_on_exit, reason, deadline)
            return
        stopped = code is not None and -code in _STOP_SIGNALS
        if code is not None:
            reason += f"; {'killed by ' + signal.Signals(-code).name if code < 0 else f'exit code {code}'}"
        self._fail(reason, stopped_from_outside=stopped)

    def _fail(self, reason: str, stopped_from_outside: bool = False) -> None:
        if not self._failed:  # the first failure's reason stands (a step's traceback, then the exit)
            self._failed = True
            logger.error("%s", reason)
            self.errored = reason
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineFailedError(reason, stopped_from_outside))

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        if self.errored is not None:
            raise EngineUnavailableError("the engine failed and is being restarted")
        if self._transport is None:
            raise RuntimeError("the engine is not running (call start() first)")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        stream = _Stream(prompt if isinstance(prompt, str) else None, ids, params.n)
        if not self._streams:
            self.progress_at = time.monotonic()  # idle until now: the watchdog counts from here
        self._streams[request_id] = stream
        finished = False
        try:
            self._send(("add", request_id, ids, params, priority, time.time(), cache_salt))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise RequestFailedError(item.error)
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.errored is None:
                self._send_abort(request_id)

    def _send_abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        if self.errored is None:
            self._send_abort(request_id)


if __name__ == "__main__":
    # The engine process: leave SIGINT/SIGTERM to the server, which stops us with a "stop" command.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from hasten.server.tracing import configure_logging

    configure_logging(sys.argv[2] if len(sys.argv) > 2 else "INFO")
    _child_main(Connection(int(sys.argv[1])))
