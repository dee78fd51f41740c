"""Prompt-lookup (n-gram) proposer: if the last n tokens occurred before, guess what followed them."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from hasten.engine.request import Request

# Most drafts proposed after a match of 1 and of 2 tokens; longer matches propose up to k. A lone
# repeated token is weak evidence (on SmolLM2's grounded prompts ~0.2 of its drafts were accepted,
# against ~0.6 after 4-token matches), and each draft widens the verification step. Replaying the
# greedy outputs of benchmarks/speculative.py's prompts (benchmarks/ngram_replay.py, k = 4):
# the same tokens per step (2.43 vs 2.44 grounded, 1.21 vs 1.22 chat) from fewer verified rows
# per step (3.22 vs 4.12 grounded, 1.78 vs 2.81 chat).
SHORT_MATCH_DEPTHS = (1, 4)


def ngram_propose(tokens: np.ndarray, k: int, min_n: int = 1, max_n: int = 4,
                  short_match_depths: tuple[int, ...] = ()) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix n-gram;
    after a match of n <= len(short_match_depths) tokens, at most short_match_depths[n - 1]."""
    total = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n :]
        windows = sliding_window_view(tokens[: total - 1], n)  # windows that end before the last token
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            depth = min(k, short_match_depths[n - 1]) if n <= len(short_match_depths) else k
            return tokens[start : start + depth].tolist()
    return []


class NgramProposer:
    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 8, scaled_depth: bool = True):
        self.min_n = min_n
        self.max_n = max_n
        self.short_match_depths = SHORT_MATCH_DEPTHS if scaled_depth else ()

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        return ngram_propose(np.asarray(token_ids, dtype=np.int64), k, self.min_n, self.max_n,
                             self.short_match_depths)

    def propose_batch(self, reqs: list[Request], ks: list[int]) -> None:
        for r, k in zip(reqs, ks, strict=True):
            r.spec_token_ids = self.propose(r.all_token_ids(), k) if k > 0 else []
            r.spec_probs = None

    def release(self, request_id: str) -> None:
        """Nothing is kept per request."""
