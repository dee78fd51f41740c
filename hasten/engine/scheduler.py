"""Iteration-level scheduler with one rule.

Each step gives every request tokens until its `num_computed_tokens` catches up with its
`num_tokens`, under a per-step token budget. A long prompt therefore runs in chunks
(chunked prefill) mixed with other requests' decode tokens; a prefix-cache hit simply
starts the request with some tokens already computed. When the block pool runs dry, the
least urgent running request is preempted (its blocks freed, recomputed later).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from hasten.config import check_positive_int
from hasten.engine.kv_cache import KVCacheManager
from hasten.engine.request import Request, RequestStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" | "priority"
    decode_defer_ms: float = 0.0  # see EngineConfig.decode_defer_ms; 0 = decodes never sit a step out

    def __post_init__(self) -> None:
        """Limits under which no request could ever be scheduled are refused (they would wait forever)."""
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {self.policy!r} (fcfs or priority)")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            check_positive_int(name, getattr(self, name))
        d = self.decode_defer_ms
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d < float("inf"):
            raise ValueError(f"decode_defer_ms must be a number >= 0, not {d!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"with enable_chunked_prefill off a prompt must fit one step: max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be at least max_model_len ({self.max_model_len}); "
                "raise it or lower max_model_len")


@dataclass
class ScheduledBatch:
    """What the model computes this step: `num_new_tokens[i]` tokens of `requests[i]`."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------ queue management

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str) -> None:
        """Remove a request wherever it is and free its blocks at once."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.block_ids:
            self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = req.finish_reason or reason
        req.metrics.finished_time = time.time()

    def _next_waiting(self) -> Request:
        if self.config.policy == "priority":
            return min(self.waiting, key=Request.sort_key)
        return self.waiting[0]

    def _victim(self) -> Request:
        """The running request to preempt: least urgent priority, then latest arrival."""
        return max(self.running, key=Request.sort_key)

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        self.running.remove(req)
        if req in batch.requests:
            i = batch.requests.index(req)
            batch.requests.pop(i)
            batch.num_new_tokens.pop(i)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.spec_probs = None
        req.status = RequestStatus.PREEMPTED
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, req)
        batch.preempted.append(req)

    # ------------------------------------------------------------ the step

    def _tokens_wanted(self, req: Request, budget: int) -> int:
        n = req.num_tokens - req.num_computed_tokens
        if req.spec_token_ids:
            # draft tokens ride along with the last real token; drop those the budget cannot take
            keep = max(0, min(len(req.spec_token_ids), budget - n))
            del req.spec_token_ids[keep:]
            if req.spec_probs is not None:
                req.spec_probs = req.spec_probs[:keep] if keep else None
            n += keep
        if not self.config.enable_chunked_prefill and n > budget:
            return 0  # a whole prompt must fit in one step
        return min(n, budget)

    def _deferred_decodes(self, running: list[Request]) -> set[Request]:
        """decode_defer_ms: while prompts wait or are part-way through prefill, the decoding requests
        (one token to compute, no drafts) whose last token came less than decode_defer_ms ago; none when
        that would leave the step without work."""
        if not self.config.decode_defer_ms:
            return set()
        if not (self.waiting or any(r.num_tokens - r.num_computed_tokens > 1 for r in running)):
            return set()
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1 and not r.spec_token_ids]
        since = time.time() - self.config.decode_defer_ms / 1000
        return {r for r in decoding if r.metrics.last_token_time is not None and r.metrics.last_token_time > since}

    def schedule(self) -> ScheduledBatch:
        order = sorted(self.running, key=Request.sort_key) if self.config.policy == "priority" else list(self.running)
        deferred = self._deferred_decodes(order)
        batch = self._schedule(order, deferred)
        if not batch and not batch.preempted and deferred:
            batch = self._schedule(order, set())  # nothing could be admitted: the decodes run after all
        return batch

    def _schedule(self, order: list[Request], deferred: set[Request]) -> ScheduledBatch:
        cfg = self.config
        batch = ScheduledBatch()
        budget = cfg.max_num_batched_tokens

        # 1. Running requests first, in arrival (or priority) order (`order`), but for `deferred`.
        for req in order:
            if req not in self.running or req in deferred:
                continue  # preempted earlier in this loop, or sitting this step out
            self.kv.free_outside_window(req)
            n = self._tokens_wanted(req, budget)
            if n <= 0:
                continue
            while not self.kv.allocate(req, n):
                victim = self._victim()
                self._preempt(victim, batch)
                if victim is req:
                    break
            else:
                batch.requests.append(req)
                batch.num_new_tokens.append(n)
            budget = cfg.max_num_batched_tokens - batch.total_tokens

        # 2. Admit waiting requests while there is budget, room and no preemption this step.
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and not batch.preempted:
            req = self._next_waiting()
            cached = self.kv.find_cached_prefix(req)
            num_cached = len(cached) * self.kv.block_size
            n = req.num_tokens - num_cached
            if not cfg.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget)
            if not self.kv.allocate(req, n, cached):
                if cfg.policy == "priority" and self.running and self._victim().sort_key() > req.sort_key():
                    self._preempt(self._victim(), batch)
                    batch.preempted.clear()  # a deliberate priority swap; keep admitting
                    continue
                break
            if req.status == RequestStatus.WAITING:
                self.kv.record_lookup(req, num_cached)
                req.metrics.num_cached_tokens = num_cached
            self.waiting.remove(req)
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.time()
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch
