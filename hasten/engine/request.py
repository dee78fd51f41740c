"""State of one sequence inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from hasten.outputs import RequestMetrics, TokenLogprobs
from hasten.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence: its prompt, what it generated, and how far the KV cache has caught up.

    The scheduling rule reads only `num_tokens` and `num_computed_tokens`: every step gives
    a request tokens until the computed count catches up with its token count.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.time)
    prompt: str | None = None
    parent_id: str | None = None  # the user's request id when n > 1
    index: int = 0  # position among the parent's n sequences

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    num_window_freed: int = 0  # leading blocks already released: no layer's sliding window reaches them
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    generator: torch.Generator | None = None
    # speculative decoding: draft tokens proposed after the last real token, and (for a draft
    # model) the proposal distributions they were drawn from, one row per draft token
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None
    spec_acceptance: float = 0.7  # running estimate of this request's draft acceptance rate
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time, num_prompt_tokens=len(self.prompt_token_ids))
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def tokens_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def tokens_with_spec(self, start: int, end: int) -> list[int]:
        """Like tokens_slice, but positions past the real tokens read the draft tokens."""
        n = self.num_tokens
        if end <= n:
            return self.tokens_slice(start, end)
        return self.tokens_slice(start, n) + self.spec_token_ids[max(0, start - n) : end - n]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def sort_key(self) -> tuple[int, float]:
        """Lower sorts first: more urgent priority, then earlier arrival."""
        return (self.priority, self.arrival_time)
