"""The grammar compiler process: xgrammar compiles in processes the server can kill.

`python -m hasten.server.grammar_worker FD` is started by the server (`grammar_service.py`)
with one end of a socket pair. It imports xgrammar once (about 2.5 s: it pulls in torch),
builds the tokenizer info the server sends, then never compiles anything itself: it is a
broker that forks one *worker* per concurrent compile and relays between the server and
the workers. So:

* a compile that runs past its budget, or that every client waiting for it gave up on,
  is stopped by SIGKILL to its worker, and its CPU and memory come back at once;
* a replacement worker is a fork (milliseconds), not a fresh interpreter;
* a worker whose memory grew by more than `recycle_bytes` (a big grammar leaves the
  heap large) exits after its job instead of staying idle with that memory;
* workers run at a lower CPU priority (`nice`), so a long compile yields to the engine
  and the HTTP server on a busy machine.

What crosses back is chosen for the process that will load the grammar next to the engine,
by the compile's CPU time (the same on a busy machine): a grammar that compiled within
`serialize_above_s` comes back as nothing but "ok" (it is compiled again there: nearly
every real schema, 5-50 ms); a slower one comes back serialized if `serialize_json()`
finishes within the compile's own time (or 0.1 s) and is at most `max_serialized_bytes`
(reading it back is ~2.5x faster than writing it), else again as "ok" if it compiled within
`max_recompile_s`, else as "too_large". xgrammar 0.2.9's serialized form is not always the
cheaper one: it grows with the square of an object's properties (500 required properties:
compiled in 0.03 s, 55 MB written in 2.6 s, read in 0.9 s; 50 objects of 20 optional
properties: 0.18 s, 373 MB, 29 s, 11 s), while long `pattern` repetitions compile slowly
into a small grammar (2 s, 70 KB, read in 1 ms).

Messages are length-prefixed pickles, both ways (only this server and its own children
are on the socket). Server -> broker: ("init", tokenizer_info_json, recycle_bytes),
("compile", job, key, serialize_above_s, max_serialized_bytes, max_recompile_s),
("cancel", job).
Broker -> server: ("ready",), ("started", job, worker_pid),
("result", job, status, payload, memory_bytes, cpu_seconds): status "ok" (payload: the
serialized grammar or None), or "rejected" / "too_large" / "died" / "unavailable"
(payload: why).
The broker exits when the server closes its end; workers exit when the broker is gone.
"""

from __future__ import annotations

import os
import pickle
import re
import selectors
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

JSON_OBJECT_KEY = "<json_object>"  # `response_format: {"type": "json_object"}`: any JSON object

_HEADER = struct.Struct("!QB")  # body length, flags
HEADER_SIZE = _HEADER.size
_RETIRING = 1  # flag on a worker's result: it exits next (the broker must not give it another job)
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ", re.M)  # "[06:10:16] /project/cpp/x.cc:50: "
_MIN_SERIALIZE_S = 0.1  # writing a grammar may always take this long (reading it back: ~40 ms)
_WORKER_NICE = 5  # compiles yield the CPU to the engine and the HTTP server


def frame(obj: Any, flags: int = 0) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data), flags) + data


def frame_size(head: bytes | bytearray) -> int:
    """The total size of the frame that starts with `head` (at least HEADER_SIZE bytes)."""
    return HEADER_SIZE + _HEADER.unpack_from(head)[0]


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _read_raw(sock: socket.socket) -> tuple[int, bytes] | None:
    """(flags, body) of one frame from a blocking socket; None at EOF."""
    head = _recv_exact(sock, HEADER_SIZE)
    if head is None:
        return None
    size, flags = _HEADER.unpack(head)
    body = _recv_exact(sock, size)
    return None if body is None else (flags, body)


def read_frame(sock: socket.socket) -> Any | None:
    raw = _read_raw(sock)
    return None if raw is None else pickle.loads(raw[1])


def load_frame(data: bytes | bytearray) -> Any:
    """The message in one whole frame (as `frame_size` delimits it)."""
    return pickle.loads(data[HEADER_SIZE:])


def compile_key(compiler: Any, key: str) -> Any:
    """The one way a grammar key becomes a CompiledGrammar (JSON without whitespace between tokens)."""
    if key == JSON_OBJECT_KEY:
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    return compiler.compile_json_schema(key, any_whitespace=False)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------------------- worker (forked)


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(0)


def _worker_main(sock: socket.socket, compiler: Any, broker_pid: int, recycle_bytes: int) -> None:
    try:
        os.nice(_WORKER_NICE)
    except OSError:
        pass
    threading.Thread(target=_exit_with_parent, args=(broker_pid,), daemon=True).start()
    base_rss = _rss_bytes()
    while True:
        msg = read_frame(sock)
        if msg is None:
            return
        result, retiring = _compile_job(compiler, *msg)
        # A big grammar leaves the heap large: then leave (the broker forks a fresh worker when needed).
        retiring = retiring or _rss_bytes() - base_rss > recycle_bytes
        sock.sendall(frame(result, _RETIRING if retiring else 0))
        if retiring:
            return


def _serialize_within(compiled: Any, seconds: float) -> str | None:
    """`compiled.serialize_json()` if it finishes within `seconds` (it releases the GIL), else None (the
    thread is left running: the caller's process exits)."""
    box: list[str] = []
    thread = threading.Thread(target=lambda: box.append(compiled.serialize_json()), daemon=True)
    thread.start()
    thread.join(seconds)
    return box[0] if box else None


