"""KV-cache block accounting: a fixed pool of blocks, per-request block tables, prefix caching.

The tensors live in the model runner; this module only decides which block ids each
request owns. Full blocks are keyed by a hash chain (parent hash + the block's token ids
+ an optional cache salt), so two requests that share a prefix share its blocks.
Unreferenced cached blocks stay reusable until the pool needs them (LRU eviction).
For a model whose every layer has a sliding window, blocks that no future query can see any more
are released while the request runs (they keep their place in its block table, unread).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from hasten.engine.request import Request


def hash_block(parent: bytes | None, tokens: list[int], salt: str | None) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    if parent is None and salt:
        h.update(b"salt:" + salt.encode())
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found cached


class BlockPool:
    """Block ids 0..num_blocks-1 with reference counts and an LRU queue of free blocks."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Free blocks in eviction order (front = evict first). Values unused.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise RuntimeError("not enough free KV blocks")
        out = []
        for _ in range(n):
            bid, _ = self.free_queue.popitem(last=False)
            old = self.block_hash[bid]
            if old is not None:  # evict a cached block
                if self.cached.get(old) == bid:
                    del self.cached[old]
                self.block_hash[bid] = None
            self.ref_cnt[bid] = 1
            out.append(bid)
        return out

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (prefix hit)."""
        for bid in block_ids:
            if self.ref_cnt[bid] == 0:
                self.free_queue.pop(bid, None)
            self.ref_cnt[bid] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference each; blocks reaching zero join the back of the LRU queue.

        Callers pass blocks in reverse order so a sequence's tail is evicted before its head.
        """
        for bid in block_ids:
            self.ref_cnt[bid] -= 1
            assert self.ref_cnt[bid] >= 0, "block freed twice"
            if self.ref_cnt[bid] == 0:
                self.free_queue[bid] = None

    def register(self, bid: int, block_hash: bytes) -> None:
        if block_hash in self.cached:
            return  # an identical block is already cached; keep the first
        self.block_hash[bid] = block_hash
        self.cached[block_hash] = bid

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, sliding_window: int = 0):
        """sliding_window > 0: the widest window of a model whose every layer is windowed; blocks
        behind it are released early (free_outside_window)."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.window_freed_blocks = 0  # blocks released early so far
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def _update_hashes(self, req: Request, upto_tokens: int) -> None:
        bs = self.block_size
        while (len(req.block_hashes) + 1) * bs <= upto_tokens:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else None
            req.block_hashes.append(hash_block(parent, req.tokens_slice(i * bs, (i + 1) * bs), req.cache_salt))

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Longest run of cached full blocks at the start of the request's tokens.

        At most num_tokens - 1 tokens are taken from the cache, so the model always
        computes at least the last token (whose logits are needed).
        """
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return []
        self._update_hashes(req, req.num_tokens - 1)
        hits: list[int] = []
        for h in req.block_hashes:
            bid = self.pool.lookup(h)
            if bid is None:
                break
            hits.append(bid)
        return hits

    def allocate(self, req: Request, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and no change) if the pool is short."""
        cached_blocks = cached_blocks or []
        total = req.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        need = -(-total // self.block_size) - len(req.block_ids) - len(cached_blocks)
        # Cached blocks with no owner sit in the free queue: touching them uses up free slots.
        reclaim = sum(1 for b in cached_blocks if self.pool.ref_cnt[b] == 0)
        if need + reclaim > self.pool.num_free:
            return False
        if cached_blocks:
            self.pool.touch(cached_blocks)
            req.block_ids.extend(cached_blocks)
            req.num_cached_blocks = len(req.block_ids)
        if need > 0:
            req.block_ids.extend(self.pool.allocate(need))
        return True

    def record_lookup(self, req: Request, num_hit_tokens: int) -> None:
        self.stats.queries += req.num_tokens
        self.stats.hits += num_hit_tokens

    def cache_computed_blocks(self, req: Request) -> None:
        """Register every newly completed full block of the request in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = req.num_computed_tokens // self.block_size
        if full <= req.num_cached_blocks:
            return
        self._update_hashes(req, full * self.block_size)
        for i in range(req.num_cached_blocks, full):
            self.pool.register(req.block_ids[i], req.block_hashes[i])
        req.num_cached_blocks = full

    def free_outside_window(self, req: Request) -> None:
        """Release the leading blocks that no query from position num_computed_tokens on can see:
        a query at position p sees keys p - window + 1 .. p, so block i is dead once
        (i + 1) * block_size <= num_computed_tokens - window + 1."""
        if self.sliding_window <= 0:
            return
        dead = min(len(req.block_ids), max(0, req.num_computed_tokens - self.sliding_window + 1) // self.block_size)
        if dead > req.num_window_freed:
            self.pool.release(list(reversed(req.block_ids[req.num_window_freed : dead])))
            self.window_freed_blocks += dead - req.num_window_freed
            req.num_window_freed = dead

    def trim(self, req: Request, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` tokens (e.g. slots of rejected drafts)."""
        keep = max(-(-num_tokens // self.block_size), req.num_window_freed)
        if len(req.block_ids) > keep:
            self.pool.release(list(reversed(req.block_ids[keep:])))
            del req.block_ids[keep:]

    def free(self, req: Request) -> None:
        self.pool.release(list(reversed(req.block_ids[req.num_window_freed :])))
        req.block_ids = []
        req.num_cached_blocks = 0
        req.num_window_freed = 0

    def reset_prefix_cache(self) -> None:
        """Forget all cached-but-unowned blocks (used by tests and benchmarks)."""
        for bid, _ in list(self.pool.free_queue.items()):
            h = self.pool.block_hash[bid]
            if h is not None:
                self.pool.cached.pop(h, None)
                self.pool.block_hash[bid] = None
