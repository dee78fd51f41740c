"""Routing: which replica of a pool should serve a request, and in which order to fail over.

``Pool.candidates`` returns the routable backends in preference order: the first is the
primary choice, the rest are failover targets. Region awareness groups backends: the
client's region first, then other regions ranked by measured latency; the pool's policy
orders backends inside each group.

All policies that need agreement between several gateway instances (prefix-aware ring
placement, session affinity) use stable hashes (BLAKE2b), never Python's salted ``hash``,
so independent gateway instances route the same key to the same replica without sharing state.

Load-aware choices (least outstanding, the prefix-aware load bound) read
``BackendState.in_flight``. The proxy counts a request there as soon as it is routed, before
it is sent (proxy.py), so a burst routed in one event-loop turn spreads by free capacity.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from hasten.gateway.config import PoolConfig
from hasten.gateway.health import BackendState, CircuitBreaker
from hasten.gateway.retry import PoisonSet


def stable_hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@dataclass(slots=True)
class RouteInput:
    """The routing-relevant facts about one request."""

    prompt: str | None = None
    session: str | None = None
    region: str | None = None
    salt: str | None = None  # the tenant's cache salt: replicas share cached prefixes only within one salt
    block_hashes: list[int] = field(default_factory=list)


class Policy(Protocol):
    def order(self, group: list[BackendState], inp: RouteInput) -> list[BackendState]: ...

    def commit(self, inp: RouteInput, backend: BackendState) -> None: ...


def _by_load(group: list[BackendState], offset: int) -> list[BackendState]:
    n = len(group)
    return sorted(group, key=lambda b: (b.in_flight / b.weight, (group.index(b) - offset) % n))


class RoundRobin:
    """Smooth weighted round robin (the nginx algorithm) over the routable backends."""

    def order(self, group: list[BackendState], inp: RouteInput) -> list[BackendState]:
        if len(group) == 1:
            return list(group)
        total = 0.0
        best = group[0]
        for b in group:
            b.rr_current += b.weight
            total += b.weight
            if b.rr_current > best.rr_current:
                best = b
        best.rr_current -= total
        i = group.index(best)
        return group[i:] + group[:i]

    def commit(self, inp: RouteInput, backend: BackendState) -> None:
        return None


class LeastOutstanding:
    """Fewest in-flight requests per unit of weight; ties rotate so idle pools still spread."""

    def __init__(self) -> None:
        self._tick = itertools.count()

    def order(self, group: list[BackendState], inp: RouteInput) -> list[BackendState]:
        return _by_load(group, next(self._tick))

    def commit(self, inp: RouteInput, backend: BackendState) -> None:
        return None


class SessionAffinity:
    """Rendezvous (highest random weight) hashing on the session header; no header: least outstanding."""

    def __init__(self) -> None:
        self._fallback = LeastOutstanding()

    def order(self, group: list[BackendState], inp: RouteInput) -> list[BackendState]:
        if not inp.session:
            return self._fallback.order(group, inp)
        key = inp.session.encode()

        def score(b: BackendState) -> float:
            u = (stable_hash(key + b"\x00" + b.url.encode()) + 1) / (2**64 + 1)
            return -b.weight / math.log(u)

        return sorted(group, key=score, reverse=True)

    def commit(self, inp: RouteInput, backend: BackendState) -> None:
        return None


class PrefixAware:
    """Approximate prefix tree plus bounded-load consistent hashing.

    The prompt is cut into blocks of ``prefix_block_chars`` characters and each prefix
    (blocks 0..i) gets a chained hash. A bounded LRU table remembers which replicas served
    each prefix hash (up to ``MAX_HOLDERS``, most recent first); a request goes to the
    least loaded replica holding its longest known prefix. Unknown prefixes are placed on a
    consistent-hash ring keyed by the first block, so that requests sharing a system prompt
    meet on one replica, across gateway instances too. A replica is skipped when it is
    overloaded: more than ``load_factor`` times its weighted share of the pool's in-flight
    requests plus ``load_slack`` (at small loads a purely relative bound would spill a
    prefix for an imbalance of one or two requests). A request that spills over adds its
    replica as a second holder of the prefix rather than moving the prefix there, so later
    requests use whichever copy has room and the prefix does not flap between replicas
    (each move would cost one more prefill).
    """

    MAX_HOLDERS = 4

    def __init__(self, cfg: PoolConfig, backends: list[BackendState], vnodes: int = 64,
                 table_size: int = 65536) -> None:
        self._block = cfg.prefix_block_chars
        self._max_blocks = cfg.prefix_max_blocks
        self._load_factor = cfg.load_factor
        self._slack = cfg.load_slack
        self._table: OrderedDict[int, tuple[str, ...]] = OrderedDict()  # prefix hash -> holder URLs
        self._table_size = table_size
        ring: list[tuple[int, str]] = []
        for b in backends:
            for i in range(max(1, round(vnodes * b.weight))):
                ring.append((stable_hash(f"{b.url}#{i}".encode()), b.url))
        ring.sort()
        self._ring_keys = [k for k, _ in ring]
        self._ring_urls = [u for _, u in ring]
        self._fallback = LeastOutstanding()

    def block_hashes(self, prompt: str, salt: str | None = None) -> list[int]:
        data = prompt.encode("utf-8", "surrogatepass")
        # blocks are measured in characters of the encoded text; approximate for non-ASCII
        step = self._block
        h = hashlib.blake2b(digest_size=8)
        if salt:  # like the replicas' cache: equal prompts of different salts are different prefixes
            h.update(salt.encode() + b"\x00")
        out: list[int] = []
        for start in range(0, min(len(data), step * self._max_blocks), step):
            h.update(data[start:start + step])
            out.append(int.from_bytes(h.copy().digest(), "big"))
        return out

    def order(self, group: list[BackendState], inp: RouteInput) -> list[BackendState]:
        if not inp.prompt:
            return self._fallback.order(group, inp)
        if not inp.block_hashes:
            inp.block_hashes = self.block_hashes(inp.prompt, inp.salt)
        by_url = {b.url: b for b in group}
        total_load = sum(b.in_flight for b in group) + 1
        total_weight = sum(b.weight for b in group)

        def fits(b: BackendState) -> bool:
            bound = math.ceil(self._load_factor * total_load * b.weight / total_weight) + self._slack
            return b.in_flight + 1 <= bound

        primary: BackendState | None = None
        for h in reversed(inp.block_hashes):
            holders = [b for u in self._table.get(h, ()) if (b := by_url.get(u)) is not None and fits(b)]
            if holders:  # the least loaded copy; ties go to the most recent holder
                primary = min(holders, key=lambda b: b.in_flight / b.weight)
                break
        if primary is None and inp.block_hashes:
            n = len(self._ring_keys)
            start = bisect.bisect_left(self._ring_keys, inp.block_hashes[0])
            for i in range(n):
                b = by_url.get(self._ring_urls[(start + i) % n])
                if b is not None and fits(b):
                    primary = b
                    break
        rest = _by_load([b for b in group if b is not primary], 0)
        return ([primary] + rest) if primary is not None else rest

    def commit(self, inp: RouteInput, backend: BackendState) -> None:
        table = self._table
        url = backend.url
        for h in inp.block_hashes:
            holders = table.get(h)
            if holders is None:
                table[h] = (url,)
            else:
                if holders[0] != url:
                    table[h] = (url, *[u for u in holders if u != url][:self.MAX_HOLDERS - 1])
                table.move_to_end(h)
        while len(table) > self._table_size:
            table.popitem(last=False)


def make_policy(cfg: PoolConfig, backends: list[BackendState]) -> Policy:
    if cfg.policy == "round_robin":
        return RoundRobin()
    if cfg.policy == "least_outstanding":
        return LeastOutstanding()
    if cfg.policy == "session":
        return SessionAffinity()
    return PrefixAware(cfg, backends)


def prompt_text(payload: dict[str, Any]) -> str | None:
    """The text that determines the prompt prefix of an OpenAI chat/completions request."""
    messages = payload.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{m.get('role', '')}\x00{content if isinstance(content, str) else ''}\x01")
        return "".join(parts) or None
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if isinstance(prompt[0], str) else ",".join(map(str, prompt))
    if isinstance(prompt, str):
        return prompt
    inp = payload.get("input")
    return inp if isinstance(inp, str) else None


class Pool:
    """One model name served by a set of replicas with a routing policy."""

    def __init__(self, cfg: PoolConfig, failure_threshold: int = 3, cooldown_s: float = 5.0) -> None:
        self.config = cfg
        self.name = cfg.name
        self.backends = [BackendState(b, CircuitBreaker(failure_threshold, cooldown_s)) for b in cfg.backends]
        self.policy = make_policy(cfg, self.backends)
        self.poison = PoisonSet(cfg.retry)  # requests that failed a replica (retry.py)

    @property
    def reads_prompt(self) -> bool:
        """Whether routing looks at the prompt (prefix-aware) or only at load and region."""
        return isinstance(self.policy, PrefixAware)

    def route_input(self, payload: dict[str, Any] | None, session: str | None,
                    region: str | None, salt: str | None = None) -> RouteInput:
        prompt = prompt_text(payload) if payload and self.reads_prompt else None
        return RouteInput(prompt=prompt, session=session, region=region, salt=salt)

    def candidates(self, inp: RouteInput, now: float | None = None) -> list[BackendState]:
        now = time.monotonic() if now is None else now
        avail = [b for b in self.backends if b.available(now)]
        if not avail:
            return []
        if inp.region is None:
            # no preference: one group, so the policy sees every replica
            return self.policy.order(avail, inp)
        groups: dict[str | None, list[BackendState]] = {}
        for b in avail:
            groups.setdefault(b.region, []).append(b)

        def region_rank(region: str | None) -> tuple[int, float]:
            if region == inp.region:
                return (0, 0.0)
            lat = [b.latency_ms for b in groups[region] if b.latency_ms is not None]
            return (1, sum(lat) / len(lat) if lat else math.inf)

        ordered: list[BackendState] = []
        for region in sorted(groups, key=region_rank):
            ordered.extend(self.policy.order(groups[region], inp))
        return ordered
