"""Prompt-lookup (n-gram) proposer: if the last n tokens occurred before, guess what followed them."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from hasten.engine.request import Request


def ngram_propose(tokens: np.ndarray, k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix n-gram."""
    total = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n :]
        windows = sliding_window_view(tokens[: total - 1], n)  # windows that end before the last token
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        return ngram_propose(np.asarray(token_ids, dtype=np.int64), k, self.min_n, self.max_n)

    def propose_batch(self, reqs: list[Request], ks: list[int]) -> None:
        for r, k in zip(reqs, ks, strict=True):
            r.spec_token_ids = self.propose(r.all_token_ids(), k) if k > 0 else []
            r.spec_probs = None

    def release(self, request_id: str) -> None:
        """Nothing is kept per request."""
