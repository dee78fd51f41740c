"""n-gram lookup where the context repeats itself, a trained EAGLE head elsewhere
(`speculative="ngram+eagle:<head folder>"`).

Prompt lookup drafts well after a long match (a rewrite or a quotation of the prompt: most of its
drafts are accepted there) and poorly after a match of one token, or none; a head trained on the
target's own features (`hasten distill draft`) drafts the same way anywhere. Per request and step,
the request gets the lookup's drafts when the context's last `min_match` or more tokens occurred
before, the head's otherwise. The head sees every step's features either way (it catches up over
the positions it skipped the next time it drafts). Both kinds of draft go to the same
distribution-exact verification: lookup drafts as fixed proposals, the head's with its
probabilities for sampled requests.
"""

from __future__ import annotations

import numpy as np

from hasten.engine.request import Request
from hasten.engine.spec.eagle import EagleProposer
from hasten.engine.spec.ngram import SHORT_MATCH_DEPTHS, ngram_match


class HybridProposer:
    wants_hidden = True  # the head's features, as EagleProposer

    def __init__(self, eagle: EagleProposer, min_match: int = 2, max_n: int = 8, scaled_depth: bool = True):
        if min_match < 1:
            raise ValueError(f"the lookup's minimum match must be >= 1 token, not {min_match}")
        self.eagle = eagle
        self.min_match = min_match
        self.max_n = max(max_n, min_match)
        self.short_match_depths = SHORT_MATCH_DEPTHS if scaled_depth else ()
        self.name = f"ngram+{eagle.name}"
        self.lookup_drafts = 0  # requests x steps drafted by each side (benchmarks read them)
        self.head_drafts = 0

    def observe(self, batch, hidden) -> None:
        self.eagle.observe(batch, hidden)

    def release(self, request_id: str) -> None:
        self.eagle.release(request_id)

    def propose_batch(self, reqs: list[Request], ks: list[int]) -> None:
        rest, rest_ks = [], []
        for r, k in zip(reqs, ks, strict=True):
            r.spec_token_ids, r.spec_probs = [], None
            if k <= 0:
                continue
            draft, _ = ngram_match(np.asarray(r.all_token_ids(), dtype=np.int64), k, self.min_match, self.max_n,
                                   self.short_match_depths)
            if draft:
                r.spec_token_ids = draft
                self.lookup_drafts += 1
            else:
                rest.append(r)
                rest_ks.append(k)
        if rest:
            self.head_drafts += len(rest)
            self.eagle.propose_batch(rest, rest_ks)
