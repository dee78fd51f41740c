"""Choose how many draft tokens to verify, from acceptance rates and the cost of a wider step.

A step over T tokens costs about `base + per_token * T` (reading the weights once, plus work
per token). With acceptance rate a, verifying k drafts yields (1 - a^(k+1)) / (1 - a) tokens
on average. We pick the k (shared by the batch) that maximises tokens per second, so
speculation switches itself off when the batch is large or drafts keep being rejected. The
cost line is fitted online from measured step times.
"""

from __future__ import annotations

from collections import deque


def expected_tokens(acceptance: float, k: int) -> float:
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


class DepthController:
    def __init__(self, max_k: int, adaptive: bool = True, per_token_ratio: float = 0.02, window: int = 64):
        self.max_k = max_k
        self.adaptive = adaptive
        self.prior_ratio = per_token_ratio  # per_token / base until measurements say otherwise
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.proposal_samples: deque[tuple[int, float]] = deque(maxlen=window)

    def record_proposal(self, num_draft_tokens: int, seconds: float) -> None:
        """Time spent proposing (a draft model's forward passes, an n-gram search)."""
        if num_draft_tokens > 0:
            self.proposal_samples.append((num_draft_tokens, seconds))

    def draft_cost_ratio(self) -> float:
        """Proposal cost per draft token, relative to the base cost of a target step."""
        if not self.proposal_samples or len(self.samples) < 8:
            return 0.0
        per_draft = sum(s for _, s in self.proposal_samples) / sum(n for n, _ in self.proposal_samples)
        base = min(s for _, s in self.samples)  # the cheapest recent step ~ base cost
        return per_draft / base if base > 0 else 0.0

    def record_step(self, num_tokens: int, seconds: float) -> None:
        self.samples.append((num_tokens, seconds))

    def cost_ratio(self) -> float:
        """per-token cost / base cost, least squares over recent steps (needs spread in T)."""
        if len(self.samples) < 8:
            return self.prior_ratio
        n = len(self.samples)
        mt = sum(t for t, _ in self.samples) / n
        ms = sum(s for _, s in self.samples) / n
        var = sum((t - mt) ** 2 for t, _ in self.samples)
        if var < 1e-9:
            return self.prior_ratio
        slope = sum((t - mt) * (s - ms) for t, s in self.samples) / var
        base = ms - slope * mt
        if base <= 0 or slope <= 0:
            return self.prior_ratio
        return slope / base

    def choose(self, acceptances: list[float], other_tokens: int) -> int:
        """Draft depth for the requests with the given acceptance estimates.

        other_tokens: tokens the step carries anyway (prefill chunks, non-speculating decodes).
        """
        if not acceptances:
            return 0
        if not self.adaptive:
            return self.max_k
        r = self.cost_ratio()
        d = self.draft_cost_ratio()
        best_k, best_rate = 0, 0.0
        for k in range(self.max_k + 1):
            tokens = sum(expected_tokens(a, k) for a in acceptances)
            cost = 1 + r * (other_tokens + len(acceptances) * (1 + k)) + d * k * len(acceptances)
            rate = tokens / cost
            if rate > best_rate * 1.02:  # prefer shallower on near-ties
                best_k, best_rate = k, rate
        return best_k
