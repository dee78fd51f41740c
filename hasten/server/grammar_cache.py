"""A least-recently-used map bounded by the bytes of its values (compiled grammars)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


class ByteLRU(Generic[V]):
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.bytes = 0
        self.evictions = 0
        self._items: OrderedDict[str, tuple[V, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def get(self, key: str) -> V | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: str, value: V, nbytes: int) -> bool:
        """Keep `value` (evicting the least recently used as needed); False if it alone is over capacity."""
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        if nbytes > self.capacity_bytes:
            return False
        self._items[key] = (value, nbytes)
        self.bytes += nbytes
        while self.bytes > self.capacity_bytes:
            _, (_, size) = self._items.popitem(last=False)
            self.bytes -= size
            self.evictions += 1
        return True
