"""Cascade routing: easy requests go to a small model, the rest to the large one.

The classifier is cheap and runs in the gateway:

* length: a prompt over ``max_easy_tokens`` (estimated) is always hard;
* complexity features: code blocks, many lines, math notation, and words that ask for
  reasoning ("prove", "step by step", "analyze", ...): two or more signals make it hard;
* embedding similarity to labelled examples: the mean of the ``k`` best cosine
  similarities to the ``easy`` examples minus the same for the ``hard`` examples; the
  request is easy when that difference is above ``margin``. Without examples, a request
  that passed the first two checks is easy.

Fallback (``models[i].fallback``) is separate: when the chosen pool fails with 502/503
(no healthy backend, every attempt failed, overloaded) the request goes to the next
listed pool. Both live in the governance middleware; this module only decides.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from hasten.gateway.embed import Embedder
from hasten.gateway.govconfig import CascadeConfig
from hasten.gateway.ratelimit import estimate_tokens

_HARD_WORDS = re.compile(r"\b(prove|proof|derive|step[- ]by[- ]step|analy[sz]e|compare|contrast|design|"
                         r"implement|optimi[sz]e|debug|refactor|explain why|trade-?offs?|algorithm|"
                         r"complexity|theorem|evaluate|critique|essay|detailed)\b", re.IGNORECASE)
_MATH = re.compile(r"[=^∑∫√]|\\frac|\d+\s*[*/]\s*\d+")


@dataclass
class CascadeDecision:
    easy: bool
    reason: str
    score: float = 0.0


def complexity_signals(text: str) -> list[str]:
    signals = []
    if "```" in text or re.search(r"\bdef |\bclass |;\s*$|\{\s*$", text, re.MULTILINE):
        signals.append("code")
    if text.count("\n") >= 8:
        signals.append("lines")
    if _MATH.search(text):
        signals.append("math")
    words = _HARD_WORDS.findall(text)
    if words:
        signals.append("reasoning")
        if len(words) >= 2:
            signals.append("reasoning+")
    if text.count("?") >= 3:
        signals.append("questions")
    return signals


class CascadeClassifier:
    def __init__(self, cfg: CascadeConfig, embedder: Embedder | None) -> None:
        self.cfg = cfg
        self._embedder = embedder
        self._easy: np.ndarray | None = None
        self._hard: np.ndarray | None = None

    @property
    def uses_embeddings(self) -> bool:
        return self._embedder is not None and bool(self.cfg.easy or self.cfg.hard)

    async def _examples(self) -> tuple[np.ndarray, np.ndarray]:
        if self._easy is None or self._hard is None:
            assert self._embedder is not None
            vecs = await self._embedder.aembed([*self.cfg.easy, *self.cfg.hard])
            self._easy, self._hard = vecs[: len(self.cfg.easy)], vecs[len(self.cfg.easy):]
        return self._easy, self._hard

    def _topk(self, mat: np.ndarray, vec: np.ndarray) -> float:
        if mat.shape[0] == 0:
            return 0.0
        sims = np.sort(mat @ vec)[::-1][: self.cfg.k]
        return float(sims.mean())

    async def decide(self, text: str, vec: np.ndarray | None = None) -> CascadeDecision:
        tokens = estimate_tokens(text)
        if tokens > self.cfg.max_easy_tokens:
            return CascadeDecision(False, "length")
        signals = complexity_signals(text)
        if len(signals) >= 2:
            return CascadeDecision(False, "complexity:" + ",".join(signals))
        if not self.uses_embeddings:
            return CascadeDecision(True, "features")
        easy, hard = await self._examples()
        if vec is None:
            assert self._embedder is not None
            vec = (await self._embedder.aembed([text]))[0]
        score = self._topk(easy, vec) - self._topk(hard, vec)
        return CascadeDecision(score > self.cfg.margin, "similarity", score)
