"""Check draft tokens against the target model without changing its output distribution.

For draft tokens d_1..d_k and target rows p_0..p_k (p_j = the target's distribution after the
real tokens and d_1..d_j): greedy requests accept d_j while it equals argmax p_{j-1}; sampled
requests accept d_j with probability min(1, p(d_j) / q(d_j)) and, at the first rejection, draw
from normalize(max(p - q, 0)). If all are accepted a bonus token is drawn from p_k. For the
n-gram proposer q is a point mass on d_j, so acceptance is p(d_j) and the residual is p with
d_j removed. This is the standard speculative-sampling rule, which leaves the distribution of
every emitted token exactly the target's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from hasten.engine.request import Request
from hasten.engine.sampler import Sampler, logprobs_for
from hasten.outputs import TokenLogprobs


@dataclass
class SpecStats:
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens produced by verification steps (accepted + one corrected/bonus each)
    steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def _contexts(req: Request, drafts: list[int]) -> list[Request]:
    """Shallow copies of the request whose outputs include the first j draft tokens (j = 0..k)."""
    views = []
    for j in range(len(drafts) + 1):
        v = copy.copy(req)
        v.output_token_ids = req.output_token_ids + drafts[:j]
        views.append(v)
    return views


def verify(
    sampler: Sampler, req: Request, rows: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None
) -> tuple[list[int], list[TokenLogprobs | None], int]:
    """Returns (tokens to append, their logprobs, number of drafts accepted)."""
    k = len(drafts)
    views = _contexts(req, drafts)
    simple = (not req.params.logits_processors and not req.params.needs_penalties and req.params.min_tokens == 0
              and not req.params.logit_bias)
    processed = rows if simple else sampler.process(rows, views)
    out: list[int] = []
    if req.params.greedy:
        best = processed.argmax(-1).tolist()
        for j in range(k):
            if best[j] != drafts[j]:
                break
            out.append(drafts[j])
        accepted = len(out)
        out.append(best[accepted])
    else:
        probs = sampler.probs(processed, views)
        accepted = 0
        for j in range(k):
            d = drafts[j]
            p_d = float(probs[j, d])
            q_d = float(draft_probs[j, d]) if draft_probs is not None else 1.0
            if q_d > 0 and sampler.uniform_for(req) < min(1.0, p_d / q_d):
                out.append(d)
                accepted += 1
                continue
            if draft_probs is not None:
                residual = (probs[j] - draft_probs[j]).clamp_(min=0)
            else:
                residual = probs[j].clone()
                residual[d] = 0.0
            if float(residual.sum()) <= 0:  # p == q: any draw from p is exact
                residual = probs[j]
            out.append(int((residual / sampler.noise_for(req, residual.shape).clamp_(min=1e-30)).argmax()))
            break
        else:
            out.append(int((probs[k] / sampler.noise_for(req, probs[k].shape).clamp_(min=1e-30)).argmax()))
    n = len(out)
    lps = logprobs_for(rows[:n], views[:n], out) if req.params.logprobs is not None else [None] * n
    return out, lps, accepted
