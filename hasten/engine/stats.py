"""Engine-facing types the HTTP side needs without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    spec_proposer: str | None = None
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0


class QueueFullError(RuntimeError):
    """The waiting queue is over its limit (the server answers 429)."""


class EngineUnavailableError(RuntimeError):
    """The engine has failed (or is not running) and cannot take a new request; the server answers 503
    while it is being restarted. Requests that were already in flight fail with a plain error (500)."""


class EngineFailedError(RuntimeError):
    """The engine as a whole failed (its step raised, or its process died) while this request was in
    flight; the server restarts it. The request gets a 500 (or an error event if its stream started),
    or a 503 when the engine process was stopped from outside (``stopped_from_outside``: killed by a
    signal such as SIGKILL, which no request can have caused by what it computed)."""

    def __init__(self, message: str = "", stopped_from_outside: bool = False) -> None:
        super().__init__(message)
        self.stopped_from_outside = stopped_from_outside


class RequestFailedError(RuntimeError):
    """The engine failed while handling this request's rows; the request alone ended (the server
    answers 500 or ends the stream with an error event). Other requests carry on."""
