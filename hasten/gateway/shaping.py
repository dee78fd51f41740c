"""Prompt shaping: drop repeated system prompts, compress long retrieved context.

* ``dedupe_system``: a system message whose text (whitespace-normalized) equals an earlier
  system message is removed.
* ``compress``: a long context (any message other than the final user message, or the
  part of the final user message before its last paragraph) over ``min_context_tokens``
  is cut to its sentences most similar to the question (the final paragraph of the last
  user message), by embedding cosine similarity, until ``token_budget`` is reached. The
  kept sentences stay in their original order.

Tokens are estimated at 4 characters each; the savings are reported per request.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from hasten.gateway.cache import normalize_text
from hasten.gateway.embed import Embedder
from hasten.gateway.govconfig import ShapingConfig
from hasten.gateway.ratelimit import estimate_tokens

_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n{2,}")


@dataclass
class ShapeResult:
    payload: dict[str, Any]
    tokens_before: int
    tokens_after: int
    dropped_system: int = 0
    compressed: int = 0

    @property
    def saved(self) -> int:
        return self.tokens_before - self.tokens_after


def split_sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE.split(text) if s and s.strip()]


def _tokens(messages: list[Any]) -> int:
    return sum(estimate_tokens(m["content"]) for m in messages
               if isinstance(m, dict) and isinstance(m.get("content"), str))


def dedupe_system(messages: list[Any]) -> tuple[list[Any], int]:
    seen: set[str] = set()
    out: list[Any] = []
    dropped = 0
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "system" and isinstance(m.get("content"), str):
            norm = normalize_text(m["content"])
            if norm in seen:
                dropped += 1
                continue
            seen.add(norm)
        out.append(m)
    return out, dropped


async def compress_context(context: str, question: str, budget: int, embedder: Embedder) -> str:
    sentences = split_sentences(context)
    if len(sentences) <= 1:
        return context
    vecs = await embedder.aembed([question, *sentences])
    sims = vecs[1:] @ vecs[0]
    keep: list[int] = []
    used = 0
    for i in np.argsort(-sims):
        cost = estimate_tokens(sentences[int(i)])
        if used + cost > budget:
            continue
        keep.append(int(i))
        used += cost
    return " ".join(sentences[i] for i in sorted(keep))


class PromptShaper:
    def __init__(self, cfg: ShapingConfig, embedder: Embedder | None) -> None:
        self.cfg = cfg
        self._embedder = embedder

    async def shape(self, payload: dict[str, Any]) -> ShapeResult | None:
        msgs = payload.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return None
        before = _tokens(msgs)
        out = list(msgs)
        dropped = 0
        if self.cfg.dedupe_system:
            out, dropped = dedupe_system(out)
        compressed = 0
        if self.cfg.compress and self._embedder is not None:
            out, compressed = await self._compress(out)
        if not dropped and not compressed:
            return None
        return ShapeResult({**payload, "messages": out}, before, _tokens(out), dropped, compressed)

    async def _compress(self, msgs: list[Any]) -> tuple[list[Any], int]:
        assert self._embedder is not None
        last = max((i for i, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "user"
                    and isinstance(m.get("content"), str)), default=None)
        if last is None:
            return msgs, 0
        paragraphs = msgs[last]["content"].rstrip().split("\n\n")
        question = paragraphs[-1]
        own_context = "\n\n".join(paragraphs[:-1])
        out = list(msgs)
        n = 0
        limit, budget = self.cfg.min_context_tokens, self.cfg.token_budget
        for i, m in enumerate(msgs):
            if i == last or not isinstance(m, dict) or not isinstance(m.get("content"), str):
                continue
            if m.get("role") in ("user", "tool") and estimate_tokens(m["content"]) > limit:
                out[i] = {**m, "content": await compress_context(m["content"], question, budget, self._embedder)}
                n += 1
        if estimate_tokens(own_context) > limit:
            short = await compress_context(own_context, question, budget, self._embedder)
            out[last] = {**msgs[last], "content": short + "\n\n" + question}
            n += 1
        return out, n
