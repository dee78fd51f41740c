"""Which failed attempts may go to another replica, and the poison set that stops the others.

Before the first byte of the response body a failed attempt is one of three things:

* **retryable**: the replica could not take the request (connect error, first-byte timeout,
  or a status listed in ``retry.on_status``, by default 429 and 503). It goes to the next
  candidate, as it always did.
* **a request failure**: the replica took the request and failed it (any other 5xx it
  answered, or the connection breaking after the request was written and before the
  response body started: the replica process died while it held the request). By default it is
  not retried, because the request itself may be what made the replica fail, and the
  client gets the replica's own answer (or a 500 ``request_failed_upstream`` for a broken
  connection). ``retry.on_failure: true`` retries these as well, without any memory.
* 4xx answers other than 429 are the request's own fault: passed back as they are.

A request failure is charged to the request: the hash of (tenant, path, body) goes into
the pool's :class:`PoisonSet`. Whether the next identical request is refused depends on
how sure the gateway is that the request caused the failure:

* **certain**: the replica was healthy (its last exchange had succeeded) and failed no
  other request within ``BURST_S`` seconds around this one. Identical requests are refused
  at once (500 ``poison_request``) until ``poison_ttl_s`` has passed since the failure.
* **suspect**: the replica failed other requests at about the same time (it crashed with
  several requests in flight, or its engine died and failed all of them) or it was
  already failing. The culprit cannot be told apart from the bystanders, so none is
  refused yet; a suspect that fails again, on any replica, is refused from then on.

So a request that makes a healthy replica fail on its own is stopped after that one
replica; one that takes a busy replica down with others is stopped after at most two.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from hasten.gateway.config import RetryConfig

# two failures of different requests on one replica this close together are one replica-wide event
BURST_S = 1.0


@dataclass(slots=True)
class Failure:
    """What the poison set remembers about one request (by its hash)."""

    status: int | None  # the replica's answer; None when the connection broke
    at: float  # time.monotonic() of the latest charged failure
    strikes: int = 1
    certain: bool = False

    @property
    def blocked(self) -> bool:
        return self.certain or self.strikes >= 2


@dataclass(slots=True)
class _LastFailure:
    at: float
    key: bytes | None  # the charged request, None for a stream that broke after its first byte


def request_key(tenant: str | None, path: str, body: bytes) -> bytes:
    """The identity of a request for the poison set: tenant, path and exact body bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update((tenant or "").encode("utf-8", "surrogatepass") + b"\x00")
    h.update(path.encode("latin-1", "replace") + b"\x00")
    h.update(body)
    return h.digest()


class PoisonSet:
    """Bounded, expiring memory of requests that failed a replica (one per pool).

    Entries live ``ttl_s`` seconds after their latest failure; beyond ``max_entries`` the
    oldest is dropped. Every method takes ``now`` (``time.monotonic()``) from the caller.
    """

    def __init__(self, cfg: RetryConfig) -> None:
        self.ttl_s = cfg.poison_ttl_s
        self.max_entries = cfg.poison_max_entries
        self.enabled = not cfg.on_failure and cfg.poison_ttl_s > 0
        self._entries: OrderedDict[bytes, Failure] = OrderedDict()  # oldest failure first
        self._last: dict[str, _LastFailure] = {}  # per replica URL: its latest failure

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes, now: float) -> Failure | None:
        entry = self._entries.get(key)
        if entry is not None and now - entry.at >= self.ttl_s:
            del self._entries[key]
            return None
        return entry

    def blocked(self, key: bytes, now: float) -> Failure | None:
        """The failure that makes this request refused now, or None."""
        entry = self.get(key, now)
        return entry if entry is not None and entry.blocked else None

    def charge(self, key: bytes, replica: str, status: int | None, now: float,
               replica_was_healthy: bool) -> Failure:
        """Record that ``replica`` failed this request; returns the request's entry."""
        self._purge(now)
        last = self._last.get(replica)
        burst = last is not None and now - last.at <= BURST_S and last.key != key
        if burst:
            assert last is not None
            self._downgrade(last.key)
        self._last[replica] = _LastFailure(now, key)
        certain = replica_was_healthy and not burst
        entry = self.get(key, now)
        if entry is None:
            entry = self._entries[key] = Failure(status, now, 1, certain)
        else:
            entry.status, entry.at = status, now
            entry.strikes += 1
            entry.certain = entry.certain or certain
            self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return entry

    def forgive(self, key: bytes) -> None:
        """The request succeeded on a replica: it is not what made one fail."""
        self._entries.pop(key, None)

    def note_failure(self, replica: str, now: float) -> None:
        """Another request failed on ``replica`` (a stream broke mid-way): a charge made just
        before was part of a replica-wide failure."""
        last = self._last.get(replica)
        if last is not None and now - last.at <= BURST_S:
            self._downgrade(last.key)
        self._last[replica] = _LastFailure(now, None)

    def _downgrade(self, key: bytes | None) -> None:
        entry = self._entries.get(key) if key is not None else None
        if entry is not None and entry.strikes == 1:
            entry.certain = False

    def _purge(self, now: float) -> None:
        entries = self._entries
        while entries:
            key, entry = next(iter(entries.items()))
            if now - entry.at < self.ttl_s:
                break
            del entries[key]