def _compile_job(compiler: Any, job: int, key: str, serialize_above_s: float, max_serialized_bytes: int,
                 max_recompile_s: float) -> tuple[tuple, bool]:
    """(result message, whether this worker must exit after sending it)."""
    t0 = time.process_time()  # CPU time: the same on a busy machine, at any nice level
    try:
        compiled = compile_key(compiler, key)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError for schemas it rejects
        message = _LOG_PREFIX.sub("", str(exc)).strip()
        return ("result", job, "rejected", message, 0, time.process_time() - t0), False
    cpu = time.process_time() - t0
    memory = int(compiled.memory_size_bytes)
    if cpu <= serialize_above_s:
        return ("result", job, "ok", None, memory, cpu), False
    # Slow to compile: send it serialized if writing it takes no longer than compiling it did (reading
    # it back is ~2.5x faster than writing), and it is not too large; else have it compiled again there.
    serialized = _serialize_within(compiled, max(cpu, _MIN_SERIALIZE_S))
    if serialized is not None and len(serialized) <= max_serialized_bytes:
        return ("result", job, "ok", serialized, memory, cpu), False
    if cpu <= max_recompile_s:
        return ("result", job, "ok", None, memory, cpu), serialized is None
    why = ("takes longer to write than to compile" if serialized is None
           else f"is {len(serialized) / 1e6:.1f} MB (at most {max_serialized_bytes / 1e6:.1f} MB)")
    return ("result", job, "too_large", f"it compiles in {cpu:.1f}s of CPU (the engine reloads a grammar in at "
            f"most {max_recompile_s:g}s) and its serialized form {why}", memory, cpu), serialized is None


# ---------------------------------------------------------------------------------- broker


@dataclass
class _Worker:
    pid: int
    sock: socket.socket
    job: int | None = None


class Broker:
    def __init__(self, server: socket.socket, compiler: Any, recycle_bytes: int) -> None:
        self.server = server
        self.compiler = compiler
        self.recycle_bytes = recycle_bytes
        self.sel = selectors.DefaultSelector()
        self.workers: dict[int, _Worker] = {}  # by pid
        self.sel.register(server, selectors.EVENT_READ, None)

    def run(self) -> None:
        try:
            while True:
                for sk, _ in self.sel.select():
                    if sk.data is None:
                        msg = read_frame(self.server)
                        if msg is None:
                            return  # the server is gone
                        self._command(msg)
                    else:
                        self._from_worker(sk.data)
        finally:
            for w in list(self.workers.values()):
                self._kill(w)

    def _command(self, msg: tuple) -> None:
        if msg[0] == "compile":
            job = msg[1]
            w = next((w for w in self.workers.values() if w.job is None), None)
            if w is None:
                try:
                    w = self._fork()
                except OSError as exc:  # out of processes or memory: not the schema's fault
                    why = f"cannot fork a worker: {exc}"
                    self.server.sendall(frame(("result", job, "unavailable", why, 0, 0.0)))
                    return
            w.job = job
            self.server.sendall(frame(("started", job, w.pid)))
            try:
                w.sock.sendall(frame(msg[1:]))
            except OSError:
                self._lost(w)
        elif msg[0] == "cancel":
            for w in list(self.workers.values()):
                if w.job == msg[1]:
                    self._kill(w)

    def _fork(self) -> _Worker:
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the worker: keep only its own socket
            code = 0
            try:
                self.sel.close()
                self.server.close()
                for w in self.workers.values():
                    w.sock.close()
                ours.close()
                _worker_main(theirs, self.compiler, os.getppid(), self.recycle_bytes)
            except BaseException:  # noqa: BLE001 - a worker never returns into the broker's code
                code = 1
            finally:
                os._exit(code)
        theirs.close()
        w = _Worker(pid, ours)
        self.workers[pid] = w
        self.sel.register(ours, selectors.EVENT_READ, w)
        return w

    def _from_worker(self, w: _Worker) -> None:
        raw = _read_raw(w.sock)
        if raw is None:
            self._lost(w)
            return
        flags, body = raw
        w.job = None
        self.server.sendall(_HEADER.pack(len(body), 0) + body)  # ("result", job, ...), relayed
        if flags & _RETIRING:
            self._reap(w)  # it is exiting: never give it another job

    def _reap(self, w: _Worker) -> int:
        self.sel.unregister(w.sock)
        w.sock.close()
        self.workers.pop(w.pid, None)
        _, status = os.waitpid(w.pid, 0)
        return status

    def _lost(self, w: _Worker) -> None:
        """A worker closed its end: recycled after a job, or it died mid-compile."""
        job = w.job
        status = self._reap(w)
        if job is not None:
            why = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                   else f"exit code {os.waitstatus_to_exitcode(status)}")
            self.server.sendall(frame(("result", job, "died", f"the grammar compiler process died ({why})",
                                       0, 0.0)))

    def _kill(self, w: _Worker) -> None:
        try:
            os.kill(w.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._reap(w)


def main(fd: int) -> None:
    server = socket.socket(fileno=fd)
    msg = read_frame(server)
    if msg is None or msg[0] != "init":
        return
    _, info_json, recycle_bytes = msg
    try:
        import xgrammar as xg

        info = xg.TokenizerInfo.deserialize_json(info_json)
        compiler = xg.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # the server caches
    except Exception as exc:  # noqa: BLE001 - reported to the server, which fails the waiting requests
        server.sendall(frame(("failed", f"{type(exc).__name__}: {exc}")))
        return
    server.sendall(frame(("ready",)))
    Broker(server, compiler, recycle_bytes).run()


if __name__ == "__main__":
    # Ctrl-C reaches the whole process group: the server shuts down and closes our socket; we follow.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        main(int(sys.argv[1]))
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server went away mid-message
    os._exit(0)  # nothing to flush; an interpreter with torch loaded takes ~1 s to tear down
