"""n-gram lookup where the context repeats itself, a trained EAGLE head elsewhere
(`speculative="ngram+eagle:<head folder>"`).

Prompt lookup drafts well after a long match (a rewrite or a quotation of the prompt: most of its
drafts are accepted there) and poorly after a match of one token, or none; a head trained on the
target's own features (`hasten distill draft`) drafts the same way anywhere. Per request and step,
the request gets the lookup's drafts when the context's last `min_match` or more tokens occurred
before, the head's otherwise. Each side keeps its own acceptance estimate per request (`plan`
swaps it into the request before the engine picks the draft depth, so long lookups are not cut
short by the head's lower rate, nor the head's drafts deepened by the lookup's). The head sees
every step's features either way and catches up over the positions it skipped the next time it
drafts. Both kinds of draft go to the same distribution-exact verification: lookup drafts as fixed
proposals, the head's with its probabilities for sampled requests.
"""

from __future__ import annotations

import numpy as np

from hasten.engine.request import Request
from hasten.engine.spec.eagle import EagleProposer
from hasten.engine.spec.ngram import SHORT_MATCH_DEPTHS, ngram_propose

LOOKUP, HEAD = "lookup", "head"


class HybridProposer:
    wants_hidden = True  # the head's features, as EagleProposer

    def __init__(self, eagle: EagleProposer, max_depth: int, min_match: int = 2, max_n: int = 8,
                 scaled_depth: bool = True):
        if min_match < 1:
            raise ValueError(f"the lookup's minimum match must be >= 1 token, not {min_match}")
        self.eagle = eagle
        self.max_depth = max_depth
        self.min_match = min_match
        self.max_n = max(max_n, min_match)
        self.short_match_depths = SHORT_MATCH_DEPTHS if scaled_depth else ()
        self.name = f"ngram+{eagle.name}"
        self.lookup_drafts = 0  # requests x steps drafted by each side (benchmarks read them)
        self.head_drafts = 0
        self._estimates: dict[str, dict[str, float]] = {}  # request id -> side -> acceptance estimate
        self._side: dict[str, str] = {}  # the side planned for the request's next (or last) step
        self._lookup: dict[str, list[int]] = {}  # the planned lookup drafts (max_depth at most)

    def observe(self, batch, hidden) -> None:
        self.eagle.observe(batch, hidden)

    def release(self, request_id: str) -> None:
        self.eagle.release(request_id)
        for table in (self._estimates, self._side, self._lookup):
            table.pop(request_id, None)

    def plan(self, reqs: list[Request]) -> None:
        """Before the engine picks the depth: which side drafts each request's next step, and that
        side's estimate in req.spec_acceptance (the engine's running estimate, kept per side: what it
        became after the previous step is that step's side's)."""
        for r in reqs:
            rid = r.request_id
            est = self._estimates.setdefault(rid, {LOOKUP: r.spec_acceptance, HEAD: r.spec_acceptance})
            if rid in self._side:
                est[self._side[rid]] = r.spec_acceptance
            draft = self._lookup_draft(r)
            side = LOOKUP if draft else HEAD
            self._side[rid] = side
            self._lookup[rid] = draft
            r.spec_acceptance = est[side]

    def _lookup_draft(self, r: Request) -> list[int]:
        """The lookup's drafts (max_depth at most) after a match of min_match tokens or more, else []."""
        return ngram_propose(np.asarray(r.all_token_ids(), dtype=np.int64), self.max_depth, self.min_match,
                             self.max_n, self.short_match_depths)

    def propose_batch(self, reqs: list[Request], ks: list[int]) -> None:
        rest, rest_ks = [], []
        for r, k in zip(reqs, ks, strict=True):
            r.spec_token_ids, r.spec_probs = [], None
            if k <= 0:
                continue
            planned = self._lookup.pop(r.request_id, None)
            draft = planned if planned is not None else self._lookup_draft(r)  # a caller that skipped plan()
            if draft:
                r.spec_token_ids = draft[:k]
                self.lookup_drafts += 1
            else:
                rest.append(r)
                rest_ks.append(k)
        if rest:
            self.head_drafts += len(rest)
            self.eagle.propose_batch(rest, rest_ks)
