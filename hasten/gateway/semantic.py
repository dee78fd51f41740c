"""Semantic response cache: answer a request whose prompt means the same as a cached one.

Entries live in partitions keyed by (tenant, model, stream flag, sampling parameters), so a
hit can only come from the same tenant asking the same model with the same parameters.
Inside a partition the prompt's embedding is compared with every stored one (cosine
similarity of unit vectors, a dot product); the best one at or above the route's
threshold is a hit. The entry points at the response stored by the exact cache.
Partitions hold at most ``max_entries`` vectors (oldest dropped) and expire with the TTL.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hasten.gateway.redis_store import RedisBlobStore


@dataclass
class _Partition:
    vectors: np.ndarray
    keys: list[str] = field(default_factory=list)
    expires: list[float] = field(default_factory=list)


@dataclass
class SemanticMatch:
    key: str
    similarity: float


class SemanticIndex:
    """In-memory vectors, or (with ``redis``) a bounded Redis list per partition."""

    def __init__(self, max_entries: int, ttl_s: float, redis: RedisBlobStore | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._redis = redis
        self._clock = clock
        self._parts: dict[str, _Partition] = {}

    async def lookup(self, partition: str, vec: np.ndarray, threshold: float) -> SemanticMatch | None:
        if self._redis is not None:
            items = [json.loads(x) for x in await self._redis.items(partition)]
            if not items:
                return None
            mat = np.stack([np.frombuffer(base64.b64decode(i["v"]), dtype=np.float32) for i in items])
            keys = [i["k"] for i in items]
        else:
            part = self._parts.get(partition)
            if part is None:
                return None
            self._expire(part)
            if not part.keys:
                return None
            mat, keys = part.vectors, part.keys
        sims = mat @ vec.astype(np.float32)
        best = int(np.argmax(sims))
        sim = float(sims[best])
        return SemanticMatch(keys[best], sim) if sim >= threshold else None

    async def add(self, partition: str, vec: np.ndarray, key: str) -> None:
        vec = vec.astype(np.float32)
        if self._redis is not None:
            item = json.dumps({"v": base64.b64encode(vec.tobytes()).decode(), "k": key}).encode()
            await self._redis.push(partition, item, self.max_entries, self.ttl_s)
            return
        part = self._parts.get(partition)
        if part is None:
            part = self._parts[partition] = _Partition(np.zeros((0, vec.shape[0]), dtype=np.float32))
        part.vectors = np.vstack([part.vectors, vec[None, :]])[-self.max_entries:]
        part.keys = (part.keys + [key])[-self.max_entries:]
        part.expires = (part.expires + [self._clock() + self.ttl_s])[-self.max_entries:]

    def _expire(self, part: _Partition) -> None:
        now = self._clock()
        n = 0
        while n < len(part.expires) and part.expires[n] <= now:
            n += 1
        if n:
            part.vectors = part.vectors[n:]
            part.keys = part.keys[n:]
            part.expires = part.expires[n:]
